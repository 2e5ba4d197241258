"""Budget-conditional route files: an allocation per budget, picked or interpolated."""

from __future__ import annotations

import json
import math

import pytest

from learnroute.bench import BenchConfig, resolve_routes
from learnroute.budget_routes import BudgetRoutes, load_route_file
from learnroute.cli import main
from learnroute.config import ConfigError, load_config
from learnroute.route import LayerRoute, Route, RouteError

LOW = Route.from_layers(["tova", "knorm"], [0.05, 0.15])  # mean 0.1
HIGH = Route.from_layers(["snapkv", "keydiff"], [0.3, 0.1])  # mean 0.2


def per_layer(route: Route) -> list[float]:
    return [e.budget for e in route.layers]


def test_a_held_budget_gets_its_own_allocation_not_the_first_one_stretched():
    family = BudgetRoutes([0.1, 0.2], [LOW, HIGH])
    assert per_layer(family.at(0.1)) == pytest.approx([0.05, 0.15])
    got = family.at(0.2)
    assert per_layer(got) == pytest.approx([0.3, 0.1]) and [e.method for e in got.layers] == ["snapkv", "keydiff"]
    assert per_layer(LOW.rescaled(0.2)) == pytest.approx([0.1, 0.3])  # what one stretched shape would keep


def test_between_two_budgets_each_layer_is_interpolated_in_log_budget():
    """At the geometric mean of 0.1 and 0.2 (w = 1/2) each layer's budget is the geometric
    mean of its two: sqrt(0.05 * 0.3) = sqrt(0.15 * 0.1), an even shape, rescaled to the
    asked mean; the methods are the nearer allocation's (w = 1/2: the higher)."""
    b = math.sqrt(0.1 * 0.2)
    got = BudgetRoutes([0.1, 0.2], [LOW, HIGH]).at(b)
    assert per_layer(got) == pytest.approx([b, b])
    assert [e.method for e in got.layers] == ["snapkv", "keydiff"]
    near_low = BudgetRoutes([0.1, 0.2], [LOW, HIGH]).at(0.11)  # w < 1/2: the lower one's methods
    assert [e.method for e in near_low.layers] == ["tova", "knorm"]
    w = math.log(0.11 / 0.1) / math.log(2)
    shape = [0.05 ** (1 - w) * 0.3**w, 0.15 ** (1 - w) * 0.1**w]
    assert per_layer(near_low) == pytest.approx([x * 0.11 / (sum(shape) / 2) for x in shape])


def test_per_head_allocations_interpolate_per_head():
    low = Route([LayerRoute.per_head([LayerRoute("keydiff", 0.02), LayerRoute("keydiff", 0.18)])] * 2)
    high = Route([LayerRoute.per_head([LayerRoute("keydiff", 0.36), LayerRoute("keydiff", 0.04)])] * 2)
    b = math.sqrt(0.1 * 0.2)  # w = 1/2: sqrt(0.02 * 0.36) = sqrt(0.18 * 0.04), an even shape
    got = BudgetRoutes([0.1, 0.2], [low, high]).at(b)
    assert got.is_per_head and got.head_budgets(2) == [pytest.approx([b, b])] * 2


def test_a_budget_outside_is_an_error_naming_the_file_or_clamped_with_a_warning(tmp_path):
    path = BudgetRoutes([0.1, 0.2], [LOW, HIGH]).to_file(tmp_path / "family.json")
    family = load_route_file(path)
    assert isinstance(family, BudgetRoutes)
    with pytest.raises(RouteError, match=r"family.json holds allocations for budgets \[0.1, 0.2\]; 0.4 is outside"):
        family.at(0.4)
    with pytest.raises(RouteError, match="a token budget: give a fraction"):
        family.at(64)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "outside": "clamp"}))
    with pytest.warns(UserWarning, match="the allocation at 0.2 is rescaled"):
        got = load_route_file(path).at(0.4)
    assert per_layer(got) == pytest.approx([0.6, 0.2])  # HIGH's shape at mean 0.4


def test_bad_budget_conditional_files_are_refused_with_what_they_hold(tmp_path):
    path = tmp_path / "bad.json"
    three = Route.from_layers(["tova"] * 3, 0.2)
    for routes, budgets, message in (
        ([LOW, three], [0.1, 0.2], r"disagree in layer or head count \(0.1: 2 layers.*0.2: 3 layers"),
        ([LOW, HIGH], [0.2, 0.1], r"strictly increasing, got \[0.2, 0.1\]"),
        ([LOW, HIGH], [16, 32], "fractions kept in"),
        ([LOW], [0.1, 0.2], "2 budgets for 1 routes"),
    ):
        path.write_text(json.dumps({"schema": "learnroute.budget_routes/1", "budgets": budgets,
                                    "routes": [r.to_dict() for r in routes]}))
        with pytest.raises(RouteError, match=message) as e:
            load_route_file(path)
        assert "bad.json" in str(e.value)


def test_bench_runs_each_budget_with_its_allocation_and_refuses_outside_ones_before_the_model(tmp_path):
    family = BudgetRoutes([0.1, 0.2], [Route.from_layers(["tova"] * 4, [0.05, 0.15, 0.1, 0.1]),
                                       Route.from_layers(["knorm"] * 4, [0.3, 0.1, 0.2, 0.2])])
    path = family.to_file(tmp_path / "family.json")
    config = BenchConfig(routes=[str(path)], budgets=[0.1, 0.2], tasks={"niah_single_1": 1})
    cells = resolve_routes(config, 4, "tiny")
    assert [(c.budget, [e.method for e in c.route.layers][0]) for c in cells] == [(0.1, "tova"), (0.2, "knorm")]
    assert per_layer(cells[1].route) == pytest.approx([0.3, 0.1, 0.2, 0.2])
    with pytest.raises(ConfigError, match=r"holds allocations for budgets \[0.1, 0.2\]; 0.4 is outside"):
        load_config(BenchConfig, None, [f"routes=[{path}]", "budgets=[0.1,0.4]"])


def test_combine_writes_a_file_the_bench_and_show_read(tmp_path, capsys):
    LOW.to_file(tmp_path / "r10.json")
    HIGH.to_file(tmp_path / "r20.json")
    out = tmp_path / "family.json"
    assert main(["combine", f"{tmp_path / 'r20.json'}@0.2", str(tmp_path / "r10.json"), "--out", str(out)]) == 0
    family = load_route_file(out)
    assert family.budgets == [0.1, 0.2] and per_layer(family.routes[0]) == [0.05, 0.15]  # sorted; r10 at its mean
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "allocations for [0.1, 0.2]" in text and "@0.1:" in text and "@0.2:" in text
    assert main(["show", str(out), "--budget", "0.2"]) == 0
    assert "snapkv" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["combine", str(tmp_path / "r10.json"), "--out", str(out)])  # never overwritten
