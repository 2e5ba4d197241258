"""``learnroute export``: a trained gates run (or checkpoint) -> a route file (and, when
the run trained a decode-time adapter, its peft folder ``<route stem>.adapter`` beside it,
named in the route's provenance)."""

from __future__ import annotations

from pathlib import Path

import yaml

from learnroute.config import ConfigError, from_dict
from learnroute.gates.cotrain import export_adapter, has_adapter
from learnroute.gates.train import TrainConfig, export_route, load_gates
from learnroute.route import Route, parse_budget


def resolve_source(source: str | Path) -> tuple[Path, Path]:
    """(checkpoint, run folder) for a run folder or a checkpoint inside one.

    A run folder gives its exported choice: ``best.safetensors`` when validation picked
    one, else the final ``gates.safetensors``.
    """
    src = Path(source)
    if src.is_dir():
        for name in ("best.safetensors", "gates.safetensors"):
            if (src / name).is_file():
                return src / name, src
        raise FileNotFoundError(f"{src} holds no gates (best.safetensors or gates.safetensors): is training finished?")
    if not src.is_file():
        raise FileNotFoundError(f"{src} is neither a train run folder nor a gates checkpoint")
    run = src.parent.parent if src.parent.name == "checkpoints" else src.parent
    return src, run


def export_cli(
    source: str | Path,
    out: str | Path,
    *,
    budget: str | None = None,
    mixture: bool = False,
    temperature: float | None = None,
    model: str | None = None,
) -> Route:
    """Load the run's config and checkpoint, check them against each other, write the route."""
    ckpt, run = resolve_source(source)
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: a checkpoint must sit in its train run folder")
    config = from_dict(TrainConfig, yaml.safe_load(cfg_path.read_text()) or {})
    b = None if budget is None else parse_budget(budget)
    if temperature is not None and not temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {temperature}")
    tensors, meta = load_gates(ckpt, model=model, methods=config.methods)
    n_layers = int(meta["n_layers"])
    if tensors["theta"].shape != (n_layers, len(config.methods)):
        raise ConfigError(
            f"checkpoint gates have shape {tuple(tensors['theta'].shape)}, expected ({n_layers}, {len(config.methods)})"
        )
    route = export_route(ckpt, config, meta["model"], n_layers, budget=b, mixture=mixture, temperature=temperature)
    if has_adapter(tensors):
        route = export_adapter(tensors, config, meta["model"], route, out)
    route.to_file(out)
    return route
