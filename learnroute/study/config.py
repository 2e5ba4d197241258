"""The study's configuration: :class:`StudyConfig` (one calibration set, eval tasks, variants
over TrainConfig, the controls) and the names its run folder gives routes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any, ClassVar

from learnroute.config import ConfigError, flatten_groups, from_dict
from learnroute.gates.config import CANDIDATES, SEED_SUFFIX, TrainConfig
from learnroute.budget_routes import load_route_file, route_at
from learnroute.route import budget_problem
from learnroute.runs import DTYPE_HELP, Dtype, device_problem, dtype_problem
from learnroute.tasks.suite import check_tasks


Budget = int | float
PROTOCOLS = ("agnostic", "aware")
TOKENS = ("@profile", "@profile_alloc", "@profile_best")  # study files a variant may start from
VARIANT_TOKEN = "@variant:"  # init_route: @variant:<name>, the trained route of a variant listed before
PROFILE_PLACEMENT = "@profile"  # placement_variant: the profile's per-layer route, not a variant's
# Keys of a variant that the study sets itself (one calibration set, one model, one budget list).
STUDY_OWNED = ("model", "tasks", "context_tokens", "seed", "methods", "output", "query_aware")


@dataclass
class StudyConfig:
    """The study: calibration and eval tasks, budgets, variants, placements."""

    # The keys by what they set; a YAML file may nest them so (``samples: {eval_seed: 1}``).
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "samples": ("model", "context_tokens", "calibration", "calibration_seed", "eval_tasks", "heldout",
                    "eval_seed"),
        "baselines": ("budgets", "aware_budgets", "protocols", "methods", "pyramid", "profile_budget",
                      "profile_all_budgets"),
        "learning": ("train", "variants", "main_variant", "mixture_of", "seeds", "imported_routes", "per_budget"),
        "placement": ("placements", "placement_budget", "placement_variant"),
        "answers": ("bootstrap", "max_new_tokens", "stop_at_final_score"),
        "run": ("prefill_cache_gib", "dtype", "device", "output"),
    }

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
    dtype: Dtype = field(default="float32", metadata={"help": DTYPE_HELP})
    device: str = field(
        default="auto",
        metadata={"help": "every stage's device: auto (CUDA when available) | cpu | cuda (refused without CUDA); "
                          "train.device or a variant's device overrides it for training"},
    )
    output: str = field(default="runs/study/default", metadata={"help": "study folder"})

    def __post_init__(self) -> None:
        # train and each variant may nest TrainConfig's keys in its groups; the study merges
        # them flat (a variant's optimiser.lr over train's lr)
        problems: list[str] = []
        self.train, found = flatten_groups(TrainConfig, dict(self.train or {}), "train.")
        problems += found
        variants = {}
        for name, over in self.variants.items():
            variants[name], found = flatten_groups(TrainConfig, dict(over or {}), f"variants.{name}.")
            problems += found
        self.variants = variants
        if problems:
            raise ValueError("\n  ".join(problems))

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
                load_route_file(path)  # a plain or a budget-conditional route
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

    def per_budget_variants(self) -> dict[str, dict[str, Any]]:
        """The variants ``per_budget`` adds: the main variant once per budget, ``<main>@<budget>``."""
        if not self.per_budget:
            return {}
        main = self.variants.get(self.main_variant, {})
        return {f"{self.main_variant}@{b}": {**main, "budgets": [b]} for b in self.all_budgets}

    def all_variants(self) -> dict[str, dict[str, Any]]:
        """Every variant the study trains, in training order, with its own keys: ``variants``,
        then the seeds' (:meth:`seeded_variants`) and the per-budget ones."""
        return {**self.variants, **self.seeded_variants(), **self.per_budget_variants()}

    def variant_configs(self, out: Path, check: bool = False) -> dict[str, dict[str, Any]]:
        """Per variant the TrainConfig data: defaults <- ``train`` <- the variant's own keys,
        with the study's model, calibration set, budgets and methods."""
        variants = self.all_variants()
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
                output=str(out / "train" / safe_name(name)),
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
            if path.is_file() and len(set(route_at(path).methods)) > 1:
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


def is_warm(variant: dict[str, Any]) -> bool:
    """Does a variant start from a route or a method (so that its untrained start is a route
    to bench)? Keys it leaves out have TrainConfig's defaults (the recipe starts from keydiff)."""
    return (variant.get("init_route", TrainConfig.init_route) is not None
            or variant.get("init_method", TrainConfig.init_method) is not None)


def safe_name(name: str) -> str:
    return name.replace("/", "_").replace("@", "_at_")


def route_name(variant: str) -> str:
    """The exported route's file stem (and its name in the tables) for a variant."""
    name = safe_name(variant)
    return name if name == "learned" or name.startswith("learned_") else f"learned_{name}"
