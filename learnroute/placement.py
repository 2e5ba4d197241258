"""Placement study: does *where* methods sit matter, with their counts held fixed?

Given a route (e.g. 12 layers SnapKV, 10 TOVA, 8 Knorm), draw N distinct random
placements of the same methods across layers (seeded; each layer keeps the route's budget
for that layer), evaluate them all and the given route on eval tasks through the bench
(same engine, same samples; same-shape routes decode as one batch), and report the given
route's rank among them with the score distribution.

The run folder is a bench folder (re-scorable with ``learnroute report``) plus
``routes/`` (every placement as a route file), ``placement.json``, ``placement.md`` and
``placement.png`` (histogram, the given route marked).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from learnroute.bench import BenchConfig, run_bench
from learnroute.runs import DTYPE_HELP, Dtype, atomic_write, prepare_folder, process_state
from learnroute.config import to_dict
from learnroute.route import Route, RouteError

GIVEN = "given.json"


@dataclass
class PlacementConfig:
    """What ``learnroute placement`` evaluates."""

    route: str = field(default="", metadata={"help": "route file whose method placement is tested"})
    n_placements: int = field(default=100, metadata={"help": "random placements drawn (distinct)"})
    placement_seed: int = field(default=0, metadata={"help": "seed of the placement draws"})
    model: str | None = field(default=None, metadata={"help": "HF model folder or hub id; null = bundled SmolLM2"})
    tasks: dict[str, int] = field(
        default_factory=lambda: {"niah_single_2": 4}, metadata={"help": "eval task -> number of samples"}
    )
    context_tokens: int = field(default=2048, metadata={"help": "context length of generated samples (tokens)"})
    include_full: bool = field(default=True, metadata={"help": "also run the full cache (reference line)"})
    query_aware: bool = field(default=False, metadata={"help": "put the question in the prefill (scored)"})
    seed: int = field(default=0, metadata={"help": "seed of the eval sample stream"})
    max_new_tokens: int | None = field(default=None, metadata={"help": "answer token cap; null = per task"})
    max_batch: int = field(default=32, metadata={"help": "most same-shape routes decoded as one batch"})
    stop_at_final_score: bool = field(
        default=False, metadata={"help": "end an answer once its score can no longer change (bench's option)"}
    )
    longbench_dir: str | None = field(default=None, metadata={"help": "folder of LongBench JSONL files"})
    dtype: Dtype = field(default="float32", metadata={"help": DTYPE_HELP})
    device: str = field(
        default="auto", metadata={"help": "auto (CUDA when available) | cpu | cuda (refused without CUDA)"}
    )
    output: str = field(default="runs/placement", metadata={"help": "run folder"})

    def validate(self) -> list[str]:
        """Problems that need no model, the bench's own checks included (sizes, tasks)."""
        problems = []
        if not self.route:
            problems.append("route is required: the route file whose placement is tested")
        elif not Path(self.route).is_file():
            problems.append(f"route file {self.route} does not exist")
        else:
            try:
                Route.from_file(self.route)
            except RouteError as e:
                problems.append(str(e))
        if self.n_placements < 1:
            problems.append(f"n_placements must be >= 1, got {self.n_placements}")
        # The placement route files are written only when the run starts, so the bench
        # checks everything else with the full cache standing in for them.
        problems += dataclasses.replace(self.bench_config(), routes=["full"]).validate()
        return problems

    def bench_config(self) -> BenchConfig:
        """The bench run that evaluates the placements (route files under ``output/routes``)."""
        out = Path(self.output)
        return BenchConfig(
            model=self.model,
            tasks=self.tasks,
            context_tokens=self.context_tokens,
            budgets=[1.0],  # unused: route files run at their own budgets (route_file_budgets=file)
            routes=(["full"] if self.include_full else []) + [str(out / "routes" / "*.json")],
            route_file_budgets="file",
            query_aware=self.query_aware,
            seed=self.seed,
            max_new_tokens=self.max_new_tokens,
            max_batch=self.max_batch,
            stop_at_final_score=self.stop_at_final_score,
            longbench_dir=self.longbench_dir,
            device=self.device,
            dtype=self.dtype,
            output=str(out),
        )


def n_distinct_placements(methods: list[str]) -> int:
    """How many different placements the method counts allow (a multinomial coefficient)."""
    total = math.factorial(len(methods))
    for c in Counter(methods).values():
        total //= math.factorial(c)
    return total


def draw_placements(route: Route, n: int, seed: int) -> list[Route]:
    """Up to ``n`` distinct random placements of ``route``'s methods, none equal to it.

    Per-layer budgets stay with the layer; only methods move. Fewer than ``n`` come back
    when the counts allow fewer distinct placements.
    """
    rng = random.Random(seed)
    possible = n_distinct_placements(route.methods) - 1
    want = min(n, possible)
    seen = {tuple(route.methods)}
    out = []
    while len(out) < want:
        methods = list(route.methods)
        rng.shuffle(methods)
        if tuple(methods) in seen:
            continue
        seen.add(tuple(methods))
        prov = {"source": "placement", "of": route.provenance, "placement_seed": seed, "index": len(out)}
        out.append(Route.from_layers(methods, route.budgets, model=route.model, **prov))
    return out


def _write_routes(folder: Path, given: Route, placements: list[Route]) -> list[Path]:
    """Route files under ``folder``; an existing different file is refused (no silent overwrite)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, route in [(GIVEN, given)] + [(f"placement_{i:03d}.json", r) for i, r in enumerate(placements)]:
        path = folder / name
        if path.is_file() and Route.from_file(path).to_dict() != route.to_dict():
            raise RouteError(f"{path} exists with another route; use another output or --overwrite")
        if not path.is_file():
            route.to_file(path)
        paths.append(path)
    return paths


def rank_of(scores: dict[str, float], given: str) -> dict[str, Any]:
    """Rank of ``given`` (1 = best) among all routes; ties share the better rank."""
    g = scores[given]
    others = [s for name, s in scores.items() if name != given]
    better = sum(s > g for s in others)
    ties = sum(s == g for s in others)
    return {
        "rank": 1 + better,
        "of": len(scores),
        "ties": ties,
        "given_score": g,
        "better_than_fraction": sum(s < g for s in others) / len(others) if others else 0.0,
    }


def histogram(scores: list[float], given: float, full: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.hist(
        [100 * s for s in scores],
        bins=min(30, max(5, len(scores) // 3)),
        color="tab:blue",
        alpha=0.7,
        label="random placements",
    )
    ax.axvline(100 * given, color="tab:red", lw=2, label="given route")
    if full is not None:
        ax.axvline(100 * full, color="black", ls="--", label="full cache")
    ax.set_xlabel("average score (x100)")
    ax.set_ylabel("placements")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_placement(config: PlacementConfig, overwrite: bool = False, *, prefills=None) -> Path:
    """Draw placements, evaluate them through the bench, and report the given route's rank
    (``prefills``: a :class:`~learnroute.engine.PrefillStore` shared with other stages)."""
    from learnroute.report import AVG, aggregate, load_rows

    out = Path(config.output)
    given = Route.from_file(config.route)
    placements = draw_placements(given, config.n_placements, config.placement_seed)
    if not placements:
        raise RouteError(
            f"route {config.route} uses one method in every layer ({given.methods[0]}): "
            "there is no other placement of its methods to compare with"
        )
    if len(placements) < config.n_placements:
        print(f"note: only {len(placements)} distinct placements exist for these method counts")
    bench = config.bench_config()
    # Under torchrun the bench shards the samples; rank 0 alone writes files (the others
    # draw the same placements, so they read the same route files).
    state = process_state()
    if state.is_main_process:
        # Check (or, with overwrite, move aside) the folder before writing route files into it.
        prepare_folder(bench, overwrite, is_main=True)
        _write_routes(out / "routes", given, placements)
        atomic_write(out / "placement.yaml", yaml.safe_dump(to_dict(config), sort_keys=False))
    else:
        prepare_folder(bench, overwrite, is_main=False)  # a different config: every rank refuses
    state.wait_for_everyone()
    run_bench(bench, prefills=prefills)
    if not state.is_main_process:
        return out
    table = aggregate(load_rows(out))
    scores = {t["route"]: t["score"] for t in table if t["task"] == AVG and t["route"] != "full"}
    full = next((t["score"] for t in table if t["task"] == AVG and t["route"] == "full"), None)
    given_name = str(out / "routes" / GIVEN)
    result = {
        "schema": "learnroute.placement/1",
        "route": config.route,
        "method_counts": given.method_counts(),
        "n_placements": len(placements),
        "distinct_possible": n_distinct_placements(given.methods),
        **rank_of(scores, given_name),
        "full_score": full,
        "placement_scores": sorted(s for name, s in scores.items() if name != given_name),
        "config": to_dict(config),
    }
    atomic_write(out / "placement.json", json.dumps(result, indent=1) + "\n")
    histogram(result["placement_scores"], result["given_score"], full, out / "placement.png")
    pct = 100 * result["better_than_fraction"]
    md = [
        "# Placement study",
        "",
        f"Route `{config.route}` ({', '.join(f'{m}: {c}' for m, c in sorted(given.method_counts().items()))}).",
        "",
        f"- rank **{result['rank']} of {result['of']}** (1 = best; {result['ties']} placements tie with it)",
        f"- better than {pct:.0f}% of {len(placements)} random placements of the same methods",
        f"- given route: {100 * result['given_score']:.1f}; placements: min {100 * min(result['placement_scores']):.1f}, "
        f"median {100 * result['placement_scores'][len(placements) // 2]:.1f}, max {100 * max(result['placement_scores']):.1f}"
        + (f"; full cache {100 * full:.1f}" if full is not None else ""),
        "",
    ]
    atomic_write(out / "placement.md", "\n".join(md))
    return out
