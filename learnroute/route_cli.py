"""``learnroute show``: print a route file as a per-layer table; ``learnroute reshape``: floor,
cap or flatten a route file's budgets after the fact; ``learnroute combine``: one
budget-conditional route file from routes made for one budget each."""

from __future__ import annotations

import argparse
import os

from learnroute.budget_routes import BudgetRoutes, combine as combine_routes, load_route_file
from learnroute.route import Route, RouteError, parse_budget


def show(argv: list[str]) -> int:
    """Print a route file: model, provenance, per-layer method and budget, method counts; a
    budget-conditional file, each allocation it holds (or, with --budget, the route it gives
    for that budget)."""
    parser = argparse.ArgumentParser(prog="learnroute show", description=show.__doc__)
    parser.add_argument("route", help="route JSON file")
    parser.add_argument("--budget", type=parse_budget, help="a budget-conditional file: the route for this budget")
    args = parser.parse_args(argv)
    try:
        found = load_route_file(args.route)
        if isinstance(found, BudgetRoutes):
            if args.budget is None:
                print(f"route {args.route}: budget-conditional, allocations for {found.budgets} "
                      f"(outside them: {found.outside})")
                for b, route in zip(found.budgets, found.routes):
                    print(f"\n@{b}:")
                    _print_route(args.route, route)
                return 0
            found = found.at(args.budget)
        elif args.budget is not None:
            found = found.rescaled(args.budget)
    except RouteError as e:
        parser.exit(2, f"learnroute show: error: {e}\n")
    _print_route(args.route, found)
    return 0


def _print_route(name: str, route: Route) -> int:
    print(f"route {name}: {route.describe()}  model={route.model}  n_layers={route.n_layers}")
    if route.provenance:
        print("provenance: " + ", ".join(f"{k}={v}" for k, v in route.provenance.items()))
    if route.is_per_head:  # a layers x KV heads grid of method@budget
        heads = [[f"{h.method}@{h.budget}" for h in e.head_entries(route.n_heads)] for e in route.layers]
        width = max(len(c) for row in heads for c in row) + 2
        print(f"{'layer':>5}  " + "".join(f"{'head ' + str(h):<{width}}" for h in range(route.n_heads)))
        for i, (entry, row) in enumerate(zip(route.layers, heads)):
            print(f"{i:>5}  " + "".join(f"{c:<{width}}" for c in row) + ("" if entry.heads else "(every head)"))
        counts: dict[str, int] = {}
        for e in route.layers:
            for h in e.head_entries(route.n_heads):
                counts[h.method] = counts.get(h.method, 0) + 1
        print("counts (layer x head entries): " + ", ".join(f"{m}={c}" for m, c in sorted(counts.items())))
        return 0
    print(f"{'layer':>5}  {'method':<20} budget")
    for i, entry in enumerate(route.layers):
        print(f"{i:>5}  {entry.method:<20} {entry.budget}")
    print("counts: " + ", ".join(f"{m}={c}" for m, c in sorted(route.method_counts().items())))
    return 0


def reshape(argv: list[str]) -> int:
    """Write a route file's budgets reshaped after the fact (mean kept): a floor, a cap on
    the spread within layers, or each layer's mean (:meth:`learnroute.route.Route.reshaped`);
    or, with --adakv, each layer's total shared over its KV heads by the sample's scores
    (:meth:`learnroute.route.Route.shared`). A budget-conditional file is reshaped
    allocation by allocation."""
    parser = argparse.ArgumentParser(prog="learnroute reshape", description=reshape.__doc__)
    parser.add_argument("route", help="route JSON file (fractional budgets), or a budget-conditional one")
    parser.add_argument("--out", required=True, help="where to write the reshaped route (must not exist)")
    parser.add_argument("--floor", type=float, help="every entry keeps at least this share of the mean, in [0, 1)")
    parser.add_argument("--head-spread", type=float,
                        help="per-head routes: each head at most this times its layer's mean head budget (>= 1)")
    parser.add_argument("--layer-mean", action="store_true", help="per-head routes: every head at its layer's mean")
    parser.add_argument("--adakv", choices=("layer", "priors"),
                        help="Ada-KV inside each layer's total: 'layer' gives every head the layer's mean as its "
                             "prior (plain Ada-KV within the route's layer totals); 'priors' keeps a per-head "
                             "route's head budgets as priors (each head's floor is --safeguard x its budget)")
    parser.add_argument("--safeguard", type=float,
                        help="with --adakv: each head's floor as a fraction of its prior, in [0, 1] (default 0.2, Ada-KV's)")
    args = parser.parse_args(argv)
    if os.path.exists(args.out):
        parser.exit(2, f"learnroute reshape: error: {args.out} exists; choose another --out (nothing is overwritten)\n")
    if args.safeguard is not None and args.adakv is None:
        parser.exit(2, "learnroute reshape: error: --safeguard sets Ada-KV's floor: give --adakv layer|priors too\n")

    def one(route: Route) -> Route:
        if args.floor is not None or args.head_spread is not None or args.layer_mean or args.adakv is None:
            route = route.reshaped(floor=args.floor, head_spread=args.head_spread, layer_mean=args.layer_mean)
        return route if args.adakv is None else route.shared(args.safeguard, priors=args.adakv == "priors")

    try:
        found = load_route_file(args.route)
        made = (BudgetRoutes(found.budgets, [one(r) for r in found.routes], found.outside, found.source,
                             dict(found.provenance)) if isinstance(found, BudgetRoutes) else one(found))
    except RouteError as e:
        parser.exit(2, f"learnroute reshape: error: {e}\n")
    made.to_file(args.out)
    print(f"wrote {args.out}: " + (made.describe() if isinstance(made, Route) else f"allocations for {made.budgets}"))
    return 0


def combine(argv: list[str]) -> int:
    """Write one budget-conditional route file from route files made for one budget each
    (``FILE@BUDGET``, or FILE at its mean budget): the bench and ``show --budget`` then pick
    each budget's own allocation, interpolating between them (:mod:`learnroute.budget_routes`)."""
    parser = argparse.ArgumentParser(prog="learnroute combine", description=combine.__doc__)
    parser.add_argument("routes", nargs="+", help="route files, FILE@BUDGET to name the budget each was made for")
    parser.add_argument("--out", required=True, help="where to write the combined file (must not exist)")
    parser.add_argument("--outside", choices=("error", "clamp"), default="error",
                        help="a budget outside those held: an error (default), or the nearest allocation rescaled")
    args = parser.parse_args(argv)
    if os.path.exists(args.out):
        parser.exit(2, f"learnroute combine: error: {args.out} exists; choose another --out (nothing is overwritten)\n")
    routes, budgets = [], []
    try:
        for spec in args.routes:
            path, sep, tail = spec.rpartition("@")
            path, budget = (path, parse_budget(tail)) if sep and path else (spec, None)
            routes.append(Route.from_file(path))
            budgets.append(budget)  # None: the route's mean budget (combine)
        made = combine_routes(routes, budgets, args.outside)
    except (RouteError, ValueError) as e:
        parser.exit(2, f"learnroute combine: error: {e}\n")
    made.to_file(args.out)
    print(f"wrote {args.out}: allocations for {made.budgets} (outside them: {made.outside})")
    return 0
