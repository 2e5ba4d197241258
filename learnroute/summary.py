"""Tables (CSV, markdown) and the plot of a bench run folder, from its JSONL files alone.

``summarize(folder, rescore=True)`` recomputes every score from ``samples.jsonl`` (the
references) and the predictions in ``results.jsonl``, so a folder copied elsewhere can be
re-scored (e.g. after a metric fix) without the model. The bench writes them at the end of
each run; ``learnroute report`` rewrites them.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

# The full cache below this mean score on a task: eviction cannot be judged there.
NEAR_ZERO = 0.1
AVG = "average"
AVG_VALID = "average (tasks the full cache solves)"


def _budget_label(budget: Any) -> str:
    return "full" if budget is None else str(budget)


def _budget_order(budget: Any) -> tuple:
    """Fractions before token counts, each ascending; the full cache last."""
    if budget is None:
        return (2, 0.0)
    return (0 if isinstance(budget, float) else 1, float(budget))


def load_rows(folder: Path, rescore: bool = False) -> list[dict]:
    """Result rows, the last of any duplicated cell winning; optionally re-scored."""
    from learnroute.runs import read_jsonl, result_key
    from learnroute.tasks.metrics import score_sample

    folder = Path(folder)
    results = folder / "results.jsonl"
    if not results.is_file():
        raise FileNotFoundError(f"{results} not found: {folder} is not a bench run folder")
    rows: dict[tuple, dict] = {}
    for r in read_jsonl(results):
        rows[result_key(r)] = r
    out = list(rows.values())
    if rescore:
        samples = {s["id"]: s for s in read_jsonl(folder / "samples.jsonl")}
        missing = sorted({r["sample_id"] for r in out} - set(samples))
        if missing:
            raise ValueError(f"{folder}/samples.jsonl lacks {len(missing)} evaluated samples, e.g. {missing[0]}")
        for r in out:
            r["score"] = score_sample(samples[r["sample_id"]], r["prediction"])
    return out


def aggregate(rows: list[dict]) -> list[dict]:
    """Per (task, route, budget): mean score, n, KV fraction, seconds (decode plus a share
    of the sample's prefill); plus average rows.

    ``rel_full`` is the score divided by the full cache's on the same task (empty when
    the run has no full cache or the full cache is near zero there). Average rows are
    macro averages over tasks; a second average leaves out tasks where the full cache
    scores below ``NEAR_ZERO``.
    """
    # One prefill serves every cell of a sample: each cell is charged its share of it.
    cells_per_sample = Counter(r["sample_id"] for r in rows)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["route"], json.dumps(r["budget"]))].append(r)
    table = []
    for (task, route, budget), rs in groups.items():
        table.append(
            {
                "task": task,
                "route": route,
                "budget": json.loads(budget),
                "n": len(rs),
                "score": mean(r["score"] for r in rs),
                "kv_fraction": mean(r["kv_fraction"] for r in rs),
                "seconds": mean(
                    r["seconds"] + r.get("prefill_seconds", 0.0) / cells_per_sample[r["sample_id"]] for r in rs
                ),
            }
        )
    full = {t["task"]: t["score"] for t in table if t["route"] == "full"}
    near_zero = {task for task, s in full.items() if s < NEAR_ZERO}
    for t in table:
        f = full.get(t["task"])
        t["rel_full"] = t["score"] / f if f is not None and t["task"] not in near_zero else None
        t["full_near_zero"] = t["task"] in near_zero
    averages = []
    by_cell: dict[tuple, list[dict]] = defaultdict(list)
    for t in table:
        by_cell[(t["route"], json.dumps(t["budget"]))].append(t)
    for (route, budget), ts in by_cell.items():
        for name, members in ((AVG, ts), (AVG_VALID, [t for t in ts if not t["full_near_zero"]])):
            if not members or (name == AVG_VALID and not full):
                continue
            rel = [t["rel_full"] for t in members if t["rel_full"] is not None]
            averages.append(
                {
                    "task": name,
                    "route": route,
                    "budget": json.loads(budget),
                    "n": sum(t["n"] for t in members),
                    "score": mean(t["score"] for t in members),
                    "kv_fraction": mean(t["kv_fraction"] for t in members),
                    "seconds": mean(t["seconds"] for t in members),
                    "rel_full": mean(rel) if rel else None,
                    "full_near_zero": False,
                }
            )
    order = {name: i for i, name in enumerate(dict.fromkeys(r["route"] for r in rows))}
    key = lambda t: (_budget_order(t["budget"]), order[t["route"]], t["task"])  # noqa: E731
    return sorted(table, key=key) + sorted(averages, key=key)


def to_csv(table: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(table[0]), lineterminator="\n")
    writer.writeheader()
    for t in table:
        writer.writerow({k: ("" if v is None else v) for k, v in t.items()})
    return buf.getvalue()


def to_markdown(table: list[dict]) -> str:
    """One table per budget: routes x tasks (scores x100), averages, relative to full, KV kept."""
    tasks = list(dict.fromkeys(t["task"] for t in table if t["task"] not in (AVG, AVG_VALID)))
    flagged = sorted({t["task"] for t in table if t["full_near_zero"]})
    has_valid = any(t["task"] == AVG_VALID for t in table)
    cells = {(t["task"], t["route"], _budget_label(t["budget"])): t for t in table}
    budgets = sorted({json.dumps(t["budget"]) for t in table}, key=lambda b: _budget_order(json.loads(b)))
    full_rows = [t for t in table if t["route"] == "full" and t["task"] == AVG]
    lines = ["# Benchmark summary", ""]
    if flagged:
        lines += [
            f"**Flag:** the full cache scores below {NEAR_ZERO * 100:.0f} on {', '.join(flagged)} "
            "(marked `*`): eviction cannot be judged there.",
            "",
        ]
    only_full = all(json.loads(b) is None for b in budgets)
    for b in budgets:
        budget = json.loads(b)
        if budget is None and not only_full:
            continue  # the full cache is a row of every budget's table
        label = _budget_label(budget)
        routes = list(dict.fromkeys(t["route"] for t in table if _budget_label(t["budget"]) == label))
        head = ["route"] + [f"{t}{'*' if t in flagged else ''}" for t in tasks] + ["avg"]
        head += ["avg (solved)"] if has_valid else []
        head += ["rel. to full", "KV kept"]
        lines += [
            f"## Budget {label}" if budget is not None else "## Full cache",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        rows = [("full", "full")] if full_rows else []
        rows += [(r, label) for r in routes if not (r == "full" and label == "full")]
        for route, lab in rows:
            vals = [route]
            for task in tasks + [AVG] + ([AVG_VALID] if has_valid else []):
                t = cells.get((task, route, lab))
                vals.append("" if t is None else f"{100 * t['score']:.1f}")
            avg = cells.get((AVG, route, lab))
            rel = avg and avg["rel_full"]
            vals.append("" if rel is None else f"{100 * rel:.0f}%")
            vals.append("" if avg is None else f"{100 * avg['kv_fraction']:.1f}%")
            lines.append("| " + " | ".join(vals) + " |")
        lines.append("")
    lines += [
        "Scores are x100 (RULER: string match; LongBench: its official metrics). "
        "`rel. to full` averages per-task score / full-cache score over tasks the full cache solves; "
        "`KV kept` is the mean fraction of full-cache KV bytes kept.",
        "",
    ]
    return "\n".join(lines)


def plot(table: list[dict], path: Path) -> None:
    """Average score vs budget, one line per route, the full cache as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display here or in CI
    import matplotlib.pyplot as plt

    avg = [t for t in table if t["task"] == AVG]
    budgets = sorted(
        {json.dumps(t["budget"]) for t in avg if t["budget"] is not None}, key=lambda b: _budget_order(json.loads(b))
    )
    xs = {b: i for i, b in enumerate(budgets)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for route in dict.fromkeys(t["route"] for t in avg):
        pts = sorted(
            (xs[json.dumps(t["budget"])], 100 * t["score"])
            for t in avg
            if t["route"] == route and t["budget"] is not None
        )
        if route == "full" or not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=route)
    for t in avg:
        if t["route"] == "full":
            ax.axhline(100 * t["score"], color="black", linestyle="--", label="full cache")
    ax.set_xticks(range(len(budgets)), [_budget_label(json.loads(b)) for b in budgets])
    ax.set_xlabel("budget (tokens per KV head, or fraction of the context)")
    ax.set_ylabel("average score (x100)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def summarize(folder: str | os.PathLike, rescore: bool = False) -> list[dict]:
    """Write ``summary.csv``, ``summary.md`` and ``plot.png`` into a run folder; return the table."""
    from learnroute.runs import atomic_write

    folder = Path(folder)
    rows = load_rows(folder, rescore=rescore)
    if not rows:
        raise ValueError(f"{folder}/results.jsonl has no rows yet")
    table = aggregate(rows)
    atomic_write(folder / "summary.csv", to_csv(table))
    atomic_write(folder / "summary.md", to_markdown(table))
    plot(table, folder / "plot.png")
    return table
