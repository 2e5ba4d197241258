import json

import pytest
from kvpress.utils import compute_n_kept

from learnroute import Route, RouteError
from learnroute.methods import allocate, resolve_budget


def test_json_roundtrip_keeps_every_field(tmp_path):
    route = Route.from_layers(["snapkv", "tova", "knorm"], [128, 0.25, 64], model="m", source="test")
    path = route.to_file(tmp_path / "r.json")
    data = json.loads(path.read_text())
    assert data["schema"] == "learnroute.route/2" and data["n_layers"] == 3 and data["model"] == "m"
    assert data["layers"][1] == {"layer": 1, "method": "tova", "budget": 0.25}
    back = Route.from_file(path)
    assert back.to_dict() == route.to_dict()
    assert isinstance(back.budgets[0], int) and isinstance(back.budgets[1], float)


def test_layers_may_come_in_any_order():
    d = Route.from_layers(["snapkv", "tova"], 8).to_dict()
    d["layers"].reverse()
    assert Route.from_dict(d).methods == ["snapkv", "tova"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["layers"].append({"layer": 1, "method": "tova", "budget": 4}), "more than once"),
        (lambda d: d["layers"].pop(), "missing layers [1]"),
        (lambda d: d["layers"][0].update(method="nope"), "unknown method 'nope'; registered: snapkv"),
        (lambda d: d["layers"][0].update(budget=0), "must be >= 1"),
        (lambda d: d["layers"][0].update(budget=-3), "must be >= 1"),
        (lambda d: d["layers"][0].update(budget=1.5), "in (0, 1]"),
        (lambda d: d["layers"][0].update(budget="big"), "neither"),
        (lambda d: d["layers"][0].update(budget=True), "neither"),
        (lambda d: d.update(extra=1), "unknown keys ['extra']"),
        (lambda d: d.update(schema="other/9"), "unsupported schema"),
    ],
)
def test_bad_route_dicts_are_refused_with_a_clear_message(mutate, message):
    d = Route.from_layers(["snapkv", "tova"], 8).to_dict()
    mutate(d)
    with pytest.raises(RouteError, match=None) as err:
        Route.from_dict(d)
    assert message in str(err.value)


def test_every_problem_is_listed_at_once():
    d = Route.from_layers(["snapkv", "tova"], 8).to_dict()
    d["layers"][0]["method"] = "nope"
    d["layers"][1]["budget"] = 0
    with pytest.raises(RouteError) as err:
        Route.from_dict(d)
    assert "layer 0: unknown method" in str(err.value) and "layer 1: budget 0" in str(err.value)


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RouteError, match="not valid JSON"):
        Route.from_file(bad)
    with pytest.raises(RouteError, match="does not exist"):
        Route.from_file(tmp_path / "absent.json")


def test_layer_count_mismatch_names_both_counts():
    route = Route.homogeneous("snapkv", 30, 64, model="SmolLM2")
    with pytest.raises(RouteError, match="30 layers .made for SmolLM2. but the model has 4"):
        route.check_layers(4)


def test_constructor_validates_methods_and_budgets():
    with pytest.raises(RouteError, match="unknown method"):
        Route.homogeneous("snapkvv", 2, 8)
    with pytest.raises(RouteError, match=">= 1"):
        Route.homogeneous("snapkv", 2, 0)


@pytest.mark.parametrize("n", [7, 100, 1000, 1966, 4097])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.3, 0.5, 0.7, 0.9, 1.0])
def test_fraction_budgets_match_kvpress_kept_counts(n, fraction):
    assert resolve_budget(fraction, n) == min(n, compute_n_kept(n, 1 - fraction))


def test_integer_budget_above_context_keeps_everything():
    assert resolve_budget(5000, 300) == 300
    assert resolve_budget(1, 300) == 1


def test_pyramid_schedule_is_decreasing_and_keeps_the_total():
    budgets = allocate("pyramid", 30, 256)
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    # KVCache-Factory's numbers: min = (256-32)//20 = 11, max = 2*224 - 11 = 437, step = 426//29 = 14
    assert budgets[0] == 437 + 32 and budgets[1] == 437 - 14 + 32 and budgets[-1] == 437 - 14 * 29 + 32
    # its integer step rounds down, so the total overshoots L*C by less than one token per layer step
    assert 0 <= sum(budgets) - 30 * 256 < 30 * 29 / 2
    with pytest.raises(ValueError, match="valid: uniform, pyramid"):
        allocate("cake", 30, 256)


def test_pyramid_route_provenance():
    route = Route.allocated("snapkv", 4, 0.5, allocator="pyramid")
    assert route.provenance["source"] == "pyramid" and route.budgets[0] > route.budgets[-1]
