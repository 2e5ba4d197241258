"""Budget-conditional routes: one allocation per budget, in one file.

A route file holds one shape of per-layer (per-head) budgets, and any other budget gets
that shape stretched (:meth:`Route.rescaled`). A learned per-head route whose heads span
0.2 % to 60 % of the context is a poor stand-in for the allocation learned at another
budget (issue 58). A :class:`BudgetRoutes` file holds an allocation per budget, and
:meth:`BudgetRoutes.at` gives the route for a requested budget:

- a budget the file holds: that allocation;
- a budget between two it holds: each (layer, KV head)'s share interpolated linearly in
  log-budget between the two allocations (the methods of the nearer one), then moved to the
  requested mean by :meth:`Route.rescaled`;
- a budget outside them: an error naming the file, the budgets it holds and the one asked
  for, or, with ``outside: "clamp"``, the nearest allocation rescaled, with a warning.

File format (JSON)::

    {"schema": "learnroute.budget_routes/1", "outside": "error",
     "budgets": [0.1, 0.2, 0.4],
     "routes": [<route object at mean 0.1>, <at 0.2>, <at 0.4>]}

Each route object is a plain route file's content (:meth:`Route.to_dict`). Budgets are
fractions kept, strictly increasing; every allocation has the same layers and KV heads.
``learnroute combine`` writes one from route files (say a study's per-budget routes);
``learnroute show`` prints every allocation; the bench, the study and
:func:`load_route_file` pick from them.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from learnroute.route import Budget, LayerRoute, Route, RouteError, write_json_file

SCHEMA = "learnroute.budget_routes/1"
Outside = Literal["error", "clamp"]
OUTSIDE = ("error", "clamp")


@dataclass
class BudgetRoutes:
    """Routes for several budgets of one model: ``routes[i]`` is the allocation at mean
    ``budgets[i]``. ``outside``: what :meth:`at` does with a budget beyond them."""

    budgets: list[Budget]
    routes: list[Route]
    outside: str = "error"
    source: str = "budget-conditional route"  # the file, in messages
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if len(self.budgets) != len(self.routes) or not self.routes:
            problems.append(f"{len(self.budgets)} budgets for {len(self.routes)} routes: give one route per budget")
        if any(isinstance(b, bool) or not isinstance(b, float) or not 0 < b <= 1 for b in self.budgets):
            problems.append(f"budgets must be fractions kept in (0, 1], got {self.budgets}")
        elif any(b >= c for b, c in zip(self.budgets, self.budgets[1:])):
            problems.append(f"budgets must be strictly increasing, got {self.budgets}")
        if self.outside not in OUTSIDE:
            problems.append(f"outside must be one of {', '.join(OUTSIDE)}, got {self.outside!r}")
        shapes = {(r.n_layers, r.n_heads) for r in self.routes}
        if len(shapes) > 1:
            held = "; ".join(f"{b}: {r.n_layers} layers, {r.n_heads or 'no per-head'} heads"
                             for b, r in zip(self.budgets, self.routes))
            problems.append(f"its allocations disagree in layer or head count ({held})")
        if len({r.model for r in self.routes}) > 1:
            problems.append(f"its allocations are for different models {sorted({str(r.model) for r in self.routes})}")
        if problems:
            raise RouteError(f"{self.source}: " + "; ".join(problems))

    @property
    def model(self) -> str | None:
        return self.routes[0].model

    @property
    def n_layers(self) -> int:
        return self.routes[0].n_layers

    def check_layers(self, n_layers: int, what: str = "the model") -> None:
        self.routes[0].check_layers(n_layers, what)

    def at(self, budget: Budget) -> Route:
        """The route for mean ``budget`` (see the module docstring)."""
        held = self.budgets
        if isinstance(budget, bool) or not isinstance(budget, float):
            raise RouteError(f"{self.source} holds allocations for fractions kept {held}; "
                             f"asked for {budget!r}, a token budget: give a fraction")
        if budget in held:
            return self._tag(self.routes[held.index(budget)].rescaled(budget), budget, "held")
        if not held[0] < budget < held[-1]:
            nearest = 0 if budget < held[0] else len(held) - 1
            if self.outside == "error":
                raise RouteError(f"{self.source} holds allocations for budgets {held}; {budget} is outside them. "
                                 f"Ask for a budget in [{held[0]}, {held[-1]}], or set \"outside\": \"clamp\" "
                                 "in the file to rescale the nearest allocation")
            warnings.warn(f"{self.source}: budget {budget} is outside {held}; the allocation at {held[nearest]} "
                          "is rescaled to it (outside: clamp)", stacklevel=2)
            return self._tag(self.routes[nearest].rescaled(budget), budget, f"clamped from {held[nearest]}")
        i = next(j for j in range(len(held) - 1) if held[j] < budget < held[j + 1])
        w = (math.log(budget) - math.log(held[i])) / (math.log(held[i + 1]) - math.log(held[i]))
        mixed = _interpolate(self.routes[i], self.routes[i + 1], w)
        return self._tag(mixed.rescaled(budget), budget, f"interpolated between {held[i]} and {held[i + 1]}")

    def _tag(self, route: Route, budget: Budget, how: str) -> Route:
        prov = {**route.provenance, "budget_routes": {"budget": budget, "how": how, "holds": list(self.budgets)}}
        return replace(route, provenance=prov)

    # ------------------------------------------------------------------ JSON

    def to_dict(self, base: str | os.PathLike | None = None) -> dict[str, Any]:
        return {"schema": SCHEMA, "outside": self.outside, "budgets": list(self.budgets),
                "routes": [r.to_dict(base) for r in self.routes], "provenance": dict(self.provenance)}

    @classmethod
    def from_dict(cls, d: Any, base: str | os.PathLike | None = None, source: str = "budget-conditional route"
                  ) -> BudgetRoutes:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise RouteError(f"{source}: not a budget-conditional route (schema {SCHEMA!r})")
        unknown = set(d) - {"schema", "outside", "budgets", "routes", "provenance"}
        if unknown:
            raise RouteError(f"{source}: unknown keys {sorted(unknown)}")
        budgets, routes = d.get("budgets"), d.get("routes")
        if not isinstance(budgets, list) or not isinstance(routes, list):
            raise RouteError(f"{source}: 'budgets' and 'routes' must be lists (one route per budget)")
        parsed, problems = [], []
        for i, r in enumerate(routes):
            try:
                parsed.append(Route.from_dict(r, base=base))
            except RouteError as e:
                problems.append(f"routes[{i}]: {e}")
        if problems:
            raise RouteError(f"{source}: " + "; ".join(problems))
        return cls(list(budgets), parsed, d.get("outside", "error"), source, dict(d.get("provenance") or {}))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> BudgetRoutes:
        path = Path(path)
        return cls.from_dict(_read(path), base=path.parent, source=f"route file {path}")

    def to_file(self, path: str | os.PathLike) -> Path:
        """Write the file as indented JSON, atomically."""
        return write_json_file(path, lambda base: self.to_dict(base=base))


def _interpolate(low: Route, high: Route, w: float) -> Route:
    """Per (layer, KV head): budget low^(1-w) * high^w, the method (and mixture) of the
    nearer allocation (``w`` < 0.5: ``low``)."""
    near = low if w < 0.5 else high
    heads = low.n_heads or high.n_heads
    if heads is None:
        budgets = [math.exp((1 - w) * math.log(a) + w * math.log(b)) for a, b in zip(low.budgets, high.budgets)]
        return Route([e.with_budgets([x], 1) for e, x in zip(near.layers, budgets)], model=near.model,
                     provenance=dict(near.provenance), adapter_path=near.adapter_path, layer_totals=near.layer_totals)
    layers = []
    for e, a, b in zip(near.layers, low.head_budgets(heads), high.head_budgets(heads)):
        xs = [math.exp((1 - w) * math.log(p) + w * math.log(q)) for p, q in zip(a, b)]
        layers.append(e.with_budgets(xs, heads) if e.heads is not None or e.share is None
                      else e.with_budgets([LayerRoute.per_head([LayerRoute(e.method, x) for x in xs]).budget], 1))
    return Route(layers, model=near.model, provenance=dict(near.provenance), adapter_path=near.adapter_path,
                 layer_totals=near.layer_totals)


def _read(path: Path) -> Any:
    if not path.is_file():
        raise RouteError(f"route file {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RouteError(f"route file {path} is not valid JSON: {e}") from None


def load_route_file(path: str | os.PathLike) -> Route | BudgetRoutes:
    """A route file of either kind: a plain :class:`Route`, or :class:`BudgetRoutes`."""
    path = Path(path)
    data = _read(path)
    if isinstance(data, dict) and data.get("schema") == SCHEMA:
        return BudgetRoutes.from_dict(data, base=path.parent, source=f"route file {path}")
    return Route.from_file(path)


def route_at(path: str | os.PathLike, budget: Budget | None = None) -> Route:
    """The route a file gives at ``budget``: a plain route file's route (rescaled to it when
    given), or a budget-conditional file's allocation for it (without a budget: its first)."""
    found = load_route_file(path)
    if isinstance(found, BudgetRoutes):
        return found.routes[0] if budget is None else found.at(budget)
    return found if budget is None else found.rescaled(budget)


def combine(routes: list[Route], budgets: list[Budget | None] | None = None, outside: str = "error") -> BudgetRoutes:
    """One budget-conditional route from routes each made for one budget (``budgets``; a
    route without one, or all of them without ``budgets``: its mean budget), sorted by budget."""
    budgets = [None] * len(routes) if budgets is None else budgets
    budgets = [round(sum(r.budgets) / r.n_layers, 6) if b is None else b for r, b in zip(routes, budgets)]
    order = sorted(range(len(routes)), key=lambda i: budgets[i])
    return BudgetRoutes([float(budgets[i]) for i in order], [routes[i] for i in order], outside,
                        provenance={"combined_from": [r.provenance.get("source", "route") for r in routes]})
