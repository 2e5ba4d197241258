"""One namespace for every task the benchmark and the profiler can load.

Synthetic RULER-style tasks go by their name (``niah_single_2``); LongBench datasets by
``longbench/<dataset>`` (``longbench/narrativeqa``), read from local JSONL files; a user's
own records by ``jsonl:PATH`` (:mod:`learnroute.tasks.custom`), for calibration and eval.
"""

from __future__ import annotations

import os
from pathlib import Path

from learnroute.tasks.custom import PREFIX as CUSTOM
from learnroute.tasks.custom import custom_problems, is_custom, load_custom
from learnroute.tasks.ruler import TASKS, Sample, make_samples

LONGBENCH = "longbench/"


def task_names() -> list[str]:
    """Every valid task name."""
    from learnroute.tasks.longbench import LONGBENCH_TASKS

    return list(TASKS) + [LONGBENCH + name for name in LONGBENCH_TASKS] + [CUSTOM + "PATH (your own records)"]


def check_tasks(
    names: list[str] | dict[str, int], split: str, longbench_dir: str | os.PathLike | None = None
) -> list[str]:
    """Problems with a task list (unknown names, missing LongBench files, unusable custom data
    files), without loading a model. Given ``{task: count}``, a custom data file must also
    hold that many records of ``split``."""
    from learnroute.tasks.longbench import LONGBENCH_TASKS, default_data_dir

    counts = names if isinstance(names, dict) else {}
    problems = []
    if not names:
        problems.append("the task list is empty; valid tasks: " + ", ".join(task_names()))
    for name in names:
        if is_custom(name):
            n = counts.get(name)
            problems += custom_problems(name, split, n if isinstance(n, int) and n >= 1 else None)
        elif name.startswith(LONGBENCH):
            dataset = name[len(LONGBENCH) :]
            path = Path(longbench_dir or default_data_dir()) / f"{dataset}.jsonl"
            if dataset.removesuffix("_e") not in LONGBENCH_TASKS:
                problems.append(f"unknown LongBench dataset {dataset!r}; valid: {', '.join(LONGBENCH_TASKS)}")
            elif split != "eval":
                problems.append(f"{name}: LongBench is evaluation data only; use synthetic tasks for {split}")
            elif not path.is_file():
                problems.append(f"{name}: LongBench file {path} not found (see `learnroute.tasks.longbench`)")
        elif name not in TASKS:
            problems.append(f"unknown task {name!r}; valid: {', '.join(task_names())}")
    return problems


def load_tasks(
    tasks: dict[str, int],
    tokenizer,
    n_tokens: int,
    split: str,
    seed: int = 0,
    longbench_dir: str | Path | None = None,
) -> list[tuple[str, Sample]]:
    """(task, sample) pairs for ``{task: count}``, in a fixed order (config order, then index)."""
    return [
        (task, s)
        for task, n in tasks.items()
        for s in load_task(task, tokenizer, n, n_tokens, split, seed, longbench_dir)
    ]


def load_task(
    name: str,
    tokenizer,
    n: int,
    n_tokens: int,
    split: str,
    seed: int = 0,
    longbench_dir: str | Path | None = None,
) -> list[Sample]:
    """``n`` samples of task ``name``: generated (RULER-style) or read (LongBench, custom data).

    ``n_tokens`` is the target context length of generated samples, the
    middle-truncation limit of LongBench prompts and of custom data contexts.
    """
    if is_custom(name):
        return load_custom(name, tokenizer, n, n_tokens, split)
    if name.startswith(LONGBENCH):
        from learnroute.tasks.longbench import load_longbench

        return load_longbench(name[len(LONGBENCH) :], tokenizer, data_dir=longbench_dir, max_tokens=n_tokens, n=n)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(task_names())}")
    return make_samples(name, tokenizer, n, n_tokens, split, seed)


def calibration_problems(tasks: dict[str, int], where: str = "tasks") -> list[str]:
    """Problems with a calibration set ``{task: count}`` (profile, training, study)."""
    problems = []
    if not tasks:
        problems.append("the calibration set is empty: give at least one task with a sample count >= 1")
    problems += [p for p in check_tasks(dict(tasks), "calibration") if "task list is empty" not in p]
    for name, n in tasks.items():
        if n < 1:
            problems.append(f"{where}.{name}: sample count must be >= 1, got {n}")
    return problems
