"""THE budget arithmetic: every budget in learnroute is resolved, shared, capped and
rounded here, so the route a trainer validates, the route ``bench`` runs and the route
RoutedPress runs keep the same tokens.

One rule for each step:

- **fractions -> tokens** (:func:`resolve_budget`): an int is tokens per KV head, capped at
  the context; a float ``f`` in (0, 1] keeps what kvpress keeps for
  ``compression_ratio = 1 - f`` (``int(n·f)``, at least 1). The engine, RoutedPress and
  validation all resolve a layer's budget with it. :func:`mean_tokens` is the
  real-valued mean (``f·n``) the soft gates train with.
- **shares -> budgets** (:func:`water_fill`): layer ``l`` keeps ``c·w_l``, capped at
  ``cap``, with one scalar ``c`` chosen so the total is exact. What a capped layer cannot
  use goes to the others in proportion to their own weights (a uniform scale of the
  uncapped layers), so rescaling an allocation to a larger total gives the allocation
  made at that total directly (tested).
- **a floor** (:func:`floored_weights`): every layer's weight is
  ``floor + (1 - floor)·L·share_l`` (mean 1): a layer keeps at least ``floor`` times the
  mean before capping.
- **a spread cap per layer** (:func:`spread_capped`): a head's weight at most ``r`` times
  its layer's mean head weight, the excess shared within the layer; water filling keeps
  it (``min(cap, c·w)`` never raises max/mean), so a padded per-head cache allocates at
  most ``r`` times the tokens it keeps.
- **exact integer totals** (:func:`round_exact`): floor, clamp into [1, cap], then single
  tokens to the largest remainders (or from the smallest) until the total is exact.
- **a route's shape at another mean** (:func:`rescale_budgets`): water filling with the
  route's own budgets as weights (fractions capped at 1.0; tokens rounded exactly).

Allocators (uniform, PyramidKV) share a budget across layers by a fixed schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from kvpress.utils import compute_n_kept

Budget = int | float


# ---------------------------------------------------------------------------- fractions <-> tokens


def resolve_budget(budget: Budget, n: int) -> int:
    """Tokens kept per KV head for a context of ``n`` tokens.

    An integer is a token count (capped at ``n``: a budget above the context keeps
    everything). A float in (0, 1] is a fraction of the context, resolved exactly as
    kvpress resolves ``compression_ratio = 1 - fraction`` so kept counts match kvpress.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be an int >= 1 or a float in (0, 1], got {budget!r}")
    if isinstance(budget, int):
        if budget < 1:
            raise ValueError(f"budget must be an int >= 1 or a float in (0, 1], got {budget!r}")
        return min(budget, n)
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be an int >= 1 or a float in (0, 1], got {budget!r}")
    # max(1, ...): below 2**-53, 1 - budget rounds to 1.0, which kvpress reads as "evict the
    # whole layer"; a fraction > 0 never asks for that (found by a property test).
    return min(n, max(1, compute_n_kept(n, 1.0 - budget)))


def mean_tokens(budget: Budget, n: int) -> float:
    """Real-valued mean tokens per KV head of ``budget`` at a context of ``n`` tokens
    (``f·n`` for a fraction, ``min(b, n)`` for tokens): what soft budgets train with;
    rounding waits for hardening."""
    if isinstance(budget, float):
        return budget * n
    return float(min(budget, n))


# ---------------------------------------------------------------------------- shares -> budgets


def water_fill(weights: torch.Tensor, total: float | torch.Tensor, cap: float) -> torch.Tensor:
    """Real-valued budgets (L,) summing to ``total``: ``min(cap, c·w_l)`` with one ``c``.

    ``weights`` (L,) >= 0; ``total`` is clipped into [0, L·cap]. Layers whose share would
    exceed ``cap`` are set to it and the rest is shared again among the others in
    proportion to their weights (at most L rounds). When every uncapped weight is 0 the
    rest is shared equally. Differentiable in ``weights`` (and ``total``) on uncapped
    layers.
    """
    w = weights.clamp_min(0)  # (L,)
    top = w.detach().max()
    if bool(top > 0):
        w = w / top  # only ratios matter; keeps tiny (subnormal) weights from losing precision
    L = w.shape[0]
    total = torch.as_tensor(total, dtype=w.dtype, device=w.device).clamp(0, L * cap)
    capped = torch.zeros(L, dtype=torch.bool, device=w.device)
    k = w
    for _ in range(L + 1):
        free_w = w.masked_fill(capped, 0)
        wsum = free_w.sum()
        if not bool(wsum > 0):  # nothing to go by: equal shares of the rest
            free_w = (~capped).to(w.dtype)
            wsum = free_w.sum().clamp_min(1)
        rest = total - cap * capped.sum().to(w.dtype)
        k = torch.where(capped, torch.full_like(w, cap), rest * (free_w / wsum))  # (L,)
        over = (k > cap) & ~capped
        if not bool(over.any()):
            break
        capped = capped | over
    return k.clamp_max(cap)


def layer_first_fill(weights: torch.Tensor, total: float | torch.Tensor, cap: float) -> torch.Tensor:
    """Budgets (L, H) summing to ``total`` that keep each layer's total where the cap
    allows: the layer totals are :func:`water_fill` of the rows' sums (each at most
    ``H·cap``), then each layer's heads share its total by :func:`water_fill` (as
    :func:`spread_capped` fills within rows). Why:
    with fixed layer totals (two-stage routes, ``layer_totals: fixed``) a head that
    reaches the cap hands its excess to its own layer's heads, where one water fill over
    every head would hand it to every other layer and move the layer totals."""
    H = weights.shape[1]
    totals = water_fill(weights.clamp_min(0).sum(1), total, H * cap)  # (L,)
    return torch.stack([water_fill(row, t, cap) for row, t in zip(weights, totals)])  # (L, H)


def floored_weights(shares: torch.Tensor, floor: float) -> torch.Tensor:
    """Weights (L,) of mean 1: ``floor + (1 - floor)·L·share_l`` (shares normalised to sum
    1; all-zero shares give uniform weights). With :func:`water_fill` every layer keeps at
    least ``floor`` times the mean budget (unless the cap is lower)."""
    if not 0.0 <= floor < 1.0:
        raise ValueError(f"budget floor must be in [0, 1), got {floor}")
    s = shares.clamp_min(0)  # (L,)
    L = s.shape[0]
    total = s.sum()
    s = s / total if bool(total > 0) else torch.full_like(s, 1.0 / L)
    return floor + (1 - floor) * L * s


def spread_capped(weights: torch.Tensor, spread: float) -> torch.Tensor:
    """Weights (L, H) with every head at most ``spread`` times its row's mean, each row's
    sum kept: the excess over the cap goes to the row's other heads in proportion to their
    weights (:func:`water_fill` within the row). After water filling over all heads (any
    cap), a row still has max/mean <= ``spread``: ``min(cap, c·w)`` compresses only the top.
    Why: the engine pads a layer's heads to its largest, so the allocated cache is
    max·H per layer; this bounds it by ``spread`` x the kept tokens."""
    if not spread >= 1.0:
        raise ValueError(f"spread must be >= 1, got {spread}")
    w = weights.clamp_min(0)  # (L, H)
    H = w.shape[-1]
    rows = w.sum(-1)  # (L,)
    out = []
    for row, total in zip(w, rows):
        if not bool(total > 0):
            out.append(row)
            continue
        out.append(water_fill(row / total, 1.0, spread / H) * total)  # (H,), at most spread·mean
    return torch.stack(out)  # (L, H)


def unit_weights(shares: torch.Tensor, floor: float, n_heads: int = 1, spread: float | None = None) -> torch.Tensor:
    """The weights (U,) gates water-fill their budgets with, from budget shares (U,) over
    the free units (a layer's ``n_heads`` heads adjacent): :func:`floored_weights`, then
    with ``spread`` and more than one head :func:`spread_capped` within each layer."""
    w = floored_weights(shares, floor)  # (U,), mean 1
    if spread is not None and n_heads > 1:
        w = spread_capped(w.view(-1, n_heads), spread).view(-1)  # (L, H) -> (U,)
    return w


def round_exact(values: Sequence[float], total: int, cap: int) -> list[int]:
    """Integers in [1, ``cap``] summing to ``total`` (clipped into [L, L·cap]).

    Each value is floored (and clamped into [1, cap]); single tokens then go to the
    largest fractional remainders ``v - int`` (or, when the 1-token minimum pushed the sum
    over, come from the smallest). Ties: the lower layer. When the values themselves lie
    in [1, cap] and sum to ``total``, every integer is within one token of its value.
    """
    L = len(values)
    total = max(L, min(int(total), L * cap))
    ints = [min(cap, max(1, math.floor(v))) for v in values]
    diff = total - sum(ints)
    while diff != 0:
        if diff > 0:
            order = sorted((i for i in range(L) if ints[i] < cap), key=lambda i: (ints[i] - values[i], i))
        else:
            order = sorted((i for i in range(L) if ints[i] > 1), key=lambda i: (values[i] - ints[i], i))
        for i in order[: abs(diff)]:
            ints[i] += 1 if diff > 0 else -1
        diff = total - sum(ints)
    return ints


def allocate_shares(
    shares: Sequence[float], budget: Budget, cap: int | None = None, floor: float = 0.0
) -> list[Budget]:
    """Per-layer budgets of mean ``budget`` from ``shares`` (>= 0, any scale).

    Weights :func:`floored_weights`, then :func:`water_fill` of ``L·budget`` with each
    layer at most ``cap`` tokens (token budgets; default: no cap) or 1.0 (fractions). Token
    budgets are rounded with :func:`round_exact` to the exact total ``L·min(budget, cap)``.
    """
    L = len(shares)
    is_frac = isinstance(budget, float)
    if not is_frac and cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1 token, got {cap}")
    limit = 1.0 if is_frac else float(cap if cap is not None else budget * L)
    w = floored_weights(torch.tensor(list(shares), dtype=torch.float64), floor)
    alloc = water_fill(w, budget * L, limit).tolist()
    if is_frac:
        return alloc
    return round_exact(alloc, round(min(budget, limit) * L), int(limit))


def rescale_budgets(
    budgets: Sequence[Budget], budget: Budget, free: Sequence[bool] | None = None, layer_heads: int | None = None
) -> list[Budget]:
    """A route's per-layer budget shape moved to mean ``budget`` over its ``free`` layers
    (default: all): :func:`water_fill` with the route's budgets as weights, capped at 1.0
    for fractions (token budgets: uncapped, rounded to the exact total). Layers that are
    not free keep the nominal ``budget`` (the engine never compresses them).

    With ``layer_heads`` = H the budgets are (layer, head) entries, H per layer, and the
    shape is moved by :func:`layer_first_fill`: each layer's total as a per-layer route's,
    a head at the cap handing its excess to its layer's other heads (fixed layer totals).

    A shape already at mean ``budget`` comes back unchanged (no float drift moves a
    token), and rescaling up gives what water filling at the larger mean gives directly.
    """
    kinds = {isinstance(b, float) for b in budgets}
    if len(kinds) > 1:
        raise ValueError("cannot rescale budgets that mix integers (tokens) and fractions")
    free = [True] * len(budgets) if free is None else list(free)
    idx = [i for i, f in enumerate(free) if f]
    out: list[Budget] = [budget] * len(budgets)
    if not idx:
        return out
    shape = [float(budgets[i]) for i in idx]
    is_frac = isinstance(budget, float)
    if isinstance(budgets[idx[0]], float) == is_frac and math.isclose(sum(shape) / len(idx), budget, rel_tol=1e-9):
        for i in idx:
            out[i] = budgets[i]
        return out
    cap = 1.0 if is_frac else float(budget) * len(idx)
    weights = torch.tensor(shape, dtype=torch.float64)  # (U,)
    if layer_heads is not None and layer_heads > 1:  # free units come in whole layers
        grid = weights.view(-1, layer_heads)  # (U,) -> (L_free, H)
        alloc = layer_first_fill(grid, budget * len(idx), cap).reshape(-1).tolist()  # (L_free, H) -> (U,)
    else:
        alloc = water_fill(weights, budget * len(idx), cap).tolist()
    if not is_frac:
        alloc = round_exact(alloc, budget * len(idx), int(cap))
    for i, b in zip(idx, alloc):
        out[i] = b
    return out


# ---------------------------------------------------------------------------- allocators


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
