"""Budget allocators: share a budget across layers (separate from scoring)."""

from __future__ import annotations

from collections.abc import Callable

Budget = int | float


def uniform(n_layers: int, budget: Budget) -> list[Budget]:
    """Every layer keeps ``budget``."""
    return [budget] * n_layers


def pyramid(n_layers: int, budget: Budget, window: int = 32, beta: int = 20) -> list[Budget]:
    """PyramidKV (Cai et al. 2024, arXiv 2406.02069), KVCache-Factory's schedule.

    For an average of ``C`` tokens per layer: ``min = (C - w) // beta``,
    ``max = 2 (C - w) - min``, layer ``l`` keeps ``max - l * ((max - min) // (L - 1)) + w``;
    the total stays ``L * C`` up to integer steps. Falls back to uniform when ``C <= w``.
    A fractional budget ``f`` uses the same shape with ``w = 0`` in fraction units,
    each layer capped at 1.0.
    """
    if n_layers == 1:
        return [budget]
    if isinstance(budget, float):
        lo = budget / beta
        hi = 2 * budget - lo
        step = (hi - lo) / (n_layers - 1)
        return [min(1.0, hi - layer * step) for layer in range(n_layers)]
    if budget <= window:
        return uniform(n_layers, budget)
    lo = (budget - window) // beta
    hi = 2 * (budget - window) - lo
    step = (hi - lo) // (n_layers - 1)
    return [max(1, hi - layer * step + window) for layer in range(n_layers)]


ALLOCATORS: dict[str, Callable[[int, Budget], list[Budget]]] = {"uniform": uniform, "pyramid": pyramid}


def allocate(name: str, n_layers: int, budget: Budget) -> list[Budget]:
    """Per-layer budgets from the allocator ``name``; an unknown name lists the valid ones."""
    try:
        fn = ALLOCATORS[name]
    except KeyError:
        raise ValueError(f"unknown budget allocator {name!r}; valid: {', '.join(ALLOCATORS)}") from None
    return fn(n_layers, budget)
