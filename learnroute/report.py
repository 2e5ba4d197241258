"""Reports from result rows alone (dicts as in a bench folder's ``results.jsonl``), for the
bench and the study alike, in three parts:

1. **statistics**: which tasks count, per-sample scores, paired bootstrap intervals (the
   study's analysis and ``report --paired`` both use them);
2. **bench tables**: a run folder's summary (CSV, markdown) and plot, per route, budget and
   task; the bench writes them at the end of each run, ``learnroute report`` rewrites them;
3. **paired reports**: one route minus each other route over the same samples, across
   folders (``learnroute report --paired``).

``summarize(folder, rescore=True)`` recomputes every score from ``samples.jsonl`` (the
references) and the predictions in ``results.jsonl``, so a folder copied elsewhere can be
re-scored (e.g. after a metric fix) without the model.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
from collections import Counter, defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

import yaml

from learnroute.runs import result_key

# ---------------------------------------------------------------------------- 1. statistics

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


def budget_steps(scores: dict, route: str, budgets: list, bootstrap: int) -> list[dict[str, Any]]:
    """More cache must never answer worse (issue 58): ``route`` at each budget minus itself
    at the next smaller budget of the same kind (tokens or fractions), paired over the same
    samples. ``drop`` when the interval lies below 0, a loss to itself with less cache.
    ``smaller_minus_full``: the route at the smaller budget minus the full cache, over the
    samples both have (None without full-cache rows). A route above the full cache must come
    back down to it by 100 % kept, so a drop from above it is the route returning toward the
    full cache's answers, not falling below them."""
    full = scores.get(("full", "null"), {})
    steps = []
    for kind in (int, float):
        mine = sorted(b for b in budgets if type(b) is kind and (route, json.dumps(b)) in scores)
        for small, large in zip(mine, mine[1:]):
            low = scores[(route, json.dumps(small))]
            d = paired(scores[(route, json.dumps(large))], low, bootstrap)
            ids = set(low) & set(full)
            above = mean(low[i] - full[i] for i in ids) if ids else None
            steps.append({"from": small, "to": large, "vs_smaller_budget": d, "drop": d["verdict"] == "loss",
                          "smaller_minus_full": above})
    return steps


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


# ---------------------------------------------------------------------------- 2. bench tables

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


# ---------------------------------------------------------------------------- 3. paired reports

# Bench settings that change what a cell scores: folders joined into one paired report must
# agree on each (the samples, the routes and the budgets may differ).
JOIN_SETTINGS = ("model", "context_tokens", "query_aware", "max_new_tokens", "route_file_budgets")


def load_folders(folders: list[str | os.PathLike], rescore: bool = False, defaults: dict | None = None) -> list[dict]:
    """Result rows of one bench folder, or of several joined into one (say one bench per
    family split, so that a paired report reads all of their samples together). Joined
    folders must agree on :data:`JOIN_SETTINGS` (read from each folder's ``config.yaml``, a
    missing key at its value in ``defaults``, the bench config's defaults the caller passes;
    a folder without one is not compared) and hold no cell twice; every mismatch and the
    first repeated cell are named in one error."""
    folders = [Path(f) for f in folders]
    if len(folders) == 1:
        return load_rows(folders[0], rescore=rescore)
    if len(set(folders)) < len(folders):
        raise ValueError(f"a folder is given twice: {', '.join(map(str, folders))}")
    # A key an older folder's config.yaml lacks (a field added since) ran at its default.
    configs = {f: {**(defaults or {}), **(yaml.safe_load((f / "config.yaml").read_text()) or {})}
               for f in folders if (f / "config.yaml").is_file()}
    problems = []
    for key in JOIN_SETTINGS:
        values = {f: c.get(key) for f, c in configs.items()}
        if len({json.dumps(v) for v in values.values()}) > 1:
            problems.append(f"{key} differs ({'; '.join(f'{v!r} in {f}' for f, v in values.items())})")
    rows: list[dict] = []
    seen: dict[tuple, Path] = {}
    for f in folders:
        for r in load_rows(f, rescore=rescore):
            key = result_key(r)
            if key in seen:
                problems.append(f"{f} and {seen[key]} both hold sample {key[0]}, route {key[1]}, budget {key[2]}")
                break
            seen[key] = f
            rows.append(r)
    if problems:
        raise ValueError("cannot join these bench folders into one report: " + "; ".join(problems)
                         + " (joined folders share the settings that change a score, and no cell)")
    return rows


def find_route(rows: list[dict], name: str) -> str:
    """The route in ``rows`` called ``name``: its exact name, or a route file's stem."""
    routes = sorted({r["route"] for r in rows})
    hits = [r for r in routes if r == name] or [r for r in routes if r.endswith(".json") and Path(r).stem == name]
    if len(hits) != 1:
        what = "no route" if not hits else f"{len(hits)} routes"
        raise ValueError(f"{what} called {name!r} in the results; routes: {', '.join(routes)}")
    return hits[0]


def parse_pools(specs: list[str] | None) -> dict[str, list[str]]:
    """``NAME=ROUTE,ROUTE[,...]`` strings (``report --pool``) as NAME -> member routes; every
    malformed one is named in one error."""
    pools: dict[str, list[str]] = {}
    bad = []
    for spec in specs or []:
        name, sep, members = spec.partition("=")
        parts = [m.strip() for m in members.split(",") if m.strip()]
        if not sep or not name.strip() or len(parts) < 2 or len(set(parts)) < len(parts) or name.strip() in pools:
            bad.append(spec)
            continue
        pools[name.strip()] = parts
    if bad:
        raise ValueError(
            f"bad --pool {', '.join(repr(b) for b in bad)}: each is NAME=ROUTE,ROUTE[,...] with a new NAME and "
            "two or more different routes (names or route file stems), e.g. split=split_ts0,split_ts1,split_ts2")
    return pools


def pool_scores(
    rows: list[dict], scores: dict[tuple[str, str], dict[str, float]], pools: dict[str, list[str]]
) -> dict[str, list[str]]:
    """Add each pool to ``scores`` as a route of its own: per budget, over the samples every
    member has, a sample's score is the mean of its members' scores (say the training seeds
    of one recipe, so that a paired interval over samples reads the recipe, not one draw).
    Returns NAME -> the members' route names in ``rows``."""
    routes = {r["route"] for r in rows}
    clash = sorted(set(pools) & (routes | {_stem(r) for r in routes}))  # names find_route would resolve
    if clash:
        raise ValueError(f"--pool names {', '.join(clash)} are routes in the results already: pick other names")
    resolved = {name: [find_route(rows, m) for m in members] for name, members in pools.items()}
    for name, members in resolved.items():
        for bk in {b for (r, b) in scores if r == members[0]}:
            pool = pooled([scores.get((m, bk), {}) for m in members])
            if pool:
                scores[(name, bk)] = pool
    return resolved


def paired_table(
    rows: list[dict],
    route: str,
    against: list[str] | None = None,
    n_boot: int = 2000,
    tasks: list[str] | None = None,
    pools: dict[str, list[str]] | None = None,
) -> str:
    """``route`` minus each route of ``against`` (default: every other route) per budget,
    paired over the same samples of the tasks the full cache solves, with a bootstrap 95 %
    interval (markdown). All-or-nothing samples make one sample worth 100 / n points:
    differences whose interval holds 0 are ties. ``tasks``: only these tasks' samples (a
    family split, say the out-of-family tasks alone). ``pools``: NAME -> routes averaged
    per sample into one route NAME (:func:`pool_scores`), usable as ``route`` or in
    ``against``; the table ends with each pool's members' own averages (the spread).
    The full cache has no budget: as ``route`` (or in ``against``) it is paired with the
    other routes at every budget, which reads how far a route is from the ceiling, and so
    whether a win over it is possible at all. ``rows``: one bench folder's result rows, or
    several folders' joined (:func:`load_folders`)."""
    if tasks:
        present = {r["task"] for r in rows}
        unknown = sorted(set(tasks) - present)
        if unknown:
            raise ValueError(f"no samples of {', '.join(unknown)} in the results; tasks: {', '.join(sorted(present))}")
        rows = [r for r in rows if r["task"] in tasks]
    _, valid = solved_tasks(rows)
    scores = sample_scores(rows, valid)
    members = pool_scores(rows, scores, pools or {})

    def pick(name: str) -> str:
        return name if name in members else find_route(rows, name)

    def at(name: str, bk: str) -> dict[str, float]:
        """A route's sample scores at one budget (JSON key); the full cache's at every budget."""
        return scores.get((name, "null" if name == "full" else bk), {})

    main = pick(route)
    mine_members = set(members.get(main, []))
    others = [pick(a) for a in against] if against else (
        sorted({r["route"] for r in rows} - {main, "full"} - mine_members) + sorted(set(members) - {main}))
    # the full cache (budget null) is paired at the budgets of the routes it is compared with
    budgeted = {main} if main != "full" else set(others)
    budgets = sorted({json.loads(b) for (r, b) in scores if b != "null" and r in budgeted}, key=_budget_order)
    n_full = len(scores.get(("full", "null"), {}))
    label = _stem(main)
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
        mine = at(main, bk)
        for o in others:
            theirs = at(o, bk)
            if not theirs or not mine:
                continue
            c = paired(mine, theirs, n_boot)
            if c["n"] == 0:
                continue
            name = _stem(o)
            ids = set(mine) & set(theirs)  # the paired samples: both scores over them
            lines.append(
                f"| {_budget_label(b)} | {name} | {c['n']} | {100 * mean(theirs[i] for i in ids):.1f} | "
                f"{100 * mean(mine[i] for i in ids):.1f} | "
                f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] | {c['verdict']} |"
            )
    lines += _pool_lines(members, scores, budgets, main, others)
    lines += _budget_step_lines(scores, main, budgets, n_boot)
    return "\n".join(lines) + "\n"


def _budget_step_lines(scores: dict, main: str, budgets: list, n_boot: int) -> list[str]:
    """More cache, never worse (issue 58): ``main`` at each budget minus itself at the next
    smaller one, paired; a drop whose interval lies below 0 is flagged (markdown lines). The
    last column is ``main`` at the smaller budget minus the full cache (:func:`budget_steps`)."""
    steps = budget_steps(scores, main, budgets, n_boot) if main != "full" else []
    if not steps:
        return []
    label = _stem(main)
    lines = ["", f"More cache, never worse: {label} at each budget minus {label} at the next smaller one "
             f"(last column: {label} at the smaller budget minus the full cache):", "",
             "| budgets | n | difference [95 % interval] | verdict | smaller budget − full cache |",
             "|---|---|---|---|---|"]
    for s in steps:
        d, above = s["vs_smaller_budget"], s["smaller_minus_full"]
        above = "n/a" if above is None else f"{100 * above:+.1f}"
        lines.append(f"| {_budget_label(s['from'])} -> {_budget_label(s['to'])} | {d['n']} | "
                     f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] | "
                     f"{'**worse with more cache**' if s['drop'] else d['verdict']} | {above} |")
    return lines


def _pool_lines(members: dict[str, list[str]], scores: dict, budgets: list, main: str, others: list[str]) -> list[str]:
    """The spread over each reported pool's members, beside its intervals (markdown lines)."""
    lines: list[str] = []
    for name, routes in members.items():  # the spread over a pool's members, beside its intervals
        if name != main and name not in others:
            continue
        lines += ["", f"Pool {name}: the mean per sample of {', '.join(_stem(r) for r in routes)}; "
                  "each member's own average (its samples in the pool), and the range:"]
        for b in budgets:
            bk = json.dumps(b)
            pool = scores.get((name, bk), {})
            if pool:
                own = [100 * mean(scores[(r, bk)][i] for i in pool) for r in routes]
                lines.append(f"- {_budget_label(b)}: {' / '.join(f'{x:.1f}' for x in own)} "
                             f"(pool {100 * mean(pool.values()):.1f}, range {max(own) - min(own):.1f})")
    return lines


def _stem(route: str) -> str:
    return Path(route).stem if route.endswith(".json") else route
