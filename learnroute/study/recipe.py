"""The study's stages, read top to bottom: profile, train, export, bench (and its controls),
placement, then the answers (:func:`learnroute.study.analysis.analyze`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learnroute.config import from_dict
from learnroute.gates.config import TrainConfig
from learnroute.methods import get_method
from learnroute.route import Route
from learnroute.report import best_homogeneous, sample_scores, solved_tasks
from learnroute.study.analysis import analyze, family_split
from learnroute.study.config import (
    CONTROLS,
    GROWABLE,
    IMPORTED,
    START,
    StudyConfig,
    is_warm,
    route_name,
)
from learnroute.budget_routes import load_route_file, route_at
from learnroute.study.manifest import build_manifest, read_manifest, write_manifest


def run_study(config: StudyConfig, overwrite: bool = False) -> Path:
    """Run (or resume) every stage; returns the study folder with study.md.

    Under torchrun / accelerate launch: the profile, training, bench and placement shard
    their samples across ranks; the exports and the analysis run on rank 0 while the others
    wait. Every rank decides what is left from the same files, after a barrier.
    """
    from learnroute.engine import PrefillStore
    from learnroute.runs import prepare_folder, process_state

    state = process_state()
    # A study grows: variants and seeds added later train and bench; finished ones are kept.
    out = prepare_folder(config, overwrite, is_main=state.is_main_process, growable=GROWABLE)
    state.wait_for_everyone()
    # Every stage of this process shares its prefills (the same samples come back stage
    # after stage); results are those of separate prefills.
    prefills = PrefillStore(int(config.prefill_cache_gib * 2**30))
    run = _Stages(config, out, state, prefills)
    run.profile()
    variants = config.variant_configs(out)  # resolves @profile tokens: after the profile
    run.train(variants)
    routes = run.export(variants)
    for protocol in config.protocols:
        run.bench(protocol, routes)
    if config.placements > 0:
        run.placement(routes)
    if prefills.made or prefills.hits:
        _say(f"rank {state.process_index}: {prefills.summary()}")
    prefills.clear()  # nothing of the stages is held through the analysis
    if run.first:
        analyze(out)
    state.wait_for_everyone()  # every rank returns a folder with study.md
    return out


@dataclass
class _Stages:
    """The study's stages, each resumable on its own, run in order by :func:`run_study`."""

    config: StudyConfig
    out: Path
    state: Any  # accelerate's process state (rank, barriers)
    prefills: Any = None  # learnroute.engine.PrefillStore: every stage's engines share it

    @property
    def first(self) -> bool:
        return self.state.is_main_process

    def log(self, msg: str) -> None:
        if self.first:
            _say(msg)

    def profile(self) -> None:
        """1. Per-layer damage on calibration samples (samples sharded across ranks;
        skipped once profile.json exists)."""
        from learnroute.profile import ProfileConfig, run_profile

        config, out = self.config, self.out
        # Every rank decides from the same file: rank 0 writes profile.json only after
        # every rank has entered run_profile and finished its shard.
        if not (out / "profile" / "profile.json").is_file():
            self.log("stage 1/5: profile on calibration samples")
            run_profile(
                ProfileConfig(
                    model=config.model,
                    tasks=dict(config.calibration),
                    context_tokens=config.context_tokens,
                    budgets=config.profile_budgets,
                    methods=list(config.methods),
                    seed=config.calibration_seed,
                    device=config.device,
                    dtype=config.dtype,
                    output=str(out / "profile"),
                ),
                progress=self.first,
                prefills=self.prefills,
            )
        self.state.wait_for_everyone()

    def train(self, variants: dict[str, dict[str, Any]]) -> None:
        """2. Every variant's gates, on the same calibration samples (skipped once route.json exists)."""
        from learnroute.gates.calibration import CalibrationStore
        from learnroute.gates.train import run_train

        # The variants share one calibration set: prefilled once for all of them, and
        # released when the stage ends (the bench and placement stages need none of it).
        calibration = CalibrationStore()
        for name, data in variants.items():
            tcfg = from_dict(TrainConfig, data)
            if not (Path(tcfg.output) / "route.json").is_file():
                self.log(f"stage 2/5: train variant {name!r}")
                run_train(tcfg, calibration=calibration, prefills=self.prefills)
                self.state.wait_for_everyone()  # rank 0 writes route.json last
        calibration.clear()

    def export(self, variants: dict[str, dict[str, Any]]) -> Path:
        """3. Every variant's route (and mixture route) into ``routes/``: cheap, always
        rewritten from the checkpoints (rank 0). Returns the folder."""
        from learnroute.gates.export import export_cli, export_start

        routes = self.out / "routes"
        if self.first:
            routes.mkdir(exist_ok=True)
            shared: dict[str, str] = {}  # start -> an identical earlier start, benched in its place
            starts: list[tuple[str, Route]] = []
            seeded = self.config.seeded_variants()  # no untrained start of their own
            for name, data in variants.items():
                run = Path(data["output"])
                # a budget_slope variant learned an allocation per budget: all of them, in one file
                export_cli(run, routes / f"{route_name(name)}.json", per_budget="auto")
                if name in self.config.mixture_of:
                    export_cli(run, routes / f"{route_name(name)}_mixture.json", mixture=True)
                if is_warm(data) and name not in seeded:  # the control: the variant untrained (once)
                    start = f"{route_name(name)}{START}"
                    route = export_start(run, routes / f"{start}.json")
                    # Variants that differ only in training (a penalty, a floor, a stream) share
                    # one start: bench it once, answer each variant's question 8 against it.
                    same = next((n for n, r in starts if r.layers == route.layers and r.model == route.model), None)
                    if same is None:
                        starts.append((start, route))
                    else:
                        shared[start] = same
            # What each route is (whose start, which seed, pinned to which budget): the bench
            # and the analysis read it here, not from the names.
            write_manifest(routes, build_manifest(self.config, shared))
            # Routes made elsewhere (trained at another length, on other families) travel
            # into the run folder, so that it holds everything its tables were made from.
            for name, path in self.config.imported_routes.items():
                load_route_file(path).to_file(routes / f"{IMPORTED}{name}.json")
        self.state.wait_for_everyone()
        return routes

    def bench_routes(self, protocol: str, routes: Path) -> list[str]:
        """The route specs one protocol benches: full, homogeneous, pyramid, the profile's and
        every route of the manifest (a start benched in another's place left out; a route
        trained for one budget at that budget only, in the protocols that have it)."""
        config, prof = self.config, self.out / "profile"
        budgets = config.protocol_budgets(protocol)
        specs = ["full"] + [f"homogeneous:{m}" for m in config.methods] + [f"pyramid:{m}" for m in config.pyramid]
        if config.profile_all_budgets:  # each budget's profile routes at that budget only
            specs += [str(prof / f"profile_{b}{s}.json@{b}") for b in budgets for s in ("", "_alloc")]
        else:
            pb = config.profiled_budget
            specs += [str(prof / f"profile_{pb}.json"), str(prof / f"profile_{pb}_alloc.json")]
        for e in read_manifest(routes, config):
            if e.benched_as is None and (e.budget is None or e.budget in budgets):
                specs.append(f"{routes / e.name}.json" + ("" if e.budget is None else f"@{e.budget}"))
        return specs

    def bench(self, protocol: str, routes: Path) -> None:
        """4. Eval samples, one protocol at its own budgets (bench skips finished samples)."""
        from learnroute.bench import run_bench

        self.log(f"stage 4/5: bench ({protocol}) on eval samples")
        run_bench(self.bench_config(protocol, self.bench_routes(protocol, routes), f"bench_{protocol}"),
                  prefills=self.prefills)
        self.controls(protocol)

    def bench_config(self, protocol: str, routes: list[str], folder: str):
        """A bench of ``routes`` on the study's eval samples, at the protocol's budgets, into ``folder``."""
        from learnroute.bench import BenchConfig

        config = self.config
        return BenchConfig(
            model=config.model,
            tasks=dict(config.eval_tasks),
            context_tokens=config.context_tokens,
            budgets=config.protocol_budgets(protocol),
            routes=routes,
            query_aware=protocol == "aware",
            seed=config.eval_seed,
            max_new_tokens=config.max_new_tokens,
            stop_at_final_score=config.stop_at_final_score,
            device=config.device,
            dtype=config.dtype,
            output=str(self.out / folder),
        )

    def controls(self, protocol: str) -> None:
        """4b. The controls ``pyramid:<best method>`` (PyramidKV's allocation over layers) and
        ``adakv:<best method>`` (Ada-KV's over each layer's KV heads) over the method whose
        homogeneous route did best at each budget (known only once the bench has run; over
        all eval samples, and in- and out-of-family apart), on the same eval samples, into
        ``bench_<protocol>_controls/``."""
        from learnroute.bench import run_bench
        from learnroute.report import load_rows

        config = self.config
        rows = load_rows(self.out / f"bench_{protocol}")
        # The best method over all eval samples, and over each family split on its own (the
        # in- and out-of-family answers compare against their own split's best method).
        best = set()
        for part in (rows, *family_split(rows, config.calibration).values()):
            if part:
                scores = sample_scores(part, solved_tasks(part)[1])
                best |= {best_homogeneous(scores, json.dumps(b)) for b in config.protocol_budgets(protocol)}
        best -= {None}
        methods = {r.split(":", 1)[1] for r in best}
        # A method that scores every KV head alike has the homogeneous route as its Ada-KV
        # split (the same tokens in every head): not benched, and the answers read it so.
        alike = sorted(m for m in methods if get_method(m).head_uniform)
        if alike:
            self.log(f"controls: {', '.join(f'adakv:{m}' for m in alike)} not benched: the method scores every "
                     "KV head alike, so Ada-KV's split keeps what the homogeneous route keeps (its answers)")
        todo = sorted([f"pyramid:{m}" for m in methods if m not in config.pyramid]
                      + [f"adakv:{m}" for m in methods if m not in alike])
        if not todo:
            return
        self.log(f"stage 4/5: bench ({protocol}) of the control {', '.join(todo)}")
        run_bench(self.bench_config(protocol, todo, f"bench_{protocol}{CONTROLS}"), prefills=self.prefills)

    def placement(self, routes: Path) -> None:
        """5. The chosen variant's route (query-agnostic, at one budget) among random
        placements of its methods; none when every candidate uses one method everywhere."""
        from learnroute.placement import PlacementConfig, run_placement

        config, out = self.config, self.out
        self.log("stage 5/5: placement study")
        b = config.placement_budget if config.placement_budget is not None else config.budgets[0]
        chosen = config.placement_choice(routes)
        if chosen is None:
            self.log(f"the routes of {', '.join(config.placement_candidates)} use one method in every layer: no "
                     "placement study (question 4 n/a; placement_variant may name other variants)")
            return
        given = out / "placement_route.json"
        new = route_at(config.placement_path(routes, chosen), b)
        if self.first and (not given.is_file() or Route.from_file(given).to_dict() != new.to_dict()):
            new.to_file(given)
        self.state.wait_for_everyone()
        run_placement(
            PlacementConfig(
                route=str(given),
                n_placements=config.placements,
                model=config.model,
                tasks=dict(config.eval_tasks),
                context_tokens=config.context_tokens,
                seed=config.eval_seed,
                max_new_tokens=config.max_new_tokens,
                stop_at_final_score=config.stop_at_final_score,
                device=config.device,
                dtype=config.dtype,
                output=str(out / "placement"),
            ),
            prefills=self.prefills,
        )


def _say(msg: str) -> None:
    import sys

    print(f"learnroute study: {msg}", file=sys.stderr, flush=True)
