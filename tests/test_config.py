"""Configs: defaults -> YAML -> key=value, one error listing every problem."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from learnroute.bench import BenchConfig
from learnroute.config import ConfigError, load_config


@dataclass
class Toy:
    n: int = 1
    rate: float = 0.5
    name: str | None = None
    items: list[int | float] = field(default_factory=lambda: [1])
    counts: dict[str, int] = field(default_factory=lambda: {"a": 1})
    flag: bool = False


def test_precedence_defaults_yaml_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("n: 3\nrate: 2\nname: from-yaml\n")
    cfg = load_config(Toy, path, ["n=5", "items=[64, 0.25]", "counts.b=2", "flag=true"])
    assert cfg.n == 5  # override beats YAML
    assert cfg.rate == 2.0 and isinstance(cfg.rate, float)  # YAML beats default; ints widen
    assert cfg.name == "from-yaml"
    assert cfg.items == [64, 0.25]
    assert cfg.counts == {"a": 1, "b": 2}  # dotted key edits one entry of the default mapping
    assert cfg.flag is True
    assert load_config(Toy) == Toy()


def test_every_problem_in_one_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("n: many\nbogus: 1\nflag: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(Toy, path, ["other=2", "rate=fast", "noequals"])
    msg = str(e.value)
    for part in [
        "n: expected an integer",
        "flag: expected true or false",
        "rate: expected a number",
        "'bogus'",
        "'other'",
        "valid keys: n, rate",
        "'noequals' is not key=value",
    ]:
        assert part in msg, part


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Toy, tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Toy, tmp_path / "list.yaml")


def test_bench_config_validation_lists_all():
    with pytest.raises(ConfigError) as e:
        load_config(
            BenchConfig,
            None,
            ["tasks={nope_task: 1, niah_single_1: 0}", "budgets=[0, 1.5]", "routes=[homogeneous:nosuch, missing.json]"],
        )
    msg = str(e.value)
    assert "unknown task 'nope_task'; valid: niah_single_1" in msg
    assert "sample count must be >= 1" in msg
    assert "budget 0 must be >= 1" in msg and "budget 1.5 as a fraction must be in (0, 1]" in msg
    assert "unknown method 'nosuch'; registered:" in msg and "snapkv" in msg
    assert "'missing.json' is neither one of full" in msg


def test_bench_config_empty_tasks():
    with pytest.raises(ConfigError, match="the task list is empty"):
        load_config(BenchConfig, None, ["tasks={}"])


def test_placement_config_collects_the_bench_problems(tmp_path, capsys):
    from learnroute.cli import main
    from learnroute.placement import PlacementConfig
    from learnroute.route import Route

    route = Route.from_layers(["snapkv", "tova"], 8).to_file(tmp_path / "r.json")
    bad = [f"route={route}", "max_batch=0", "context_tokens=4", "tasks={niah_single_2: 0}", "n_placements=0"]
    expected = ["max_batch must be >= 1, got 0", "context_tokens must be >= 16, got 4",
                "tasks.niah_single_2: sample count must be >= 1, got 0", "n_placements must be >= 1, got 0"]
    with pytest.raises(ConfigError) as err:
        load_config(PlacementConfig, None, bad + ["output=" + str(tmp_path / "out")])
    for problem in expected:
        assert problem in str(err.value)
    assert "routes" not in str(err.value)  # placement route files are written later: not a problem
    # Through the command line: the same collected error, exit code 2, nothing written.
    with pytest.raises(SystemExit) as exit_:
        main(["placement", *bad, "output=" + str(tmp_path / "out")])
    assert exit_.value.code == 2
    err_text = capsys.readouterr().err
    assert all(problem in err_text for problem in expected) and "Traceback" not in err_text
    assert not (tmp_path / "out").exists()
    # A good config still loads.
    assert load_config(PlacementConfig, None, [f"route={route}"]).bench_config().max_batch == 32


def test_unknown_keys_and_invalid_values_come_in_one_error():
    """`steps=-3 budgets=[1.5] foo=1`: the unknown key and both bad values, in one message."""
    from learnroute.gates.config import TrainConfig

    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, None, ["steps=-3", "budgets=[1.5]", "foo=1", "lr=fast"])
    msg = str(e.value)
    for part in ["'foo'", "steps must be >= 1, got -3", "budgets: ", "1.5", "lr: expected a number"]:
        assert part in msg, (part, msg)


def test_choice_fields_are_typed_and_every_bad_choice_is_listed_in_one_error():
    """A field whose annotation is a Literal accepts only its values; the error names each
    bad field with its valid values, beside the other problems."""
    import typing

    from learnroute.config import from_dict
    from learnroute.gates.config import TrainConfig
    from learnroute.gates.gates import LEARN, MIXING
    from learnroute.gates.topk import RELAXATIONS
    from learnroute.route import LAYER_TOTALS

    with pytest.raises(ConfigError) as e:
        from_dict(TrainConfig, {"granularity": "block", "dtype": "fp16", "learn": "all", "steps": -1})
    msg = str(e.value)
    assert "granularity: expected one of 'layer', 'head', got 'block'" in msg
    assert "dtype: expected one of 'float32', 'bfloat16', got 'fp16'" in msg
    assert "learn: expected one of 'both', 'methods', 'budgets', 'none', got 'all'" in msg
    assert "steps must be >= 1" in msg
    # the annotations are the values the code runs with
    hints = typing.get_type_hints(TrainConfig)
    assert typing.get_args(hints["learn"]) == LEARN and typing.get_args(hints["mixing"]) == MIXING
    assert set(typing.get_args(hints["relaxation"])) == set(RELAXATIONS)
    assert typing.get_args(hints["layer_totals"]) == LAYER_TOTALS


def test_grouped_keys_load_as_the_flat_ones_and_overrides_name_either(tmp_path):
    """A YAML file may nest TrainConfig's keys in their groups; the config is the one the
    flat file gives, and an override may name the group or not (the later one wins)."""
    from learnroute.gates.config import TrainConfig

    grouped, flat = tmp_path / "grouped.yaml", tmp_path / "flat.yaml"
    grouped.write_text("optimiser: {lr: 0.1, steps: 3}\ngates: {learn: both}\ndata: {context_tokens: 512}\n")
    flat.write_text("lr: 0.1\nsteps: 3\nlearn: both\ncontext_tokens: 512\n")
    a, b = load_config(TrainConfig, grouped), load_config(TrainConfig, flat)
    assert a == b and (a.lr, a.steps, a.learn, a.context_tokens) == (0.1, 3, "both", 512)
    c = load_config(TrainConfig, grouped, ["optimiser.lr=0.2", "steps=4", "data.tasks.niah_single_1=2"])
    assert (c.lr, c.steps, c.tasks["niah_single_1"]) == (0.2, 4, 2)
    assert c.tasks["niah_multikey"] == 6  # a dotted key edits one entry of the default mapping
    assert load_config(TrainConfig, flat, ["optimiser={lr: 0.7}"]).lr == 0.7


def test_grouping_mistakes_are_listed_in_one_error(tmp_path):
    from learnroute.gates.config import TrainConfig

    path = tmp_path / "bad.yaml"
    path.write_text("optimiser: {lr: 0.1, foo: 1, learn: both}\nlr: 0.3\nloss: 5\nsteps: -1\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, path)
    msg = str(e.value)
    assert "optimiser.foo: not a key of optimiser; its keys: steps, batch_size, lr" in msg
    assert "optimiser.learn: not a key of optimiser (learn belongs to gates)" in msg
    assert "lr is given twice (optimiser.lr and lr); keep one" in msg
    assert "loss: the group of ce_weight, kl_weight" in msg and "expected a mapping, got 5" in msg
    assert "steps must be >= 1" in msg


def test_every_field_of_a_grouped_config_is_in_exactly_one_group():
    import dataclasses

    from learnroute.config import describe
    from learnroute.gates.config import TrainConfig
    from learnroute.study.config import StudyConfig

    for cls in (TrainConfig, StudyConfig):
        grouped = [name for names in cls.GROUPS.values() for name in names]
        assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(cls)), cls.__name__
        assert not set(cls.GROUPS) & set(grouped)  # a group is never also a key
        text = describe(cls)
        assert all(f"\n  {g}:\n" in f"\n{text}\n" for g in cls.GROUPS)  # --help lists the keys by group


def test_a_study_variant_may_nest_train_keys_in_their_groups():
    from learnroute.study.config import StudyConfig

    s = load_config(StudyConfig, None, ["train={optimiser: {lr: 0.5}, steps: 3}",
                                        "variants={learned: {optimiser: {lr: 0.1}, gates: {learn: both}}}"])
    assert s.train == {"lr": 0.5, "steps": 3} and s.variants == {"learned": {"lr": 0.1, "learn": "both"}}
    with pytest.raises(ConfigError, match=r"variants.learned.optimiser.learn: not a key of optimiser"):
        load_config(StudyConfig, None, ["variants={learned: {optimiser: {learn: both}}}"])
