"""Reports on a bench run folder, from its JSONL files alone: the summary tables and plot
(:mod:`learnroute.summary`) and paired comparisons of one route with the others
(``learnroute report --paired``).

``learnroute.summary.summarize(folder, rescore=True)`` recomputes every score from ``samples.jsonl`` (the
references) and the predictions in ``results.jsonl``, so a folder copied elsewhere can be
re-scored (e.g. after a metric fix) without the model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from statistics import mean

from learnroute.stats import VALID_FULL, paired, sample_scores, solved_tasks
from learnroute.summary import _budget_label, _budget_order, load_rows


def find_route(rows: list[dict], name: str) -> str:
    """The route in ``rows`` called ``name``: its exact name, or a route file's stem."""
    routes = sorted({r["route"] for r in rows})
    hits = [r for r in routes if r == name] or [r for r in routes if r.endswith(".json") and Path(r).stem == name]
    if len(hits) != 1:
        what = "no route" if not hits else f"{len(hits)} routes"
        raise ValueError(f"{what} called {name!r} in this folder; routes: {', '.join(routes)}")
    return hits[0]


def paired_table(
    folder: str | os.PathLike,
    route: str,
    against: list[str] | None = None,
    n_boot: int = 2000,
    rescore: bool = False,
    tasks: list[str] | None = None,
) -> str:
    """``route`` minus each route of ``against`` (default: every other route) per budget,
    paired over the same samples of the tasks the full cache solves, with a bootstrap 95 %
    interval (markdown). All-or-nothing samples make one sample worth 100 / n points:
    differences whose interval holds 0 are ties. ``tasks``: only these tasks' samples (a
    family split, say the out-of-family tasks alone)."""
    rows = load_rows(Path(folder), rescore=rescore)
    if tasks:
        present = {r["task"] for r in rows}
        unknown = sorted(set(tasks) - present)
        if unknown:
            raise ValueError(f"no samples of {', '.join(unknown)} in this folder; tasks: {', '.join(sorted(present))}")
        rows = [r for r in rows if r["task"] in tasks]
    main = find_route(rows, route)
    others = [find_route(rows, a) for a in against] if against else sorted({r["route"] for r in rows} - {main, "full"})
    _, valid = solved_tasks(rows)
    scores = sample_scores(rows, valid)
    budgets = sorted({r["budget"] for r in rows if r["route"] == main}, key=_budget_order)
    n_full = len(scores.get(("full", "null"), {}))
    label = Path(main).stem if main.endswith(".json") else main
    lines = [
        f"{label} minus each route, x100, paired over the samples of "
        f"{', '.join(sorted(valid))} (the full cache scores >= {100 * VALID_FULL:.0f}; full cache "
        f"{100 * mean(scores[('full', 'null')].values()):.1f} on {n_full})." if n_full else "",
        "",
        f"| budget | route | n | its score | {label} score | difference [95 % interval] | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in budgets:
        bk = json.dumps(b)
        mine = scores.get((main, bk), {})
        for o in others:
            if (o, bk) not in scores or not mine:
                continue
            c = paired(mine, scores[(o, bk)], n_boot)
            if c["n"] == 0:
                continue
            name = Path(o).stem if o.endswith(".json") else o
            ids = set(mine) & set(scores[(o, bk)])  # the paired samples: both scores over them
            lines.append(
                f"| {_budget_label(b)} | {name} | {c['n']} | {100 * mean(scores[(o, bk)][i] for i in ids):.1f} | "
                f"{100 * mean(mine[i] for i in ids):.1f} | "
                f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] | {c['verdict']} |"
            )
    return "\n".join(lines) + "\n"
