"""Properties of budgets and routes over many generated cases (hypothesis).

Each property is stated from the definition (a token count is capped at the context, a
fraction keeps about that share, totals add up), not from the implementation's formula.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learnroute.methods import resolve_budget
from learnroute.methods.budgets import pyramid
from learnroute.methods.registry import METHODS
from learnroute.profile import allocate_by_sensitivity
from learnroute.route import LayerRoute, Route

settings.register_profile("learnroute", deadline=None, max_examples=200)  # CPU shared with others: no timing
settings.load_profile("learnroute")

tokens = st.integers(min_value=1, max_value=1_000_000)
fractions = st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False)
# Allocators divide a fraction (budget / 20 and the like): keep clear of subnormal floats.
shares = st.floats(min_value=1e-9, max_value=1.0, allow_nan=False)
budgets = st.one_of(tokens, fractions)


# ------------------------------------------------------------------ resolve_budget


@given(budget=tokens, n=st.integers(min_value=1, max_value=200_000))
def test_a_token_budget_keeps_that_many_or_the_whole_context(budget, n):
    assert resolve_budget(budget, n) == min(budget, n)


@given(f=fractions, g=fractions, n=st.integers(min_value=1, max_value=200_000))
def test_a_fraction_keeps_about_that_share_at_least_one_token_and_grows_with_it(f, g, n):
    k = resolve_budget(f, n)
    assert 1 <= k <= n
    assert k == 1 or abs(k - f * n) < 1 + 1e-9 * n  # within one token of the exact share
    lo, hi = sorted((f, g))
    assert resolve_budget(lo, n) <= resolve_budget(hi, n)


@given(n=st.integers(min_value=1, max_value=200_000))
def test_the_whole_fraction_keeps_everything(n):
    assert resolve_budget(1.0, n) == n


# ------------------------------------------------------------------ pyramid allocator


@given(n_layers=st.integers(min_value=2, max_value=80), c=st.integers(min_value=1, max_value=100_000))
def test_pyramid_token_budgets_shrink_with_depth_and_keep_the_total(n_layers, c):
    alloc = pyramid(n_layers, c)
    assert len(alloc) == n_layers and all(isinstance(b, int) and b >= 1 for b in alloc)
    if c <= 32:  # no room above the window: uniform
        assert alloc == [c] * n_layers
        return
    assert alloc == sorted(alloc, reverse=True)
    assert alloc[-1] >= 32  # every layer keeps at least the observation window
    # An arithmetic series whose step is rounded down (as KVCache-Factory does): the total
    # is L x C plus what the rounding leaves, less than one token per layer per step.
    excess = sum(alloc) - n_layers * c
    assert 0 <= excess <= n_layers * (n_layers - 2) / 2


@given(n_layers=st.integers(min_value=2, max_value=80), f=shares)
def test_pyramid_fractions_keep_the_total_unless_a_layer_is_capped(n_layers, f):
    alloc = pyramid(n_layers, f)
    assert all(0 < b <= 1.0 for b in alloc) and alloc == sorted(alloc, reverse=True)
    if max(alloc) < 1.0:
        assert sum(alloc) == pytest.approx(n_layers * f, rel=1e-9)
    else:
        assert sum(alloc) <= n_layers * f * (1 + 1e-9)


# ------------------------------------------------------------------ routes


@st.composite
def layer_routes(draw) -> LayerRoute:
    method = draw(st.sampled_from(list(METHODS)))
    budget = draw(budgets)
    if method == "full" or not draw(st.booleans()):
        return LayerRoute(method, budget)
    others = draw(st.lists(st.sampled_from([m for m in METHODS if m not in ("full", method)]), max_size=3, unique=True))
    weights = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
    mixture = ((method, draw(weights.filter(lambda w: w > 0))), *((m, draw(weights)) for m in others))
    return LayerRoute(method, budget, mixture)


routes = st.builds(
    Route,
    layers=st.lists(layer_routes(), min_size=1, max_size=40),
    model=st.one_of(st.none(), st.text(max_size=20)),
    provenance=st.dictionaries(
        st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8), budgets), max_size=3
    ),
)


@given(route=routes)
def test_route_json_round_trip_keeps_every_field_and_budget_kind(route):
    back = Route.from_dict(json.loads(json.dumps(route.to_dict())))
    assert back == route
    # 64 and 64.0 compare equal in Python but mean different things: tokens vs a fraction.
    assert [type(b) for b in back.budgets] == [type(b) for b in route.budgets]
    with tempfile.TemporaryDirectory() as tmp:
        assert Route.from_file(route.to_file(Path(tmp) / "r.json")) == route


# ------------------------------------------------------------------ sensitivity allocation

sensitivities = st.lists(
    st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1e3, allow_nan=False)), min_size=1, max_size=64
)


@given(sens=sensitivities, budget=st.integers(min_value=1, max_value=4096), cap=st.one_of(st.none(), tokens))
def test_sensitivity_allocation_of_tokens_has_the_exact_total_within_bounds(sens, budget, cap):
    alloc = allocate_by_sensitivity(sens, budget, cap=cap)
    n = len(sens)
    per_layer = budget if cap is None else min(budget, cap)
    assert sum(alloc) == n * per_layer  # exactly, as the README promises
    assert all(isinstance(b, int) and 1 <= b for b in alloc)
    assert cap is None or max(alloc) <= cap
    # A more sensitive layer never ends more than one token (rounding) below a less
    # sensitive one; with no signal at all every layer gets the same up to rounding.
    for i in range(n):
        for j in range(n):
            if sens[i] > sens[j]:
                assert alloc[i] >= alloc[j] - 1, (i, j)
    if not any(sens):
        assert max(alloc) - min(alloc) <= 1


@given(sens=sensitivities, budget=shares)
def test_sensitivity_allocation_of_fractions_keeps_the_total_floor_and_cap(sens, budget):
    alloc = allocate_by_sensitivity(sens, budget)
    assert math.isclose(sum(alloc), len(sens) * budget, rel_tol=1e-9)
    floor = 0.05 * budget
    assert all(floor * (1 - 1e-9) <= b <= 1.0 for b in alloc)
    for i in range(len(sens)):
        for j in range(len(sens)):
            if sens[i] > sens[j]:
                assert alloc[i] >= alloc[j] * (1 - 1e-9)


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 50.0), min_size=2, max_size=30).filter(lambda w: sum(w) > 1e-3),
    budget=st.floats(0.01, 0.9),
)
def test_rescaled_fraction_routes_keep_their_total(weights, budget):
    """bench's rescale of a fractional route caps layers at the whole context and hands the
    excess on, so the route keeps L x budget (clipping alone lost it)."""
    total = sum(weights)
    route = Route.from_layers(["tova"] * len(weights), [max(1e-6, 0.5 * w / total) for w in weights])
    out = route.rescaled(budget)
    assert max(out.budgets) <= 1.0 + 1e-12
    assert sum(out.budgets) == pytest.approx(budget * len(weights), rel=1e-9)


# ------------------------------------------------------------------ the one budget arithmetic (learnroute.methods.budgets)

# Weights of 0 or at least 1e-6: products with subnormal floats underflow in any arithmetic.
weight_lists = st.lists(st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=100.0)), min_size=1, max_size=40)


def _water_fill(weights, total, cap):
    import torch

    from learnroute.methods.budgets import water_fill

    return water_fill(torch.tensor(weights, dtype=torch.float64), total, cap).tolist()


@given(w=weight_lists, mean=st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=2.0)), cap=st.floats(min_value=0.05, max_value=1.0))
def test_water_fill_keeps_the_total_the_cap_and_one_scale(w, mean, cap):
    """Definition: k_l = min(cap, c·w_l) for one c, total L·mean (what fits under the cap)."""
    L = len(w)
    k = _water_fill(w, L * mean, cap)
    total = min(L * mean, L * cap)
    assert sum(k) == pytest.approx(total, rel=1e-9, abs=1e-9)
    assert all(0.0 <= x <= cap for x in k)
    if sum(w) > 0 and total < L * cap * (1 - 1e-9):
        # every layer below the cap is at the same multiple c of its weight
        ratios = [x / wi for x, wi in zip(k, w) if wi > 0 and x < cap * (1 - 1e-9)]
        assert not ratios or max(ratios) == pytest.approx(min(ratios), rel=1e-6)
        # and a capped layer's weight is at least any uncapped layer's
        capped = [wi for x, wi in zip(k, w) if x >= cap * (1 - 1e-9)]
        uncapped = [wi for x, wi in zip(k, w) if x < cap * (1 - 1e-9)]
        assert not capped or not uncapped or min(capped) >= max(uncapped) * (1 - 1e-9)


means = st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=1.0))


@given(w=weight_lists, lo=means, hi=means)
def test_water_fill_is_monotone_in_the_mean_and_rescaling_up_composes(w, lo, hi):
    lo, hi = min(lo, hi), max(lo, hi)
    L = len(w)
    a, b = _water_fill(w, L * lo, 1.0), _water_fill(w, L * hi, 1.0)
    assert all(x <= y + 1e-9 for x, y in zip(a, b))  # more budget never takes from a layer
    if sum(w) > 0 and lo > 0:
        # the allocation made at lo, rescaled to hi, is the allocation made at hi directly
        again = _water_fill(a, L * hi, 1.0)
        assert again == pytest.approx(b, rel=1e-6, abs=1e-9)


@given(
    values=st.lists(st.floats(min_value=1.0, max_value=60.0), min_size=1, max_size=30),
    cap=st.integers(min_value=60, max_value=100),
)
def test_round_exact_is_within_one_token_of_each_value(values, cap):
    from learnroute.methods.budgets import round_exact

    total = round(sum(values))
    ints = round_exact(values, total, cap)
    assert sum(ints) == total
    assert all(1 <= x <= cap for x in ints)
    assert all(abs(x - v) < 1 + 1e-9 for x, v in zip(ints, values)), (ints, values)


@given(
    b=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=20),
    cap=st.integers(1, 60),
    total=st.integers(0, 2000),
)
def test_round_exact_hits_the_clipped_total_within_bounds(b, cap, total):
    from learnroute.methods.budgets import round_exact

    ints = round_exact(b, total, cap)
    assert sum(ints) == max(len(b), min(total, len(b) * cap))
    assert all(1 <= x <= cap for x in ints)


@given(
    shares_=st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=1, max_size=30),
    lo=st.integers(min_value=1, max_value=500),
    hi=st.integers(min_value=1, max_value=500),
    cap=st.integers(min_value=1, max_value=600),
)
def test_token_allocation_is_exact_capped_and_monotone(shares_, lo, hi, cap):
    """allocate_shares (profile and gates alike): exact integer totals, caps, and each
    layer within one token of its real-valued share; more mean budget never takes a token
    from a layer beyond rounding."""
    import torch

    from learnroute.methods.budgets import allocate_shares, floored_weights, water_fill

    lo, hi = min(lo, hi), max(lo, hi)
    L = len(shares_)
    a, b = allocate_shares(shares_, lo, cap=cap, floor=0.05), allocate_shares(shares_, hi, cap=cap, floor=0.05)
    for budget, ints in ((lo, a), (hi, b)):
        assert sum(ints) == L * min(budget, cap)
        assert all(1 <= x <= cap for x in ints)
        real = water_fill(floored_weights(torch.tensor(shares_, dtype=torch.float64), 0.05), budget * L, cap).tolist()
        if all(r >= 1 for r in real):
            assert all(abs(x - r) < 1 + 1e-6 for x, r in zip(ints, real))
    assert all(y >= x - 1 for x, y in zip(a, b))


@given(
    w=st.lists(st.floats(min_value=0.01, max_value=1.0), min_size=2, max_size=20),
    budget=st.floats(min_value=0.01, max_value=0.5),
)
def test_a_route_at_its_own_mean_rescales_to_itself(w, budget):
    """Rescaling must not drift a token: a route already at the mean keeps its budgets."""
    shape = [max(1e-6, budget * x / (sum(w) / len(w))) for x in w]
    if max(shape) > 1.0:
        return
    route = Route.from_layers(["tova"] * len(w), shape)
    mean = sum(route.budgets) / len(w)
    assert route.rescaled(mean).budgets == route.budgets
