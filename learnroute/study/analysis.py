"""The study's comparisons: every question answered from the run folders alone, with
paired bootstrap intervals (``study.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean
from typing import Any

from learnroute.config import from_dict, to_dict
from learnroute.gates.config import TrainConfig
from learnroute.methods import get_method
from learnroute.route import Route
from learnroute.runs import atomic_write
from learnroute.stats import VALID_FULL, best_homogeneous, paired, pooled, sample_scores, solved_tasks
from learnroute.study.config import (
    Budget,
    CONTROLS,
    CONTROL_KINDS,
    IMPORTED,
    START,
    StudyConfig,
    safe_name,
    route_name,
    shared_starts,
)
from learnroute.study.render import plot_routes, plot_scores, to_markdown


def _label(route: str) -> str:
    """Short names for route files: learned[_<v>], profile, profile_alloc."""
    stem = Path(route).stem
    if stem.startswith("profile_"):
        return "profile_alloc" if stem.endswith("_alloc") else "profile"
    return stem if route.endswith(".json") else route


def _seed_answers(scores: dict, bk: str, seeded: list[str], refs: dict[str, dict[str, str]],
                  bootstrap: int) -> dict[str, Any]:
    """The main variant's training seeds at one budget: each seed's average, the spread, each
    seed minus its reference per question (``refs``: question -> seed -> reference route),
    and the seeds pooled (a sample's score the mean over seeds) minus the references pooled
    alike, so that the recipe, not one draw, is paired with intervals over samples. Q8's
    reference is each seed's own start: the main's (train_seed changes the optimisation, not
    the initialisation), or for a later-stage main its seed's earlier stage."""
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


def _answers(config: StudyConfig, rows: list[dict], main: str, budgets: list[Budget]) -> dict[str, Any]:
    """Questions 1-3, 5, 6, 8 and the controls per budget over ``rows`` (one protocol, one
    set of eval tasks): the tasks the full cache solves, averages, paired intervals."""
    # Route names by what they are, not by their suffix: a variant may be called cold_start.
    variant_routes = {route_name(v) for v in config.variants}
    starts = {f"{r}{START}": r for r in variant_routes}  # each warm variant's untrained start -> it
    seeds = {route_name(v) for v in config.seed_variants}
    # a later-stage main's seeds each start from their own seed of the earlier stage
    seed_start = {route_name(v): route_name(s) for v, s in config.stage_seed_variants.items()}
    stage_seeds = {route_name(v) for v in config.seeded_variants()} - seeds
    full_task, valid = solved_tasks(rows)
    all_tasks = not any(s >= VALID_FULL for s in full_task.values())  # say so in the tables
    scores = sample_scores(rows, valid)
    full = next((v for (route, _), v in scores.items() if route == "full"), {})
    routes = sorted({route for route, _ in scores})
    per_budget = []
    for b in budgets:
        bk = json.dumps(b)
        avg = {route: mean(scores[(route, bk)].values()) for route in routes if (route, bk) in scores}
        best_h = best_homogeneous(scores, bk)
        # Per task (every task, solved or not): the routes of questions 1-2; Q3 reads it too.
        wanted = {main, best_h, "profile", "profile_alloc"} - {None}
        cells: dict[str, dict[str, list[float]]] = {}
        for x in rows:  # one pass: route -> task -> scores at this budget
            if x["route"] in wanted and json.dumps(x["budget"]) == bk:
                cells.setdefault(x["route"], {}).setdefault(x["task"], []).append(float(x["score"]))
        by_task = {r: {t: mean(v) for t, v in sorted(ts.items())} for r, ts in cells.items()}
        entry: dict[str, Any] = {"budget": b, "avg": avg, "full": mean(full.values()) if full else None}
        entry["best_homogeneous"] = best_h
        for kind in CONTROL_KINDS:  # the controls: PyramidKV's and Ada-KV's allocations over that method
            ctrl = f"{kind}:{best_h.split(':', 1)[1]}" if best_h else None
            if kind == "adakv" and best_h and (ctrl, bk) not in scores and get_method(ctrl.split(":", 1)[1]).head_uniform:
                ctrl = best_h  # not benched: a method that scores every head alike has it as its Ada-KV split
            entry[f"{kind}_best"] = ctrl if (ctrl, bk) in scores else None
        if main in avg and best_h:
            m = scores[(main, bk)]
            entry["q1_vs_best_homogeneous"] = paired(m, scores[(best_h, bk)], config.bootstrap)
            for kind in CONTROL_KINDS:
                if entry[f"{kind}_best"]:
                    entry[f"q1_vs_{kind}_best"] = paired(m, scores[(entry[f"{kind}_best"], bk)], config.bootstrap)
            for p in ("profile", "profile_alloc"):
                if (p, bk) in scores:
                    entry[f"q2_vs_{p}"] = paired(m, scores[(p, bk)], config.bootstrap)
            # Q3: tasks where the learned route beats the best homogeneous route
            wins = ties = losses = 0
            for t in sorted(valid):
                if t in by_task.get(main, {}) and t in by_task.get(best_h, {}):
                    d = by_task[main][t] - by_task[best_h][t]
                    wins, ties, losses = wins + (d > 0), ties + (d == 0), losses + (d < 0)
            entry["q3_tasks"] = {"wins": wins, "ties": ties, "losses": losses, "tasks": len(valid)}
            f, h, lv = entry["full"], avg[best_h], avg[main]
            entry["q5_gap_recovered"] = (lv - h) / (f - h) if f is not None and f > h else None
            entry["q6_variants"] = {
                r: paired(scores[(r, bk)], m, config.bootstrap)
                for r in routes
                if (r.startswith("learned") or r.startswith(IMPORTED)) and r != main
                and (r not in starts or r in variant_routes) and r not in seeds and r not in stage_seeds
                and (r, bk) in scores
            }
            seeded = [main] + [r for r in routes if r in seeds and (r, bk) in scores]
            if len(seeded) > 1:  # the spread over optimisation seeds, beside the intervals over samples
                own = {r: seed_start.get(r, f"{main}{START}") for r in seeded}
                entry["seeds"] = _seed_answers(scores, bk, seeded, {"q1": dict.fromkeys(seeded, best_h),
                                               "q2": dict.fromkeys(seeded, "profile_alloc"), "q8": own},
                                               config.bootstrap)
            entry["best_homogeneous_rel_full"] = h / f if f else None
        # The ceiling: the full cache minus each reference of Q1 and Q2. Where the full cache
        # itself does not beat a reference, a route beats it only by answering what the full
        # cache gets wrong, so a tie there says little about the route (docs/log.md §0.15).
        if full:
            entry["headroom"] = {
                ref: paired(full, scores[(name, bk)], config.bootstrap)
                for ref, name in (("best_homogeneous", best_h), ("profile_alloc", "profile_alloc"))
                if name and (name, bk) in scores
            }
        # Q9: each per-head learned route minus the main route and the head-level allocator
        # adakv:<best homogeneous method>. When the main route is itself per-head there is no
        # per-layer main to beat (vs_main is None for it): Q6 reads the per-layer variants
        # against it instead
        heads = [route_name(v) for v, d in config.variants.items()
                 if {**config.train, **d}.get("granularity", TrainConfig.granularity) == "head"]
        ada = entry.get("adakv_best")
        entry["q9_per_head"] = {
            r: {"vs_main": paired(scores[(r, bk)], scores[(main, bk)], config.bootstrap)
                if main in avg and r != main else None,
                "vs_adakv": paired(scores[(r, bk)], scores[(ada, bk)], config.bootstrap) if ada else None,
                "allocated_over_kept": _allocated_over_kept(rows, r, bk)}
            for r in heads if (r, bk) in scores
        }
        # Q8: every learned route minus its own untrained start (learning's credit)
        entry["q8_vs_start"] = {
            v: paired(scores[(v, bk)], scores[(s, bk)], config.bootstrap)
            for s, v in sorted(starts.items(), key=lambda x: x[1])
            if (s, bk) in scores and (v, bk) in scores
        }
        entry["by_task"] = by_task
        per_budget.append(entry)
    return {
        "main_vs_smaller_budget": budget_steps(scores, main, budgets, config.bootstrap),
        "valid_tasks": sorted(valid),
        "left_out_tasks": sorted(set(full_task) - valid),
        "no_task_qualifies": all_tasks,
        "full_by_task": full_task,
        "n_eval_samples": len(full),
        "budgets": per_budget,
    }


def budget_steps(scores: dict, route: str, budgets: list[Budget], bootstrap: int) -> list[dict[str, Any]]:
    """More cache must never answer worse (issue 58): ``route`` at each budget minus itself
    at the next smaller budget of the same kind (tokens or fractions), paired over the same
    samples. ``drop`` when the interval lies below 0, a loss to itself with less cache."""
    steps = []
    for kind in (int, float):
        mine = sorted(b for b in budgets if type(b) is kind and (route, json.dumps(b)) in scores)
        for small, large in zip(mine, mine[1:]):
            d = paired(scores[(route, json.dumps(large))], scores[(route, json.dumps(small))], bootstrap)
            steps.append({"from": small, "to": large, "vs_smaller_budget": d, "drop": d["verdict"] == "loss"})
    return steps


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

    from learnroute.summary import load_rows

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
    result: dict[str, Any] = {"schema": "learnroute.study/1", "config": to_dict(config), "answers": f"{stem}.md",
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
            if r["route"] == f"{main}_at_{r['budget']}":  # the per-budget routes, one row in the tables
                r["route"] = f"{main}_per_budget"
        aliases = shared_starts(folder / "routes")  # a shared start answers for every variant it starts
        rows += [{**r, "route": alias} for alias, same in aliases.items() for r in rows if r["route"] == same]
        answers = _answers(config, rows, main, config.protocol_budgets(protocol))
        # In-family (eval tasks that calibrated the routes) and out-of-family (tasks they
        # never saw), side by side with the same questions and intervals.
        split = family_split(rows, config.calibration)
        if split["in"] and split["out"]:
            answers["families"] = {k: _answers(config, v, main, config.protocol_budgets(protocol)) for k, v in split.items()}
        result["protocols"][protocol] = answers
    placement = folder / "placement" / "placement.json"
    if placement.is_file():
        p = json.loads(placement.read_text())
        result["q4_placement"] = {k: p[k] for k in ("rank", "of", "ties", "given_score", "better_than_fraction")}
        chosen = config.placement_choice(folder / "routes")  # its route file's stem names it
        result["q4_placement"]["variant"] = config.placement_path(folder / "routes", chosen or "?").stem
    atomic_write(folder / f"{stem}.json", json.dumps(result, indent=1) + "\n")
    atomic_write(folder / f"{stem}.md", to_markdown(result, main))
    if stem != "study":  # the study's own figures stay its main's
        return result
    plot_scores(result, main, folder / "scores.png")
    routes_file = folder / "routes" / f"{main}.json"
    profile_alloc = folder / "profile" / f"profile_{config.profiled_budget}_alloc.json"
    if routes_file.is_file() and profile_alloc.is_file():
        plot_routes(Route.from_file(routes_file), Route.from_file(profile_alloc), folder / "routes.png")
    return result
