"""Gates checkpoints: safetensors with the gate logits (and AdamW state, and an adapter's
LoRA weights) plus metadata naming the model, layer count and methods, so a checkpoint
made for something else is refused on load."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from learnroute.gates.config import TrainConfig
from learnroute.gates.gates import Gates
from learnroute.route import RouteError

def checkpoint_meta(config: TrainConfig, model_name: str, n_layers: int, n_heads: int = 1) -> dict[str, str]:
    """``n_heads``: gates per layer (1, or the model's KV heads for ``granularity: head``)."""
    return {
        "schema": "learnroute.gates/1",
        "model": model_name,
        "n_layers": str(n_layers),
        "n_heads": str(n_heads),
        "methods": json.dumps(config.methods),
        "learn": config.learn,
        "budget_floor": json.dumps(config.budget_floor),
        "head_spread": json.dumps(config.head_spread),
        "layer_totals": config.layer_totals,
        "ref_budget": json.dumps(config.ref_budget),
    }


def gate_params(gates: Gates) -> list[tuple[str, torch.nn.Parameter]]:
    """The gates' parameters by their checkpoint names (beta_slope where it exists)."""
    named = [("theta", gates.theta), ("beta", gates.beta), ("beta_slope", gates.beta_slope)]
    return [(name, p) for name, p in named if p is not None]


def save_gates(
    path: Path, gates: Gates, meta: dict[str, str], optimizer=None, extra: dict | None = None, adapter=None
) -> None:
    """Gates (and AdamW state) as safetensors, written atomically; metadata names the
    model, layer count and method set so a wrong checkpoint is refused on load."""
    from safetensors.torch import save_file

    tensors = {"theta": gates.theta.detach().cpu().contiguous(), "beta": gates.beta.detach().cpu().contiguous()}
    tensors["free"] = gates.free.to(torch.int8).cpu()
    if gates.beta_slope is not None:  # budget_slope: the shares' slope in log-budget
        tensors["beta_slope"] = gates.beta_slope.detach().cpu().contiguous()
    if gates.layer_shares is not None:  # fixed layer totals: shares() needs them to rebuild the budgets
        tensors["layer_shares"] = gates.layer_shares.detach().cpu().contiguous()  # (L,), or (B, L) per budget
    if gates.layer_share_budgets is not None:  # per-budget layer totals: the budgets of their rows (B,)
        tensors["layer_share_budgets"] = gates.layer_share_budgets.cpu().contiguous()
    if adapter is not None:  # cotrain.AdapterTraining: LoRA weights (and their AdamW state)
        tensors.update(adapter.tensors(optimizer))
    if optimizer is not None:
        for name, p in gate_params(gates):
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"opt.{name}.{key}"] = value.detach().cpu().reshape(value.shape).contiguous()
    meta = {**meta, **{k: json.dumps(v) for k, v in (extra or {}).items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def load_gates(path: str | Path, *, model: str | None = None, n_layers: int | None = None,
               methods: list[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a gates checkpoint; refuses one made for another model,
    layer count or method set (every mismatch in one error)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"gates checkpoint {path} not found")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    problems = []
    if meta.get("schema") != "learnroute.gates/1":
        problems.append(f"{path} is not a learnroute gates checkpoint (schema {meta.get('schema')!r})")
    else:
        if model is not None and meta.get("model") != model:
            problems.append(f"checkpoint was trained on model {meta.get('model')!r}, not {model!r}")
        if n_layers is not None and int(meta.get("n_layers", -1)) != n_layers:
            problems.append(f"checkpoint has {meta.get('n_layers')} layers, the model has {n_layers}")
        if methods is not None and json.loads(meta.get("methods", "[]")) != list(methods):
            problems.append(f"checkpoint gates methods {meta.get('methods')}, not {list(methods)}")
    if problems:
        raise RouteError("cannot use this gates checkpoint:\n  " + "\n  ".join(problems))
    return tensors, meta


def latest_checkpoint(folder: Path) -> Path | None:
    ckpts = sorted(folder.glob("step_*.safetensors"))
    return ckpts[-1] if ckpts else None
