"""``learnroute study``: learned vs profile-guided vs homogeneous routes, end to end.

Stages (each a sub-folder of the study folder, each resumable on its own):

1. ``profile/``: per-layer damage on **calibration** samples -> ``profile_<b>.json``
   (per-layer best method) and ``profile_<b>_alloc.json`` (+ sensitivity budgets);
2. ``train/<variant>/``: learned gates per variant (the main route and the ablations),
   on the same calibration samples;
3. ``routes/``: every learned route exported (hardened; mixtures where asked);
4. ``bench_<protocol>/``: **eval** samples (a disjoint seed stream): the full cache, every
   homogeneous method, pyramid, profile-guided and learned routes at every budget;
5. ``placement/``: a route with several methods (a variant's or the profile's) among
   random placements of its methods;
6. ``study.json`` / ``study.md``: the answers, with paired bootstrap intervals.

Finished stages are skipped (a train variant with its ``route.json``, a profile with its
``profile.json``); bench and placement skip finished samples themselves. ``analyze``
rebuilds the answers from the folders alone (``learnroute report STUDY_FOLDER``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from learnroute.config import ConfigError, from_dict, to_dict
from learnroute.gates.config import CANDIDATES, SEED_SUFFIX, TrainConfig
from learnroute.methods import get_method
from learnroute.route import Route, budget_problem
from learnroute.runs import atomic_write, device_problem, dtype_problem
from learnroute.stats import VALID_FULL, best_homogeneous, paired, pooled, sample_scores, solved_tasks
from learnroute.tasks.suite import check_tasks

Budget = int | float
PROTOCOLS = ("agnostic", "aware")
# Keys of a variant that the study sets itself (one calibration set, one model, one budget list).
TOKENS = ("@profile", "@profile_alloc", "@profile_best")  # study files a variant may start from
VARIANT_TOKEN = "@variant:"  # init_route: @variant:<name>, the trained route of a variant listed before
PROFILE_PLACEMENT = "@profile"  # placement_variant: the profile's per-layer route, not a variant's
STUDY_OWNED = ("model", "tasks", "context_tokens", "seed", "methods", "output", "query_aware")


@dataclass
class StudyConfig:
    """The study: calibration and eval tasks, budgets, variants, placements."""

    model: str | None = field(default=None, metadata={"help": "HF model folder or hub id; null = bundled SmolLM2"})
    context_tokens: int = field(default=1024, metadata={"help": "context length of every sample (tokens)"})
    calibration: dict[str, int] = field(
        default_factory=lambda: {"niah_single_2": 3, "niah_multikey": 3, "niah_multivalue": 3, "multihop_qa": 3},
        metadata={"help": "calibration task -> samples (profile and training; never evaluated); jsonl:PATH reads its calibration split"},
    )
    calibration_seed: int = field(default=0, metadata={"help": "seed of the calibration sample stream"})
    eval_tasks: dict[str, int] = field(
        default_factory=lambda: {"niah_single_1": 4, "niah_single_2": 4, "niah_multivalue": 4, "niah_multiquery": 4},
        metadata={"help": "eval task -> samples (disjoint seed stream from calibration; jsonl:PATH: its eval split)"},
    )
    heldout: list[str] | None = field(
        default=None,
        metadata={"help": "eval tasks declared out-of-family (checked: never in calibration, nor in a variant's "
                          "val_tasks). Every eval task outside calibration is answered out-of-family anyway"},
    )
    eval_seed: int = field(default=0, metadata={"help": "seed of the eval sample stream"})
    budgets: list[Budget] = field(
        default_factory=lambda: [0.1, 0.2],
        metadata={"help": "budgets compared (fractions kept, or tokens per KV head); the aware protocol's too unless aware_budgets"},
    )
    aware_budgets: list[Budget] | None = field(
        default=None,
        metadata={
            "help": "the query-aware protocol's budgets (null = budgets): with the question in the prefill, "
            "the budgets where homogeneous routes differ may lie elsewhere"
        },
    )
    protocols: list[str] = field(default_factory=lambda: ["agnostic"], metadata={"help": "agnostic and/or aware"})
    methods: list[str] = field(default_factory=lambda: list(CANDIDATES), metadata={"help": "candidate methods"})
    pyramid: list[str] = field(default_factory=lambda: ["snapkv"], metadata={"help": "methods also run with PyramidKV budgets"})
    profile_budget: Budget | None = field(
        default=None, metadata={"help": "budget the profile measures (null = the first budget); routes rescale"}
    )
    profile_all_budgets: bool = field(
        default=False,
        metadata={
            "help": "profile every study budget (budgets x the profile's cost): the profile routes at each "
            "budget are its own for that budget, and per-budget variants start from them; otherwise the "
            "profile_budget routes are rescaled (a shape made for one budget can fail at another)"
        },
    )
    train: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TrainConfig overrides shared by every variant (steps, lr, ...)"}
    )
    variants: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"learned": {"init_method": "@profile_best"}},
        metadata={
            "help": "variant -> TrainConfig overrides (the default: the recommended recipe, TrainConfig's "
            "defaults, over this study's profile's best method); init_route may be @profile or @profile_alloc, or "
            "@variant:<name>, the trained route of a variant listed before (a second stage), "
            "init_method @profile_best (the method with the least mean damage in the profile)"
        },
    )
    main_variant: str = field(default="learned", metadata={"help": "the variant questions 1-5 are asked of"})
    mixture_of: list[str] = field(default_factory=list, metadata={"help": "variants also exported as mixture routes"})
    seeds: list[int] | None = field(
        default=None,
        metadata={"help": "extra optimisation seeds (train_seed) of the main variant: each trained on the same "
                          "samples, benched as <main>_seed<k>; a later-stage main (init_route @variant:<first>) "
                          "trains <first>_seed<k> too and starts from it; study.md gives the spread over seeds "
                          "beside the intervals over samples"},
    )
    imported_routes: dict[str, str] = field(
        default_factory=dict,
        metadata={"help": "name -> a route file made elsewhere (say another study's routes/learned_<v>.json, "
                          "trained at another context length), copied into routes/ and benched beside this "
                          "study's routes as imported_<name>; Q6 answers each minus the main route"},
    )
    per_budget: bool = field(default=False, metadata={"help": "also train the main variant once per budget (each benched at its own budget only)"})
    placements: int = field(default=20, metadata={"help": "random placements of placement_variant's route"})
    placement_budget: Budget | None = field(default=None, metadata={"help": "its budget (null = the first budget)"})
    placement_variant: str | list[str] | None = field(
        default=None,
        metadata={"help": "the variant whose placement is studied, or a list: the first whose route has two or "
                          "more methods (a one-method route has no placement); '@profile' is the profile's "
                          "own per-layer route (profile_<profile_budget>.json); null = main_variant"},
    )
    bootstrap: int = field(default=2000, metadata={"help": "bootstrap resamples for the paired intervals"})
    max_new_tokens: int | None = field(default=None, metadata={"help": "answer cap; null = each task's own"})
    stop_at_final_score: bool = field(
        default=True,
        metadata={"help": "bench and placement end an answer once its score can no longer change (RULER's "
                          "string matches: every reference found); same scores, far fewer decode steps"},
    )
    prefill_cache_gib: float = field(
        default=4.0,
        metadata={"help": "GiB of prefills each process keeps across stages (0 = none): the profile and training "
                          "prefill the same calibration samples, the bench, its controls and the placement the "
                          "same eval samples; a kept one is not prefilled or scored again (results are the "
                          "same). A 1k-token sample of the default model takes 0.11 GiB, a 4k one about 0.44 GiB. "
                          "Each process (rank) keeps its own, on top of what its stage needs: at 4k a bench "
                          "rank peaked at 9.2 GiB with 1 GiB kept, and two ranks with 4 GiB each ran out of 24 GiB"},
    )
    dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16: the model's weights and activations (bfloat16 halves the KV cache; answers can differ)"})
    device: str = field(
        default="auto",
        metadata={"help": "every stage's device: auto (CUDA when available) | cpu | cuda (refused without CUDA); "
                          "train.device or a variant's device overrides it for training"},
    )
    output: str = field(default="runs/study/default", metadata={"help": "study folder"})

    def validate(self) -> list[str]:
        problems = []
        problems += [f"calibration: {p}" for p in check_tasks(dict(self.calibration), "calibration")]
        problems += [f"eval_tasks: {p}" for p in check_tasks(dict(self.eval_tasks), "eval")]
        for name, tasks in (("calibration", self.calibration), ("eval_tasks", self.eval_tasks)):
            for t, n in tasks.items():
                if n < 1:
                    problems.append(f"{name}.{t}: sample count must be >= 1, got {n}")
        if not self.budgets:
            problems.append("budgets is empty")
        if self.aware_budgets is not None:
            if not self.aware_budgets:
                problems.append("aware_budgets is empty (null: the aware protocol uses budgets)")
            if "aware" not in self.protocols:
                problems.append(f"aware_budgets is set but 'aware' is not in protocols {self.protocols}")
        for b in self.all_budgets + [x for x in (self.profile_budget, self.placement_budget) if x is not None]:
            if (p := budget_problem(b)) is not None:
                problems.append(f"budgets: {p}")
        if not self.prefill_cache_gib >= 0:
            problems.append(f"prefill_cache_gib must be >= 0 (0 = keep no prefill), got {self.prefill_cache_gib}")
        bad = [p for p in self.protocols if p not in PROTOCOLS]
        if bad or not self.protocols:
            problems.append(f"protocols must be a non-empty subset of {', '.join(PROTOCOLS)}, got {self.protocols}")
        if self.main_variant not in self.variants:
            problems.append(f"main_variant {self.main_variant!r} is not among the variants {list(self.variants)}")
        for v in self.placement_candidates:
            if v not in self.variants and v != PROFILE_PLACEMENT:
                problems.append(f"placement_variant {v!r} is neither among the variants {list(self.variants)} "
                                f"nor {PROFILE_PLACEMENT!r} (the profile's per-layer route)")
        for v in self.mixture_of:
            if v not in self.variants:
                problems.append(f"mixture_of: {v!r} is not a variant ({', '.join(self.variants)})")
        if self.placements < 0 or self.bootstrap < 100:
            problems.append("placements must be >= 0 and bootstrap >= 100")
        if (p := device_problem(self.device)) is not None:
            problems.append(p)
        if (p := dtype_problem(self.dtype)) is not None:
            problems.append(p)
        problems += self._import_problems()
        # Every variant's training config must be valid (checked with the profile tokens
        # standing in for files that exist only once the profile has run).
        try:
            variants = self.variant_configs(Path(self.output), check=True)
        except ConfigError as e:
            return problems + [str(e)]
        for name, cfg in variants.items():
            try:
                from_dict(TrainConfig, cfg)
            except ConfigError as e:
                problems.append(f"variant {name!r}: {e}")
        problems += self._family_problems(variants)
        return problems

    def _import_problems(self) -> list[str]:
        """Imported routes must be readable route files with plain names (checked before any work)."""
        problems = []
        for name, path in self.imported_routes.items():
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                problems.append(f"imported_routes: name {name!r} must be letters, digits, '_', '-' or '.'")
            if not Path(path).is_file():
                problems.append(f"imported_routes.{name}: {path} is not a file (a route JSON, e.g. another "
                                "study's routes/learned_<variant>.json)")
                continue
            try:
                Route.from_file(path)
            except Exception as e:  # a route file's own error says what is wrong in it
                problems.append(f"imported_routes.{name}: {path} is not a valid route: {e}")
        return problems

    def _family_problems(self, variants: dict[str, dict[str, Any]]) -> list[str]:
        """Out-of-family eval tasks must stay unseen: not calibrated on, not validated on."""
        problems = []
        out = set(self.eval_tasks) - set(self.calibration)
        for t in self.heldout or []:
            if t not in self.eval_tasks:
                problems.append(f"heldout: {t!r} is not an eval task ({', '.join(self.eval_tasks)})")
            elif t in self.calibration:
                problems.append(f"heldout: {t!r} is also a calibration task: an out-of-family family must be unseen")
        for name, cfg in variants.items():
            if seen := sorted(set(cfg.get("val_tasks") or {}) & (out | set(self.heldout or []))):
                problems.append(f"variant {name!r}: val_tasks {seen} are out-of-family eval tasks; validate on "
                                "other families (their eval answers would no longer be out-of-family)")
        return problems

    def _stages(self) -> list[str]:
        """The main variant's chain of stages, first to last: the variants its ``init_route``
        names with ``@variant:``, recursively, then the main variant itself."""
        chain = [self.main_variant]
        while True:
            source = self.variants.get(chain[0], {}).get("init_route")
            if not (isinstance(source, str) and source.startswith(VARIANT_TOKEN)):
                return chain
            source = source[len(VARIANT_TOKEN):]
            if source in chain or source not in self.variants:  # check() reports a bad name
                return chain
            chain.insert(0, source)

    def seeded_variants(self) -> dict[str, dict[str, Any]]:
        """The variants ``seeds`` adds: the main variant's overrides again per optimisation
        seed, named ``<main>_seed<k>``. A main variant that is a later stage (``init_route:
        "@variant:<first>"``) is the whole recipe again per seed: ``<first>_seed<k>`` trains
        with seed k and ``<main>_seed<k>`` starts from it, as ``train --seeds`` with
        ``{seed}`` in ``init_route`` does (docs/log.md §0.21), so that the spread over
        seeds is the recipe's, not only its last stage's."""
        chain, out = self._stages(), {}
        for k in self.seeds or []:
            for i, name in enumerate(chain):
                over = {**self.variants.get(name, {}), "train_seed": k}
                if i > 0:  # start from this seed's own earlier stage
                    over["init_route"] = f"{VARIANT_TOKEN}{chain[i - 1]}{SEED_SUFFIX}{k}"
                out[f"{name}{SEED_SUFFIX}{k}"] = over
        return out

    @property
    def seed_variants(self) -> set[str]:
        """The names of the main variant's seeds among :meth:`seeded_variants` (its spread)."""
        return {f"{self.main_variant}{SEED_SUFFIX}{k}" for k in self.seeds or []}

    @property
    def stage_seed_variants(self) -> dict[str, str]:
        """Each seed of the main variant -> its own untrained start, where that start is a
        seed of an earlier stage (empty when the main variant is a first stage: its seeds
        share its start, train_seed changing the optimisation only). Read off the init_route
        :meth:`seeded_variants` gives each seed."""
        seeded, out = self.seeded_variants(), {}
        for name in self.seed_variants:
            source = seeded[name].get("init_route")
            if isinstance(source, str) and source.startswith(VARIANT_TOKEN) and source[len(VARIANT_TOKEN):] in seeded:
                out[name] = source[len(VARIANT_TOKEN):]
        return out

    def variant_configs(self, out: Path, check: bool = False) -> dict[str, dict[str, Any]]:
        """Per variant the TrainConfig data: defaults <- ``train`` <- the variant's own keys,
        with the study's model, calibration set, budgets and methods."""
        variants = {**self.variants, **self.seeded_variants()}
        if self.per_budget:
            for b in self.all_budgets:
                variants[f"{self.main_variant}@{b}"] = {**self.variants.get(self.main_variant, {}), "budgets": [b]}
        out_cfgs: dict[str, dict[str, Any]] = {}
        for name, over in variants.items():
            owned = sorted(set(over) & set(STUDY_OWNED))
            if owned:
                raise ConfigError(f"variant {name!r} sets {owned}; the study sets those for every variant")
            data = {"device": self.device, "dtype": self.dtype, **self.train, **over}
            data.update(
                model=self.model,
                tasks=dict(self.calibration),
                context_tokens=self.context_tokens,
                seed=self.calibration_seed,
                methods=list(self.methods),
                output=str(out / "train" / _safe(name)),
            )
            # A budget-robust route is trained over every budget the study benches it at.
            data.setdefault("budgets", self.all_budgets)
            # Before the profile exists its files cannot be read: in the check, a method stands
            # in for a token, so that a fixed-method variant (learn=budgets or none) starting
            # from the profile's best method or from its route is checked as given a start.
            fixed = data.get("learn", TrainConfig.learn) in ("budgets", "none")
            for key in ("init_route", "init_method"):
                value = data.get(key)
                if not (isinstance(value, str) and value.startswith("@")):
                    continue
                if key == "init_route" and value.startswith(VARIANT_TOKEN):
                    # a second stage (e.g. per-head splits over a per-layer route's layer totals):
                    # variants train in order, so the earlier one's route.json exists by then
                    source = value[len(VARIANT_TOKEN):]
                    if source not in out_cfgs:
                        raise ConfigError(f"variant {name!r}: init_route {value!r} names no variant listed before "
                                          f"it; valid: {', '.join(VARIANT_TOKEN + v for v in out_cfgs) or 'none'}")
                    data[key] = None if check else str(Path(out_cfgs[source]["output"]) / "route.json")
                else:
                    if value not in TOKENS:
                        raise ConfigError(f"variant {name!r}: unknown study token {value!r}; valid: {', '.join(TOKENS)}")
                    data[key] = None if check else self._resolve_token(out, value, data["budgets"])
                if check and fixed and (key == "init_method" or data.get("init_method", TrainConfig.init_method) is None):
                    data["init_method"] = self.methods[0]  # stands in until the profile (or source variant) exists
            out_cfgs[name] = data
        return out_cfgs

    @property
    def placement_candidates(self) -> list[str]:
        """The variants whose placement may be studied, in order of preference."""
        v = self.placement_variant
        return [self.main_variant] if v is None else [v] if isinstance(v, str) else list(v)

    def placement_path(self, routes: Path, candidate: str) -> Path:
        """A placement candidate's route file: a variant's export in ``routes``, or (for
        ``@profile``) the profile's per-layer route beside it, at the profiled budget."""
        if candidate == PROFILE_PLACEMENT:  # the study token's own file, at the profiled budget
            return Path(self._resolve_token(routes.parent, PROFILE_PLACEMENT, []))
        return routes / f"{route_name(candidate)}.json"

    def placement_choice(self, routes: Path) -> str | None:
        """The first candidate whose route (exported in ``routes``) has two or more methods."""
        for v in self.placement_candidates:
            path = self.placement_path(routes, v)
            if path.is_file() and len(set(Route.from_file(path).methods)) > 1:
                return v
        return None

    @property
    def all_budgets(self) -> list[Budget]:
        """Every budget of every protocol: ``budgets``, then the aware-only ones."""
        return list(self.budgets) + [b for b in self.aware_budgets or [] if b not in self.budgets]

    def protocol_budgets(self, protocol: str) -> list[Budget]:
        """The budgets one protocol is benched and analysed at."""
        if protocol == "aware" and self.aware_budgets is not None:
            return list(self.aware_budgets)
        return list(self.budgets)

    @property
    def profiled_budget(self) -> Budget:
        """The budget the profile measures (its routes are rescaled to the others)."""
        return self.profile_budget if self.profile_budget is not None else self.budgets[0]

    @property
    def profile_budgets(self) -> list[Budget]:
        """Every budget the profile measures."""
        return self.all_budgets if self.profile_all_budgets else [self.profiled_budget]

    def _resolve_token(self, out: Path, token: str, budgets: list[Budget]) -> str:
        """A study token's file (or method) for a variant trained at ``budgets``: the
        profile's own for that budget when the variant has one budget the profile measured."""
        prof = out / "profile"
        b = budgets[0] if len(budgets) == 1 and budgets[0] in self.profile_budgets else self.profiled_budget
        if token == "@profile":
            return str(prof / f"profile_{b}.json")
        if token == "@profile_alloc":
            return str(prof / f"profile_{b}_alloc.json")
        if token == "@profile_best":
            profile = json.loads((prof / "profile.json").read_text())
            damage = profile["damage"][profile["select_by"]][json.dumps(b)]
            means = [mean(row[j] for row in damage) for j in range(len(profile["methods"]))]
            return profile["methods"][min(range(len(means)), key=means.__getitem__)]
        raise ConfigError(f"unknown study token {token!r}; valid: {', '.join(TOKENS)}")


# What a study may gain on a resume (never change or lose): variants and seeds train and
# bench, imported routes bench, a protocol benches every route (training does not depend on
# the protocols; aware_budgets, which would change the trained budgets, may not grow).
GROWABLE = ("variants", "seeds", "imported_routes", "protocols")
CONTROLS = "_controls"  # bench_<protocol>_controls/: pyramid: and adakv:<best homogeneous method>, after the bench
CONTROL_KINDS = ("pyramid", "adakv")
START = "_start"  # suffix of a variant's untrained start among the routes (the control of question 8)
IMPORTED = "imported_"  # routes/imported_<name>.json: routes made elsewhere (imported_routes)
SHARED_STARTS = "shared_starts.json"  # routes/: {start: the identical start benched in its place}


def shared_starts(routes: Path) -> dict[str, str]:
    """The starts not benched because an identical one is (none in studies made before it)."""
    path = Path(routes) / SHARED_STARTS
    return json.loads(path.read_text()) if path.is_file() else {}


def _warm(variant: dict[str, Any]) -> bool:
    """Does a variant start from a route or a method (so that its untrained start is a route
    to bench)? Keys it leaves out have TrainConfig's defaults (the recipe starts from keydiff)."""
    return (variant.get("init_route", TrainConfig.init_route) is not None
            or variant.get("init_method", TrainConfig.init_method) is not None)


def _safe(name: str) -> str:
    return name.replace("/", "_").replace("@", "_at_")


def route_name(variant: str) -> str:
    """The exported route's file stem (and its name in the tables) for a variant."""
    name = _safe(variant)
    return name if name == "learned" or name.startswith("learned_") else f"learned_{name}"


# ---------------------------------------------------------------------------- the run


def run_study(config: StudyConfig, overwrite: bool = False) -> Path:
    """Run (or resume) every stage; returns the study folder with study.md.

    Under torchrun / accelerate launch: the profile, training, bench and placement shard
    their samples across ranks; the exports and the analysis run on rank 0 while the others
    wait. Every rank decides what is left from the same files, after a barrier.
    """
    from learnroute.engine import shared_prefills
    from learnroute.runs import prepare_folder, process_state

    state = process_state()
    # A study grows: variants and seeds added later train and bench; finished ones are kept.
    out = prepare_folder(config, overwrite, is_main=state.is_main_process, growable=GROWABLE)
    state.wait_for_everyone()
    run = _Stages(config, out, state)
    # Every stage of this process shares its prefills (the same samples come back stage
    # after stage); results are those of separate prefills.
    with shared_prefills(int(config.prefill_cache_gib * 2**30)) as prefills:
        run.profile()
        variants = config.variant_configs(out)  # resolves @profile tokens: after the profile
        run.train(variants)
        routes = run.export(variants)
        for protocol in config.protocols:
            run.bench(protocol, variants, routes)
        if config.placements > 0:
            run.placement(routes)
    if prefills.made or prefills.hits:
        _say(f"rank {state.process_index}: {prefills.summary()}")
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
            )
        self.state.wait_for_everyone()

    def train(self, variants: dict[str, dict[str, Any]]) -> None:
        """2. Every variant's gates, on the same calibration samples (skipped once route.json exists)."""
        from learnroute.gates.train import run_train, shared_calibration

        # The variants share one calibration set: prefilled once for all of them, and
        # released when the stage ends (the bench and placement stages need none of it).
        with shared_calibration():
            for name, data in variants.items():
                tcfg = from_dict(TrainConfig, data)
                if not (Path(tcfg.output) / "route.json").is_file():
                    self.log(f"stage 2/5: train variant {name!r}")
                    run_train(tcfg)
                    self.state.wait_for_everyone()  # rank 0 writes route.json last

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
                export_cli(run, routes / f"{route_name(name)}.json")
                if name in self.config.mixture_of:
                    export_cli(run, routes / f"{route_name(name)}_mixture.json", mixture=True)
                if _warm(data) and name not in seeded:  # the control: the variant untrained (once)
                    start = f"{route_name(name)}{START}"
                    route = export_start(run, routes / f"{start}.json")
                    # Variants that differ only in training (a penalty, a floor, a stream) share
                    # one start: bench it once, answer each variant's question 8 against it.
                    same = next((n for n, r in starts if r.layers == route.layers and r.model == route.model), None)
                    if same is None:
                        starts.append((start, route))
                    else:
                        shared[start] = same
            atomic_write(routes / SHARED_STARTS, json.dumps(shared, indent=1) + "\n")
            # Routes made elsewhere (trained at another length, on other families) travel
            # into the run folder, so that it holds everything its tables were made from.
            for name, path in self.config.imported_routes.items():
                Route.from_file(path).to_file(routes / f"{IMPORTED}{name}.json")
        self.state.wait_for_everyone()
        return routes

    def bench_routes(self, protocol: str, variants: dict[str, dict[str, Any]], routes: Path) -> list[str]:
        """The route specs one protocol benches: full, homogeneous, pyramid, the profile's and
        every variant's routes (a variant trained for one budget at that budget only)."""
        config, prof = self.config, self.out / "profile"
        budgets = config.protocol_budgets(protocol)
        shared = shared_starts(routes)
        seeded = config.seeded_variants()  # benched without an untrained start of their own
        specs = ["full"] + [f"homogeneous:{m}" for m in config.methods] + [f"pyramid:{m}" for m in config.pyramid]
        if config.profile_all_budgets:  # each budget's profile routes at that budget only
            specs += [str(prof / f"profile_{b}{s}.json@{b}") for b in budgets for s in ("", "_alloc")]
        else:
            pb = config.profiled_budget
            specs += [str(prof / f"profile_{pb}.json"), str(prof / f"profile_{pb}_alloc.json")]
        for name, data in variants.items():
            names = [route_name(name)] + ([f"{route_name(name)}_mixture"] if name in config.mixture_of else [])
            start = f"{route_name(name)}{START}"
            names += [start] if _warm(data) and name not in seeded and start not in shared else []
            # A variant trained for one budget (per_budget) is benched at that budget only,
            # in the protocols that have that budget.
            pin = ""
            if len(data["budgets"]) == 1 and data["budgets"][0] in config.all_budgets:
                if data["budgets"][0] not in budgets:
                    continue
                pin = f"@{data['budgets'][0]}"
            specs += [f"{routes / n}.json{pin}" for n in names]
        specs += [f"{routes / IMPORTED}{name}.json" for name in config.imported_routes]
        return specs

    def bench(self, protocol: str, variants: dict[str, dict[str, Any]], routes: Path) -> None:
        """4. Eval samples, one protocol at its own budgets (bench skips finished samples)."""
        from learnroute.bench import run_bench

        self.log(f"stage 4/5: bench ({protocol}) on eval samples")
        run_bench(self.bench_config(protocol, self.bench_routes(protocol, variants, routes), f"bench_{protocol}"))
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
        from learnroute.summary import load_rows

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
        run_bench(self.bench_config(protocol, todo, f"bench_{protocol}{CONTROLS}"))

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
        new = Route.from_file(config.placement_path(routes, chosen)).rescaled(b)
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
            )
        )


def _say(msg: str) -> None:
    import sys

    print(f"learnroute study: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- analysis


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
        "valid_tasks": sorted(valid),
        "left_out_tasks": sorted(set(full_task) - valid),
        "no_task_qualifies": all_tasks,
        "full_by_task": full_task,
        "n_eval_samples": len(full),
        "budgets": per_budget,
    }


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
        stem = f"study_{_safe(main_variant)}"
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


def plot_scores(result: dict[str, Any], main: str, path: Path) -> None:
    """Average score vs budget per protocol: full cache, best homogeneous (per budget),
    profile, profile_alloc, the learned route and its variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocols = list(result["protocols"].items())
    if not protocols:
        return
    fig, axes = plt.subplots(1, len(protocols), figsize=(5.5 * len(protocols), 4), squeeze=False)
    for ax, (protocol, res) in zip(axes[0], protocols):
        budgets = [e["budget"] for e in res["budgets"]]
        x = list(range(len(budgets)))
        full = res["budgets"][0]["full"] if res["budgets"] else None
        if full is not None:
            ax.axhline(100 * full, color="black", ls="--", lw=1, label="full cache")
        best = [100 * e["avg"].get(e["best_homogeneous"], float("nan")) for e in res["budgets"]]
        ax.plot(x, best, "o-", color="gray", label="best homogeneous (per budget)")
        styles = {"profile": ("tab:orange", ":"), "profile_alloc": ("tab:orange", "-"), main: ("tab:red", "-")}
        routes = ["profile", "profile_alloc", main] + sorted(
            {r for e in res["budgets"] for r in e["avg"] if r.startswith("learned") and r != main}
        )
        for r in routes:
            ys = [100 * e["avg"].get(r, float("nan")) for e in res["budgets"]]
            color, ls = styles.get(r, (None, "--"))
            ax.plot(x, ys, marker="o", ls=ls, color=color, lw=2.5 if r == main else 1.2, label=r, alpha=1 if r in styles else 0.6)
        ax.set_xticks(x, [str(b) for b in budgets])
        ax.set_xlabel("budget (mean kept per layer)")
        ax.set_ylabel(f"average score x100 ({res['n_eval_samples']} eval samples)")
        ax.set_title(f"query-{protocol}", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_routes(learned: Route, profile: Route, path: Path) -> None:
    """Per layer: the learned route's method next to the profile's choice, and the learned
    budgets next to the profile's sensitivity-allocated ones (as multiples of the mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted(set(learned.methods) | set(profile.methods))
    L = learned.n_layers
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(6, 0.3 * L), 6), sharex=True)
    a1.scatter(range(L), [methods.index(m) for m in profile.methods], s=80, facecolors="none", edgecolors="tab:orange", label="profile")
    a1.scatter(range(L), [methods.index(m) for m in learned.methods], s=20, color="tab:red", label="learned")
    a1.set_yticks(range(len(methods)), methods, fontsize=8)
    a1.legend(fontsize=7)
    a1.set_title("method per layer", fontsize=9)
    for route, color, label, off in ((profile, "tab:orange", "profile_alloc", -0.2), (learned, "tab:red", "learned", 0.2)):
        mean_b = sum(route.budgets) / L
        a2.bar([i + off for i in range(L)], [b / mean_b for b in route.budgets], width=0.4, color=color, label=label)
    a2.axhline(1.0, color="gray", ls="--", lw=1)
    a2.set_ylabel("budget / mean")
    a2.set_xlabel("layer")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ci(c: dict | None, room: dict | None = None) -> str:
    """A paired difference with its interval and verdict; marked ``(ceiling)`` when ``room``
    (the full cache minus the same reference) is not a win: no room to beat it there."""
    if not c or c.get("diff") is None:
        return "n/a"
    mark = " (ceiling)" if room and room.get("verdict") in ("tie", "loss") else ""
    return f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] {c['verdict']}{mark}"


def _q12(e: dict[str, Any]) -> tuple[str, str]:
    """Q1 (main minus the best homogeneous route) and Q2 (minus profile_alloc) of one budget's
    answers, each marked where the full cache itself does not beat that reference."""
    room = e.get("headroom") or {}  # absent in a study.json written before it
    return (_ci(e.get("q1_vs_best_homogeneous"), room.get("best_homogeneous")),
            _ci(e.get("q2_vs_profile_alloc"), room.get("profile_alloc")))


CEILING_NOTE = ("'(ceiling)': the full cache itself does not beat that reference at that budget (paired), so "
                "a route beats it only by answering what the full cache gets wrong.")


def _control_lines(res: dict[str, Any], main: str, where: str = "") -> list[str]:
    """study.md's tables of the controls (pyramid: and adakv:<best>), of Q9 (per-head
    learning) and of Q8 (each learned route minus its start), for one protocol and family
    split (``where``: how the split is named in the tables' captions; empty for all)."""
    lines: list[str] = []
    if any(e.get(f"q1_vs_{k}_best") for k in CONTROL_KINDS for e in res["budgets"]):
        lines += ["", f"Controls{where}: `{main}` minus PyramidKV's allocation over layers and Ada-KV's over "
                  "each layer's KV heads, both over the best homogeneous method (paired, x100):", ""]
        lines.append(f"| budget | control route | its score | {main} - it |")
        lines.append("|---|---|---|---|")
        for e in res["budgets"]:
            for k in CONTROL_KINDS:
                if e.get(f"{k}_best"):
                    label = e[f"{k}_best"]
                    if not label.startswith(f"{k}:"):  # the homogeneous route stands in (see _answers)
                        label = f"{k}:{label.split(':', 1)[1]} (= {label}: every KV head scores alike)"
                    lines.append(f"| {e['budget']} | {label} | {100 * e['avg'][e[f'{k}_best']]:.1f} | "
                                 f"{_ci(e.get(f'q1_vs_{k}_best'))} |")
    per_head = sorted({v for e in res["budgets"] for v in e.get("q9_per_head", {})})
    if per_head:
        versus = (f"the main route `{main}` (n/a for itself: the main route is per-head, and Q6 reads the "
                  "per-layer variants against it)" if main in per_head else f"the main per-layer route `{main}`")
        lines += ["", f"Q9{where}, per-head learning (`granularity: head`): each per-head route minus {versus}, "
                  "and minus `adakv:<best homogeneous method>` (paired, x100):", ""]
        lines.append("| route | versus | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
        lines.append("|---|---|" + "---|" * len(res["budgets"]))
        for v in per_head:
            for key, label in (("vs_main", main), ("vs_adakv", "adakv:<best>")):
                lines.append(f"| {v} | {label} | " + " | ".join(
                    _ci(e.get("q9_per_head", {}).get(v, {}).get(key)) for e in res["budgets"]) + " |")
            ratios = [e.get("q9_per_head", {}).get(v, {}).get("allocated_over_kept") for e in res["budgets"]]
            lines.append(f"| {v} | allocated / kept bytes | "
                         + " | ".join("n/a" if x is None else f"x{x:.2f}" for x in ratios) + " |")
    started = sorted({v for e in res["budgets"] for v in e.get("q8_vs_start", {})})
    if started:
        lines += ["", f"Q8{where}, each learned route minus its untrained start (`<route>_start`, the same "
                  "warm start hardened without training; paired, x100):", ""]
        lines.append("| route | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
        lines.append("|---|" + "---|" * len(res["budgets"]))
        for v in started:
            lines.append(f"| {v} | " + " | ".join(_ci(e.get("q8_vs_start", {}).get(v)) for e in res["budgets"]) + " |")
    return lines


def to_markdown(result: dict[str, Any], main: str) -> str:
    """The answers to questions 1-8 as tables (scores x100, paired 95 % intervals)."""
    lines = ["# Study results", ""]
    for protocol, res in result["protocols"].items():
        lines += [
            f"## Protocol: query-{protocol}",
            "",
            f"{res['n_eval_samples']} eval samples on the tasks the full cache solves (>= {100 * VALID_FULL:.0f}): "
            f"{', '.join(res['valid_tasks'])}; left out: {', '.join(res['left_out_tasks']) or 'none'}. "
            "Differences are paired over the same samples, with a bootstrap 95 % interval; "
            f"'tie' when it holds 0. {CEILING_NOTE} "
            + (
                "The profile routes are the profile's own at each budget."
                if result["config"].get("profile_all_budgets")
                else f"The profile routes are made at {result['config'].get('profile_budget') or result['config']['budgets'][0]} "
                "and rescaled to the other budgets."
            )
            + (" **No task reaches the threshold with the full cache: averages use every task.**"
               if res.get("no_task_qualifies") else ""),
            "",
            f"| budget | full | best homogeneous | profile | profile_alloc | {main} | "
            f"Q1 {main} - best homog. | Q2 - profile | Q2 - profile_alloc | Q3 task wins/ties/losses | Q5 gap recovered |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in res["budgets"]:
            avg = e["avg"]
            fmt = lambda r: f"{100 * avg[r]:.1f}" if r in avg else "n/a"  # noqa: E731
            q3 = e.get("q3_tasks")
            gap = e.get("q5_gap_recovered")
            q1, q2_alloc = _q12(e)
            lines.append(
                f"| {e['budget']} | {100 * e['full']:.1f} | {fmt(e['best_homogeneous'])} ({e['best_homogeneous']}) | "
                f"{fmt('profile')} | {fmt('profile_alloc')} | {fmt(main)} | {q1} | "
                f"{_ci(e.get('q2_vs_profile'))} | {q2_alloc} | "
                + (f"{q3['wins']}/{q3['ties']}/{q3['losses']} of {q3['tasks']}" if q3 else "n/a")
                + f" | {'n/a' if gap is None else f'{100 * gap:.0f} %'} |"
            )
        lines += ["", "Every route's average (x100) per budget:", ""]
        routes = sorted({r for e in res["budgets"] for r in e["avg"]})
        lines.append("| route | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
        lines.append("|---|" + "---|" * len(res["budgets"]))
        for r in routes:
            cells = [f"{100 * e['avg'][r]:.1f}" if r in e["avg"] else "" for e in res["budgets"]]
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
        if any(e.get("by_task") for e in res["budgets"]):
            lines += ["", "Per task (x100; every task, also those left out of the averages; best homogeneous: "
                      "the best on average at that budget):", ""]
            lines.append("| task (full cache) | route | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
            lines.append("|---|---|" + "---|" * len(res["budgets"]))
            for t in sorted(res["full_by_task"]):
                for i, (label, key) in enumerate(((main, main), ("best homogeneous", None),
                                                  ("profile", "profile"), ("profile_alloc", "profile_alloc"))):
                    cells = []
                    for e in res["budgets"]:
                        r = e["best_homogeneous"] if key is None else key
                        v = e.get("by_task", {}).get(r, {}).get(t)
                        cells.append("" if v is None else f"{100 * v:.1f}")
                    head = f"{t} ({100 * res['full_by_task'][t]:.1f})" if i == 0 else ""
                    lines.append(f"| {head} | {label} | " + " | ".join(cells) + " |")
        variants = sorted({v for e in res["budgets"] for v in e.get("q6_variants", {})})
        if variants:
            lines += ["", f"Q6, each variant minus `{main}` (paired, x100):", ""]
            lines.append("| variant | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
            lines.append("|---|" + "---|" * len(res["budgets"]))
            for v in variants:
                lines.append(f"| {v} | " + " | ".join(_ci(e.get("q6_variants", {}).get(v)) for e in res["budgets"]) + " |")
        if "families" in res:
            lines += ["", *_family_table(res["families"], main)]
        lines += _seed_lines(res, main)
        lines += _control_lines(res, main)
        for key, part in res.get("families", {}).items():
            name = {"in": "in-family", "out": "out-of-family"}[key]
            lines += _seed_lines(part, main, f" {name} ({part['n_eval_samples']} samples)")
            lines += _control_lines(part, main, f" {name} ({part['n_eval_samples']} samples)")
        lines.append("")
    if "q4_placement" in result:
        p = result["q4_placement"]
        lines += [
            "## Q4: placement",
            "",
            f"The route `{p.get('variant', main)}` ranks **{p['rank']} of {p['of']}** among random placements of its methods "
            f"({p['ties']} tie with it; better than {100 * p['better_than_fraction']:.0f} %).",
            "",
        ]
    return "\n".join(lines)


def _seed_lines(res: dict[str, Any], main: str, where: str = "") -> list[str]:
    """The main variant's training seeds (markdown lines): each seed's average and its
    questions 1, 2 and 8, the spread over seeds, and the seeds pooled (a sample's score the
    mean over seeds) with the same questions; none for a study without seeds."""
    if not any(e.get("seeds") for e in res["budgets"]):
        return []
    lines = ["", f"Training seeds of `{main}`{where} (the same samples and split; each seed's average, its "
             "paired differences, and the spread over seeds), x100:", "",
             "| budget | route | average | Q1 - best homog. | Q2 - profile_alloc | Q8 - its start |",
             "|---|---|---|---|---|---|"]
    for e in res["budgets"]:
        sd = e.get("seeds")
        if not sd:
            continue
        for r, v in sd["routes"].items():
            lines.append(f"| {e['budget']} | {r} | {100 * v:.1f} | {_ci(sd['q1'][r])} | "
                         f"{_ci(sd.get('q2', {}).get(r))} | {_ci(sd.get('q8', {}).get(r))} |")
        lines.append(f"| {e['budget']} | spread | {100 * sd['min']:.1f}-{100 * sd['max']:.1f} "
                     f"(sd {100 * sd['sd']:.1f}) | | | |")
        pool = sd.get("pooled")  # absent in a study.json written before pooling
        if pool and pool["avg"] is not None:
            lines.append(f"| {e['budget']} | **seeds pooled** | {100 * pool['avg']:.1f} | {_ci(pool.get('q1'))} | "
                         f"{_ci(pool.get('q2'))} | {_ci(pool.get('q8'))} |")
    return lines


def _family_table(families: dict[str, Any], main: str) -> list[str]:
    """In-family vs out-of-family answers side by side (markdown lines)."""
    out = [
        "In-family (eval tasks the routes were calibrated on: "
        + ", ".join(families["in"]["valid_tasks"]) + f"; {families['in']['n_eval_samples']} samples) vs "
        "out-of-family (tasks they never saw: " + ", ".join(families["out"]["valid_tasks"])
        + f"; {families['out']['n_eval_samples']} samples), paired x100. {CEILING_NOTE}",
        "",
        f"| budget | family | full | best homogeneous | {main} | Q1 {main} - best homog. | Q2 - profile_alloc | "
        "Q8 - its start |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e_in, e_out in zip(families["in"]["budgets"], families["out"]["budgets"]):
        for label, e in (("in", e_in), ("out", e_out)):
            avg, best = e["avg"], e.get("best_homogeneous")
            fmt = lambda r: f"{100 * avg[r]:.1f}" if r in avg else "n/a"  # noqa: E731
            full = "n/a" if e.get("full") is None else f"{100 * e['full']:.1f}"
            out.append(f"| {e['budget']} | {label} | {full} | {fmt(best)} ({best}) | {fmt(main)} | "
                       f"{' | '.join(_q12(e))} | "
                       f"{_ci(e.get('q8_vs_start', {}).get(main))} |")
    return out


def summary_table(result: dict[str, Any]) -> str:
    """The short table ``make run`` prints: questions 1-3, 5 and 8 per protocol and budget,
    on every eval task and, when the study has both, in-family and out-of-family."""
    lines = ["| protocol | budget | Q1 vs best homog. | Q2 vs profile_alloc | Q8 vs its start | Q3 task wins "
             "| Q5 gap recovered |",
             "|---|---|---|---|---|---|---|"]
    main = route_name(result["config"].get("main_variant", "learned"))
    family_label = {"in": "in-family", "out": "out-of-family"}
    rows = []  # (label, answers): every eval task, then each family split
    for protocol, whole in result["protocols"].items():
        rows.append((protocol, whole))
        rows += [(f"{protocol}, {family_label[k]}", v) for k, v in whole.get("families", {}).items()]
    for label, res in rows:
        for e in res["budgets"]:
            q3 = e.get("q3_tasks")
            gap = e.get("q5_gap_recovered")
            lines.append(
                f"| {label} | {e['budget']} | {' | '.join(_q12(e))} | {_ci(e.get('q8_vs_start', {}).get(main))} | "
                + (f"{q3['wins']}/{q3['tasks']}" if q3 else "n/a")
                + f" | {'n/a' if gap is None else f'{100 * gap:.0f} %'} |"
            )
    if any("(ceiling)" in line for line in lines):
        lines.append(f"\n{CEILING_NOTE}")
    if "q4_placement" in result:
        p = result["q4_placement"]
        lines.append(
            f"\nQ4: the placement of `{p.get('variant', 'learned')}` ranks {p['rank']} of {p['of']} random placements of its methods."
        )
    return "\n".join(lines)
