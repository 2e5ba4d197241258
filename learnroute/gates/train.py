"""``learnroute train``: learn per-layer gates (methods and/or budgets) on calibration samples.

The model is frozen. Each calibration sample is prefilled **once** with the full cache
(no gradient) and every candidate method's scores are computed once, as per-(layer, head)
ranks. A training step then runs only the question and answer tokens
(:func:`learnroute._hf.forward_tokens`) against the full-cache keys/values with the gates'
soft keep-mask as an additive ``log(m + eps)`` bias per (layer, KV head). Eviction after
the prefill keeps the very key/value vectors the full-cache prefill computed, so this is
the inference being optimised, not an approximation of it.

Kept per calibration sample, in memory: the keys and values of every layer (about 94 MB
at 2k tokens on SmolLM2-135M, fp32), the ranks (L, M, H_kv, n) and, with ``kl_weight``,
the full cache's answer log-probabilities. The prefill's hidden-state capture (larger
than the cache) is dropped once the scores exist.

Held-out calibration samples (``val_fraction``; never eval samples) score the *hardened*
route (argmax methods, integer budgets, real eviction) with teacher forcing every
``eval_every`` steps; the route exported is the best one on them (step 0, the initial
gates, included), which is what protects a warm start from drifting away.

Run folder::

    config.yaml  versions.json  train.log   history.jsonl (one row per step / evaluation)
    checkpoints/step_<N>.safetensors  (gates + AdamW state; resume takes the latest)
    best.safetensors   gates.safetensors (final)   route.json (hardened, best)
    pi.png (π per layer)   budgets.png (learned budget per layer)
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from learnroute.config import ConfigError, to_dict
from learnroute.gates import cotrain
from learnroute.gates.gates import LEARN, MIXING, Gates
from learnroute.gates.topk import RELAXATIONS
from learnroute.methods.registry import METHODS
from learnroute.route import Route, RouteError, budget_problem
from learnroute.tasks.suite import calibration_problems

Budget = int | float
CANDIDATES = ["snapkv", "streaming_llm", "h2o", "tova", "knorm", "expected_attention", "keydiff", "lava"]
SELECT = ("best_val", "last")
logger = logging.getLogger("learnroute.train")


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the message says what was kept."""


@dataclass
class TrainConfig:
    """What ``learnroute train`` learns, on which calibration samples, and how."""

    model: str | None = field(default=None, metadata={"help": "HF model folder or hub id; null = bundled SmolLM2"})
    tasks: dict[str, int] = field(
        default_factory=lambda: {"niah_single_2": 4, "niah_multikey": 4},
        metadata={"help": "synthetic task -> number of calibration samples (train + validation)"},
    )
    context_tokens: int = field(default=1024, metadata={"help": "context length of the calibration samples (tokens)"})
    seed: int = field(default=0, metadata={"help": "seed of the calibration sample stream, the split and training"})
    val_fraction: float = field(
        default=0.25, metadata={"help": "share of calibration samples held out to pick the step (0 = none)"}
    )
    methods: list[str] = field(default_factory=lambda: list(CANDIDATES), metadata={"help": "candidate methods"})
    learn: str = field(default="both", metadata={"help": "both | methods | budgets (methods fixed at init)"})
    mixing: str = field(default="score", metadata={"help": "score: mix ranks then soft top-k; mask: mix soft masks"})
    relaxation: str = field(default="sigmoid", metadata={"help": "differentiable top-k: sigmoid | sinkhorn"})
    budgets: list[Budget] = field(
        default_factory=lambda: [0.1, 0.2],
        metadata={"help": "mean budgets, one drawn per step (tokens per KV head or fractions); one = per-budget"},
    )
    steps: int = field(default=200, metadata={"help": "optimiser steps"})
    batch_size: int = field(default=4, metadata={"help": "calibration samples per step (split across processes)"})
    lr: float = field(default=0.02, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    gate_temperature: list[float] = field(
        default_factory=lambda: [1.0, 0.05], metadata={"help": "π temperature [start, end], geometric annealing"}
    )
    topk_temperature: list[float] = field(
        default_factory=lambda: [0.5, 0.05],
        metadata={"help": "soft top-k temperature [start, end], in units of topk_scale"},
    )
    topk_scale: str = field(
        default="budget",
        metadata={"help": "budget: temperature x the layer's kept fraction k_l/n (as sharp at 5 tokens as at 500); "
                  "rank: in rank units (ranks are in [0, 1])"},
    )
    gumbel: bool = field(default=False, metadata={"help": "Gumbel-softmax gates (noise drawn per step)"})
    entropy_weight: float = field(default=0.0, metadata={"help": "weight of the mean entropy of π (sharpening)"})
    ce_weight: float = field(default=1.0, metadata={"help": "weight of the reference answer's cross-entropy"})
    kl_weight: float = field(default=0.0, metadata={"help": "weight of KL(full cache || soft route) on answer tokens"})
    first_token_weight: float = field(
        default=1.0, metadata={"help": "CE weight of the first answer token relative to the others (greedy decoding)"}
    )
    straight_through: float = field(
        default=0.1, metadata={"help": "final share of steps with straight-through one-hot π (0 = none)"}
    )
    budget_floor: float = field(default=0.05, metadata={"help": "every layer keeps at least this share of the mean"})
    init_route: str | None = field(
        default=None, metadata={"help": "route file to start from (e.g. a profile route): methods and budget shape"}
    )
    init_method: str | None = field(
        default=None,
        metadata={
            "help": "one method in every layer to start from (learn=budgets needs this or init_route); "
            "with init_route too, the route gives only the budget shape"
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
    eval_every: int = field(default=25, metadata={"help": "evaluate the hardened route on validation every N steps"})
    select: str = field(default="best_val", metadata={"help": "best_val: export the best validated step; last"})
    save_every: int = field(default=50, metadata={"help": "checkpoint every N steps"})
    query_aware: bool = field(default=False, metadata={"help": "put the question in the prefill (scored)"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    output: str = field(default="runs/train", metadata={"help": "run folder"})
    wandb: bool = field(default=False, metadata={"help": "log to Weights & Biases (offline without network)"})
    wandb_project: str = field(default="learnroute", metadata={"help": "wandb project"})

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
        if not 0.0 <= self.val_fraction < 1.0:
            problems.append(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        elif self.tasks and sum(self.tasks.values()) - round(self.val_fraction * sum(self.tasks.values())) < 1:
            problems.append(
                f"val_fraction={self.val_fraction} of {sum(self.tasks.values())} calibration samples leaves none to train on"
            )
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
        for name in ("entropy_weight", "ce_weight", "kl_weight", "first_token_weight", "weight_decay"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.select not in SELECT:
            problems.append(f"select must be one of {', '.join(SELECT)}, got {self.select!r}")
        if self.init_route is not None:
            try:
                route = Route.from_file(self.init_route)
            except RouteError as e:
                problems.append(f"init_route: {e}")
            else:
                missing = sorted(set(route.methods) - set(self.methods))
                if missing and self.init_method is None:  # init_method replaces the route's methods
                    problems.append(f"init_route uses methods {missing} that are not candidates {self.methods}")
        if self.init_method is not None and self.init_method not in self.methods:
            problems.append(f"init_method {self.init_method!r} is not one of the candidates {self.methods}")
        if self.learn == "budgets" and self.init_route is None and self.init_method is None:
            problems.append("learn=budgets keeps the methods fixed: give init_method or init_route")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.context_tokens < 16:
            problems.append(f"context_tokens must be >= 16, got {self.context_tokens}")
        problems += cotrain.config_problems(self)  # adapter settings, learn=none
        return problems


# ---------------------------------------------------------------------------- calibration data


@dataclass
class CalibItem:
    """One calibration sample, prefilled once: what every training step needs of it."""

    sample_id: str
    task: str
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, H_kv, n_l, d)
    ranks: torch.Tensor  # (L, M, H_kv, n): per-method ranks in [0, 1] (fixed layers: zeros)
    ids: torch.Tensor  # (1, q + a): question then reference answer
    positions: torch.Tensor  # (1, q + a): original positions after the context
    keep: slice  # logits at these positions predict the answer tokens
    target: torch.Tensor  # (a,)
    ref_logp: torch.Tensor | None  # (a, V) full-cache log-probs (for the KL term)

    @property
    def n_tokens(self) -> int:
        return int(self.ranks.shape[-1])


# Calibration items of the last training run in this process, by (model, device,
# protocol, methods, KL term, sample id). A study trains a dozen variants on one
# calibration set in one process: each would prefill and score every sample again
# (~3 s per 1k-token sample on 2 CPU cores). Items are read-only during training.
_ITEMS: dict[tuple, CalibItem] = {}


def prepare_item(engine, task: str, sample, methods: list[str], with_ref: bool) -> CalibItem:
    """Prefill ``sample`` once, rank every method's scores in every compressible layer."""
    from learnroute import _hf
    from learnroute.methods.mixing import rank_normalize
    from learnroute.profile import teacher_forcing

    tf = teacher_forcing(engine, sample)
    with torch.no_grad():
        prefill = engine.prefill(tf.prompt)
        n = prefill.n_tokens
        engine.check_routes([Route.homogeneous(m, engine.n_layers, 1) for m in methods], n)
        h = prefill.layers[0].keys.shape[1]
        ranks = torch.zeros(engine.n_layers, len(methods), h, n, device=engine.model.device)  # (L, M, H_kv, n)
        for layer in range(engine.n_layers):
            if engine.is_fixed(layer, prefill.layer_tokens[layer], n):
                continue
            for j, m in enumerate(methods):
                ranks[layer, j] = rank_normalize(engine.scores(prefill, layer, m)[0])  # (H_kv, n)
        kv = [(c.keys, c.values) for c in prefill.layers]
        ref = None
        if with_ref:
            logits = _hf.forward_tokens(engine.model, kv, tf.ids, tf.positions, keep=tf.keep)  # (1, a, V)
            ref = torch.log_softmax(logits[0].float(), -1)  # (a, V)
    # Drop the capture's hidden states and memoised scores: only keys/values are needed.
    del prefill
    return CalibItem(sample.id, task, kv, ranks, tf.ids, tf.positions, tf.keep, tf.answer[0], ref)


# ---------------------------------------------------------------------------- losses


def answer_loss(
    model, item: CalibItem, masks: torch.Tensor | None, *, eps: float, first_token_weight: float = 1.0,
    ce_weight: float = 1.0, kl_weight: float = 0.0, hard: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced loss of the reference answer under keep-masks (L, H, n) (None = full).

    Soft masks enter as ``log(m + eps)``; ``hard`` masks (0/1) as -inf on evicted tokens,
    which is exactly evicting them. Returns (loss, CE): CE weighted towards the first
    token by ``first_token_weight`` (times ``ce_weight``), plus ``kl_weight`` x KL(full || route).
    """
    from learnroute import _hf

    biases = None
    if masks is not None:
        if hard:
            bias = torch.zeros_like(masks).masked_fill(masks < 0.5, float("-inf"))  # (L, H, n)
        else:
            bias = torch.log(masks + eps)  # (L, H, n)
        biases = {layer: bias[layer].unsqueeze(0) for layer in range(bias.shape[0])}  # (1, H, n) each
    logits = _hf.forward_tokens(model, item.kv, item.ids, item.positions, biases=biases, keep=item.keep)  # (1, a, V)
    logp = torch.log_softmax(logits[0].float(), -1)  # (a, V)
    nll = -logp.gather(-1, item.target[:, None]).squeeze(-1)  # (a,)
    w = torch.ones_like(nll)
    w[0] = first_token_weight
    ce = (w * nll).sum() / w.sum()
    loss = ce_weight * ce
    if kl_weight > 0 and item.ref_logp is not None:
        kl = (item.ref_logp.exp() * (item.ref_logp - logp)).sum(-1).mean()
        loss = loss + kl_weight * kl
    return loss, ce.detach()


def resolve_mean(budget: Budget, n: int) -> float:
    """Mean tokens per KV head for a budget and a context of ``n`` tokens (fractions stay
    fractional: learned budgets need no rounding until hardening)."""
    if isinstance(budget, float):
        return budget * n
    return float(min(budget, n))


def anneal(bounds: list[float], step: int, steps: int) -> float:
    """Geometric interpolation from ``bounds[0]`` at step 0 to ``bounds[1]`` at the last step."""
    frac = step / max(steps - 1, 1)
    return float(bounds[0] * (bounds[1] / bounds[0]) ** frac)


@torch.no_grad()
def validate_hard(model, gates: Gates, items: list[CalibItem], budgets: list[Budget], eps: float) -> float:
    """Mean teacher-forced CE of the hardened route over ``items`` x ``budgets``."""
    total = []
    for item in items:
        for b in budgets:
            masks = gates.hard_masks(item.ranks, resolve_mean(b, item.n_tokens))
            total.append(float(answer_loss(model, item, masks, eps=eps, hard=True)[1]))
    return sum(total) / len(total)


# ---------------------------------------------------------------------------- checkpoints


def _meta(config: TrainConfig, model_name: str, n_layers: int) -> dict[str, str]:
    return {
        "schema": "learnroute.gates/1",
        "model": model_name,
        "n_layers": str(n_layers),
        "methods": json.dumps(config.methods),
        "learn": config.learn,
        "budget_floor": json.dumps(config.budget_floor),
    }


def save_gates(
    path: Path, gates: Gates, meta: dict[str, str], optimizer=None, extra: dict | None = None, adapter=None
) -> None:
    """Gates (and AdamW state) as safetensors, written atomically; metadata names the
    model, layer count and method set so a wrong checkpoint is refused on load."""
    from safetensors.torch import save_file

    tensors = {"theta": gates.theta.detach().cpu().contiguous(), "beta": gates.beta.detach().cpu().contiguous()}
    tensors["free"] = gates.free.to(torch.int8).cpu()
    if adapter is not None:  # cotrain.AdapterTraining: LoRA weights (and their AdamW state)
        tensors.update(adapter.tensors(optimizer))
    if optimizer is not None:
        for name, p in (("theta", gates.theta), ("beta", gates.beta)):
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"opt.{name}.{key}"] = value.detach().cpu().reshape(value.shape).contiguous()
    meta = {**meta, **{k: json.dumps(v) for k, v in (extra or {}).items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def load_gates(path: str | Path, *, model: str | None = None, n_layers: int | None = None,
               methods: list[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a gates checkpoint; refuses one made for another model,
    layer count or method set (every mismatch in one error)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"gates checkpoint {path} not found")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    problems = []
    if meta.get("schema") != "learnroute.gates/1":
        problems.append(f"{path} is not a learnroute gates checkpoint (schema {meta.get('schema')!r})")
    else:
        if model is not None and meta.get("model") != model:
            problems.append(f"checkpoint was trained on model {meta.get('model')!r}, not {model!r}")
        if n_layers is not None and int(meta.get("n_layers", -1)) != n_layers:
            problems.append(f"checkpoint has {meta.get('n_layers')} layers, the model has {n_layers}")
        if methods is not None and json.loads(meta.get("methods", "[]")) != list(methods):
            problems.append(f"checkpoint gates methods {meta.get('methods')}, not {list(methods)}")
    if problems:
        raise RouteError("cannot use this gates checkpoint:\n  " + "\n  ".join(problems))
    return tensors, meta


def _latest_checkpoint(folder: Path) -> Path | None:
    ckpts = sorted(folder.glob("step_*.safetensors"))
    return ckpts[-1] if ckpts else None


# ---------------------------------------------------------------------------- the run


def _init_from(config: TrainConfig, n_layers: int) -> tuple[list[str] | None, list[float] | None]:
    """Initial per-layer methods and budget shares from ``init_route`` / ``init_method``
    (both: the route's budget shape with ``init_method`` in every layer)."""
    if config.init_route is not None:
        route = Route.from_file(config.init_route)
        route.check_layers(n_layers, "the model")
        kinds = {isinstance(b, float) for b in route.budgets}
        shares = None
        if len(kinds) == 1 and len(set(route.budgets)) > 1:
            # Invert the gates' budget map k_l = mean·(f + (1 - f)·L·share_l) so the initial
            # soft budgets reproduce the route's shape (layers below the floor get ~0 share).
            mean = float(sum(route.budgets)) / n_layers
            f = config.budget_floor
            shares = [max(float(b) / mean - f, 0.0) / (n_layers * (1 - f)) for b in route.budgets]
            total = sum(shares)
            shares = [x / total for x in shares] if total > 0 else None
        if config.init_method is not None:
            return [config.init_method] * n_layers, shares
        return route.methods, shares
    if config.init_method is not None:
        return [config.init_method] * n_layers, None
    return None, None


def initial_logit(config: TrainConfig) -> float:
    """The logit of a layer's initial method: ``init_logit``, or the one that gives it
    π = ``init_pi`` at the first gate temperature (the other M - 1 logits are 0):
    π = e^(x/T) / (e^(x/T) + M - 1)  =>  x = T · ln(π (M - 1) / (1 - π))."""
    if config.init_pi is None:
        return config.init_logit
    p, m = config.init_pi, len(config.methods)
    return config.gate_temperature[0] * math.log(p * (m - 1) / (1 - p))


def build_gates(config: TrainConfig, n_layers: int, free: list[bool]) -> Gates:
    if config.learn == "none":  # frozen at the route: hard masks (an adapter trains)
        return cotrain.build_fixed_gates(config, None, n_layers, free)
    methods, shares = _init_from(config, n_layers)
    return Gates(
        config.methods,
        free,
        learn=config.learn,
        init_methods=methods,
        init_shares=shares,
        init_logit=initial_logit(config),
        budget_floor=config.budget_floor,
    )


def run_train(config: TrainConfig, overwrite: bool = False, progress: bool = True) -> Path:
    """Train gates on calibration samples into ``config.output``; resumes from the latest
    checkpoint of an interrupted run with the same config."""
    from accelerate import Accelerator
    from tqdm import tqdm

    from learnroute.engine import Engine
    from learnroute.models import load_model, model_name
    from learnroute.runs import append_jsonl, atomic_write, prepare_folder, read_jsonl, wandb_run
    from learnroute.tasks.suite import load_tasks

    cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available")
    acc = Accelerator(cpu=cpu)
    rank, world = acc.process_index, acc.num_processes
    out = prepare_folder(config, overwrite, acc.is_main_process)
    acc.wait_for_everyone()
    log = _logger(out / "train.log", acc.is_main_process)

    model, tokenizer = load_model(config.model)
    model.to(acc.device)
    name = model_name(model)
    engine = Engine(model, tokenizer, query_aware=config.query_aware)
    n_layers = engine.n_layers
    _init_from(config, n_layers)  # a warm-start route for another layer count fails here, before any prefill

    pairs = load_tasks(config.tasks, tokenizer, config.context_tokens, "calibration", config.seed)
    if any(s.split != "calibration" for _, s in pairs):  # a programming error, never user input
        raise RuntimeError("gates must train on calibration samples only")
    order = list(range(len(pairs)))
    random.Random(config.seed).shuffle(order)
    n_val = int(round(config.val_fraction * len(pairs)))
    val_idx, train_idx = sorted(order[:n_val]), sorted(order[n_val:])
    if acc.is_main_process:
        atomic_write(
            out / "split.json",
            json.dumps({"train": [pairs[i][1].id for i in train_idx], "val": [pairs[i][1].id for i in val_idx]}, indent=1)
            + "\n",
        )

    with frozen(model), contextlib.ExitStack() as stack:
        log.info("prefilling %d calibration samples (%d train, %d validation)", len(pairs), len(train_idx), n_val)
        mine = train_idx[rank::world]
        mine_set = set(mine)
        items: dict[int, CalibItem] = {}
        # The sample id fixes task, split, context length, seed and index; the model is
        # named by its path (or the default) and its converted name.
        same = (config.model, name, str(acc.device), config.query_aware, tuple(config.methods), config.kl_weight > 0)
        keys = {i: (*same, pairs[i][1].id) for i in mine + (val_idx if acc.is_main_process else [])}
        for stale in set(_ITEMS) - set(keys.values()):
            del _ITEMS[stale]
        for i in tqdm(keys, desc="prefill", disable=not progress or not acc.is_main_process):
            if keys[i] not in _ITEMS:
                task, sample = pairs[i]
                _ITEMS[keys[i]] = prepare_item(engine, task, sample, config.methods, config.kl_weight > 0)
            items[i] = _ITEMS[keys[i]]
        first = next(iter(items.values()))
        free = [not engine.is_fixed(layer, int(first.kv[layer][0].shape[2]), first.n_tokens) for layer in range(n_layers)]
        gates = build_gates(config, n_layers, free).to(acc.device)
        meta = _meta(config, name, n_layers)
        params = [p for p in (gates.theta, gates.beta) if p.requires_grad]
        groups = [{"params": params}] if params else []
        lora = None
        if config.adapter:  # on for every question/answer pass from here on; the prefills are done
            lora = stack.enter_context(cotrain.AdapterTraining(model, config, name).scope())
            groups.append(lora.param_group(config))
            params = params + lora.params
        optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
        start, best = 0, {"step": None, "val": math.inf}
        ckpt = _latest_checkpoint(out / "checkpoints")
        if ckpt is not None:
            start, best = _resume(ckpt, gates, optimizer, name, n_layers, config.methods)
            if lora is not None:
                lora.resume(load_gates(ckpt)[0], optimizer)
            log.info("resumed from %s (step %d)", ckpt, start)
        # Rows up to the checkpoint's step are final (evaluations of a step run before its save);
        # a run killed before its first checkpoint starts over, so its rows all go.
        if acc.is_main_process:
            kept = [r for r in read_jsonl(out / "history.jsonl") if ckpt is not None and r["step"] <= start]
            atomic_write(out / "history.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        val_items = [items[i] for i in val_idx] if acc.is_main_process else []
        wb = wandb_run(config, out) if config.wandb and acc.is_main_process else None

        def evaluate(step: int) -> None:
            if not val_items or not acc.is_main_process:
                return
            val = validate_hard(model, gates, val_items, config.budgets, config.eps)
            row = {"step": step, "val_ce": val, "methods": gates.hard_mixture().argmax(-1).tolist()}
            append_jsonl(out / "history.jsonl", [row])
            log.info("step %d: validation CE of the hardened route %.4f", step, val)
            if wb is not None:
                wb.log({"val_ce": val}, step=step)
            if val < best["val"]:
                best.update(step=step, val=val)
                save_gates(out / "best.safetensors", gates, meta, extra={"step": step, "val_ce": val}, adapter=lora)

        if start == 0:
            evaluate(0)  # the initial gates (a warm start) compete with every trained step
        st_from = config.steps - int(round(config.straight_through * config.steps))
        bar = tqdm(range(start, config.steps), desc="train", disable=not progress or not acc.is_main_process)
        for step in bar:
            rng = torch.Generator().manual_seed(config.seed * 1_000_003 + step)  # per-step: resume is exact
            batch = [train_idx[int(j)] for j in torch.randperm(len(train_idx), generator=rng)[: config.batch_size]]
            budget = config.budgets[int(torch.randint(len(config.budgets), (1,), generator=rng))]
            temp = anneal(config.gate_temperature, step, config.steps)
            tau = anneal(config.topk_temperature, step, config.steps)
            optimizer.zero_grad(set_to_none=False)
            # Each process prefilled its own share of the training samples: it computes the
            # batch members it holds (gradients are summed across processes below).
            local = [i for i in batch if i in mine_set]
            loss_sum, ce_sum = torch.zeros((), device=acc.device), torch.zeros((), device=acc.device)
            for i in local:
                item = items[i]
                masks = gates.soft_masks(
                    item.ranks,
                    resolve_mean(budget, item.n_tokens),
                    temperature=temp,
                    tau=tau,
                    mixing=config.mixing,
                    relaxation=config.relaxation,
                    gumbel=rng if config.gumbel else None,
                    straight_through=step >= st_from,
                    tau_scale=config.topk_scale,
                )
                loss, ce = answer_loss(
                    model, item, masks, eps=config.eps, first_token_weight=config.first_token_weight,
                    ce_weight=config.ce_weight, kl_weight=config.kl_weight, hard=getattr(gates, "fixed", False),
                )
                if config.entropy_weight > 0 and gates.theta.requires_grad:
                    loss = loss + config.entropy_weight * gates.entropy(temp)
                (loss / len(batch)).backward()
                loss_sum += loss.detach()
                ce_sum += ce
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if world > 1:
                    p.grad = acc.reduce(p.grad, reduction="sum")
            loss_all = float(acc.reduce(loss_sum, reduction="sum")) / len(batch)
            ce_all = float(acc.reduce(ce_sum, reduction="sum")) / len(batch)
            if not math.isfinite(loss_all) or any(not bool(torch.isfinite(p.grad).all()) for p in params):
                last = _latest_checkpoint(out / "checkpoints")
                raise TrainingError(
                    f"the loss or a gradient became NaN/inf at step {step + 1} (loss {loss_all}); nothing was updated. "
                    f"The last good checkpoint is {last or 'none (no step was saved yet)'}; try a smaller lr or "
                    "a larger topk_temperature end value"
                )
            optimizer.step()
            if acc.is_main_process:
                row = {"step": step + 1, "loss": loss_all, "ce": ce_all, "budget": budget, "T": temp, "tau": tau}
                append_jsonl(out / "history.jsonl", [row])
                if wb is not None:
                    wb.log({"loss": loss_all, "ce": ce_all, "T": temp, "tau": tau}, step=step + 1)
                bar.set_postfix(loss=f"{loss_all:.3f}", budget=budget)
            done = step + 1
            if done % config.eval_every == 0 or done == config.steps:
                evaluate(done)
            if acc.is_main_process and (done % config.save_every == 0 or done == config.steps):
                save_gates(
                    out / "checkpoints" / f"step_{done:06d}.safetensors", gates, meta, optimizer,
                    extra={"step": done, "best": best}, adapter=lora,
                )
        acc.wait_for_everyone()
        if acc.is_main_process:
            save_gates(out / "gates.safetensors", gates, meta, extra={"step": config.steps}, adapter=lora)
            chosen = out / ("best.safetensors" if config.select == "best_val" and best["step"] is not None else "gates.safetensors")
            route = export_route(chosen, config, name, n_layers)
            if lora is not None:  # route.json + route.adapter/ side by side
                route = cotrain.export_adapter(load_gates(chosen)[0], config, name, route, out / "route.json")
            route.to_file(out / "route.json")
            plot_gates(out, chosen, config)
            log.info("exported %s (from %s, validation CE %s)", out / "route.json", chosen.name, best)
            if wb is not None:
                wb.finish()
    return out


def _resume(ckpt: Path, gates: Gates, optimizer, model: str, n_layers: int, methods: list[str]):
    tensors, meta = load_gates(ckpt, model=model, n_layers=n_layers, methods=methods)
    with torch.no_grad():
        gates.theta.copy_(tensors["theta"])
        gates.beta.copy_(tensors["beta"])
    for name, p in (("theta", gates.theta), ("beta", gates.beta)):
        state = {k.split(".", 2)[2]: v.to(p.device) for k, v in tensors.items() if k.startswith(f"opt.{name}.")}
        if state:
            optimizer.state[p] = state
    best = json.loads(meta.get("best", "null")) or {"step": None, "val": math.inf}
    return int(json.loads(meta["step"])), best


class frozen:
    """Context manager: the model's parameters do not require grad inside (restored after),
    so backward computes gradients for the gates only."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self):
        self.saved = [(p, p.requires_grad) for p in self.model.parameters()]
        for p, _ in self.saved:
            p.requires_grad_(False)
        return self.model

    def __exit__(self, *exc) -> None:
        for p, flag in self.saved:
            p.requires_grad_(flag)


def _logger(path: Path, is_main: bool) -> logging.Logger:
    """The run's logger: always a log file (main process), plus stderr."""
    log = logging.getLogger(f"learnroute.train.{path.parent}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    if is_main:
        fh = logging.FileHandler(path)
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(fh)
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(sh)
    return log


# ---------------------------------------------------------------------------- export and plots


def gates_from_checkpoint(
    path: Path, config: TrainConfig, model: str | None, n_layers: int
) -> tuple[Gates, dict[str, str]]:
    """Gates rebuilt from a checkpoint (checked against the model, layers and methods),
    and the checkpoint's metadata."""
    tensors, meta = load_gates(path, model=model, n_layers=n_layers, methods=config.methods)
    free = [bool(x) for x in tensors["free"].tolist()]
    gates = Gates(config.methods, free, learn="both", budget_floor=json.loads(meta.get("budget_floor", "0.05")))
    with torch.no_grad():
        gates.theta.copy_(tensors["theta"])
        gates.beta.copy_(tensors["beta"])
    return gates, meta


def export_route(
    path: Path, config: TrainConfig, model: str | None, n_layers: int, *, budget: Budget | None = None,
    mixture: bool = False, temperature: float | None = None,
) -> Route:
    """The hardened (or ``mixture``) route of a gates checkpoint.

    Per layer the argmax method; budgets from the learned shares at ``budget`` (default:
    the first training budget): integers rounded with the exact total ``L_free x budget``
    (capped at ``context_tokens``), or fractions of the context. ``bench`` rescales the
    shape to other budgets. ``mixture`` keeps π at ``temperature`` (default: the final
    training temperature) as per-layer weights.
    """
    if config.learn == "none":  # the route was fixed: export it (its adapter: cotrain.export_adapter)
        return cotrain.export_fixed(config, model, n_layers, path, budget)
    gates, meta = gates_from_checkpoint(path, config, model, n_layers)
    budget = config.budgets[0] if budget is None else budget
    free = gates.free.tolist()
    if isinstance(budget, float):
        k = gates.budgets(budget * config.context_tokens, config.context_tokens).detach()
        budgets: list[Budget] = [
            min(1.0, float(x) / config.context_tokens) if f else budget for x, f in zip(k.tolist(), free)
        ]
    else:
        hard = gates.hard_budgets(float(budget), config.context_tokens)
        budgets = [b if f else budget for b, f in zip(hard, free)]
    idx = gates.theta.detach().argmax(-1).tolist()
    methods = [config.methods[i] for i in idx]
    temperature = config.gate_temperature[1] if temperature is None else temperature
    pi = torch.softmax(gates.theta.detach() / temperature, -1)  # (L, M)
    mixtures = None
    if mixture:
        # The argmax method's weight is at least 1/M, so every layer keeps its own method.
        mixtures = [{m: float(w) for m, w in zip(config.methods, row) if w > 1e-6} for row in pi.tolist()]
    prov: dict[str, Any] = {
        "source": "learned",
        "kind": "mixture" if mixture else "hardened",
        "checkpoint": str(path),
        "step": json.loads(meta.get("step", "null")),
        "budget": budget,
        "pi": [[round(x, 5) for x in row] for row in pi.tolist()],
        "pi_temperature": temperature,
        "budget_shares": [round(x, 6) for x in gates.shares().detach().tolist()],
        "calibration_tasks": dict(config.tasks),
        "train_config": to_dict(config),
    }
    return Route.from_layers(methods, budgets, model=model, mixtures=mixtures, **prov)


def plot_gates(out: Path, path: Path, config: TrainConfig) -> None:
    """``pi.png`` (π per layer x method, the argmax boxed) and ``budgets.png`` (learned
    budget per layer as a multiple of the mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tensors, _ = load_gates(path)
    theta = tensors["theta"]
    pi = torch.softmax(theta / config.gate_temperature[1], -1).numpy()  # (L, M)
    L, M = pi.shape
    fig, ax = plt.subplots(figsize=(1.5 + 0.5 * M, 0.22 * L + 1.8))
    im = ax.imshow(pi, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    for layer, j in enumerate(theta.argmax(-1).tolist()):
        ax.add_patch(plt.Rectangle((j - 0.5, layer - 0.5), 1, 1, fill=False, ec="red", lw=1))
    ax.set_xticks(range(M), config.methods, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("layer")
    ax.set_title(f"learned π (T = {config.gate_temperature[1]:g})", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(out / "pi.png", dpi=110)
    plt.close(fig)
    free = tensors["free"].bool()
    shares = torch.softmax(tensors["beta"].masked_fill(~free, float("-inf")), 0) * int(free.sum())
    floor = config.budget_floor
    mult = floor + (1 - floor) * shares  # per-layer budget / mean budget (before the context cap)
    fig, ax = plt.subplots(figsize=(max(5, 0.25 * L), 3))
    ax.bar(range(L), mult.numpy())
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set_xlabel("layer")
    ax.set_ylabel("budget / mean budget")
    ax.set_title("learned per-layer budgets", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "budgets.png", dpi=110)
    plt.close(fig)
