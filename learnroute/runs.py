"""Run folders shared by bench, profile and placement: resolved config, versions, and
JSONL files appended atomically so killed runs resume."""

from __future__ import annotations

import typing
from typing import Literal

import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from learnroute.config import ConfigError, to_dict

# Config fields that change no score (batching and the device change float rounding at
# most; stop_at_final_score shortens predictions whose score is already final): a rerun may
# change them and still resume (and a run saved before ``device`` existed resumes).
_RESUME_FREE = ("output", "wandb", "wandb_project", "max_batch", "max_padding", "stop_at_final_score", "device",
                "prefill_cache_gib")
DEVICES = ("auto", "cpu", "cuda")
# The model dtypes a run may load in (``dtype`` of every config; gates and adapters stay float32).
Dtype = Literal["float32", "bfloat16"]
DTYPES = typing.get_args(Dtype)
DTYPE_HELP = "float32 | bfloat16: the model's weights and activations (bfloat16 halves the KV cache; answers can differ)"


def versions() -> dict[str, Any]:
    """Library versions and the git commit of the learnroute checkout (if any)."""
    import torch
    import transformers
    from importlib.metadata import version

    import learnroute

    commit = None
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(learnroute.__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "learnroute": learnroute.__version__,
        "git_commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvpress": version("kvpress"),
        "platform": platform.platform(),
    }


def device_problem(device: str) -> str | None:
    """What is wrong with a config's ``device`` key (None if nothing): auto | cpu | cuda."""
    if device not in DEVICES:
        return f"device must be auto, cpu or cuda, got {device!r}"
    return None


def dtype_problem(dtype: str) -> str | None:
    """What is wrong with a config's ``dtype`` key (None if nothing): float32 | bfloat16."""
    if dtype not in DTYPES:
        return f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}"
    return None


def resolve_device(device: str) -> str:
    """The device a run puts its model on, the same rule in every verb: ``auto`` is cuda
    when CUDA is available, else cpu; ``cuda`` without CUDA is a :class:`ConfigError`."""
    import torch

    if (problem := device_problem(device)) is not None:
        raise ConfigError(problem)
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def process_state():
    """accelerate's process state: this process's rank among those torchrun or accelerate
    launched (one process: rank 0 of 1).

    Ranks meet at barriers between stages; one rank's long stage (unbalanced profile or
    bench shards, a rank-0-only stage) can keep the others waiting far longer than
    torch's default 30-minute process-group timeout, hence 24 hours.
    """
    from datetime import timedelta

    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(hours=24))


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append rows under an exclusive lock in one write (whole lines or nothing useful).

    A previous crash may have left a partial last line; it is cut off first, so every
    line in the file is a complete JSON row.
    """
    if not rows:
        return
    data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size:
                f.seek(size - 1)
                if f.read(1) != b"\n":  # a torn line from a killed writer: drop it
                    f.seek(0)
                    content = f.read()
                    f.truncate(content.rfind(b"\n") + 1)
            f.seek(0, os.SEEK_END)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def result_key(row: dict) -> tuple[str, str, str]:
    """A results row's cell: (sample id, route, budget as JSON); reruns skip done keys."""
    return row["sample_id"], row["route"], json.dumps(row["budget"])


def read_jsonl(path: Path) -> list[dict]:
    """Complete rows of a JSONL file (a torn last line is ignored)."""
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.endswith("\n"):
            break  # torn last line of a killed run
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not a JSON row ({e})") from None
    return rows


def _comparable(config: dict, defaults: dict | None = None) -> dict:
    # A key missing from a saved config reads as the field's default (null when it has
    # none): a field added later (aware_budgets, a train config's stream) defaults to the
    # behaviour runs had before it existed, so it must not refuse runs saved before it.
    full = {**(defaults or {}), **config}
    return {k: v for k, v in full.items() if k not in _RESUME_FREE and v is not None}


def _defaults(config: Any) -> dict:
    """The config class's defaults as a resolved dict (every config field has one)."""
    try:
        return to_dict(type(config)())
    except TypeError:  # a config class with a required field: no defaults to read from
        return {}


def _grown(old: Any, new: Any) -> bool:
    """Does ``new`` keep everything ``old`` had (a mapping: every old key with its value; a
    list: every old item), adding only?"""
    if old is None:
        return True
    if isinstance(old, dict) and isinstance(new, dict):
        return all(k in new and new[k] == v for k, v in old.items())
    if isinstance(old, list) and isinstance(new, list):
        return all(x in new for x in old)
    return old == new


def prepare_folder(config: Any, overwrite: bool, is_main: bool, growable: tuple[str, ...] = ()) -> Path:
    """Create or reopen the run folder; refuse a different config unless ``overwrite``.

    Keys in ``growable`` (a study's variants and seeds) may gain entries on a resume,
    never change or lose one: what was run stays valid and the new entries are run.
    With ``overwrite`` the old folder is moved aside to ``<output>.replaced-<time>``,
    never deleted.
    """
    out = Path(config.output)
    resolved = to_dict(config)
    saved = out / "config.yaml"
    conflict = folder_conflict(config, growable)
    if conflict is not None:
        if not overwrite:
            raise ConfigError(conflict)
        if is_main:
            move_aside(out)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(saved, yaml.safe_dump(resolved, sort_keys=False))
        _record_start(out / "versions.json")
    return out


def move_aside(out: Path) -> Path:
    """Move a run folder to ``<output>.replaced-<time>`` (never deleted); returns where."""
    aside = out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    shutil.move(str(out), aside)
    print(f"moved the previous run in {out} to {aside}", file=sys.stderr)
    return aside


def folder_conflict(config: Any, growable: tuple[str, ...] = ()) -> str | None:
    """Why ``config.output`` cannot resume with ``config`` (it holds a run with a different
    config), or None when it is new or resumable. Reads only; :func:`prepare_folder` acts."""
    out = Path(config.output)
    saved = out / "config.yaml"
    if not saved.is_file():
        return None
    resolved = to_dict(config)
    old = yaml.safe_load(saved.read_text()) or {}
    a, b = _comparable(old, _defaults(config)), _comparable(resolved)
    grew = [k for k in growable if _grown(a.pop(k, None), b.pop(k, None))]
    if a == b and len(grew) == len(growable):
        return None
    diff = sorted(
        k for k in set(old) | set(resolved)
        if k not in _RESUME_FREE and old.get(k) != resolved.get(k) and k not in grew
    )
    return (f"{out} holds a run with a different config (differs in: {', '.join(diff)}); "
            "pass --overwrite to move it aside and start afresh, or choose another output")


def _record_start(path: Path) -> None:
    """Write this start's versions to ``path``, keeping every earlier start under
    ``starts``: a run resumed under another commit must still say which commits wrote it."""
    current = versions()
    now = {**current, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    starts: list[dict[str, Any]] = []
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = {}
        # A versions.json from before the history existed is one start of unknown time.
        starts = old.get("starts") or ([{k: v for k, v in old.items() if k != "starts"}] if old else [])
    atomic_write(path, json.dumps({**current, "starts": starts + [now]}, indent=2) + "\n")


def wandb_run(config: Any, out: Path):
    """A wandb run for ``config`` (which has ``wandb_project``), offline when no network is
    reachable (or as ``WANDB_MODE`` says); it writes under ``out``."""
    import socket

    import wandb

    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        try:
            socket.create_connection(("api.wandb.ai", 443), timeout=2).close()
            mode = "online"
        except OSError:
            mode = "offline"
    return wandb.init(project=config.wandb_project, config=to_dict(config), dir=str(out), mode=mode)
