"""The study's comparisons: every question answered from the run folders alone, with
paired bootstrap intervals (``study.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from learnroute.config import from_dict, to_dict
from learnroute.methods import get_method
from learnroute.route import Route
from learnroute.runs import atomic_write
from learnroute.report import VALID_FULL, best_homogeneous, budget_steps, paired, pooled, sample_scores, solved_tasks
from learnroute.study.config import CONTROL_KINDS, CONTROLS, START, Budget, StudyConfig, route_name, safe_name
from learnroute.budget_routes import route_at
from learnroute.study.manifest import RouteEntry, build_manifest, read_manifest
from learnroute.study.render import plot_routes, plot_scores, to_markdown

PER_BUDGET = "_per_budget"  # the main variant's per-budget routes, one row in the tables


def _label(route: str) -> str:
    """Short names for route files: learned[_<v>], profile, profile_alloc."""
    stem = Path(route).stem
    if stem.startswith("profile_"):
        return "profile_alloc" if stem.endswith("_alloc") else "profile"
    return stem if route.endswith(".json") else route


def _seed_answers(scores: dict, bk: str, seeded: list[str], refs: dict[str, dict[str, str]],
                  bootstrap: int) -> dict[str, Any]:
    """The main variant's training seeds at one budget: each seed's average, the spread, each
    seed minus its reference per comparison (``refs``: comparison -> seed -> reference
    route), and the seeds pooled (a sample's score the mean over seeds) minus the references
    pooled alike, so that the recipe, not one draw, is paired with intervals over samples.
    ``vs_start``'s reference is each seed's own start (the manifest's): the main's
    (train_seed changes the optimisation, not the initialisation), or for a later-stage main
    its seed's earlier stage."""
    means = [mean(scores[(r, bk)].values()) for r in seeded]
    out: dict[str, Any] = {
        "routes": dict(zip(seeded, means)),
        "min": min(means), "max": max(means),
        "sd": (sum((x - mean(means)) ** 2 for x in means) / (len(means) - 1)) ** 0.5,
    }
    pool = pooled([scores[(r, bk)] for r in seeded])
    out["pooled"] = {"avg": mean(pool.values()) if pool else None, "n": len(pool)}
    for key, ref in refs.items():
        if all((x, bk) in scores for x in ref.values()):
            out[key] = {r: paired(scores[(r, bk)], scores[(ref[r], bk)], bootstrap) for r in seeded}
            out["pooled"][key] = paired(pool, pooled([scores[(ref[r], bk)] for r in seeded]), bootstrap)
    return out


@dataclass
class _Roles:
    """Which route plays which part in the comparisons, read off the manifest."""

    main: str  # the main route's name
    main_start: str  # its untrained start
    variants: set[str]  # compared with the main route (variants_vs_main)
    starts: dict[str, str]  # untrained start -> its learned route (vs_start)
    seeds: dict[str, str]  # the main variant's seed routes -> each one's own start
    per_head: set[str]  # learned per-head routes (per_head)

    @classmethod
    def of(cls, entries: list[RouteEntry], main_variant: str, main: str) -> _Roles:
        seeds = {e.name: e.start or f"{main}{START}" for e in entries if e.kind == "seed" and e.variant == main_variant}
        # Without seeds of the main variant (another main asked for), seed routes are variants.
        ordinary = [e for e in entries if e.kind == "learned" or (e.kind == "seed" and not seeds)]
        own = next((e for e in entries if e.name == main and e.kind == "learned"), None)
        variants = {e.name for e in ordinary} | {e.name for e in entries if e.kind in ("mixture", "imported")}
        starts = {e.start: e.name for e in entries if e.kind == "learned" and e.start}
        if any(e.kind == "per_budget" and e.variant == main_variant for e in entries):  # one row: see analyze
            variants.add(f"{main}{PER_BUDGET}")
            starts[f"{main}{PER_BUDGET}{START}"] = f"{main}{PER_BUDGET}"
        variants |= {e.name for e in entries if e.kind == "per_budget" and e.variant != main_variant}
        return cls(main, (own.start if own and own.start else f"{main}{START}"), variants - {main}, starts, seeds,
                   {e.name for e in ordinary if e.per_head})


def roles(config: StudyConfig, entries: list[RouteEntry] | None = None) -> _Roles:
    """Who is who in ``config``'s comparisons: from the manifest ``entries``, or the one the
    config implies."""
    entries = build_manifest(config) if entries is None else entries
    return _Roles.of(entries, config.main_variant, route_name(config.main_variant))


def _answers(config: StudyConfig, rows: list[dict], roles: _Roles, budgets: list[Budget]) -> dict[str, Any]:
    """The comparisons per budget over ``rows`` (one protocol, one set of eval tasks): the
    tasks the full cache solves, averages, paired intervals."""
    full_task, valid = solved_tasks(rows)
    scores = sample_scores(rows, valid)
    full = next((v for (route, _), v in scores.items() if route == "full"), {})
    per_budget = [_at_budget(config, rows, scores, valid, full, roles, b) for b in budgets]
    return {
        "main_vs_smaller_budget": budget_steps(scores, roles.main, budgets, config.bootstrap),
        "valid_tasks": sorted(valid),
        "left_out_tasks": sorted(set(full_task) - valid),
        "no_task_qualifies": not any(s >= VALID_FULL for s in full_task.values()),  # say so in the tables
        "full_by_task": full_task,
        "n_eval_samples": len(full),
        "budgets": per_budget,
    }


def _by_task(rows: list[dict], routes: set[str], bk: str) -> dict[str, dict[str, float]]:
    """Per route (of ``routes``), per task (every task, solved or not), its mean score at one budget."""
    cells: dict[str, dict[str, list[float]]] = {}
    for x in rows:  # one pass: route -> task -> scores at this budget
        if x["route"] in routes and json.dumps(x["budget"]) == bk:
            cells.setdefault(x["route"], {}).setdefault(x["task"], []).append(float(x["score"]))
    return {r: {t: mean(v) for t, v in sorted(ts.items())} for r, ts in cells.items()}


def _at_budget(config: StudyConfig, rows: list[dict], scores: dict, valid: set, full: dict, roles: _Roles,
               b: Budget) -> dict[str, Any]:
    """Every comparison at budget ``b``; each key names what it compares (study.md labels
    them with the study's question numbers)."""
    bk, main, boot = json.dumps(b), roles.main, config.bootstrap
    routes = sorted({route for route, _ in scores})
    avg = {route: mean(scores[(route, bk)].values()) for route in routes if (route, bk) in scores}
    best_h = best_homogeneous(scores, bk)
    by_task = _by_task(rows, {main, best_h, "profile", "profile_alloc"} - {None}, bk)
    entry: dict[str, Any] = {"budget": b, "avg": avg, "full": mean(full.values()) if full else None}
    entry["best_homogeneous"] = best_h
    for kind in CONTROL_KINDS:  # the controls: PyramidKV's and Ada-KV's allocations over that method
        ctrl = f"{kind}:{best_h.split(':', 1)[1]}" if best_h else None
        if kind == "adakv" and best_h and (ctrl, bk) not in scores and get_method(ctrl.split(":", 1)[1]).head_uniform:
            ctrl = best_h  # not benched: a method that scores every head alike has it as its Ada-KV split
        entry[f"{kind}_best"] = ctrl if (ctrl, bk) in scores else None
    if main in avg and best_h:
        m = scores[(main, bk)]
        entry["vs_best_homogeneous"] = paired(m, scores[(best_h, bk)], boot)
        for kind in CONTROL_KINDS:
            if entry[f"{kind}_best"]:
                entry[f"vs_{kind}_best"] = paired(m, scores[(entry[f"{kind}_best"], bk)], boot)
        for p in ("profile", "profile_alloc"):
            if (p, bk) in scores:
                entry[f"vs_{p}"] = paired(m, scores[(p, bk)], boot)
        # the tasks where the learned route beats the best homogeneous route
        diffs = [by_task[main][t] - by_task[best_h][t] for t in sorted(valid)
                 if t in by_task.get(main, {}) and t in by_task.get(best_h, {})]
        entry["task_wins"] = {"wins": sum(d > 0 for d in diffs), "ties": sum(d == 0 for d in diffs),
                              "losses": sum(d < 0 for d in diffs), "tasks": len(valid)}
        f, h, lv = entry["full"], avg[best_h], avg[main]
        entry["gap_recovered"] = (lv - h) / (f - h) if f is not None and f > h else None
        entry["variants_vs_main"] = {r: paired(scores[(r, bk)], m, boot) for r in routes
                                     if r in roles.variants and (r, bk) in scores}
        seeded = [main] + [r for r in routes if r in roles.seeds and (r, bk) in scores]
        if len(seeded) > 1:  # the spread over optimisation seeds, beside the intervals over samples
            own = {r: roles.seeds.get(r, roles.main_start) for r in seeded}
            entry["seeds"] = _seed_answers(scores, bk, seeded, {"vs_best_homogeneous": dict.fromkeys(seeded, best_h),
                                           "vs_profile_alloc": dict.fromkeys(seeded, "profile_alloc"),
                                           "vs_start": own}, boot)
        entry["best_homogeneous_rel_full"] = h / f if f else None
    # The ceiling: the full cache minus each reference of Q1 and Q2. Where the full cache
    # itself does not beat a reference, a route beats it only by answering what the full
    # cache gets wrong, so a tie there says little about the route (docs/log.md §0.15).
    if full:
        entry["headroom"] = {
            ref: paired(full, scores[(name, bk)], boot)
            for ref, name in (("best_homogeneous", best_h), ("profile_alloc", "profile_alloc"))
            if name and (name, bk) in scores
        }
    # Each per-head learned route minus the main route and the head-level allocator
    # adakv:<best homogeneous method>. When the main route is itself per-head there is no
    # per-layer main to beat (vs_main is None for it): variants_vs_main reads the per-layer
    # variants against it instead.
    ada = entry.get("adakv_best")
    entry["per_head"] = {
        r: {"vs_main": paired(scores[(r, bk)], scores[(main, bk)], boot) if main in avg and r != main else None,
            "vs_adakv": paired(scores[(r, bk)], scores[(ada, bk)], boot) if ada else None,
            "allocated_over_kept": _allocated_over_kept(rows, r, bk)}
        for r in sorted(roles.per_head) if (r, bk) in scores
    }
    # every learned route minus its own untrained start (learning's credit)
    entry["vs_start"] = {
        v: paired(scores[(v, bk)], scores[(s, bk)], boot)
        for s, v in sorted(roles.starts.items(), key=lambda x: x[1])
        if (s, bk) in scores and (v, bk) in scores
    }
    entry["by_task"] = by_task
    return entry


def family_split(rows: list[dict], calibration: dict[str, int]) -> dict[str, list[dict]]:
    """Bench rows in-family (``"in"``: tasks the routes were calibrated on) and
    out-of-family (``"out"``: tasks they never saw)."""
    return {"in": [r for r in rows if r["task"] in calibration], "out": [r for r in rows if r["task"] not in calibration]}


def _allocated_over_kept(rows: list[dict], route: str, budget_key: str) -> float | None:
    """The cache ``route`` allocates (its heads padded to each layer's longest) over the
    tokens it keeps, summed over its answers at one budget; None for rows without both."""
    kept = alloc = 0
    for x in rows:
        if x["route"] == route and json.dumps(x["budget"]) == budget_key:
            if x.get("kv_bytes") is None or x.get("allocated_kv_bytes") is None:
                return None
            kept, alloc = kept + x["kv_bytes"], alloc + x["allocated_kv_bytes"]
    return alloc / kept if kept else None


def analyze(folder: str | Path, rescore: bool = False, main_variant: str | None = None) -> dict[str, Any]:
    """The study's answers from its folders alone; writes study.json and study.md.

    ``main_variant``: ask every question of another trained variant instead of the config's
    main (say a candidate for the default recipe), written to ``study_<variant>.json`` and
    ``.md`` beside the study's own answers, which stay as they are. The config's ``seeds``
    are the config main's: with another main they are compared as ordinary variants (Q6)."""
    import dataclasses

    import yaml

    from learnroute.report import load_rows

    folder = Path(folder)
    config = from_dict(StudyConfig, yaml.safe_load((folder / "config.yaml").read_text()) or {})
    stem = "study"
    if main_variant is not None and main_variant != config.main_variant:
        stem = f"study_{safe_name(main_variant)}"
        if main_variant not in config.variants:
            raise ValueError(f"main variant {main_variant!r} is not a variant of {folder / 'config.yaml'}; "
                             f"variants: {', '.join(config.variants)}")
        # the config main's seeds: ordinary variants now
        config = dataclasses.replace(config, main_variant=main_variant, seeds=None,
                                     variants={**config.variants, **config.seeded_variants()})
    main = route_name(config.main_variant)
    entries = read_manifest(folder / "routes", config)
    who = roles(config, entries)
    merged = {e.name: f"{main}{PER_BUDGET}" for e in entries
              if e.kind == "per_budget" and e.variant == config.main_variant}
    merged |= {e.name: f"{main}{PER_BUDGET}{START}" for e in entries if e.kind == "start" and e.start_of in merged}
    result: dict[str, Any] = {"schema": "learnroute.study/2", "config": to_dict(config), "answers": f"{stem}.md",
                              "protocols": {}}
    for protocol in config.protocols:
        bench = folder / f"bench_{protocol}"
        if not (bench / "results.jsonl").is_file():
            continue
        rows = load_rows(bench, rescore=rescore)
        controls = folder / f"bench_{protocol}{CONTROLS}"
        if (controls / "results.jsonl").is_file():  # the same eval samples, the pyramid and adakv controls
            rows += [r for r in load_rows(controls, rescore=rescore) if r["route"] != "full"]
        for r in rows:
            r["route"] = _label(r["route"])
        # a start left out because an identical one is benched answers for its route too
        for e in entries:
            if e.benched_as is not None:
                rows += [{**r, "route": e.name} for r in rows if r["route"] == e.benched_as
                         and (e.budget is None or json.dumps(r["budget"]) == json.dumps(e.budget))]
        for r in rows:  # the main variant's per-budget routes (and their starts): one row in the tables
            r["route"] = merged.get(r["route"], r["route"])
        answers = _answers(config, rows, who, config.protocol_budgets(protocol))
        # In-family (eval tasks that calibrated the routes) and out-of-family (tasks they
        # never saw), side by side with the same questions and intervals.
        split = family_split(rows, config.calibration)
        if split["in"] and split["out"]:
            answers["families"] = {k: _answers(config, v, who, config.protocol_budgets(protocol))
                                   for k, v in split.items()}
        result["protocols"][protocol] = answers
    placement = folder / "placement" / "placement.json"
    if placement.is_file():
        p = json.loads(placement.read_text())
        result["placement"] = {k: p[k] for k in ("rank", "of", "ties", "given_score", "better_than_fraction")}
        chosen = config.placement_choice(folder / "routes")  # its route file's stem names it
        result["placement"]["variant"] = config.placement_path(folder / "routes", chosen or "?").stem
    atomic_write(folder / f"{stem}.json", json.dumps(result, indent=1) + "\n")
    atomic_write(folder / f"{stem}.md", to_markdown(result, main))
    if stem != "study":  # the study's own figures stay its main's
        return result
    plot_scores(result, main, folder / "scores.png")
    routes_file = folder / "routes" / f"{main}.json"
    profile_alloc = folder / "profile" / f"profile_{config.profiled_budget}_alloc.json"
    if routes_file.is_file() and profile_alloc.is_file():
        plot_routes(route_at(routes_file), Route.from_file(profile_alloc), folder / "routes.png")
    return result
