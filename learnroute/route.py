"""Route: per layer, which method scores the cache and how many tokens per KV head it keeps.

JSON form (``schema`` ``learnroute.route/2``; version 1 files, without ``heads``, read
the same)::

    {"schema": "learnroute.route/2", "model": "SmolLM2-135M-Instruct", "n_layers": 30,
     "layers": [{"layer": 0, "method": "snapkv", "budget": 128},
                {"layer": 1, "heads": [{"method": "tova", "budget": 200},
                                       {"method": "snapkv", "budget": 40},
                                       {"method": "snapkv", "budget": 144}]}, ...],
     "provenance": {"source": "homogeneous", ...}}

A budget is an int >= 1 (tokens per KV head) or a float in (0, 1] (fraction of the
context, resolved per sample). A layer entry either holds for every KV head of the layer
(``method`` and ``budget``) or gives one entry per KV head (``heads``, each with its own
method, budget and optional mixture): a per-head layer. Every per-head layer of a route
has the same number of heads, the model's KV heads.

``"share": "adakv"`` on a layer lets its KV heads share the layer's tokens by the sample's
scores (Ada-KV): on a per-layer entry every head's prior is ``budget``; on a per-head
entry each head's own budget is its prior, the layer keeping their sum. Each head keeps at
least ``safeguard`` (default 0.2, Ada-KV's) x its prior, the rest going to the top scores
over all heads (:meth:`Route.shared` makes such a route from a learned one).

``provenance["adapter"]`` (optional) names a decode-time LoRA adapter folder
(:mod:`learnroute.adapter`) that runs with the route: a path relative to the route file
(or absolute). Read from a file, it is resolved into :attr:`Route.adapter_path`; written,
it is stored relative to the file again.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from learnroute.methods.budgets import allocate, floored_weights, rescale_budgets, spread_capped, water_fill
from learnroute.methods.registry import METHODS

SCHEMA = "learnroute.route/2"
SHARES = ("adakv",)  # LayerRoute.share: how a layer's heads may share its budget
ADAKV_SAFEGUARD = 0.20  # Ada-KV's floor per head, as a fraction of the layer's budget (kvpress's default)
READABLE = ("learnroute.route/1", SCHEMA)  # version 1: per-layer entries only
# a per-head route's layer totals: part of its learned shape (learn) or kept from a per-layer
# route when it is rescaled (fixed: two-stage routes, a TrainConfig's layer_totals)
Granularity = Literal["layer", "head"]  # gates (and profile cells) per layer or per (layer, KV head)
LAYER_TOTALS = ("learn", "fixed")
Budget = int | float


class RouteError(ValueError):
    """A malformed or inconsistent route (the message lists every problem)."""


def budget_problem(budget: Any) -> str | None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        return f"budget {budget!r} is neither an int >= 1 nor a float in (0, 1]"
    if isinstance(budget, int) and budget < 1:
        return f"budget {budget} must be >= 1 (tokens per KV head) or a float in (0, 1]"
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        return f"budget {budget} as a fraction must be in (0, 1]"
    return None


def parse_budget(text: str) -> Budget:
    """A budget typed on a command line: an integer is tokens per KV head, a decimal a
    fraction of the context (``128`` keeps 128 tokens, ``0.25`` a quarter), as in route
    files. Raises ValueError saying what is valid."""
    try:
        budget: Any = int(text)
    except ValueError:
        try:
            budget = float(text)
        except ValueError:
            budget = text  # budget_problem names what is wrong
    if (problem := budget_problem(budget)) is not None:
        raise ValueError(problem)
    return budget


@dataclass(frozen=True)
class LayerRoute:
    """One layer's entry: a registered method name and a budget.

    ``mixture`` (optional) makes it a mixture layer: ((method, weight), ...) over
    registered methods; the layer keeps the top-k of ``Σ_m w_m · rank(scores_m)``
    (:func:`learnroute.methods.mixing.mixed_scores`), and ``method`` names the heaviest
    component (what hardening would pick).
    """

    method: str
    budget: Budget
    mixture: tuple[tuple[str, float], ...] | None = None
    # One entry per KV head (each without heads of its own), or None: every head alike.
    heads: tuple[LayerRoute, ...] | None = None
    # How the layer's KV heads share its budget (None: each keeps ``budget``). "adakv":
    # Ada-KV (Feng et al., 2024): the layer keeps H_kv x budget tokens, chosen by the top
    # scores over all its heads, each head keeping at least ADAKV_SAFEGUARD x budget of its
    # own best (kvpress's AdaKVPress, alpha_safeguard 0.20): per-head counts per sample.
    # On a per-head layer the heads' budgets are priors: the layer keeps their sum, head h
    # at least ``safeguard`` x its own budget, the rest by the top scores over all heads.
    share: str | None = None
    # The share's floor per head as a fraction of the head's budget (None: ADAKV_SAFEGUARD).
    safeguard: float | None = None

    @classmethod
    def per_head(cls, heads: list[LayerRoute] | tuple[LayerRoute, ...], share: str | None = None,
                 safeguard: float | None = None) -> LayerRoute:
        """A layer whose KV heads each have their own entry. ``method`` (the heads' most
        common method, the earliest head's among ties) and ``budget`` (their mean: a
        fraction, or tokens rounded) summarise it for per-layer readers (tables, plots);
        the engine keeps each head's own (``share``: their sum, split per sample)."""
        heads = tuple(heads)
        if not heads:
            raise RouteError("a per-head layer needs at least one head")
        counts = Counter(h.method for h in heads)
        method = max(counts, key=lambda m: (counts[m], -[h.method for h in heads].index(m)))
        budgets = [h.budget for h in heads]
        mean = sum(budgets) / len(budgets)
        budget = mean if any(isinstance(b, float) for b in budgets) else max(1, round(mean))
        return cls(method, budget, None, heads, share, safeguard)

    @property
    def methods(self) -> list[str]:
        """Every method this layer needs scores of."""
        if self.heads is not None:
            return list(dict.fromkeys(m for h in self.heads for m in h.methods))
        return [m for m, _ in self.mixture] if self.mixture else [self.method]

    def head_entries(self, n_heads: int) -> tuple[LayerRoute, ...]:
        """The entry of each of ``n_heads`` KV heads (this entry for each, unless per-head)."""
        return self.heads if self.heads is not None else (self,) * n_heads

    def hardened(self) -> LayerRoute:
        """The entry with mixtures replaced by their heaviest method (per head too)."""
        if self.heads is not None:
            return LayerRoute.per_head([h.hardened() for h in self.heads], self.share, self.safeguard)
        return LayerRoute(self.method, self.budget, share=self.share, safeguard=self.safeguard)

    def with_budgets(self, budgets: list[Budget], n_heads: int) -> LayerRoute:
        """The entry with each of its ``n_heads`` heads at ``budgets`` (methods, mixtures
        and share kept): one entry while the heads stay alike, else per-head."""
        if self.heads is None and len(set(budgets)) == 1:
            return LayerRoute(self.method, budgets[0], self.mixture, share=self.share, safeguard=self.safeguard)
        return LayerRoute.per_head([LayerRoute(h.method, b, h.mixture) for h, b in zip(self.head_entries(n_heads), budgets)],
                                   self.share, self.safeguard)


def mixture_problems(mixture: Any, method: str | None = None) -> list[str]:
    """What is wrong with a layer's mixture weights (a mapping method -> weight)."""
    if not isinstance(mixture, dict) or not mixture:
        return [f"mixture must be a non-empty object of method -> weight, got {mixture!r}"]
    problems = []
    for m, w in mixture.items():
        if m not in METHODS or m == "full":
            valid = ", ".join(x for x in METHODS if x != "full")
            problems.append(f"mixture: unknown method {m!r}; registered: {valid}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or w == float("inf"):
            problems.append(f"mixture: weight of {m!r} must be a finite number >= 0, got {w!r}")
    weights = [w for w in mixture.values() if isinstance(w, (int, float)) and not isinstance(w, bool)]
    if not problems and sum(weights) <= 0:
        problems.append("mixture: weights sum to 0")
    if method is not None and method not in mixture:
        problems.append(f"mixture does not contain the layer's method {method!r}")
    return problems


def _entry_dict(e: LayerRoute) -> dict[str, Any]:
    return ({"method": e.method, "budget": e.budget} | ({"mixture": dict(e.mixture)} if e.mixture is not None else {})
            | _share_dict(e))


def _share_dict(e: LayerRoute) -> dict[str, Any]:
    return (({"share": e.share} if e.share is not None else {})
            | ({"safeguard": e.safeguard} if e.safeguard is not None else {}))


def _parse_entry(item: Any, where: str, problems: list[str], schema: str = SCHEMA) -> LayerRoute | None:
    """One layer's (or head's) method, budget and mixture from JSON; problems appended."""
    if not isinstance(item, dict) or "method" not in item or "budget" not in item:
        problems.append(f"{where} must be an object with 'method' and 'budget' (or 'heads'), got {item!r}")
        return None
    method, budget = item["method"], item["budget"]
    mixture, bad = item.get("mixture"), []
    if mixture is not None:  # the raw weights are checked here; a valid mixture becomes pairs
        bad = [f"{where}: {p}" for p in mixture_problems(mixture, method)]
        mixture = None if bad else tuple((str(m), float(w)) for m, w in mixture.items())
    entry = LayerRoute(method, budget, mixture, share=item.get("share"), safeguard=item.get("safeguard"))
    found = entry_problems(entry, where) + bad  # methods, budget, share: the rules a Route applies
    if entry.share is not None and schema != SCHEMA:
        found.append(f"{where}: 'share' needs schema {SCHEMA!r}")
    problems += found
    return None if found else entry


def entry_problems(entry: LayerRoute, where: str) -> list[str]:
    """What is wrong with one (layer or head) entry's method, budget and mixture."""
    problems = []
    if entry.method not in METHODS:
        problems.append(f"{where}: unknown method {entry.method!r}; registered: {', '.join(METHODS)}")
    if (p := budget_problem(entry.budget)) is not None:
        problems.append(f"{where}: {p}")
    if entry.mixture is not None:
        problems += [f"{where}: {p}" for p in mixture_problems(dict(entry.mixture), entry.method)]
    if entry.share is not None and entry.share not in SHARES:
        problems.append(f"{where}: share {entry.share!r} is not one of {', '.join(SHARES)}")
    if entry.share is not None and entry.mixture is not None:
        problems.append(f"{where}: a mixture layer cannot share its budget across heads (share needs one method)")
    if entry.safeguard is not None and (entry.share is None or isinstance(entry.safeguard, bool)
                                        or not isinstance(entry.safeguard, (int, float)) or not 0 <= entry.safeguard <= 1):
        problems.append(f"{where}: safeguard (each head's floor, a fraction of its budget) must be a number in "
                        f"[0, 1] on a layer with a share, got {entry.safeguard!r}")
    return problems


@dataclass
class Route:
    """Per-layer methods and budgets, plus where the route came from."""

    layers: list[LayerRoute]
    model: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    adapter_path: Path | None = None  # the adapter folder that decodes with this route (None: no adapter)
    # fixed: rescaling keeps each layer's total as a per-layer route's, a head at the context
    # cap handing its excess to its own layer's heads (learn: one water fill over every head)
    layer_totals: str = "learn"

    def __post_init__(self) -> None:
        problems = []
        if self.layer_totals not in LAYER_TOTALS:
            problems.append(f"layer_totals must be one of {', '.join(LAYER_TOTALS)}, got {self.layer_totals!r}")
        elif self.layer_totals == "fixed" and not any(e.heads is not None for e in self.layers):
            problems.append("layer_totals 'fixed' keeps layer totals while heads share them: it needs a per-head route")
        if not self.layers:
            problems.append("a route needs at least one layer")
        head_counts = set()
        for i, entry in enumerate(self.layers):
            if entry.heads is None:
                problems += entry_problems(entry, f"layer {i}")
                continue
            head_counts.add(len(entry.heads))
            problems += [p for p in entry_problems(replace(entry, heads=None, method=entry.heads[0].method), f"layer {i}")
                         if "share" in p or "safeguard" in p]
            if entry.share is not None and (len({h.method for h in entry.heads}) > 1
                                            or any(h.mixture for h in entry.heads)):
                problems.append(f"layer {i}: heads that share the layer's budget by scores need one method "
                                f"(no mixtures), got {[h.method for h in entry.heads]}")
            for h, head in enumerate(entry.heads):
                problems += entry_problems(head, f"layer {i} head {h}")
                if head.heads is not None or head.share is not None:
                    problems.append(f"layer {i} head {h}: a head cannot have heads or a share of its own")
            if len({isinstance(head.budget, float) for head in entry.heads}) > 1:
                problems.append(f"layer {i}: its heads mix token budgets (ints) and fractions (floats)")
        if len(head_counts) > 1:
            problems.append(f"per-head layers give different numbers of heads {sorted(head_counts)}: "
                            "every per-head layer needs one entry per KV head of the model")
        if problems:
            raise RouteError("invalid route:\n  " + "\n  ".join(problems))
        if self.adapter_path is not None:
            self.adapter_path = Path(self.adapter_path)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def homogeneous(cls, method: str, n_layers: int, budget: Budget, model: str | None = None) -> Route:
        """The same method and budget in every layer."""
        return cls.allocated(method, n_layers, budget, allocator="uniform", model=model)

    @classmethod
    def allocated(
        cls, method: str, n_layers: int, budget: Budget, allocator: str = "uniform", model: str | None = None
    ) -> Route:
        """One method everywhere, per-layer budgets from an allocator (``uniform``, ``pyramid``)."""
        budgets = allocate(allocator, n_layers, budget)
        source = "homogeneous" if allocator == "uniform" else allocator
        prov = {"source": source, "method": method, "budget": budget, "allocator": allocator}
        return cls([LayerRoute(method, b) for b in budgets], model=model, provenance=prov)

    @classmethod
    def adakv(cls, method: str, n_layers: int, budget: Budget, model: str | None = None) -> Route:
        """Ada-KV over ``method``: every layer keeps ``budget`` per KV head on average, its
        heads sharing the layer's tokens by their scores (``share="adakv"``)."""
        prov = {"source": "adakv", "method": method, "budget": budget, "safeguard": ADAKV_SAFEGUARD}
        return cls([LayerRoute(method, budget, share="adakv")] * n_layers, model=model, provenance=prov)

    @classmethod
    def full(cls, n_layers: int, model: str | None = None) -> Route:
        """The full cache (reference)."""
        return cls([LayerRoute("full", 1.0)] * n_layers, model=model, provenance={"source": "full"})

    @classmethod
    def from_layers(
        cls,
        methods: list[str],
        budgets: list[Budget] | Budget,
        model: str | None = None,
        mixtures: list[dict[str, float] | None] | None = None,
        **provenance: Any,
    ) -> Route:
        """A mixed route from per-layer methods and budgets (one budget for all, or a list);
        ``mixtures`` optionally gives per-layer mixture weights (method -> weight)."""
        if not isinstance(budgets, list):
            budgets = [budgets] * len(methods)
        if len(budgets) != len(methods):
            raise RouteError(f"{len(methods)} methods but {len(budgets)} budgets")
        mixtures = mixtures or [None] * len(methods)
        if len(mixtures) != len(methods):
            raise RouteError(f"{len(methods)} methods but {len(mixtures)} mixtures")
        layers = [
            LayerRoute(m, b, None if mix is None else tuple((k, float(w)) for k, w in mix.items()))
            for m, b, mix in zip(methods, budgets, mixtures)
        ]
        return cls(layers, model=model, provenance=provenance)

    # ------------------------------------------------------------------ properties

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def methods(self) -> list[str]:
        return [entry.method for entry in self.layers]

    @property
    def budgets(self) -> list[Budget]:
        return [entry.budget for entry in self.layers]

    @property
    def is_mixture(self) -> bool:
        """Does any layer (or head) mix several methods' scores?"""
        return any(h.mixture is not None for e in self.layers for h in (e.heads or (e,)))

    @property
    def n_heads(self) -> int | None:
        """KV heads per per-head layer, or None when every layer holds for all its heads."""
        return next((len(e.heads) for e in self.layers if e.heads is not None), None)

    @property
    def is_per_head(self) -> bool:
        return self.n_heads is not None

    def head_budgets(self, n_heads: int) -> list[list[Budget]]:
        """Per layer, each of ``n_heads`` KV heads' budget (per-layer entries repeated)."""
        return [[h.budget for h in e.head_entries(n_heads)] for e in self.layers]

    def hardened(self) -> Route:
        """The same route with every mixture layer (or head) replaced by its heaviest method."""
        prov = {**self.provenance, "hardened_from_mixture": self.is_mixture}
        return replace(self, layers=[e.hardened() for e in self.layers], provenance=prov)

    def rescaled(self, budget: Budget, free: list[bool] | None = None) -> Route:
        """The route's methods (and mixtures, and adapter) with its per-layer budget shape
        moved to mean ``budget`` over its ``free`` layers (default: all), by
        :func:`learnroute.methods.budgets.rescale_budgets`: fractions capped at the whole
        context with the excess shared by water filling (with ``layer_totals`` fixed, within
        the head's layer first), token budgets rounded to the exact total. A route already at
        that mean comes back with the same budgets."""
        prov = {**self.provenance, "rescaled_to": budget}
        H = self.n_heads
        try:
            if H is None:
                budgets = rescale_budgets(self.budgets, budget, free)
            else:  # one shape over every (layer, KV head): per-head budgets follow the same rules
                flat = [b for per_layer in self.head_budgets(H) for b in per_layer]
                free_flat = None if free is None else [f for f in free for _ in range(H)]
                got = rescale_budgets(flat, budget, free_flat, H if self.layer_totals == "fixed" else None)
        except ValueError as e:
            raise RouteError(f"cannot rescale this route: {e}; use route_file_budgets=file") from None
        if H is None:
            layers = [e.with_budgets([b], 1) for e, b in zip(self.layers, budgets)]
        else:
            layers = []
            for i, e in enumerate(self.layers):
                mine = got[i * H : (i + 1) * H]
                if e.heads is None and (len(set(mine)) == 1 or e.share is not None):
                    # a layer whose heads were alike stays one entry (its heads sharing as before);
                    # exact token totals may hand its heads one token more or less: their mean
                    b = mine[0] if len(set(mine)) == 1 else LayerRoute.per_head([LayerRoute(e.method, x) for x in mine]).budget
                    layers.append(e.with_budgets([b], 1))
                else:
                    layers.append(e.with_budgets(mine, H) if e.heads is not None else LayerRoute.per_head(
                        [LayerRoute(e.method, b, e.mixture) for b in mine]))
        return replace(self, layers=layers, provenance=prov)

    def reshaped(self, *, floor: float | None = None, head_spread: float | None = None,
                 layer_mean: bool = False) -> Route:
        """The route with its fractional budgets reshaped after the fact, the mean kept:
        ``floor`` lifts every entry (each head of a per-head route) to at least that share of
        the mean (``floor + (1 - floor)·U·share``, as the gates' floor); then ``head_spread``
        caps each head at that many times its layer's mean head budget (the excess to the
        layer's other heads, as the gates' cap); then ``layer_mean`` gives every head its
        layer's mean. Methods and mixtures stay. A probe, not a trained route: a floor or cap
        put on after training is not one trained with (docs/log.md §0.13)."""
        problems = []
        if floor is not None and not 0.0 <= floor < 1.0:
            problems.append(f"floor must be in [0, 1), got {floor}")
        if head_spread is not None and not head_spread >= 1.0:
            problems.append(f"head_spread must be >= 1 (a head's budget over its layer's mean), got {head_spread}")
        if (head_spread is not None or layer_mean) and not self.is_per_head:
            problems.append("head_spread and layer_mean reshape budgets within layers: they need a per-head route")
        if floor is None and head_spread is None and not layer_mean:
            problems.append("nothing to do: give floor, head_spread or layer_mean")
        H = self.n_heads or 1
        grid = self.head_budgets(H)  # (L, H) lists; H = 1 for a per-layer route
        if any(isinstance(b, int) for row in grid for b in row):
            problems.append("reshaping needs fractional budgets (fractions of the context; bench turns them "
                            "into tokens per sample): this route has token budgets")
        if problems:
            raise RouteError("cannot reshape this route:\n  " + "\n  ".join(problems))
        b = torch.tensor(grid, dtype=torch.float64)  # (L, H)
        if floor is not None:
            flat = b.reshape(-1)  # (L·H,)
            b = water_fill(floored_weights(flat, floor), flat.sum(), 1.0).view_as(b)  # (L, H), mean kept
        if head_spread is not None:
            b = spread_capped(b, head_spread)  # (L, H), each layer's sum kept
        if layer_mean:
            b = b.mean(1, keepdim=True).expand_as(b)  # (L, H)
        layers = []
        for e, row in zip(self.layers, b.tolist()):
            if self.is_per_head and (e.heads is not None or len(set(row)) > 1):
                layers.append(LayerRoute.per_head([LayerRoute(h.method, x, h.mixture)
                                                   for h, x in zip(e.head_entries(H), row)], e.share, e.safeguard))
            else:  # a per-layer entry whose heads stay alike
                layers.append(e.with_budgets([row[0]], 1))
        prov = {**self.provenance, "reshaped": {"floor": floor, "head_spread": head_spread, "layer_mean": layer_mean}}
        return replace(self, layers=layers, provenance=prov)

    def shared(self, safeguard: float | None = None, priors: bool = False) -> Route:
        """The route with Ada-KV inside each layer: the layer keeps its total, and its KV
        heads share it by the sample's scores (``share="adakv"``; issue 58 part 3). With
        ``priors``, a per-head route's head budgets stay as each head's prior (its floor
        is ``safeguard`` x its own budget); without, every head's prior is the layer's mean
        (plain Ada-KV within the learned layer totals). ``safeguard``: None is Ada-KV's 0.2.
        Each layer needs one method (no mixtures)."""
        problems = []
        if safeguard is not None and not 0.0 <= safeguard <= 1.0:
            problems.append(f"safeguard must be in [0, 1] (each head's floor over its budget), got {safeguard}")
        if priors and not self.is_per_head:
            problems.append("priors keep each head's own budget: they need a per-head route")
        for i, e in enumerate(self.layers):
            heads = e.head_entries(self.n_heads or 1)
            if len({h.method for h in heads}) > 1 or any(h.mixture for h in heads):
                problems.append(f"layer {i}: its heads use {sorted({h.method for h in heads})} or mixtures; "
                                "sharing by scores needs one method per layer")
        if problems:
            raise RouteError("cannot share this route's layer budgets by scores:\n  " + "\n  ".join(problems))
        H = self.n_heads or 1
        layers = []
        for e, row in zip(self.layers, self.head_budgets(H)):
            if priors and e.heads is not None:
                layers.append(LayerRoute.per_head(list(e.heads), "adakv", safeguard))
            else:  # the layer's mean per head (a fraction; tokens rounded)
                mean = LayerRoute.per_head([LayerRoute(e.method, b) for b in row]).budget
                layers.append(LayerRoute(e.method, mean, share="adakv", safeguard=safeguard))
        prov = {**self.provenance, "shared": {"share": "adakv", "safeguard": safeguard, "priors": priors}}
        return replace(self, layers=layers, provenance=prov, layer_totals=self.layer_totals if priors else "learn")

    def with_adapter(self, path: str | os.PathLike | None) -> Route:
        """The same route decoding with the adapter folder ``path`` (None: without adapter)."""
        prov = {k: v for k, v in self.provenance.items() if k != "adapter"}
        if path is not None:
            prov["adapter"] = str(path)
        return replace(self, layers=list(self.layers), provenance=prov, adapter_path=path)

    def method_counts(self) -> dict[str, int]:
        return dict(Counter(self.methods))

    def check_layers(self, n_layers: int, what: str = "the model") -> None:
        """Refuse a route made for another layer count."""
        if self.n_layers != n_layers:
            where = f" (made for {self.model})" if self.model else ""
            raise RouteError(f"route has {self.n_layers} layers{where} but {what} has {n_layers}")

    def check_heads(self, n_heads: int, what: str = "the model") -> None:
        """Refuse a per-head route made for another number of KV heads."""
        if self.n_heads is not None and self.n_heads != n_heads:
            where = f" (made for {self.model})" if self.model else ""
            raise RouteError(f"route gives {self.n_heads} heads per per-head layer{where} but {what} has "
                             f"{n_heads} KV heads per layer")

    def describe(self) -> str:
        """A short human label, e.g. ``snapkv@128`` or ``mixed[snapkv:12,tova:18]``."""
        counts = self.method_counts()
        # 6 decimals: hardened fractions come from float32 arithmetic (0.075 reads back as
        # 0.07500000298023224), which is noise in a label.
        budgets = {str(round(b, 6)) if isinstance(b, float) else str(b) for b in self.budgets}
        b = budgets.pop() if len(budgets) == 1 else "var"
        if self.is_mixture:
            return f"mixture[{len(counts)} argmax methods]@{b}"
        if len(counts) == 1 and all(e.share for e in self.layers):
            return f"{self.layers[0].share}:{self.methods[0]}@{b}"
        tail = ("+adapter" if self.adapter_path is not None else "") + ("/head" if self.is_per_head else "")
        if len(counts) == 1:
            return f"{self.methods[0]}@{b}{tail}"
        inner = ",".join(f"{m}:{c}" for m, c in sorted(counts.items()))
        return f"mixed[{inner}]@{b}{tail}"

    # ------------------------------------------------------------------ JSON

    def to_dict(self, base: str | os.PathLike | None = None) -> dict[str, Any]:
        """The JSON structure; the adapter path is written relative to ``base`` (the
        folder of the route file) when given."""
        provenance = dict(self.provenance)
        if self.adapter_path is not None:
            where = str(self.adapter_path)
            if base is not None:
                where = os.path.relpath(os.path.abspath(self.adapter_path), os.path.abspath(base))
            provenance["adapter"] = where
        return {
            "schema": SCHEMA,
            "model": self.model,
            "n_layers": self.n_layers,
            "layers": [
                {"layer": i} | ({"heads": [_entry_dict(h) for h in e.heads]} | _share_dict(e) if e.heads is not None
                                else _entry_dict(e))
                for i, e in enumerate(self.layers)
            ],
            "provenance": provenance,
        } | ({"layer_totals": self.layer_totals} if self.layer_totals != "learn" else {})

    @classmethod
    def from_dict(cls, d: Any, base: str | os.PathLike | None = None) -> Route:
        """Parse the JSON structure; every problem is reported in one error. A relative
        ``provenance["adapter"]`` is resolved against ``base`` (the route file's folder)."""
        if not isinstance(d, dict):
            raise RouteError(f"a route must be a JSON object, got {type(d).__name__}")
        problems = []
        schema = d.get("schema", SCHEMA)
        if schema not in READABLE:
            problems.append(f"unsupported schema {schema!r} (readable: {', '.join(READABLE)})")
        unknown = set(d) - {"schema", "model", "n_layers", "layers", "provenance", "layer_totals"}
        if unknown:
            problems.append(f"unknown keys {sorted(unknown)}")
        layers = d.get("layers")
        if not isinstance(layers, list) or not layers:
            problems.append("'layers' must be a non-empty list of {'method': ..., 'budget': ...}")
            raise RouteError("invalid route:\n  " + "\n  ".join(problems))
        n_layers = d.get("n_layers", len(layers))
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            problems.append(f"'n_layers' must be a positive int, got {n_layers!r}")
            n_layers = len(layers)
        entries: dict[int, LayerRoute] = {}
        for pos, item in enumerate(layers):
            if not isinstance(item, dict):
                problems.append(f"layers[{pos}] must be an object with 'method' and 'budget' (or 'heads'), got {item!r}")
                continue
            idx = item.get("layer", pos)
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n_layers:
                problems.append(f"layers[{pos}]: layer index {idx!r} outside 0..{n_layers - 1}")
                continue
            if idx in entries:
                problems.append(f"layer {idx} appears more than once")
                continue
            if "heads" not in item:
                entry = _parse_entry(item, f"layer {idx}", problems, schema)
                extra = set(item) - {"layer", "method", "budget", "mixture", "share", "safeguard"}
            else:
                heads = item["heads"]
                extra = set(item) - {"layer", "heads", "share", "safeguard"}
                if schema != SCHEMA:
                    problems.append(f"layer {idx}: per-head entries ('heads') need schema {SCHEMA!r}")
                if not isinstance(heads, list) or not heads:
                    problems.append(f"layer {idx}: 'heads' must be a non-empty list of {{'method': ..., 'budget': ...}}")
                    continue
                parsed = [_parse_entry(h, f"layer {idx} head {j}", problems, schema) for j, h in enumerate(heads)]
                for j, h in enumerate(heads):
                    if isinstance(h, dict) and (bad := set(h) - {"method", "budget", "mixture"}):
                        problems.append(f"layer {idx} head {j}: unknown keys {sorted(bad)}")
                entry = None if None in parsed else LayerRoute.per_head(parsed, item.get("share"), item.get("safeguard"))
            if extra:
                problems.append(f"layer {idx}: unknown keys {sorted(extra)}")
            if entry is not None:
                entries[idx] = entry
        missing = [i for i in range(n_layers) if i not in entries]
        if missing and not problems:
            problems.append(f"missing layers {missing} (n_layers = {n_layers})")
        provenance = d.get("provenance", {})
        adapter = None
        if not isinstance(provenance, dict):
            problems.append("'provenance' must be an object")
        elif provenance.get("adapter") is not None:
            if not isinstance(provenance["adapter"], str) or not provenance["adapter"]:
                problems.append(f"provenance.adapter must be a folder path, got {provenance['adapter']!r}")
            else:
                adapter = Path(provenance["adapter"])
                if base is not None and not adapter.is_absolute():
                    adapter = Path(base) / adapter
        layer_totals = d.get("layer_totals", "learn")
        if layer_totals not in LAYER_TOTALS:
            problems.append(f"'layer_totals' must be one of {', '.join(LAYER_TOTALS)}, got {layer_totals!r}")
        if problems:
            raise RouteError("invalid route:\n  " + "\n  ".join(problems))
        return cls([entries[i] for i in range(n_layers)], model=d.get("model"), provenance=dict(provenance),
                   adapter_path=adapter, layer_totals=layer_totals)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Route:
        path = Path(path)
        if not path.is_file():
            raise RouteError(f"route file {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RouteError(f"route file {path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(data, base=path.parent)
        except RouteError as e:
            raise RouteError(f"{path}: {e}") from None

    def to_file(self, path: str | os.PathLike) -> Path:
        """Write the route as indented JSON (atomically: a crash never leaves half a file)."""
        return write_json_file(path, lambda base: self.to_dict(base=base))


def write_json_file(path: str | os.PathLike, data: Callable[[Path], Any]) -> Path:
    """Write ``data(the file's folder)`` (a route file's content, its relative paths made
    against that folder) as indented JSON, atomically: a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data(path.parent), f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path
