"""The initial gates of a training run: a cold start, or a warm start from a route
(``init_route``: its methods and budget shape) or one method (``init_method``); frozen
gates for ``learn: none``. The study exports these too, as each variant's untrained
start (``<variant>_start``): a gain is credited to learning only over it."""

from __future__ import annotations

import math

from learnroute.budget_routes import BudgetRoutes, load_route_file
from learnroute.gates import cotrain
from learnroute.gates.config import TrainConfig, init_route_file, resolved_slope
from learnroute.gates.gates import Gates
from learnroute.route import Route


def start_file(config: TrainConfig) -> Route | BudgetRoutes | None:
    """The ``init_route`` file, read (``{seed}`` resolved; None without one)."""
    return None if config.init_route is None else load_route_file(init_route_file(config))


def init_from(
    config: TrainConfig, n_layers: int, free: list[bool] | None = None, n_heads: int = 1,
    found: Route | BudgetRoutes | None = None,
) -> tuple[list[str] | None, list[float] | None]:
    """Initial methods and budget shares from ``init_route`` / ``init_method`` (both: the
    route's budget shape with ``init_method`` everywhere), per layer, or per (layer, KV
    head) for a per-head route and ``n_heads`` > 1 gates. The shape is read over the
    ``free`` layers (those routes compress; default all). A budget-conditional
    ``init_route`` starts from its allocation at its first budget (see :func:`layer_share_table`).
    ``found``: the file already read (:func:`start_file`), else it is read here."""
    if config.init_route is None:
        return ([config.init_method] * n_layers if config.init_method is not None else None), None
    found = start_file(config) if found is None else found
    route = found.routes[0] if isinstance(found, BudgetRoutes) else found
    return route_shape(route, config, n_layers, free, n_heads)


def route_shape(
    route: Route, config: TrainConfig, n_layers: int, free: list[bool] | None = None, n_heads: int = 1
) -> tuple[list[str], list[float] | None]:
    """:func:`init_from` for one route: its methods and the budget shares that reproduce its budgets."""
    route.check_layers(n_layers, "the model")
    free = [True] * n_layers if free is None else free
    if route.is_per_head and n_heads > 1:  # one unit per (layer, head): the gates' own layout
        route.check_heads(n_heads)
        entries = [h for e in route.layers for h in e.head_entries(n_heads)]
        free = [f for f in free for _ in range(n_heads)]
        methods = [h.method for h in entries]
        all_budgets = [h.budget for h in entries]
    else:
        methods, all_budgets = route.methods, route.budgets
    budgets = [b for b, f in zip(all_budgets, free) if f]
    shares = None
    if len({isinstance(b, float) for b in budgets}) == 1 and len(set(budgets)) > 1:
        # Invert the gates' budget map k_u = mean·(f + (1 - f)·U·share_u), U and the mean
        # over the free units, so the initial soft budgets reproduce the route's shape
        # (units below the floor get ~0 share; fixed layers none).
        mean = float(sum(budgets)) / len(budgets)
        f, L = config.budget_floor, len(budgets)
        shares = [max(float(b) / mean - f, 0.0) / (L * (1 - f)) if ok else 0.0 for b, ok in zip(all_budgets, free)]
        total = sum(shares)
        shares = [x / total for x in shares] if total > 0 else None
    if config.init_method is not None:
        methods = [config.init_method] * len(methods)
    return methods, shares


def layer_share_table(
    found: Route | BudgetRoutes | None, config: TrainConfig, n_layers: int, free: list[bool], n_heads: int
) -> tuple[list[float], list[list[float]]] | None:
    """Per-budget layer totals for ``layer_totals: fixed`` from a budget-conditional
    ``init_route``, read as ``found`` (:func:`start_file`; a two-stage run's first stage's
    ``route_by_budget.json``): each held budget's layer shares (L,), so that the second
    stage keeps every budget's own layer totals and not the first budget's rescaled. None for a plain route file (one row: the
    gates' own ``layer_shares``) or learned layer totals."""
    if config.layer_totals != "fixed" or not isinstance(found, BudgetRoutes):
        return None
    rows = []
    for route in found.routes:
        _, shares = route_shape(route, config, n_layers, free, n_heads)
        if shares is None:  # equal budgets at this budget: every free layer alike
            shares = [1.0 if f else 0.0 for f in free]
        if len(shares) != n_layers:  # per (layer, head): a layer's share is its heads' sum
            shares = [sum(shares[l * n_heads:(l + 1) * n_heads]) for l in range(n_layers)]
        rows.append(shares)
    return list(found.budgets), rows


def initial_logit(config: TrainConfig) -> float:
    """The logit of a layer's initial method: ``init_logit``, or the one that gives it
    π = ``init_pi`` at the first gate temperature (the other M - 1 logits are 0):
    π = e^(x/T) / (e^(x/T) + M - 1)  =>  x = T · ln(π (M - 1) / (1 - π))."""
    if config.init_pi is None:
        return config.init_logit
    p, m = config.init_pi, len(config.methods)
    return config.gate_temperature[0] * math.log(p * (m - 1) / (1 - p))


def build_gates(config: TrainConfig, n_layers: int, free: list[bool], n_heads: int = 1) -> Gates:
    """The run's initial gates (``learn: none``: frozen at the route, hard masks); one gate
    per (layer, KV head) when ``n_heads`` > 1 (``granularity: head``)."""
    if config.learn == "none":
        return cotrain.build_fixed_gates(config, None, n_layers, free)
    found = start_file(config)  # read once: the start's shape and, per budget, its layer totals
    methods, shares = init_from(config, n_layers, free, n_heads, found)
    return Gates(
        config.methods,
        free,
        learn=config.learn,
        init_methods=methods,
        init_shares=shares,
        init_logit=initial_logit(config),
        budget_floor=config.budget_floor,
        n_heads=n_heads,
        head_spread=config.head_spread,
        layer_totals=config.layer_totals,
        budget_slope=resolved_slope(config),
        ref_budget=config.ref_budget,
        layer_share_table=layer_share_table(found, config, n_layers, free, n_heads),
    )
