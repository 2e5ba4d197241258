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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from learnroute.config import ConfigError
from learnroute.gates import cotrain
from learnroute.gates.calibration import (
    STREAM_OFFSET, CalibItem, CalibrationStore, Stream, calibration_items,
)
from learnroute.gates.checkpoint import checkpoint_meta, gate_params, latest_checkpoint, load_gates, save_gates
from learnroute.gates.config import (
    CANDIDATES, SEED_FIELD, SEED_SUFFIX, SELECT, TrainConfig, init_route_file, optimisation_seed, stage_configs,
)
from learnroute.gates.gates import Gates
from learnroute.gates.start import init_from, build_gates
from learnroute.methods.budgets import Budget, mean_tokens
from learnroute.route import Route, RouteError
from learnroute.runs import folder_conflict, move_aside, process_state

__all__ = ["CANDIDATES", "SELECT", "TrainConfig", "TrainingError", "run_train", "run_train_seeds"]
logger = logging.getLogger("learnroute.train")


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the message says what was kept."""


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
    # A one-token answer with first_token_weight 0 weighs nothing: its CE is 0 (with a
    # gradient of 0), not 0 / 0.
    ce = (w * nll).sum() / w.sum() if float(w.sum()) > 0 else (w * nll).sum()
    loss = ce_weight * ce
    if kl_weight > 0 and item.ref_logp is not None:
        kl = (item.ref_logp.exp() * (item.ref_logp - logp)).sum(-1).mean()
        loss = loss + kl_weight * kl
    return loss, ce.detach()


def anneal(bounds: list[float], step: int, steps: int) -> float:
    """Geometric interpolation from ``bounds[0]`` at step 0 to ``bounds[1]`` at the last step."""
    frac = step / max(steps - 1, 1)
    return float(bounds[0] * (bounds[1] / bounds[0]) ** frac)


# ---------------------------------------------------------------------------- the routes users run


def validation_routes(gates: Gates, config: TrainConfig, model: str | None = None) -> dict[Budget, Route]:
    """The hardened route at every training budget, made as users get it: exported at the
    first training budget (:meth:`Gates.harden`, what ``route.json`` holds), then rescaled
    to each budget as ``bench`` rescales a route file (:meth:`Route.rescaled`)."""
    free = gates.free.tolist()
    if gates.budget_dependent:  # a budget-conditional route: each budget's own allocation
        return {b: gates.harden(b, config.context_tokens, model=model) for b in config.budgets}
    exported = gates.harden(config.budgets[0], config.context_tokens, model=model)
    return {b: exported.rescaled(b, free) for b in config.budgets}


@torch.no_grad()
def validate_hard(model, gates: Gates, items: list[CalibItem], routes: dict[Budget, Route], eps: float) -> float:
    """Mean teacher-forced CE over ``items`` x ``routes`` (:func:`validation_routes`), each
    route's keep-sets selected as the engine selects them (:func:`route_masks`)."""
    total = []
    for item in items:
        for route in routes.values():
            masks = gates.hard_masks(item.ranks, route)  # (L, H, n)
            total.append(float(answer_loss(model, item, masks, eps=eps, hard=True)[1]))
    return sum(total) / len(total)


# ---------------------------------------------------------------------------- the run, in stages


@dataclass
class _Run:
    """What the stages of one training run share."""

    config: TrainConfig
    acc: Any  # accelerate.Accelerator
    out: Path
    log: logging.Logger
    model: torch.nn.Module
    engine: Any  # learnroute.engine.Engine
    name: str  # the model's name, checked by checkpoints
    progress: bool
    calibration: CalibrationStore  # where this run's calibration items are made (or found)

    @property
    def main(self) -> bool:
        return self.acc.is_main_process


def _setup(
    config: TrainConfig, overwrite: bool, progress: bool, calibration: CalibrationStore, prefills=None
) -> _Run:
    """Devices, the run folder and its log, the frozen model and the engine."""
    from accelerate import Accelerator

    from learnroute.engine import Engine
    from learnroute.models import load_model, model_name
    from learnroute.runs import prepare_folder, resolve_device

    acc = Accelerator(cpu=resolve_device(config.device) == "cpu")
    out = prepare_folder(config, overwrite, acc.is_main_process)
    acc.wait_for_everyone()
    log = _logger(out / "train.log", acc.is_main_process)
    model, tokenizer = load_model(config.model, dtype=config.dtype)
    model.to(acc.device)
    engine = Engine(model, tokenizer, query_aware=config.query_aware, prefills=prefills)
    # a warm-start route for another layer (or head) count fails here, before any prefill
    init_from(config, engine.n_layers, n_heads=engine.n_kv_heads if config.per_head_gates else 1)
    return _Run(config, acc, out, log, model, engine, model_name(model), progress, calibration)


def _split(run: _Run) -> tuple[list, list[int], list[int]]:
    """Calibration samples and their train / validation split (``split.json``)."""
    from learnroute.runs import atomic_write
    from learnroute.tasks.suite import load_tasks

    config = run.config
    pairs = load_tasks(config.tasks, run.engine.tokenizer, config.context_tokens, "calibration", config.seed)
    if config.val_tasks is not None:  # held-out families validate; every sample of tasks trains
        held = load_tasks(config.val_tasks, run.engine.tokenizer, config.context_tokens, "calibration", config.seed)
        train_idx, val_idx = list(range(len(pairs))), list(range(len(pairs), len(pairs) + len(held)))
        pairs = pairs + held
    else:
        order = list(range(len(pairs)))
        random.Random(config.seed).shuffle(order)
        n_val = int(round(config.val_fraction * len(pairs)))
        val_idx, train_idx = sorted(order[:n_val]), sorted(order[n_val:])
    if any(s.split != "calibration" for _, s in pairs):  # a programming error, never user input
        raise RuntimeError("gates must train on calibration samples only")
    if run.main:
        ids = {"train": [pairs[i][1].id for i in train_idx], "val": [pairs[i][1].id for i in val_idx]}
        if config.stream:  # training samples come from the stream (sample ids from STREAM_OFFSET on)
            ids["train"] = []
            ids["stream"] = {"per_step": config.stream, "pool": config.stream_pool, "first_index": STREAM_OFFSET,
                             "families": dict(config.tasks)}
        atomic_write(run.out / "split.json", json.dumps(ids, indent=1) + "\n")
    return pairs, train_idx, val_idx


class _Trainer:
    """The optimisation of one run: gates (+ adapter), AdamW, resume, validation, steps,
    checkpoints. Built after the prefills; :meth:`fit` runs the remaining steps."""

    def __init__(self, run: _Run, items: dict[int, CalibItem], train_idx: list[int], val_idx: list[int],
                 mine: list[int], stack: contextlib.ExitStack) -> None:
        from learnroute.runs import wandb_run

        config, self.run, self.items = run.config, run, items
        self.train_idx, self.mine = train_idx, set(mine)
        self.stream = Stream(run) if config.stream else None
        first = next(iter(items.values())) if items else self.stream.item(*self.stream.drawn(0)[0])
        engine = run.engine
        free = [not engine.is_fixed(layer, int(first.kv[layer][0].shape[2]), first.n_tokens) for layer in range(engine.n_layers)]
        heads = engine.n_kv_heads if config.per_head_gates else 1  # gates per layer
        self.gates = build_gates(config, engine.n_layers, free, heads).to(run.acc.device)
        self.meta = checkpoint_meta(config, run.name, engine.n_layers, heads)
        self.params = self.gates.trainable()
        groups = [{"params": self.params}] if self.params else []
        self.lora = None
        if config.adapter:  # on for every question/answer pass from here on; the prefills are done
            self.lora = stack.enter_context(cotrain.AdapterTraining(run.model, config, run.name).scope())
            groups.append(self.lora.param_group(config))
            self.params = self.params + self.lora.params
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
        self.val_items = [items[i] for i in val_idx] if run.main else []
        self.wb = wandb_run(config, run.out) if config.wandb and run.main else None
        self.fixed_routes = validation_routes(self.gates, config) if getattr(self.gates, "fixed", False) else None
        self.start, self.best = self._resume()

    def _resume(self) -> tuple[int, dict]:
        """(first step, best validation so far) from the latest checkpoint; history rows
        after it are dropped. Rows up to the checkpoint's step are final (evaluations of a
        step run before its save); a run killed before its first checkpoint starts over."""
        from learnroute.runs import atomic_write, read_jsonl

        run = self.run
        start, best = 0, {"step": None, "val": math.inf}
        ckpt = latest_checkpoint(run.out / "checkpoints")
        if ckpt is not None:
            start, best = _resume(ckpt, self.gates, self.optimizer, run.name, run.engine.n_layers, run.config.methods)
            if self.lora is not None:
                self.lora.resume(load_gates(ckpt)[0], self.optimizer)
            run.log.info("resumed from %s (step %d)", ckpt, start)
        if run.main:
            kept = [r for r in read_jsonl(run.out / "history.jsonl") if ckpt is not None and r["step"] <= start]
            atomic_write(run.out / "history.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        return start, best

    def evaluate(self, step: int) -> None:
        """Validation CE of the hardened routes users would run; keeps the best step."""
        from learnroute.runs import append_jsonl

        run = self.run
        if not self.val_items or not run.main:
            return
        val = validate_hard(run.model, self.gates, self.val_items, validation_routes(self.gates, run.config), run.config.eps)
        row = {"step": step, "val_ce": val, "methods": self.gates.hard_mixture().argmax(-1).tolist()}
        append_jsonl(run.out / "history.jsonl", [row])
        run.log.info("step %d: validation CE of the hardened route %.4f", step, val)
        if self.wb is not None:
            self.wb.log({"val_ce": val}, step=step)
        if val < self.best["val"]:
            self.best.update(step=step, val=val)
            save_gates(run.out / "best.safetensors", self.gates, self.meta, extra={"step": step, "val_ce": val}, adapter=self.lora)

    def masks(self, item: CalibItem, budget: Budget, rng: torch.Generator, step: int) -> torch.Tensor:
        """The step's keep-masks (L, H, n) for one item: soft, or a fixed route's hard ones."""
        config = self.run.config
        if self.fixed_routes is not None:
            return self.gates.hard_masks(item.ranks, self.fixed_routes[budget])
        return self.gates.soft_masks(
            item.ranks,
            mean_tokens(budget, item.n_tokens),
            temperature=anneal(config.gate_temperature, step, config.steps),
            tau=anneal(config.topk_temperature, step, config.steps),
            mixing=config.mixing,
            relaxation=config.relaxation,
            gumbel=rng if config.gumbel else None,
            straight_through=step >= config.steps - int(round(config.straight_through * config.steps)),
            tau_scale=config.topk_scale,
        )

    def batch(self, step: int, rng: torch.Generator) -> tuple[list, list[CalibItem]]:
        """The step's batch (drawn from the step's seed: resume is exact) and the items of it
        this process computes: the members it prefilled (fixed set), or every world-th one
        (stream; prefilled here on demand)."""
        if self.stream is not None:
            batch = self.stream.batch(step, rng)
            acc = self.run.acc
            return batch, [self.stream.item(*m) for m in batch[acc.process_index :: acc.num_processes]]
        order = torch.randperm(len(self.train_idx), generator=rng)[: self.run.config.batch_size]
        batch = [self.train_idx[int(j)] for j in order]
        return batch, [self.items[i] for i in batch if i in self.mine]

    def step(self, step: int) -> tuple[float, float, Budget]:
        """One optimiser step on a batch drawn from the step's seed (resume is exact).
        Each process computes the batch members it prefilled; gradients are summed."""
        config, acc = self.run.config, self.run.acc
        rng = torch.Generator().manual_seed(optimisation_seed(config) * 1_000_003 + step)
        batch, local = self.batch(step, rng)
        budget = config.budgets[int(torch.randint(len(config.budgets), (1,), generator=rng))]
        temp = anneal(config.gate_temperature, step, config.steps)
        self.optimizer.zero_grad(set_to_none=False)
        loss_sum, ce_sum = torch.zeros((), device=acc.device), torch.zeros((), device=acc.device)
        for item in local:
            loss, ce = answer_loss(
                self.run.model, item, self.masks(item, budget, rng, step), eps=config.eps,
                first_token_weight=config.first_token_weight, ce_weight=config.ce_weight,
                kl_weight=config.kl_weight, hard=self.fixed_routes is not None,
            )
            if config.entropy_weight > 0 and self.gates.theta.requires_grad:
                loss = loss + config.entropy_weight * self.gates.entropy(temp)
            if config.uniform_weight > 0 and self.gates.beta.requires_grad:
                loss = loss + config.uniform_weight * self.gates.share_divergence()
            if config.slope_weight > 0 and self.gates.beta_slope is not None and self.gates.beta_slope.requires_grad:
                loss = loss + config.slope_weight * self.gates.slope_penalty()
            (loss / len(batch)).backward()
            loss_sum += loss.detach()
            ce_sum += ce
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if acc.num_processes > 1:
                p.grad = acc.reduce(p.grad, reduction="sum")
        loss_all = float(acc.reduce(loss_sum, reduction="sum")) / len(batch)
        ce_all = float(acc.reduce(ce_sum, reduction="sum")) / len(batch)
        if not math.isfinite(loss_all) or any(not bool(torch.isfinite(p.grad).all()) for p in self.params):
            last = latest_checkpoint(self.run.out / "checkpoints")
            raise TrainingError(
                f"the loss or a gradient became NaN/inf at step {step + 1} (loss {loss_all}); nothing was updated. "
                f"The last good checkpoint is {last or 'none (no step was saved yet)'}; try a smaller lr or "
                "a larger topk_temperature end value"
            )
        self.optimizer.step()
        return loss_all, ce_all, budget

    def fit(self) -> None:
        """Steps from the resumed one to the last: log, evaluate, checkpoint."""
        from tqdm import tqdm

        from learnroute.runs import append_jsonl

        run, config = self.run, self.run.config
        if self.start == 0:
            self.evaluate(0)  # the initial gates (a warm start) compete with every trained step
        bar = tqdm(range(self.start, config.steps), desc="train", disable=not run.progress or not run.main)
        for step in bar:
            loss, ce, budget = self.step(step)
            temp, tau = anneal(config.gate_temperature, step, config.steps), anneal(config.topk_temperature, step, config.steps)
            if run.main:
                row = {"step": step + 1, "loss": loss, "ce": ce, "budget": budget, "T": temp, "tau": tau}
                append_jsonl(run.out / "history.jsonl", [row])
                if self.wb is not None:
                    self.wb.log({"loss": loss, "ce": ce, "T": temp, "tau": tau}, step=step + 1)
                bar.set_postfix(loss=f"{loss:.3f}", budget=budget)
            done = step + 1
            if done % config.eval_every == 0 or done == config.steps:
                self.evaluate(done)
            if run.main and (done % config.save_every == 0 or done == config.steps):
                save_gates(
                    run.out / "checkpoints" / f"step_{done:06d}.safetensors", self.gates, self.meta, self.optimizer,
                    extra={"step": done, "best": self.best}, adapter=self.lora,
                )

    def finish(self) -> None:
        """Final gates, the chosen checkpoint exported as ``route.json`` (with its adapter)
        by the same :func:`export_cli` users run, and the plots."""
        from learnroute.gates.export import chosen_checkpoint, export_cli, plot_gates

        run = self.run
        run.acc.wait_for_everyone()
        if not run.main:
            return
        save_gates(run.out / "gates.safetensors", self.gates, self.meta, extra={"step": run.config.steps}, adapter=self.lora)
        chosen = chosen_checkpoint(run.out, run.config.select)
        export_cli(run.out, run.out / "route.json")
        if self.gates.budget_dependent:  # a slope or per-budget layer totals: each budget's own allocation
            export_cli(run.out, run.out / "route_by_budget.json", per_budget=True)
        plot_gates(run.out, chosen, run.config)
        run.log.info("exported %s (from %s, validation CE %s)", run.out / "route.json", chosen.name, self.best)
        if self.wb is not None:
            self.wb.finish()


def run_train(
    config: TrainConfig,
    overwrite: bool = False,
    progress: bool = True,
    *,
    calibration: CalibrationStore | None = None,
    prefills=None,
) -> Path:
    """Train gates on calibration samples into ``config.output``; resumes from the latest
    checkpoint of an interrupted run with the same config.

    ``calibration``: a :class:`~learnroute.gates.calibration.CalibrationStore` shared with
    other runs on the same samples (a study's variants, seeds), which then prefill them
    once; ``prefills``: a :class:`~learnroute.engine.PrefillStore` shared with other stages.
    Without them the run keeps what it made only while it runs.

    A two-stage recipe (``stages``, :func:`~learnroute.gates.config.stage_configs`) trains
    its per-layer first stage into ``<output>/first_stage`` and then the per-head second
    stage from its route into ``<output>``, sharing one prefill of the calibration samples.
    Every stage's folder is checked before the first starts; ``overwrite`` moves the whole
    run aside once (a second stage must not resume from another first stage's route).
    """
    calibration = CalibrationStore() if calibration is None else calibration
    stages = stage_configs(config)
    if len(stages) == 1:
        return _train_one(stages[0], overwrite, progress, calibration, prefills)
    conflicts = _stage_conflicts([config])
    if conflicts and not overwrite:
        raise ConfigError("; ".join(conflicts))
    if conflicts:
        state = process_state()
        if state.is_main_process:
            move_aside(Path(config.output))
        state.wait_for_everyone()
    for cfg in stages:  # one calibration store: the second stage reuses the first's prefills
        out = _train_one(cfg, False, progress, calibration, prefills)
        process_state().wait_for_everyone()  # rank 0 writes route.json last: the next stage reads it
    return out


def _stage_conflicts(configs: list[TrainConfig]) -> list[str]:
    """Why the folder of any stage of ``configs`` cannot resume (each a folder_conflict)."""
    return [c for config in configs for stage in stage_configs(config) if (c := folder_conflict(stage))]


def _train_one(config: TrainConfig, overwrite: bool, progress: bool, calibration: CalibrationStore,
               prefills=None) -> Path:
    """One training run (one stage). Its steps: set-up, split, prefill, optimisation (resume,
    steps, validation, checkpoints), export and plots. With ``stream``, training samples
    are drawn fresh as it goes (:class:`~learnroute.gates.calibration.Stream`)."""
    run = _setup(config, overwrite, progress, calibration, prefills)
    if config.init_route is not None and config.init_method is not None:
        # the recipe's init_method (keydiff) is a default a user giving a route may not expect
        run.log.info("starting from the budgets of %s with %s in every layer (init_method; "
                     "init_method: null keeps the route's methods)", init_route_file(config), config.init_method)
    pairs, train_idx, val_idx = _split(run)
    rank, world = run.acc.process_index, run.acc.num_processes
    mine = [] if config.stream else train_idx[rank::world]  # a stream prefills its samples as it goes
    with frozen(run.model), contextlib.ExitStack() as stack:
        run.log.info("prefilling %d calibration samples (%d train, %d validation)", len(pairs), len(train_idx), len(val_idx))
        items = calibration_items(run, pairs, mine + (val_idx if run.main else []), run.calibration)
        trainer = _Trainer(run, items, train_idx, val_idx, mine, stack)
        trainer.fit()
        trainer.finish()
    return run.out


def seed_configs(config: TrainConfig, seeds: list[int]) -> list[TrainConfig]:
    """``config`` once per optimisation seed: ``train_seed=k``, ``output=<output>_seed<k>``,
    ``{seed}`` in ``init_route`` replaced by ``k``. Raises :class:`ConfigError` listing what is
    wrong with ``seeds``."""
    problems = []
    if not seeds:
        problems.append("--seeds needs at least one seed, e.g. --seeds 0,1,2")
    if bad := [s for s in seeds if not isinstance(s, int) or isinstance(s, bool) or s < 0]:
        problems.append(f"--seeds must be integers >= 0, got {bad}")
    if dup := sorted({s for s in seeds if seeds.count(s) > 1}):
        problems.append(f"--seeds lists {dup} more than once")
    if config.train_seed is not None:
        problems.append(f"train_seed={config.train_seed} and --seeds both set the optimisation seed; drop one")
    if problems:
        raise ConfigError("; ".join(problems))
    configs = [replace(config, train_seed=s, output=f"{config.output}{SEED_SUFFIX}{s}") for s in seeds]
    # each seed's own start ({seed} in init_route), written out so that its config.yaml names the file
    configs = [replace(c, init_route=init_route_file(c)) for c in configs]
    if config.init_route is not None and SEED_FIELD in config.init_route:  # every seed's start exists, before any run
        problems = [f"seed {c.train_seed}: {p}" for c in configs for p in c.init_route_problems()]
        if problems:
            raise ConfigError("; ".join(problems))
    return configs


def run_train_seeds(
    config: TrainConfig, seeds: list[int], overwrite: bool = False, progress: bool = True
) -> list[Path]:
    """Train ``config`` once per optimisation seed into ``<output>_seed<k>``, one run after
    another in this process. Each run is the one ``train_seed=k output=<output>_seed<k>``
    trains alone, but the runs share their calibration prefills (one
    :class:`~learnroute.gates.calibration.CalibrationStore`, as a study's variants do): the
    samples are prefilled once, not once per seed (at 4k tokens on 2 CPU cores that is 12
    minutes a seed). Every run folder is checked before
    the first run starts, so a conflict in the last one does not wait for the others."""
    configs = seed_configs(config, seeds)
    if not overwrite and (conflicts := _stage_conflicts(configs)):
        raise ConfigError("; ".join(conflicts))
    outs, calibration = [], CalibrationStore()
    for cfg in configs:
        outs.append(run_train(cfg, overwrite, progress, calibration=calibration))
        process_state().wait_for_everyone()  # rank 0 writes route.json last
    return outs


def _resume(ckpt: Path, gates: Gates, optimizer, model: str, n_layers: int, methods: list[str]):
    tensors, meta = load_gates(ckpt, model=model, n_layers=n_layers, methods=methods)
    if tensors["theta"].shape != gates.theta.shape:  # per-layer gates resumed per head, or the reverse
        raise RouteError(f"checkpoint {ckpt} holds gates of shape {tuple(tensors['theta'].shape)}, this run's are "
                         f"{tuple(gates.theta.shape)} (granularity changed?)")
    with torch.no_grad():
        gates.theta.copy_(tensors["theta"])
        gates.beta.copy_(tensors["beta"])
        if gates.beta_slope is not None:
            gates.beta_slope.copy_(tensors["beta_slope"])
    for name, p in gate_params(gates):
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


