"""Export: a trained gates run (or checkpoint) -> a route file (and, when the run trained
a decode-time adapter, its peft folder ``<route stem>.adapter`` beside it, named in the
route's provenance); the run's plots of π and budgets.

:func:`export_route` is the one way a checkpoint becomes a route: ``learnroute export``,
the trainer's final ``route.json`` and the study's export stage all call it, and it
hardens with :meth:`learnroute.gates.gates.Gates.harden`, the route validation runs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from learnroute.config import ConfigError, from_dict, to_dict
from learnroute.gates import cotrain
from learnroute.gates.checkpoint import load_gates
from learnroute.gates.config import TrainConfig
from learnroute.gates.gates import Gates, layer_shares_at, unit_shares
from learnroute.gates.start import build_gates
from learnroute.methods.budgets import Budget, unit_weights
from learnroute.route import LayerRoute, Route, parse_budget


def gate_heads(meta: dict[str, str]) -> int:
    """Gates per layer of a checkpoint (1 for per-layer gates and checkpoints made before
    per-head gates existed)."""
    return int(meta.get("n_heads", "1"))


def checkpoint_share_table(tensors: dict[str, torch.Tensor]) -> tuple[list[float], torch.Tensor] | None:
    """A checkpoint's per-budget layer totals (budgets (B,), shares (B, L)); None without."""
    if "layer_share_budgets" not in tensors:
        return None
    return tensors["layer_share_budgets"].tolist(), tensors["layer_shares"]


def budget_dependent(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint's allocation depends on the budget (:attr:`Gates.budget_dependent`)."""
    return "beta_slope" in tensors or "layer_share_budgets" in tensors


def gates_from_checkpoint(
    path: Path, config: TrainConfig, model: str | None, n_layers: int
) -> tuple[Gates, dict[str, str]]:
    """Gates rebuilt from a checkpoint (checked against the model, layers and methods),
    and the checkpoint's metadata. A ``learn: none`` run gives its fixed route's gates."""
    tensors, meta = load_gates(path, model=model, n_layers=n_layers, methods=config.methods)
    free = [bool(x) for x in tensors["free"].tolist()]
    if config.learn == "none":
        return cotrain.build_fixed_gates(config, model, n_layers, free), meta
    gates = Gates(config.methods, free, learn="both", budget_floor=json.loads(meta.get("budget_floor", "0.05")),
                  n_heads=gate_heads(meta), head_spread=json.loads(meta.get("head_spread", "null")),
                  layer_totals=meta.get("layer_totals", "learn"), budget_slope="beta_slope" in tensors,
                  ref_budget=json.loads(meta.get("ref_budget", "0.1")),
                  layer_share_table=checkpoint_share_table(tensors))
    with torch.no_grad():
        gates.theta.copy_(tensors["theta"])
        gates.beta.copy_(tensors["beta"])
        if gates.beta_slope is not None:
            gates.beta_slope.copy_(tensors["beta_slope"])
        if gates.layer_shares is not None:
            gates.layer_shares.copy_(tensors["layer_shares"])
    return gates, meta


def export_route(
    path: Path, config: TrainConfig, model: str | None, n_layers: int, *, budget: Budget | None = None,
    mixture: bool = False, temperature: float | None = None,
) -> Route:
    """The hardened (or ``mixture``) route of a gates checkpoint at ``budget`` (default:
    the first training budget), by :meth:`Gates.harden`: per layer the argmax method;
    budgets from the learned shares, fractions of the context for a fractional budget,
    integer tokens with the exact total ``L_free x budget`` (each layer at most
    ``context_tokens``) for a token budget. ``bench`` rescales the shape to other budgets.
    ``mixture`` keeps π at ``temperature`` (default: the final training temperature) as
    per-layer weights. A ``learn: none`` run exports the route it trained its adapter for.
    """
    gates, meta = gates_from_checkpoint(path, config, model, n_layers)
    budget = config.budgets[0] if budget is None else budget
    route = gates.harden(budget, config.context_tokens, model=model)
    prov: dict[str, Any] = {
        "checkpoint": str(path),
        "step": json.loads(meta.get("step", "null")),
        "calibration_tasks": dict(config.tasks),
        "train_config": to_dict(config),
    }
    if getattr(gates, "fixed", False):
        prov = {**route.provenance, "adapter_trained_for": route.provenance.get("source", "route"), **prov}
        return replace(route, provenance=prov)
    temperature = config.gate_temperature[1] if temperature is None else temperature
    pi = torch.softmax(gates.theta.detach() / temperature, -1)  # (L·H, M): per layer, or per (layer, head)
    mixtures = None
    if mixture:
        # The argmax method's weight is at least 1/M, so every unit keeps its own method.
        mixtures = [{m: float(w) for m, w in zip(config.methods, row) if w > 1e-6} for row in pi.tolist()]
    prov = {
        "source": "learned",
        "kind": "mixture" if mixture else "hardened",
        **prov,
        "budget": budget,
        "pi": [[round(x, 5) for x in row] for row in pi.tolist()],
        "pi_temperature": temperature,
        "budget_shares": [round(x, 6) for x in gates.shares().detach().tolist()],
    }
    if not route.is_per_head:
        return Route.from_layers(route.methods, route.budgets, model=model, mixtures=mixtures, **prov)
    H = gates.n_heads
    layers = []
    for l, e in enumerate(route.layers):
        if e.heads is None or mixtures is None:
            layers.append(e)
            continue
        mix = [tuple(mixtures[l * H + h].items()) for h in range(H)]
        layers.append(LayerRoute.per_head([LayerRoute(x.method, x.budget, m) for x, m in zip(e.heads, mix)]))
    return Route(layers, model=model, provenance=prov, layer_totals=route.layer_totals)


def plot_gates(out: Path, path: Path, config: TrainConfig) -> None:
    """``pi.png`` (π per layer x method, the argmax boxed) and ``budgets.png`` (learned
    budget per layer as a multiple of the mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tensors, meta = load_gates(path)
    theta = tensors["theta"]
    pi = torch.softmax(theta / config.gate_temperature[1], -1).numpy()  # (L·H, M): one row per gate
    L, M = pi.shape
    unit = "layer" if gate_heads(meta) == 1 else f"layer x head ({gate_heads(meta)} heads per layer)"
    fig, ax = plt.subplots(figsize=(1.5 + 0.5 * M, 0.22 * L + 1.8))
    im = ax.imshow(pi, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    for layer, j in enumerate(theta.argmax(-1).tolist()):
        ax.add_patch(plt.Rectangle((j - 0.5, layer - 0.5), 1, 1, fill=False, ec="red", lw=1))
    ax.set_xticks(range(M), config.methods, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(f"learned π (T = {config.gate_temperature[1]:g})", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(out / "pi.png", dpi=110)
    plt.close(fig)
    H = gate_heads(meta)
    free = tensors["free"].bool().repeat_interleave(H)  # (L·H,)
    # per-budget layer totals: drawn at the first training budget, as route.json holds them
    fixed = layer_shares_at(tensors.get("layer_shares"), tensors.get("layer_share_budgets"), float(config.budgets[0]))
    shares = unit_shares(tensors["beta"], free, H, fixed)  # (L·H,), 0 on fixed units
    floor = config.budget_floor
    # per-unit budget / mean budget (before the context cap), by the gates' own arithmetic:
    # the floor, then the checkpoint's head_spread cap; fixed units drawn at the floor
    w = unit_weights(shares[free], floor, H, json.loads(meta.get("head_spread", "null")))  # (U_free,)
    mult = torch.full_like(shares, floor).masked_scatter(free, w)  # (L·H,)
    fig, ax = plt.subplots(figsize=(max(5, 0.25 * L), 3))
    ax.bar(range(L), mult.numpy())
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set_xlabel(unit)
    ax.set_ylabel("budget / mean budget")
    ax.set_title(f"learned budgets per {unit.split(' (')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "budgets.png", dpi=110)
    plt.close(fig)


def chosen_checkpoint(run: Path, select: str) -> Path:
    """The checkpoint a finished run exports, as its own ``route.json`` was made:
    ``best.safetensors`` under ``select: best_val`` when validation picked a step, else
    the final ``gates.safetensors``."""
    names = ("best.safetensors", "gates.safetensors") if select == "best_val" else ("gates.safetensors",)
    for name in names:
        if (run / name).is_file():
            return run / name
    raise FileNotFoundError(f"{run} holds no gates ({' or '.join(names)}): is training finished?")


def resolve_source(source: str | Path) -> tuple[Path | None, Path]:
    """(checkpoint, run folder) for a run folder (checkpoint None: chosen by the run's
    ``select``, :func:`chosen_checkpoint`) or a checkpoint inside one."""
    src = Path(source)
    if src.is_dir():
        if not (src / "best.safetensors").is_file() and not (src / "gates.safetensors").is_file():
            raise FileNotFoundError(f"{src} holds no gates (best.safetensors or gates.safetensors): is training finished?")
        return None, src
    if not src.is_file():
        raise FileNotFoundError(f"{src} is neither a train run folder nor a gates checkpoint")
    run = src.parent.parent if src.parent.name == "checkpoints" else src.parent
    return src, run


def load_run(source: str | Path) -> tuple[Path, Path, TrainConfig]:
    """(checkpoint, run folder, its training config) for a run folder or a checkpoint in one;
    a run folder gives the checkpoint its own ``select`` exported (:func:`chosen_checkpoint`)."""
    ckpt, run = resolve_source(source)
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: a checkpoint must sit in its train run folder")
    config = from_dict(TrainConfig, yaml.safe_load(cfg_path.read_text()) or {})
    return ckpt or chosen_checkpoint(run, config.select), run, config


def export_cli(
    source: str | Path,
    out: str | Path,
    *,
    budget: str | None = None,
    mixture: bool = False,
    temperature: float | None = None,
    model: str | None = None,
    per_budget: bool | Literal["auto"] = False,
) -> Route:
    """Load the run's config and checkpoint, check them against each other, write the route.
    ``per_budget``: a budget-conditional route file instead (:mod:`learnroute.budget_routes`),
    the hardened allocation at each training budget (a ``budget_slope`` run's own per
    budget); the route at the first of them is returned. ``"auto"``: that file when the run
    learned a budget slope (its checkpoint holds ``beta_slope``: exported at one budget alone,
    the others would only be rescaled) and neither ``budget`` nor ``mixture`` is asked for."""
    ckpt, run, config = load_run(source)
    b = None if budget is None else parse_budget(budget)
    if temperature is not None and not temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {temperature}")
    tensors, meta = load_gates(ckpt, model=model, methods=config.methods)
    n_layers = int(meta["n_layers"])
    units = n_layers * gate_heads(meta)
    if tensors["theta"].shape != (units, len(config.methods)):
        raise ConfigError(
            f"checkpoint gates have shape {tuple(tensors['theta'].shape)}, expected ({units}, {len(config.methods)})"
        )
    if per_budget == "auto":
        per_budget = budget_dependent(tensors) and b is None and not mixture
    if per_budget:
        from learnroute.budget_routes import BudgetRoutes

        if b is not None or mixture:
            raise ValueError("per_budget writes the hardened route at every training budget: --budget and "
                             "--mixture do not apply")
        held = sorted({x for x in config.budgets if isinstance(x, float)})
        if not held:
            raise ValueError(f"a budget-conditional route needs fraction budgets; the run trained at {config.budgets}")
        routes = [export_route(ckpt, config, meta["model"], n_layers, budget=x) for x in held]
        if cotrain.has_adapter(tensors):
            first = cotrain.export_adapter(tensors, config, meta["model"], routes[0], out)
            routes = [first] + [r.with_adapter(first.adapter_path) for r in routes[1:]]
        BudgetRoutes(held, routes, source=f"route file {out}", provenance={"source": "learned", "run": str(run)}
                     ).to_file(out)
        return routes[0]
    route = export_route(ckpt, config, meta["model"], n_layers, budget=b, mixture=mixture, temperature=temperature)
    if cotrain.has_adapter(tensors):
        route = cotrain.export_adapter(tensors, config, meta["model"], route, out)
    route.to_file(out)
    return route


def export_start(source: str | Path, out: str | Path, *, budget: str | None = None, model: str | None = None) -> Route:
    """The untrained start of a train run: its initial gates (:func:`learnroute.gates.start.build_gates`),
    hardened and exported exactly as its trained route is (at ``budget``, default the first
    training budget; no adapter; with per-budget layer totals and no ``budget``, a
    budget-conditional file of every training budget's start). Bench it beside the trained
    route: a gain is credited to learning only over it."""
    ckpt, run, config = load_run(source)
    b = config.budgets[0] if budget is None else parse_budget(budget)
    tensors, meta = load_gates(ckpt, model=model, methods=config.methods)
    n_layers = int(meta["n_layers"])
    gates = build_gates(config, n_layers, [bool(x) for x in tensors["free"].tolist()], gate_heads(meta))

    def start_at(x: Budget) -> Route:
        route = gates.harden(x, config.context_tokens, model=meta["model"])
        prov = {**route.provenance, "source": "start", "start_of": str(run), "budget": x,
                "train_config": to_dict(config)}
        return replace(route, provenance=prov)

    if budget is None and gates.layer_share_budgets is not None:
        # per-budget layer totals (a second stage): the start differs by budget, not by rescaling
        from learnroute.budget_routes import BudgetRoutes

        held = sorted({x for x in config.budgets if isinstance(x, float)})
        routes = [start_at(x) for x in held]
        BudgetRoutes(held, routes, source=f"route file {out}", provenance={"source": "start", "start_of": str(run)}
                     ).to_file(out)
        return routes[0]
    route = start_at(b)
    route.to_file(out)
    return route

