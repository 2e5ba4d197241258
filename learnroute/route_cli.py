"""``learnroute show``: print a route file as a per-layer table."""

from __future__ import annotations

import argparse

from learnroute.route import Route, RouteError


def show(argv: list[str]) -> int:
    """Print a route file: model, provenance, per-layer method and budget, method counts."""
    parser = argparse.ArgumentParser(prog="learnroute show", description=show.__doc__)
    parser.add_argument("route", help="route JSON file")
    args = parser.parse_args(argv)
    try:
        route = Route.from_file(args.route)
    except RouteError as e:
        parser.exit(2, f"learnroute show: error: {e}\n")
    print(f"route {args.route}: {route.describe()}  model={route.model}  n_layers={route.n_layers}")
    if route.provenance:
        print("provenance: " + ", ".join(f"{k}={v}" for k, v in route.provenance.items()))
    print(f"{'layer':>5}  {'method':<20} budget")
    for i, entry in enumerate(route.layers):
        print(f"{i:>5}  {entry.method:<20} {entry.budget}")
    print("counts: " + ", ".join(f"{m}={c}" for m, c in sorted(route.method_counts().items())))
    return 0
