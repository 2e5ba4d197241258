"""``learnroute train``'s configuration: :class:`TrainConfig` and its checks (no model needed).

Below every other module of :mod:`learnroute.gates` that reads a config (the trainer,
the adapter co-training, export), so they import it one way.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from learnroute import adapter as _adapter
from learnroute.budget_routes import BudgetRoutes, load_route_file
from learnroute.gates.gates import LAYER_TOTALS, LEARN, MIXING
from learnroute.gates.topk import RELAXATIONS
from learnroute.methods.registry import METHODS
from learnroute.route import Granularity, Route, RouteError, budget_problem
from learnroute.runs import DTYPE_HELP, Dtype, device_problem, dtype_problem
from learnroute.tasks.ruler import TASKS
from learnroute.tasks.suite import calibration_problems

Budget = int | float
CANDIDATES = ["snapkv", "streaming_llm", "h2o", "tova", "knorm", "expected_attention", "keydiff", "lava"]
Select = Literal["best_val", "last"]
Stages = Literal["auto", "one", "two"]
Learn = Literal["both", "methods", "budgets", "none"]  # none: frozen gates (a fixed route; an adapter trains)
Mixing = Literal["score", "mask"]
Relaxation = Literal["sigmoid", "sinkhorn"]
LayerTotals = Literal["learn", "fixed"]
SELECT = typing.get_args(Select)
GRANULARITY = typing.get_args(Granularity)
SEED_SUFFIX = "_seed"  # <name>_seed<k>: a run of optimisation seed k (`train --seeds`, a study's `seeds`)
SEED_FIELD = "{seed}"  # in init_route: the optimisation seed, so that `train --seeds` chains a first stage's seeds
STAGES = typing.get_args(Stages)
# From this context length on, `stages: auto` trains the recommended recipe in two stages
# (per-layer budgets, then their split over each layer's KV heads): at 4096 tokens two
# stages beat one out of family at 6, 10 and 35 % kept and tied it in family, on the eval
# samples they were chosen on and on fresh ones; at 1024 tokens they were not better
# (docs/results.md, "The recommended recipe"). 2048 was not measured: it gets one stage.
TWO_STAGES_FROM_TOKENS = 4096
FIRST_STAGE = "first_stage"  # <output>/first_stage/: a two-stage run's first stage


@dataclass
class TrainConfig:
    """What ``learnroute train`` learns, on which calibration samples, and how.

    The defaults are the recommended recipe (docs/results.md): per-head budgets learned
    over keydiff from uniform budgets, lr 0.03, 150 steps, one route for five budgets, and
    ``stages: auto`` (two stages from :data:`TWO_STAGES_FROM_TOKENS` context tokens on).
    ``configs/train/default.yaml`` writes the same values out, in the groups below.
    """

    # The keys by what they set; a YAML file may nest them so (``optimiser: {lr: 0.03}``).
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "data": ("model", "tasks", "context_tokens", "seed", "val_tasks", "val_fraction", "stream", "stream_pool",
                 "query_aware"),
        "gates": ("methods", "learn", "granularity", "budgets", "stages", "layer_totals", "init_route",
                  "init_method", "init_logit", "init_pi", "budget_floor", "head_spread", "budget_slope", "mixing",
                  "relaxation",
                  "gate_temperature", "topk_temperature", "topk_scale", "gumbel", "straight_through", "eps"),
        "loss": ("ce_weight", "kl_weight", "first_token_weight", "entropy_weight", "uniform_weight", "slope_weight"),
        "optimiser": ("steps", "batch_size", "lr", "weight_decay", "train_seed", "eval_every", "select",
                      "save_every"),
        "lora": ("adapter", "lora_rank", "lora_alpha", "lora_targets", "adapter_lr"),
        "run": ("dtype", "device", "output", "wandb", "wandb_project"),
    }

    model: str | None = field(default=None, metadata={"help": "HF model folder or hub id; null = bundled SmolLM2"})
    tasks: dict[str, int] = field(
        default_factory=lambda: {f"niah_{t}": 6 for t in ("single_1", "single_2", "single_3", "multikey",
                                                             "multivalue", "multiquery")},
        metadata={"help": "task -> number of calibration samples (train + validation): a generated family "
                          "(niah_single_2, ...) or your own records, jsonl:PATH (their calibration split)"},
    )
    context_tokens: int = field(default=1024, metadata={"help": "context length of the calibration samples (tokens)"})
    seed: int = field(default=0, metadata={"help": "seed of the calibration sample stream, the split and training"})
    train_seed: int | None = field(
        default=None,
        metadata={"help": "seed of the optimisation alone (batch order, budget draws, Gumbel noise, LoRA init) on "
                          "the same samples and split; null = seed. Several train_seeds measure a recipe's spread"},
    )
    val_tasks: dict[str, int] | None = field(
        default=None,
        metadata={"help": "validation samples from these families' calibration split instead of val_fraction of "
                          "tasks; families not in tasks choose the step for transfer (must not overlap tasks)"},
    )
    val_fraction: float = field(
        default=0.25, metadata={"help": "share of calibration samples held out to pick the step (0 = none)"}
    )
    methods: list[str] = field(default_factory=lambda: list(CANDIDATES), metadata={"help": "candidate methods"})
    learn: Learn = field(default="budgets", metadata={"help": "both | methods | budgets (methods fixed at init)"})
    granularity: Granularity = field(
        default="head",
        metadata={"help": "layer: one gate (π and budget share) per layer | head: one per (layer, KV head), "
                          "exported as a per-head route (every registered method scores per KV head)"},
    )
    mixing: Mixing = field(default="score", metadata={"help": "score: mix ranks then soft top-k; mask: mix soft masks"})
    relaxation: Relaxation = field(default="sigmoid", metadata={"help": "differentiable top-k: sigmoid | sinkhorn"})
    budgets: list[Budget] = field(
        default_factory=lambda: [0.075, 0.1, 0.15, 0.2, 0.4],
        metadata={"help": "mean budgets, one drawn per step (tokens per KV head or fractions); one = per-budget"},
    )
    stages: Stages = field(
        default="auto",
        metadata={"help": "one | two | auto. two: first per-layer budgets (into <output>/first_stage), then "
                          "per-head budgets that keep its layer totals (layer_totals fixed, starting from its "
                          "route; with budget_slope, its route at each budget: each budget's own totals); "
                          "needs granularity head, learn budgets or both, no init_route. auto: two "
                          f"from context_tokens >= {TWO_STAGES_FROM_TOKENS} where the recipe allows, else one"},
    )
    steps: int = field(default=150, metadata={"help": "optimiser steps"})
    batch_size: int = field(default=2, metadata={"help": "calibration samples per step (split across processes)"})
    stream: int = field(
        default=0,
        metadata={"help": "fresh calibration samples drawn per step from the calibration split of the families in "
                          "tasks (weighted by their counts; never the samples tasks fixes); 0 = train on the "
                          "fixed set. tasks still gives the validation samples (val_fraction of them)"},
    )
    stream_pool: int = field(
        default=0,
        metadata={"help": "with stream: batches of batch_size drawn from the last stream_pool drawn samples "
                          "(their prefills reused); 0 = each step trains on its stream fresh samples"},
    )
    lr: float = field(default=0.03, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    gate_temperature: list[float] = field(
        default_factory=lambda: [0.2, 0.05], metadata={"help": "π temperature [start, end], geometric annealing"}
    )
    topk_temperature: list[float] = field(
        default_factory=lambda: [0.5, 0.05],
        metadata={"help": "soft top-k temperature [start, end], in units of topk_scale"},
    )
    topk_scale: Literal["budget", "rank"] = field(
        default="budget",
        metadata={"help": "budget: temperature x the layer's kept fraction k_l/n (as sharp at 5 tokens as at 500); "
                  "rank: in rank units (ranks are in [0, 1])"},
    )
    gumbel: bool = field(default=False, metadata={"help": "Gumbel-softmax gates (noise drawn per step)"})
    entropy_weight: float = field(default=0.0, metadata={"help": "weight of the mean entropy of π (sharpening)"})
    uniform_weight: float = field(
        default=0.0,
        metadata={"help": "weight of KL(uniform || budget shares) over the free layers: shares stay near "
                          "uniform unless the task loss pays for leaving it (starved layers overfit a family)"},
    )
    slope_weight: float = field(
        default=1.0,
        metadata={"help": "with the budget slope on: weight of mean(beta'^2), which holds each budget's allocation "
                          "toward the one shape rescaled (0 = a free slope; no effect without the slope). The free "
                          "slope fitted large budgets to the calibration families and lost out of family; 1.0 "
                          "never dropped with more cache and tied the one shape (docs/results.md, \"Every budget\")"},
    )
    ce_weight: float = field(default=1.0, metadata={"help": "weight of the reference answer's cross-entropy"})
    kl_weight: float = field(default=0.0, metadata={"help": "weight of KL(full cache || soft route) on answer tokens"})
    first_token_weight: float = field(
        default=1.0, metadata={"help": "CE weight of the first answer token relative to the others (greedy decoding)"}
    )
    straight_through: float = field(
        default=0.1, metadata={"help": "final share of steps with straight-through one-hot π (0 = none)"}
    )
    budget_floor: float = field(default=0.05, metadata={"help": "every layer keeps at least this share of the mean"})
    budget_slope: bool | Literal["auto"] = field(
        default="auto",
        metadata={"help": "budget shares affine in log-budget (logits beta + log(b / b_ref) * beta', the slope "
                          "learned from 0): each training budget gets its own allocation, validated as such, and "
                          "export writes a budget-conditional route (route_by_budget.json). auto: on where budgets "
                          "are learned at two or more fraction budgets, else off; true refuses any other config"},
    )
    head_spread: float | None = field(
        default=None,
        metadata={"help": "granularity head: each head keeps at most this times its layer's mean head budget "
                          "(the excess goes to the layer's other heads), so the padded cache allocates at most "
                          "this times the tokens kept; null = no limit"},
    )
    layer_totals: LayerTotals = field(
        default="learn",
        metadata={"help": "granularity head: learn | fixed. fixed keeps each layer's share of the budget at its "
                          "start (init_route's budget shape, else uniform; a budget-conditional init_route gives "
                          "each of its budgets' own) and learns only how the layer splits "
                          "it over its KV heads (a head at the context cap hands its excess to its own layer's heads; "
                          "the route is written with layer_totals fixed and bench rescales it layers first)"},
    )
    init_route: str | None = field(
        default=None,
        metadata={"help": "route file to start from (e.g. a profile route): methods and budget shape. {seed} in it "
                          "is the optimisation seed (train_seed, else seed), so that --seeds starts each seed from "
                          "its own route, e.g. a first stage's <output>_seed{seed}/route.json"},
    )
    init_method: str | None = field(
        default="keydiff",
        metadata={
            "help": "one method in every layer to start from (learn=budgets needs this or init_route); "
            "with init_route too, the route gives only the budget shape; null with learn: both = cold start"
        },
    )
    init_logit: float = field(default=4.0, metadata={"help": "logit of a layer's initial method when warm-starting"})
    init_pi: float | None = field(
        default=None,
        metadata={
            "help": "warm start: the initial method's share of π at the first gate temperature (overrides "
            "init_logit). A logit of 4 at T = 0.2 is π ≈ 1 - 1e-8: its gradient vanishes and no layer can "
            "leave its initial method; 0.5 leaves them free to move"
        },
    )
    # --- decode-time LoRA adapter (learnroute.gates.cotrain); learn=none trains it for a fixed route
    adapter: bool = field(default=False, metadata={"help": "train a LoRA adapter on question+answer tokens too"})
    lora_rank: int = field(default=8, metadata={"help": "adapter: LoRA rank"})
    lora_alpha: float = field(default=16.0, metadata={"help": "adapter: LoRA alpha (scale alpha / rank)"})
    lora_targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata={"help": "adapter: module names to adapt (attention and/or gate_proj, up_proj, down_proj)"},
    )
    adapter_lr: float = field(default=1e-3, metadata={"help": "adapter: AdamW learning rate"})
    # --- end adapter
    eps: float = field(default=1e-6, metadata={"help": "the bias is log(mask + eps)"})
    eval_every: int = field(default=15, metadata={"help": "evaluate the hardened route on validation every N steps"})
    select: Select = field(default="best_val", metadata={"help": "best_val: export the best validated step; last"})
    save_every: int = field(default=50, metadata={"help": "checkpoint every N steps"})
    query_aware: bool = field(default=False, metadata={
        "help": "put the question in the compressed prefill; train in the mode the route will run in"})
    dtype: Dtype = field(default="float32", metadata={"help": DTYPE_HELP})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    output: str = field(default="runs/train/default", metadata={"help": "run folder"})
    wandb: bool = field(default=False, metadata={"help": "log to Weights & Biases (offline without network)"})
    wandb_project: str = field(default="learnroute", metadata={"help": "wandb project"})

    @property
    def per_head_gates(self) -> bool:
        """Whether the gates are per (layer, KV head). ``learn: none`` freezes the gates at
        a per-layer route, so granularity (a default of the recipe) does not apply to it."""
        return self.granularity == "head" and self.learn != "none"

    def _granularity_problems(self) -> list[str]:
        problems = []
        if self.granularity not in GRANULARITY:
            problems.append(f"granularity must be one of {', '.join(GRANULARITY)}, got {self.granularity!r}")
        if self.head_spread is not None:
            if not self.head_spread >= 1.0:
                problems.append(f"head_spread must be >= 1 (a head's budget over its layer's mean), got {self.head_spread}")
            if self.granularity != "head":
                problems.append(f"head_spread={self.head_spread} limits per-head budgets: it needs granularity: head, "
                                f"got {self.granularity!r}")
        if self.stages not in STAGES:
            problems.append(f"stages must be one of {', '.join(STAGES)}, got {self.stages!r}")
        elif self.stages == "two" and (why := two_stage_conflicts(self)):
            problems.append(f"stages: two trains per-layer budgets, then their split over heads: {why}")
        if self.layer_totals not in LAYER_TOTALS:
            problems.append(f"layer_totals must be one of {', '.join(LAYER_TOTALS)}, got {self.layer_totals!r}")
        elif self.layer_totals == "fixed":
            if self.granularity != "head":
                problems.append(f"layer_totals=fixed keeps per-layer budgets and learns their split over heads: "
                                f"it needs granularity: head, got {self.granularity!r}")
            if self.learn not in ("both", "budgets"):
                problems.append(f"layer_totals=fixed learns budgets within layers: it needs learn: both or budgets, "
                                f"got {self.learn!r}")
        return problems

    def init_route_problems(self) -> list[str]:
        """What is wrong with ``init_route`` (``{seed}`` resolved): a missing or unreadable
        file, a route these gates cannot start from."""
        problems = []
        if (route_file := init_route_file(self)) is not None:
            try:
                found = load_route_file(route_file)
            except RouteError as e:
                seeded = f" ({SEED_FIELD} = {optimisation_seed(self)})" if route_file != self.init_route else ""
                problems.append(f"init_route{seeded}: {e}")
            else:
                route = found.routes[0] if isinstance(found, BudgetRoutes) else found
                if isinstance(found, BudgetRoutes):
                    problems += self._per_budget_start_problems(route_file, found.budgets)
                if route.is_per_head and not self.per_head_gates:
                    problems.append(f"init_route {route_file} is a per-head route: with granularity 'layer' "
                                    "gates are per layer (use granularity: head, or a per-layer route)")
                if any(e.share is not None for e in route.layers):
                    problems.append(f"init_route {route_file} shares layer budgets across heads by scores "
                                    "(share): gates start from fixed budgets")
                missing = sorted(set(route.methods) - set(self.methods))
                if missing and self.init_method is None:  # init_method replaces the route's methods
                    problems.append(f"init_route uses methods {missing} that are not candidates {self.methods}")
        return problems

    def _per_budget_start_problems(self, route_file: str, held: list[float]) -> list[str]:
        """What a budget-conditional ``init_route`` (allocations at ``held`` budgets) cannot
        start: fixed gates, or per-budget layer totals asked for budgets outside the file's."""
        if self.learn == "none":
            return [f"init_route {route_file} is budget-conditional (budgets {held}): learn: none trains an "
                    "adapter for one fixed route; give a plain route file"]
        outside = [b for b in self.budgets if not (isinstance(b, float) and held[0] <= b <= held[-1])]
        if self.layer_totals == "fixed" and outside:
            return [f"init_route {route_file} holds layer totals for budgets {held}; budgets {outside} are "
                    f"outside them: train at fractions in [{held[0]}, {held[-1]}]"]
        return []

    @property
    def ref_budget(self) -> float:
        """The budget at which ``budget_slope`` leaves the shares as beta says: the geometric
        mean of the training budgets (fractions)."""
        fractions = [b for b in self.budgets if isinstance(b, float) and b > 0] or [0.1]
        return float(math.exp(sum(math.log(b) for b in fractions) / len(fractions)))

    def validate(self) -> list[str]:
        """Problems that need no model."""
        problems = []
        problems += calibration_problems(self.tasks)
        candidates = [m for m in METHODS if m != "full" and not METHODS[m].budget_dependent]
        if len(self.methods) < 1:
            problems.append("methods is empty; candidates: " + ", ".join(candidates))
        for m in self.methods:
            if m not in candidates:
                why = "scores depend on the budget" if m in METHODS and METHODS[m].budget_dependent else "unknown"
                problems.append(f"methods: {m!r} cannot be a gate candidate ({why}); candidates: {', '.join(candidates)}")
        if len(set(self.methods)) != len(self.methods):
            problems.append("methods lists a method twice")
        if self.learn not in LEARN:
            problems.append(f"learn must be one of {', '.join(LEARN)}, got {self.learn!r}")
        if self.mixing not in MIXING:
            problems.append(f"mixing must be one of {', '.join(MIXING)}, got {self.mixing!r}")
        if self.relaxation not in RELAXATIONS:
            problems.append(f"relaxation must be one of {', '.join(RELAXATIONS)}, got {self.relaxation!r}")
        if not self.budgets:
            problems.append("budgets is empty; give mean budgets (tokens per KV head or fractions in (0, 1])")
        for b in self.budgets:
            if (p := budget_problem(b)) is not None:
                problems.append(f"budgets: {p}")
            elif isinstance(b, int) and b >= self.context_tokens:
                problems.append(
                    f"budgets: {b} tokens per KV head is not below context_tokens ({self.context_tokens}): "
                    "nothing would be evicted"
                )
        if self.budget_slope not in (True, False, "auto"):
            problems.append(f"budget_slope must be true, false or auto, got {self.budget_slope!r}")
        elif self.budget_slope is True:  # asked for: refused where it cannot be learned (auto turns off there)
            problems += [f"{why} (or budget_slope: auto)" for why in slope_conflicts(self)]
        if self.topk_scale not in ("budget", "rank"):
            problems.append(f"topk_scale must be 'budget' or 'rank', got {self.topk_scale!r}")
        for name in ("gate_temperature", "topk_temperature"):
            t = getattr(self, name)
            if len(t) != 2 or any(not x > 0 for x in t):
                problems.append(f"{name} must be [start, end] with both > 0, got {t}")
        for name in ("steps", "batch_size", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            problems.append(f"lr must be > 0, got {self.lr}")
        problems += self._sample_problems()
        if not 0.0 <= self.straight_through <= 1.0:
            problems.append(f"straight_through must be in [0, 1], got {self.straight_through}")
        if not 0.0 <= self.budget_floor < 1.0:
            problems.append(f"budget_floor must be in [0, 1), got {self.budget_floor}")
        if self.init_pi is not None and not 1.0 / max(len(self.methods), 1) < self.init_pi < 1.0:
            problems.append(f"init_pi must be in (1/M, 1) = ({1 / max(len(self.methods), 1):.3g}, 1), got {self.init_pi}")
        if not self.eps > 0:
            problems.append(f"eps must be > 0, got {self.eps}")
        if self.ce_weight == 0 and self.kl_weight == 0:
            problems.append("ce_weight and kl_weight are both 0: there is no task loss to train on")
        for name in ("entropy_weight", "uniform_weight", "slope_weight", "ce_weight", "kl_weight", "first_token_weight",
                     "weight_decay"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        problems += self._granularity_problems()
        if self.select not in SELECT:
            problems.append(f"select must be one of {', '.join(SELECT)}, got {self.select!r}")
        problems += self.init_route_problems()
        if self.init_method is not None and self.init_method not in self.methods:
            problems.append(f"init_method {self.init_method!r} is not one of the candidates {self.methods}: add it "
                            "to methods or start from one of them (init_method: null with learn: both = cold start)")
        if self.learn == "budgets" and self.init_route is None and self.init_method is None:
            problems.append("learn=budgets keeps the methods fixed: give init_method or init_route")
        if (p := device_problem(self.device)) is not None:
            problems.append(p)
        if (p := dtype_problem(self.dtype)) is not None:
            problems.append(p)
        if self.context_tokens < 16:
            problems.append(f"context_tokens must be >= 16, got {self.context_tokens}")
        problems += adapter_problems(self)  # adapter settings, learn=none
        return problems

    def _sample_problems(self) -> list[str]:
        """The calibration stream and the validation split (samples, families, fraction)."""
        problems = []
        if self.stream < 0 or self.stream_pool < 0:
            problems.append(f"stream and stream_pool must be >= 0, got {self.stream} and {self.stream_pool}")
        elif self.stream_pool and not self.stream:
            problems.append("stream_pool needs stream >= 1 (fresh samples per step) to fill the pool")
        elif self.stream and self.stream_pool and self.stream_pool < self.stream:
            problems.append(f"stream_pool ({self.stream_pool}) must hold at least one step's stream ({self.stream})")
        if self.stream and (fixed := [t for t in self.tasks if t not in TASKS]):
            problems.append(f"stream draws fresh samples of generated families; {fixed} are read from files "
                            f"(a stream needs tasks among: {', '.join(TASKS)})")
        if self.val_tasks is not None:
            problems += calibration_problems(self.val_tasks, "val_tasks")
            if overlap := sorted(set(self.val_tasks) & set(self.tasks)):
                problems.append(f"val_tasks {overlap} are also training tasks: validation families must be held out")
        if not 0.0 <= self.val_fraction < 1.0:
            problems.append(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        elif (not self.stream and self.val_tasks is None and self.tasks
              and sum(self.tasks.values()) - round(self.val_fraction * sum(self.tasks.values())) < 1):
            problems.append(
                f"val_fraction={self.val_fraction} of {sum(self.tasks.values())} calibration samples leaves none to train on"
            )
        return problems


def adapter_problems(config: TrainConfig) -> list[str]:
    """What is wrong with the adapter settings (no model needed)."""
    problems = []
    if config.learn == "none":
        if not config.adapter:
            problems.append("learn=none trains nothing but an adapter: set adapter=true")
        if config.init_route is None and config.init_method is None:
            problems.append("learn=none keeps the route fixed: give init_route (a route file) or init_method")
    if config.init_route is not None and config.init_method is None and config.learn == "none":
        try:
            route = Route.from_file(init_route_file(config))
        except RouteError:
            pass  # reported by the gates' own checks
        else:
            need = sorted({m for e in route.layers for m in e.methods if not METHODS[m].keeps_all} - set(config.methods))
            if need:
                problems.append(f"init_route's layers need the methods {need}: add them to methods")
    if not config.adapter:
        return problems
    if config.lora_rank < 1:
        problems.append(f"lora_rank must be >= 1, got {config.lora_rank}")
    if not config.lora_alpha > 0:
        problems.append(f"lora_alpha must be > 0, got {config.lora_alpha}")
    if not config.lora_targets or not all(isinstance(t, str) and t for t in config.lora_targets):
        problems.append(
            f"lora_targets must name linear modules, e.g. {_adapter.ATTENTION_TARGETS} and/or {_adapter.MLP_TARGETS}"
        )
    if not config.adapter_lr > 0:
        problems.append(f"adapter_lr must be > 0, got {config.adapter_lr}")
    return problems


def optimisation_seed(config: TrainConfig) -> int:
    """The seed of the optimisation: ``train_seed``, or ``seed`` when it is null."""
    return config.seed if config.train_seed is None else config.train_seed


def init_route_file(config: TrainConfig) -> str | None:
    """``init_route`` with ``{seed}`` replaced by the optimisation seed (None without one)."""
    if config.init_route is None:
        return None
    return config.init_route.replace(SEED_FIELD, str(optimisation_seed(config)))


def two_stage_conflicts(config: TrainConfig) -> str | None:
    """Why ``config`` cannot train in two stages (None when it can)."""
    why = []
    if config.granularity != "head":
        why.append(f"it needs granularity: head, got {config.granularity!r}")
    if config.learn not in ("both", "budgets"):
        why.append(f"it needs learn: budgets or both, got {config.learn!r}")
    if config.init_route is not None:
        why.append("its second stage starts from the first stage's route, so init_route must be null")
    if config.layer_totals != "learn":
        why.append("its first stage learns the layer totals, so layer_totals must be learn")
    if config.adapter:
        why.append("it trains no adapter (adapter: false)")
    return "; ".join(why) or None


def slope_conflicts(config: TrainConfig) -> list[str]:
    """Why ``config`` cannot learn a budget slope (empty when it can)."""
    why = []
    if config.learn not in ("both", "budgets"):
        why.append(f"budget_slope learns how the budget shares move with the budget: it needs learn "
                   f"budgets or both, not {config.learn!r}")
    if any(not isinstance(b, float) for b in config.budgets) or len(set(config.budgets)) < 2:
        why.append(f"budget_slope needs two or more fraction budgets (e.g. [0.1, 0.2, 0.4]), got {config.budgets}")
    return why


def resolved_slope(config: TrainConfig) -> bool:
    """Whether ``config`` learns a budget slope: ``budget_slope`` as given, auto where it can."""
    if config.budget_slope == "auto":
        return not slope_conflicts(config)
    return bool(config.budget_slope)


def resolved_stages(config: TrainConfig) -> int:
    """How many stages ``config`` trains: ``stages`` one or two as given; auto two from
    :data:`TWO_STAGES_FROM_TOKENS` context tokens on when the recipe allows it, else one."""
    if config.stages == "auto":
        return 2 if config.context_tokens >= TWO_STAGES_FROM_TOKENS and two_stage_conflicts(config) is None else 1
    return 2 if config.stages == "two" else 1


def stage_configs(config: TrainConfig) -> list[TrainConfig]:
    """The runs ``config`` trains, first to last, each with ``stages: one``: itself, or a
    per-layer first stage in ``<output>/first_stage`` and the per-head second stage in
    ``<output>`` that keeps the first stage's layer totals and starts from its route (with a
    budget slope, its route at every training budget: the layer totals per budget)."""
    config = replace(config, budget_slope=resolved_slope(config))  # each stage's config.yaml says which
    if resolved_stages(config) == 1:
        return [replace(config, stages="one")]
    first = replace(config, stages="one", granularity="layer", head_spread=None,
                    output=f"{config.output}/{FIRST_STAGE}")
    # With a budget slope the first stage learned its layer totals per budget: the second keeps
    # each budget's own (its route_by_budget.json), not the first budget's rescaled to the rest
    start = "route_by_budget.json" if config.budget_slope else "route.json"
    second = replace(config, stages="one", layer_totals="fixed", init_route=f"{first.output}/{start}")
    return [first, second]
