"""The statistics of a comparison: which tasks count, per-sample scores, paired bootstrap.

Used by ``learnroute report --paired`` and the study's analysis alike; it reads result rows
(dicts as in a bench folder's ``results.jsonl``) and imports nothing from the package.
"""

from __future__ import annotations

import json
import random
from statistics import mean
from typing import Any

VALID_FULL = 0.3  # tasks where the full cache scores below this are left out of averages


def paired(a: dict[str, float], b: dict[str, float], n_boot: int, seed: int = 0) -> dict[str, Any]:
    """Mean of a - b over the samples both have, with a percentile bootstrap 95 % interval
    (resampling samples; seeded). ``verdict``: win / loss / tie (the interval holds 0)."""
    ids = sorted(set(a) & set(b))
    d = [a[i] - b[i] for i in ids]
    if not d:
        return {"n": 0, "diff": None, "lo": None, "hi": None, "verdict": "n/a"}
    rng = random.Random(seed)
    boots = sorted(mean(rng.choice(d) for _ in d) for _ in range(n_boot))
    lo, hi = boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]
    verdict = "tie" if lo <= 0 <= hi else ("win" if lo > 0 else "loss")
    return {"n": len(d), "diff": mean(d), "lo": lo, "hi": hi, "verdict": verdict}


def pooled(members: list[dict[str, float]]) -> dict[str, float]:
    """Sample id -> the mean of the members' scores, over the samples every member has: one
    route standing for several (say a recipe's training seeds), so that a paired interval
    over samples reads the recipe rather than one draw of it."""
    ids = set.intersection(*(set(m) for m in members)) if members else set()
    return {i: mean(m[i] for m in members) for i in ids}


def solved_tasks(rows: list[dict]) -> tuple[dict[str, float], set[str]]:
    """The full cache's mean score per task, and the tasks it solves (>= ``VALID_FULL``):
    those the averages use. If none qualifies (e.g. a tiny random model), every task."""
    by_task: dict[str, list[float]] = {}
    for r in rows:
        if r["route"] == "full":
            by_task.setdefault(r["task"], []).append(float(r["score"]))
    full_task = {t: mean(v) for t, v in by_task.items()}
    return full_task, {t for t, s in full_task.items() if s >= VALID_FULL} or set(full_task)


def sample_scores(rows: list[dict], tasks: set[str]) -> dict[tuple[str, str], dict[str, float]]:
    """(route, budget JSON) -> sample id -> score, over ``tasks``."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if r["task"] in tasks:
            out.setdefault((r["route"], json.dumps(r["budget"])), {})[r["sample_id"]] = float(r["score"])
    return out


def best_homogeneous(scores: dict[tuple[str, str], dict[str, float]], budget_key: str) -> str | None:
    """The homogeneous route (``homogeneous:<method>``) with the best average at one budget
    (JSON key), over the samples ``scores`` holds; ties: the first by name. None if none ran."""
    avg = {r: sum(v.values()) / len(v) for (r, b), v in scores.items() if b == budget_key and r.startswith("homogeneous:") and v}
    return max(sorted(avg), key=avg.get) if avg else None

