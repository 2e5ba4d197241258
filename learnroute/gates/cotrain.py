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
from dataclasses import replace
from pathlib import Path

import torch

from learnroute import adapter as _adapter
from learnroute.gates.config import TrainConfig, init_route_file, optimisation_seed
from learnroute.gates.gates import Gates
from learnroute.route import LayerRoute, Route, RouteError

LORA_KEY = "lora."
OPT_KEY = "opt.lora."


# ---------------------------------------------------------------------------- a fixed route


def fixed_route(config: TrainConfig, model: str | None, n_layers: int) -> Route:
    """The route ``learn: none`` trains for: ``init_route``, or ``init_method`` in every
    layer at the first training budget (both: the route's budgets with ``init_method``)."""
    if config.init_route is not None:
        route = Route.from_file(init_route_file(config))
        route.check_layers(n_layers, "the model")
        if config.init_method is not None:
            route.layers = [LayerRoute(config.init_method, e.budget) for e in route.layers]
        return route
    return Route.homogeneous(config.init_method, n_layers, config.budgets[0], model=model)


class FixedGates(Gates):
    """Gates frozen at a route (``learn: none``): masks are the route's hard keep-masks,
    its budget shape rescaled to each step's mean over the free layers (as ``bench``
    rescales a route file: :meth:`learnroute.route.Route.rescaled`)."""

    fixed = True

    def __init__(self, methods: list[str], free: list[bool], route: Route, budget_floor: float = 0.05) -> None:
        super().__init__(
            methods, free, learn="none", init_methods=[e.method if e.method in methods else methods[0] for e in route.layers],
            budget_floor=budget_floor,
        )
        self.route = route

    def harden(self, budget, context_tokens: int, model: str | None = None) -> Route:
        """The fixed route at mean ``budget`` over the free layers, naming ``model`` as
        :meth:`Gates.harden` does (a route made from a method alone names none)."""
        route = self.route.rescaled(budget, self.free.tolist())
        return route if model is None else replace(route, model=model)

def build_fixed_gates(config: TrainConfig, model: str | None, n_layers: int, free: list[bool]) -> FixedGates:
    return FixedGates(config.methods, free, fixed_route(config, model, n_layers), config.budget_floor)


# ---------------------------------------------------------------------------- training


class AdapterTraining:
    """The adapter a train run learns: on the model for the run, in its checkpoints."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig, model_name: str) -> None:
        self.model = model
        self.adapter = _adapter.Adapter.new(config.lora_rank, config.lora_alpha, config.lora_targets, model_name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(optimisation_seed(config))  # peft's LoRA init (A random, B = 0): the same on every run
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
