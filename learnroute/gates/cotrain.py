"""Co-adaptation: a decode-time LoRA adapter trained by ``learnroute train`` with a route.

The hooks :mod:`learnroute.gates.train` calls when ``adapter: true``:

- :class:`AdapterTraining` creates the adapter on the model (peft's LoRA init, seeded,
  so B = 0 and step 0 is the route without adapter), keeps it on for every question and
  answer pass of the run (the calibration prefills ran before it existed: the cached
  keys and values are the base model's), hands its weights to the optimiser (own
  learning rate ``adapter_lr``), and writes / restores them with AdamW's state in the
  gates' checkpoints (keys ``lora.<peft key>`` and ``opt.lora.<peft key>.<state>``), so a
  resumed run ends where an uninterrupted one does;
- :class:`FixedGates` (``learn: none``): the gates frozen at ``init_route`` (or
  ``init_method`` everywhere) as **hard** masks: each layer's method (or mixture) keeps
  the top-k of its ranks at the route's per-layer budgets rescaled to the step's mean
  budget, as ``bench`` rescales a route file; only the adapter trains;
- :func:`export_adapter` writes the adapter folder (peft's format) beside the route file
  and names it in the route's provenance; :func:`fixed_route` is what ``learn: none``
  exports (the route it trained for).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from learnroute import adapter as _adapter
from learnroute.gates.gates import Gates
from learnroute.gates.topk import hard_topk_mask
from learnroute.methods.mixing import mix_ranks
from learnroute.methods.registry import METHODS
from learnroute.route import LayerRoute, Route, RouteError

if TYPE_CHECKING:
    from learnroute.gates.train import TrainConfig

LORA_KEY = "lora."
OPT_KEY = "opt.lora."


def config_problems(config: TrainConfig) -> list[str]:
    """What is wrong with the adapter settings (no model needed)."""
    problems = []
    if config.learn == "none":
        if not config.adapter:
            problems.append("learn=none trains nothing but an adapter: set adapter=true")
        if config.init_route is None and config.init_method is None:
            problems.append("learn=none keeps the route fixed: give init_route (a route file) or init_method")
    if config.init_route is not None and config.init_method is None and config.learn == "none":
        try:
            route = Route.from_file(config.init_route)
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


# ---------------------------------------------------------------------------- a fixed route


def fixed_route(config: TrainConfig, model: str | None, n_layers: int) -> Route:
    """The route ``learn: none`` trains for: ``init_route``, or ``init_method`` in every
    layer at the first training budget (both: the route's budgets with ``init_method``)."""
    if config.init_route is not None:
        route = Route.from_file(config.init_route)
        route.check_layers(n_layers, "the model")
        if config.init_method is not None:
            route.layers = [LayerRoute(config.init_method, e.budget) for e in route.layers]
        return route
    return Route.homogeneous(config.init_method, n_layers, config.budgets[0], model=model)


class FixedGates(Gates):
    """Gates frozen at a route (``learn: none``): masks are the route's hard keep-masks."""

    fixed = True

    def __init__(self, methods: list[str], free: list[bool], route: Route, budget_floor: float = 0.05) -> None:
        super().__init__(
            methods, free, learn="none", init_methods=[e.method if e.method in methods else methods[0] for e in route.layers],
            budget_floor=budget_floor,
        )
        L, M = len(free), len(methods)
        weights = torch.zeros(L, M)
        for layer, e in enumerate(route.layers):
            for m, w in e.mixture or ((e.method, 1.0),):
                if m in methods:
                    weights[layer, methods.index(m)] += w
        self.register_buffer("weights", weights, persistent=False)  # (L, M) per-layer method weights
        mean = sum(float(b) for b in route.budgets) / L
        self.share_of_mean = [float(b) / mean for b in route.budgets]  # the route's per-layer shape
        self.keeps_all = [METHODS[e.method].keeps_all and e.mixture is None for e in route.layers]

    def counts(self, mean_k: float, n: int) -> list[int]:
        """Tokens kept per KV head in each layer: the route's shape at mean ``mean_k``."""
        out = []
        for layer in range(self.n_layers):
            if self.keeps_all[layer] or not bool(self.free[layer]):
                out.append(n)
            else:
                out.append(min(n, max(1, round(mean_k * self.share_of_mean[layer]))))
        return out

    def hard_masks(self, ranks: torch.Tensor, mean_k: float) -> torch.Tensor:
        """0/1 keep-masks (L, H, n) of the route (ranks (L, M, H, n))."""
        L, _, H, n = ranks.shape
        scores = mix_ranks(ranks, self.weights.to(ranks.device))  # (L, H, n): one method's ranks, or the mixture's
        k = torch.tensor(self.counts(mean_k, n), device=ranks.device)  # (L,)
        masks = hard_topk_mask(scores, k[:, None].expand(L, H))  # (L, H, n)
        return torch.where(self.free[:, None, None], masks, torch.ones_like(masks))

    def soft_masks(self, ranks: torch.Tensor, mean_k: float, **_: Any) -> torch.Tensor:
        """The same hard masks (the route does not train); the trainer applies them as
        -inf biases, i.e. real eviction."""
        return self.hard_masks(ranks, mean_k)


def build_fixed_gates(config: TrainConfig, model: str | None, n_layers: int, free: list[bool]) -> FixedGates:
    return FixedGates(config.methods, free, fixed_route(config, model, n_layers), config.budget_floor)


# ---------------------------------------------------------------------------- training


class AdapterTraining:
    """The adapter a train run learns: on the model for the run, in its checkpoints."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig, model_name: str) -> None:
        self.model = model
        self.adapter = _adapter.Adapter.new(config.lora_rank, config.lora_alpha, config.lora_targets, model_name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)  # peft's LoRA init (A random, B = 0): the same on every run
            _adapter.attach(model, self.adapter, model_name)
        self.named = _adapter.trainable_params(model, self.adapter)  # key -> live parameter
        self.params = list(self.named.values())

    @contextlib.contextmanager
    def scope(self):
        """The adapter on and trainable for the block; detached at exit."""
        try:
            with _adapter.using(self.model, self.adapter, trainable=True):
                yield self
        finally:
            _adapter.detach(self.model, self.adapter)

    def param_group(self, config: TrainConfig) -> dict:
        return {"params": self.params, "lr": config.adapter_lr}

    def tensors(self, optimizer=None) -> dict[str, torch.Tensor]:
        """Weights (and AdamW state) for a gates checkpoint."""
        out = {LORA_KEY + k: p.detach().cpu().contiguous() for k, p in self.named.items()}
        if optimizer is not None:
            for k, p in self.named.items():
                for name, value in optimizer.state.get(p, {}).items():
                    out[f"{OPT_KEY}{k}.{name}"] = value.detach().cpu().reshape(value.shape).contiguous()
        return out

    def resume(self, tensors: dict[str, torch.Tensor], optimizer) -> None:
        """Weights and AdamW state back from a checkpoint's tensors."""
        missing = [k for k in self.named if LORA_KEY + k not in tensors]
        if missing:
            raise RouteError(f"the checkpoint holds no adapter weights for {missing[:3]} (another adapter config?)")
        with torch.no_grad():
            for k, p in self.named.items():
                saved = tensors[LORA_KEY + k]
                if saved.shape != p.shape:
                    raise RouteError(f"checkpoint adapter weight {k} has shape {tuple(saved.shape)}, not {tuple(p.shape)}")
                p.copy_(saved.to(p.device))
        for k, p in self.named.items():
            prefix = f"{OPT_KEY}{k}."
            state = {n[len(prefix):]: v.to(p.device) for n, v in tensors.items() if n.startswith(prefix)}
            if state:
                optimizer.state[p] = state


# ---------------------------------------------------------------------------- export


def has_adapter(tensors: dict[str, torch.Tensor]) -> bool:
    return any(k.startswith(LORA_KEY) for k in tensors)


def export_adapter(
    tensors: dict[str, torch.Tensor], config: TrainConfig, model: str | None, route: Route, route_file: str | Path
) -> Route:
    """Write the checkpoint's adapter as a peft folder beside ``route_file``
    (``<stem>.adapter``) and return the route naming it."""
    state = {k[len(LORA_KEY):]: v for k, v in tensors.items() if k.startswith(LORA_KEY)}
    adapter = _adapter.Adapter(_adapter.lora_config(config.lora_rank, config.lora_alpha, config.lora_targets, model), state)
    route_file = Path(route_file)
    folder = route_file.with_name(route_file.stem + ".adapter")
    adapter.save(folder)
    prov = {
        "adapter_config": {"rank": config.lora_rank, "alpha": config.lora_alpha, "targets": list(config.lora_targets)},
    }
    out = route.with_adapter(folder)
    out.provenance.update(prov)
    return out


def export_fixed(config: TrainConfig, model: str | None, n_layers: int, checkpoint: Path, budget=None) -> Route:
    """What a ``learn: none`` run exports: the route it trained its adapter for
    (rescaled to ``budget`` if given), its provenance extended with the run's."""
    import json

    from learnroute.bench import rescale
    from learnroute.config import to_dict
    from learnroute.gates.train import load_gates

    route = fixed_route(config, model, n_layers)
    if budget is not None:
        route = rescale(route, budget)
    _, meta = load_gates(checkpoint)
    route.provenance.update({
        "adapter_trained_for": route.provenance.get("source", "route"),
        "checkpoint": str(checkpoint),
        "step": json.loads(meta.get("step", "null")),
        "calibration_tasks": dict(config.tasks),
        "train_config": to_dict(config),
    })
    return route
