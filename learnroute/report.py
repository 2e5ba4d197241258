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

import yaml

from learnroute.config import to_dict
from learnroute.runs import result_key
from learnroute.stats import VALID_FULL, paired, pooled, sample_scores, solved_tasks
from learnroute.summary import _budget_label, _budget_order, load_rows

# Bench settings that change what a cell scores: folders joined into one paired report must
# agree on each (the samples, the routes and the budgets may differ).
JOIN_SETTINGS = ("model", "context_tokens", "query_aware", "max_new_tokens", "route_file_budgets")


def load_folders(folders: list[str | os.PathLike], rescore: bool = False) -> list[dict]:
    """Result rows of one bench folder, or of several joined into one (say one bench per
    family split, so that a paired report reads all of their samples together). Joined
    folders must agree on :data:`JOIN_SETTINGS` (read from each folder's ``config.yaml``, a
    missing key at the bench's default; a folder without one is not compared) and hold no
    cell twice; every mismatch and the first repeated cell are named in one error."""
    folders = [Path(f) for f in folders]
    if len(folders) == 1:
        return load_rows(folders[0], rescore=rescore)
    if len(set(folders)) < len(folders):
        raise ValueError(f"a folder is given twice: {', '.join(map(str, folders))}")
    from learnroute.bench import BenchConfig  # only when joining: it loads the method registry

    # A key an older folder's config.yaml lacks (a field added since) ran at its default.
    defaults = to_dict(BenchConfig())
    configs = {f: {**defaults, **(yaml.safe_load((f / "config.yaml").read_text()) or {})}
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
    folder: str | os.PathLike | list[str | os.PathLike],
    route: str,
    against: list[str] | None = None,
    n_boot: int = 2000,
    rescore: bool = False,
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
    whether a win over it is possible at all. ``folder``: one bench folder, or a list of
    them joined (:func:`load_folders`)."""
    rows = load_folders(folder if isinstance(folder, list) else [folder], rescore=rescore)
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
    return "\n".join(lines) + "\n"


def _stem(route: str) -> str:
    return Path(route).stem if route.endswith(".json") else route
