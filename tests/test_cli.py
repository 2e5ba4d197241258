"""The command line's errors (one line for bad input, a traceback for bugs) and the one
``device`` key that bench, profile, placement, study and train share."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config

from learnroute import bench as B
from learnroute.cli import main
from learnroute.config import ConfigError, load_config
from learnroute.runs import resolve_device

# ---------------------------------------------------------------------------- errors


def test_options_before_the_verb_say_where_they_go(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", "x.yaml", "bench"])
    assert e.value.code == 2
    assert "--config must come after the verb: learnroute bench --config x.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--overwrite"])
    assert e.value.code == 2
    assert "give a command first" in capsys.readouterr().err


def _bench_argv(tmp_path, *extra):
    return ["bench", "tasks={niah_single_1: 1}", "routes=[full]", f"output={tmp_path / 'run'}", *extra]


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """A RuntimeError (a torch shape error, CUDA out of memory) is not bad input: it is raised."""

    def shape_bug(config, overwrite=False):
        raise RuntimeError("The size of tensor a (3) must match the size of tensor b (4)")

    monkeypatch.setattr(B, "run_bench", shape_bug)
    with pytest.raises(RuntimeError, match="must match the size"):
        main(_bench_argv(tmp_path))


@pytest.mark.parametrize("error", [ConfigError("bad key"), FileNotFoundError("no such file: r.json")])
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, error):
    def refuse(config, overwrite=False):
        raise error

    monkeypatch.setattr(B, "run_bench", refuse)
    with pytest.raises(SystemExit) as e:
        main(_bench_argv(tmp_path))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"learnroute bench: error: {error}\n"


def test_a_training_that_diverges_is_one_line(tmp_path, monkeypatch, capsys):
    """The trainer's NaN stop says which checkpoint and what to change: a message, not a bug."""
    from learnroute.gates import train as T

    def diverge(config, overwrite=False):
        raise T.TrainingError("the loss or a gradient became NaN/inf at step 3")

    monkeypatch.setattr(T, "run_train", diverge)
    with pytest.raises(SystemExit) as e:
        main(["train", "tasks={niah_single_1: 2}", f"output={tmp_path / 'run'}"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "learnroute train: error: the loss or a gradient became NaN/inf at step 3\n"


def test_an_unsupported_model_is_one_line(tmp_path, capsys):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(SystemExit) as e:
        main(_bench_argv(tmp_path, f"model={tmp_path / 'gpt2'}"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("learnroute bench: error: unsupported architecture 'gpt2'") and err.count("\n") == 1


# ---------------------------------------------------------------------------- device


def test_device_resolution(monkeypatch):
    for available in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert resolve_device("auto") == ("cuda" if available else "cpu")
        assert resolve_device("cpu") == "cpu"
    assert resolve_device("cuda") == "cuda"  # available (patched)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device=cuda but no CUDA device is available"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="device must be auto, cpu or cuda, got 'gpu'"):
        resolve_device("gpu")


@pytest.mark.parametrize(
    "module, cls",
    [("learnroute.bench", "BenchConfig"), ("learnroute.profile", "ProfileConfig"),
     ("learnroute.placement", "PlacementConfig"), ("learnroute.study", "StudyConfig"),
     ("learnroute.gates.train", "TrainConfig")],
)
def test_every_verb_has_the_same_device_key(module, cls, tmp_path):
    import importlib

    from learnroute import Route

    config_cls = getattr(importlib.import_module(module), cls)
    given = []
    if cls == "PlacementConfig":  # its one required key
        given = [f"route={Route.from_layers(['snapkv', 'tova'], 0.5).to_file(tmp_path / 'r.json')}"]
    assert config_cls().device == "auto"
    with pytest.raises(ConfigError, match="device must be auto, cpu or cuda, got 'gpu'"):
        load_config(config_cls, None, given + ["device=gpu"])
    config = load_config(config_cls, None, given + ["device=cpu"])
    assert config.device == "cpu"
    if cls == "PlacementConfig":
        assert config.bench_config().device == "cpu"  # the bench it runs has it too


def test_study_passes_its_device_to_every_stage(tmp_path):
    from learnroute.study import StudyConfig

    cfg = StudyConfig(device="cpu", variants={"learned": {}, "gpu": {"device": "cuda"}}, train={"steps": 3})
    variants = cfg.variant_configs(tmp_path)
    assert variants["learned"]["device"] == "cpu" and variants["gpu"]["device"] == "cuda"  # a variant's own wins
    study = StudyConfig(train={"device": "cuda"}, variants={"learned": {}})  # no @profile_best: no profile to read
    assert study.variant_configs(tmp_path)["learned"]["device"] == "cuda"
    study = StudyConfig(dtype="bfloat16", variants={"learned": {}})  # the model's dtype too, to every stage
    assert study.variant_configs(tmp_path)["learned"]["dtype"] == "bfloat16"


def test_device_cuda_without_cuda_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (_bench_argv(tmp_path, "device=cuda"),
                 ["profile", "tasks={niah_single_1: 1}", "device=cuda", f"output={tmp_path / 'p'}"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "device=cuda but no CUDA device is available" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "p").exists()  # refused before any folder


def _pretend_cuda(monkeypatch):
    """CUDA 'available' (this machine has none): a model moved to it fails loudly, so a
    run that finishes kept its model on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    one = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True, device=torch.device("cuda", 0),
                          wait_for_everyone=lambda: None)
    monkeypatch.setattr(B, "process_state", lambda: one)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path on a machine without CUDA")
def test_bench_device_cpu_runs_on_the_cpu(tiny_dir, tmp_path, monkeypatch):
    from learnroute.runs import read_jsonl

    _pretend_cuda(monkeypatch)
    argv = [f"model={tiny_dir}", "tasks={niah_single_1: 1}", "context_tokens=200", "routes=[full]",
            "max_new_tokens=2"]
    B.run_bench(load_config(B.BenchConfig, None, argv + ["device=cpu", f"output={tmp_path / 'cpu'}"]))
    assert len(read_jsonl(tmp_path / "cpu" / "results.jsonl")) == 1
    with pytest.raises((AssertionError, RuntimeError)):  # auto: the model goes to the (missing) GPU
        B.run_bench(load_config(B.BenchConfig, None, argv + [f"output={tmp_path / 'auto'}"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path on a machine without CUDA")
def test_profile_device_cpu_runs_on_the_cpu(tiny_dir, tmp_path, monkeypatch):
    from learnroute.profile import ProfileConfig, run_profile

    _pretend_cuda(monkeypatch)
    argv = [f"model={tiny_dir}", "tasks={niah_single_1: 1}", "context_tokens=200", "budgets=[16]",
            "methods=[snapkv, knorm]"]
    out = run_profile(load_config(ProfileConfig, None, argv + ["device=cpu", f"output={tmp_path / 'cpu'}"]),
                      progress=False)
    assert json.loads((out / "profile.json").read_text())["best"]["16"]
    with pytest.raises((AssertionError, RuntimeError)):  # auto: the model goes to the (missing) GPU
        run_profile(load_config(ProfileConfig, None, argv + [f"output={tmp_path / 'auto'}"]), progress=False)
