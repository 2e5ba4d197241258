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


# ---------------------------------------------------------------------------- budget_slope training


def test_budget_slope_shares_are_beta_plus_the_slope_times_the_log_budget_ratio():
    import torch

    from learnroute.gates.gates import Gates

    gates = Gates(["tova", "knorm"], [True, True, False, True], learn="both", budget_slope=True, ref_budget=0.2)
    assert torch.allclose(gates.shares(0.05), gates.shares(0.4))  # a zero slope: one allocation at every budget
    with torch.no_grad():
        gates.beta.copy_(torch.tensor([0.1, -0.3, 0.0, 0.5]))
        gates.beta_slope.copy_(torch.tensor([1.0, -2.0, 0.0, 0.5]))
    s = math.log(0.05 / 0.2)
    free = [0, 1, 3]
    logits = [[0.1, -0.3, 0.0, 0.5][u] + s * [1.0, -2.0, 0.0, 0.5][u] for u in free]
    want = [math.exp(x) / sum(math.exp(y) for y in logits) for x in logits]
    got = gates.shares(0.05).detach()
    assert got[free].tolist() == pytest.approx(want) and float(got[2]) == 0.0  # fixed layer: no share
    assert len(gates.trainable()) == 3
    assert Gates(["tova"], [True], learn="both").beta_slope is None


def test_budget_slope_config_needs_learned_budgets_and_fractions():
    """Asked for (true), the slope is refused where it cannot be learned; auto (the default)
    turns it on for the recipe and off for such a config without an error."""
    from learnroute.gates.config import TrainConfig, resolved_slope, stage_configs

    with pytest.raises(ConfigError, match="budget_slope .* needs learn budgets or both, not 'methods'"):
        load_config(TrainConfig, None, ["budget_slope=true", "learn=methods", "init_method=null"])
    with pytest.raises(ConfigError, match=r"budget_slope needs two or more fraction budgets .* got \[64, 128\]"):
        load_config(TrainConfig, None, ["budget_slope=true", "budgets=[64,128]", "context_tokens=1024"])
    assert load_config(TrainConfig, None, ["budget_slope=true"]).ref_budget == pytest.approx(
        math.exp(sum(math.log(b) for b in (0.075, 0.1, 0.15, 0.2, 0.4)) / 5))
    with pytest.raises(ConfigError, match="budget_slope: expected true or false or 'auto', got 'maybe'"):
        load_config(TrainConfig, None, ["budget_slope=maybe"])
    assert resolved_slope(TrainConfig()) is True
    assert resolved_slope(load_config(TrainConfig, None, ["budget_slope=false"])) is False
    assert resolved_slope(load_config(TrainConfig, None, ["learn=methods", "init_method=null"])) is False
    assert resolved_slope(load_config(TrainConfig, None, ["budgets=[64,128]", "context_tokens=1024"])) is False
    assert resolved_slope(load_config(TrainConfig, None, ["budgets=[0.2]"])) is False
    # every stage's resolved config says which, so its config.yaml does (one stage at 1k, two at 4k)
    assert [c.budget_slope for c in stage_configs(TrainConfig())] == [True]
    assert [c.budget_slope for c in stage_configs(TrainConfig(context_tokens=4096))] == [True, True]


def test_slope_weight_holds_the_allocations_toward_one_rescaled_shape(tiny_dir, tmp_path):
    """slope_weight penalises mean(beta'^2): the same run (seed, samples, steps) with a large
    weight ends with a smaller slope, so its allocations at 0.2 and 0.4 differ less from one
    shape rescaled; below 0 it is refused before training."""
    from learnroute.gates.checkpoint import load_gates
    from learnroute.gates.config import TrainConfig
    from tests.conftest import PER_LAYER
    from tests.test_gates import write_config

    slopes = {}
    for w in (0.0, 50.0):
        over = {**PER_LAYER, "budget_slope": True, "slope_weight": w, "budgets": [0.2, 0.4], "steps": 3, "lr": 0.3,
                "save_every": 3, "eval_every": 3, "tasks": {"niah_single_1": 3}, "output": str(tmp_path / f"run{w}")}
        assert main(["train", "--config", str(write_config(tmp_path, tiny_dir, **over))]) == 0
        slopes[w] = load_gates(tmp_path / f"run{w}" / "gates.safetensors")[0]["beta_slope"].abs().mean().item()
    assert slopes[50.0] < 0.5 * slopes[0.0], slopes
    with pytest.raises(ConfigError, match="slope_weight must be >= 0, got -1"):
        load_config(TrainConfig, None, ["budget_slope=true", "slope_weight=-1"])


def test_a_budget_slope_run_exports_one_allocation_per_training_budget(tiny_dir, tmp_path, capsys):
    """Trained with budget_slope, the gates learn a slope (the allocations at 0.2 and 0.4 are
    shaped differently), route_by_budget.json holds the hardened route at each training
    budget, route.json stays the plain route at the first, and a plain `export` (or `--per-budget`)
    writes the same file again; `--budget B` writes the one route at B."""
    from learnroute.gates.checkpoint import load_gates
    from tests.conftest import PER_LAYER
    from tests.test_gates import write_config

    over = {**PER_LAYER, "budget_slope": True, "budgets": [0.2, 0.4], "steps": 4, "lr": 0.3, "save_every": 4}
    assert main(["train", "--config", str(write_config(tmp_path, tiny_dir, **over))]) == 0
    run = tmp_path / "run"
    tensors, _ = load_gates(run / "gates.safetensors")
    assert float(tensors["beta_slope"].abs().max()) > 0  # the slope trained away from 0
    assert "opt.beta_slope.exp_avg" in load_gates(next((run / "checkpoints").glob("*.safetensors")))[0]  # resumable
    family = load_route_file(run / "route_by_budget.json")
    assert isinstance(family, BudgetRoutes) and family.budgets == [0.2, 0.4]
    low, high = family.routes
    assert sum(low.budgets) / 4 == pytest.approx(0.2, abs=1e-6) and sum(high.budgets) / 4 == pytest.approx(0.4, abs=1e-6)
    assert per_layer(low) == pytest.approx(per_layer(Route.from_file(run / "route.json")))
    assert per_layer(high) != pytest.approx(per_layer(low.rescaled(0.4)), abs=1e-4)  # its own shape, not a stretch
    for flags in ([], ["--per-budget"]):
        again = tmp_path / "again.json"
        assert main(["export", str(run), "--out", str(again), *flags]) == 0
        assert [per_layer(r) for r in load_route_file(again).routes] == [per_layer(r) for r in family.routes]
        assert "one allocation per training budget [0.2, 0.4]" in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(tmp_path / "one.json"), "--budget", "0.2"]) == 0
    assert per_layer(Route.from_file(tmp_path / "one.json")) == pytest.approx(per_layer(low))


# ---------------------------------------------------------------------------- per-budget layer totals


def test_per_budget_layer_totals_follow_the_budget_by_hand():
    """Two layers of two heads, floor 0, layer shares 0.75 / 0.25 at 10 % and 0.25 / 0.75 at
    40 % (mean 10 and 40 tokens of 100): the heads keep 15, 15, 5, 5 and 20, 20, 60, 60. At
    20 %, half-way in log-budget, the shares are 0.5 / 0.5 (20 each); below 10 % the first
    row holds. One row per budget is what a first stage with a budget slope hands on."""
    import torch

    from learnroute.gates.gates import Gates

    kw = dict(n_heads=2, budget_floor=0.0, init_methods=["snapkv"] * 2, layer_totals="fixed",
              layer_share_table=([0.1, 0.4], [[0.75, 0.25], [0.25, 0.75]]))
    gates = Gates(["snapkv"], [True, True], **kw)
    assert gates.budget_dependent and gates.beta_slope is None
    assert gates.budgets(10.0, 100).tolist() == pytest.approx([15.0, 15.0, 5.0, 5.0], abs=1e-4)
    assert gates.budgets(40.0, 100).tolist() == pytest.approx([20.0, 20.0, 60.0, 60.0], abs=1e-4)
    assert gates.budgets(20.0, 100).tolist() == pytest.approx([20.0] * 4, abs=1e-4)
    assert gates.budgets(5.0, 100).tolist() == pytest.approx([7.5, 7.5, 2.5, 2.5], abs=1e-4)
    with torch.no_grad():  # the heads still split their layer's total as beta says: 3:1 in layer 0
        gates.beta.copy_(torch.tensor([math.log(3.0), 0.0, 0.0, 0.0]))
    assert gates.budgets(40.0, 100).tolist() == pytest.approx([30.0, 10.0, 60.0, 60.0], abs=1e-4)
    with pytest.raises(ValueError, match="needs layer_totals='fixed'"):
        Gates(["snapkv"], [True, True], **{**kw, "layer_totals": "learn"})
    with pytest.raises(ValueError, match=r"budgets must be increasing fractions in \(0, 1\], got \[0.4, 0.1\]"):
        Gates(["snapkv"], [True, True], **{**kw, "layer_share_table": ([0.4, 0.1], [[0.5, 0.5], [0.5, 0.5]])})
    with pytest.raises(ValueError, match=r"one row of 2 layer shares per budget \(2 budgets\), got shape \(2, 3\)"):
        Gates(["snapkv"], [True, True], **{**kw, "layer_share_table": ([0.1, 0.4], [[0.5, 0.5, 0.0]] * 2)})


def test_a_second_stage_keeps_each_budgets_own_layer_totals(tiny_dir, tmp_path, capsys):
    """Two stages with a budget slope: the first stage learns per-layer allocations at 0.2 and
    0.4 that are shaped differently; the second (per head, layer totals fixed) starts from its
    route_by_budget.json and keeps, at each budget, that budget's layer totals (not the 0.2
    shape rescaled to 0.4), through training, the checkpoint and `export` (and its untrained
    start, `export --start`, is the first stage's allocations split evenly over the heads)."""
    from learnroute.gates.config import TrainConfig, stage_configs
    from tests.test_gates import write_config

    over = dict(learn="budgets", init_method="tova", granularity="head", stages="two", budget_slope=True,
                slope_weight=0.0, budgets=[0.2, 0.4], steps=3, eval_every=3, save_every=3, select="last", lr=0.5)
    assert main(["train", "--config", str(write_config(tmp_path, tiny_dir, **over))]) == 0
    run = tmp_path / "run"
    first = load_route_file(run / "first_stage" / "route_by_budget.json")
    low = per_layer(first.routes[0])
    assert per_layer(first.routes[1]) != pytest.approx(per_layer(first.routes[0].rescaled(0.4)), abs=1e-3)
    again = tmp_path / "again.json"
    assert main(["export", str(run), "--out", str(again)]) == 0
    start = tmp_path / "start.json"
    assert main(["export", str(run), "--out", str(start), "--start"]) == 0
    for path in (run / "route_by_budget.json", again):
        second = load_route_file(path)
        assert isinstance(second, BudgetRoutes) and second.budgets == [0.2, 0.4]
        for stage1, stage2 in zip(first.routes, second.routes):
            heads = stage2.head_budgets(stage2.n_heads)  # (L, H)
            assert [sum(h) / len(h) for h in heads] == pytest.approx(per_layer(stage1), abs=1e-5)
        assert any(abs(h[0] - h[-1]) > 1e-3 for h in second.routes[1].head_budgets(second.routes[1].n_heads))
    plain_heads = Route.from_file(run / "route.json").head_budgets(2)  # (L, H): the route at the first budget
    assert [sum(h) / len(h) for h in plain_heads] == pytest.approx(low, abs=1e-5)
    started = load_route_file(start)
    assert isinstance(started, BudgetRoutes)
    for stage1, route in zip(first.routes, started.routes):
        assert [b for h in route.head_budgets(route.n_heads) for b in h] == pytest.approx(
            [b for b in per_layer(stage1) for _ in range(route.n_heads)], abs=1e-5)
    # without a budget slope, the first stage has one shape: the second starts from route.json
    plain = TrainConfig(context_tokens=4096, budget_slope=False)
    assert stage_configs(plain)[1].init_route.endswith("first_stage/route.json")
    assert stage_configs(TrainConfig(context_tokens=4096))[1].init_route.endswith("first_stage/route_by_budget.json")


def test_per_budget_layer_totals_outside_the_files_budgets_are_refused(tmp_path):
    """A budget-conditional init_route with fixed layer totals holds totals only for its own
    budgets: training at others is refused, naming the file, what it holds and what was asked."""
    from learnroute.gates.config import TrainConfig

    two = [Route.from_layers(["tova"] * 2, [0.1, 0.3]), Route.from_layers(["tova"] * 2, [0.3, 0.5])]
    path = BudgetRoutes([0.2, 0.4], two).to_file(tmp_path / "family.json")
    base = [f"init_route={path}", "granularity=head", "layer_totals=fixed", "learn=budgets"]
    with pytest.raises(ConfigError, match=rf"init_route {path} holds layer totals for budgets \[0.2, 0.4\]; "
                                          r"budgets \[0.1, 0.6\] are outside them"):
        load_config(TrainConfig, None, [*base, "budgets=[0.1,0.2,0.6]"])
    assert load_config(TrainConfig, None, [*base, "budgets=[0.2,0.3,0.4]"]).init_route == str(path)
    with pytest.raises(ConfigError, match="is budget-conditional .* learn: none"):
        load_config(TrainConfig, None, [f"init_route={path}", "learn=none", "adapter=true", "budgets=[0.2]"])
