"""Learned gates: the bias primitive, gates and budgets, training, resume, export, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import learnroute as lr
from learnroute import _hf
from learnroute.cli import main
from learnroute.config import ConfigError, load_config
from learnroute.engine import Engine
from learnroute.gates import calibration as C
from learnroute.gates import train as T
from learnroute.gates.export import export_cli
from learnroute.gates.gates import Gates
from learnroute.methods.base import Method
from learnroute.methods.select import keep_indices
from learnroute.methods.registry import register_method, unregister_method
from learnroute.methods.scorers import TOVA
from learnroute.route import Route, RouteError
from learnroute.runs import read_jsonl
from learnroute.tasks import make_samples
from tests.conftest import PER_LAYER

BAD_LAYERS = {18}


@dataclass
class PlantedWorst(Method):
    """TOVA, except in BAD_LAYERS where it keeps the tokens TOVA would drop (test only).

    Measured on the default model (niah_single_1, 300 tokens, half the cache kept, TOVA in
    every other layer): reversing TOVA in layer 18 multiplies the KL to the full cache by
    9.4; in most layers it changes it by less than 40 %, and in some it helps (layer 14:
    0.53), so the planted layer is chosen, not arbitrary. (Layer 17, 1.7 alone, did not
    move in training: jointly with the others its reversal costs too little.)
    """

    name = "planted_worst"

    def score(self, layer, n_kept=None):
        s = TOVA().score(layer)
        return -s if layer.module.layer_idx in BAD_LAYERS else s


@pytest.fixture
def planted():
    register_method(PlantedWorst)
    yield "planted_worst"
    unregister_method("planted_worst")


def write_config(tmp_path: Path, model_dir, **over) -> Path:
    cfg = {
        "model": str(model_dir),
        "tasks": {"niah_single_1": 4},
        "context_tokens": 200,
        "methods": ["snapkv", "tova", "knorm", "streaming_llm"],
        "budgets": [0.25, 40],
        "steps": 6,
        "batch_size": 2,
        "eval_every": 3,
        "save_every": 2,
        "output": str(tmp_path / "run"),
        **PER_LAYER,
    }
    cfg.update(over)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(path: Path, *extra: str) -> int:
    return main(["train", "--config", str(path), *extra])


# ---------------------------------------------------------------------------- the primitive


def test_minus_inf_bias_equals_evicting_with_per_layer_budgets(tiny, tokenizer, sample):
    """forward_tokens with -inf biases = a plain forward over a physically compressed cache."""
    engine = Engine(tiny, tokenizer)
    prompt = engine.encode(sample.context, sample.question, sample.answer_prefix)
    pre = engine.prefill(prompt)
    n, q = pre.n_tokens, prompt.question_ids.shape[1]
    budgets = [7, 60, 150, n - 3]  # different per layer
    methods = ["snapkv", "tova", "knorm", "h2o"]
    pos = torch.arange(n, n + q).unsqueeze(0)
    kept, biases = [], {}
    for layer, (m, k) in enumerate(zip(methods, budgets)):
        idx = keep_indices(engine.scores(pre, layer, m), k)  # (1, H_kv, k)
        cap = pre.layers[layer]
        g = idx.unsqueeze(-1).expand(-1, -1, -1, cap.keys.shape[-1])  # (1, H_kv, k, d)
        kept.append((cap.keys.gather(2, g), cap.values.gather(2, g)))
        bias = torch.full((1, cap.keys.shape[1], n), float("-inf")).scatter(2, idx, 0.0)  # (1, H_kv, n)
        biases[layer] = bias
    # Reference: transformers' own cache object holding only the kept tokens, the model's own forward.
    cache = DynamicCache(config=tiny.config)
    for layer, (k, v) in enumerate(kept):
        cache.update(k, v, layer)
    with torch.no_grad(), lr.routed_attention(tiny):
        ref = tiny(input_ids=prompt.question_ids, past_key_values=cache, position_ids=pos).logits
    full = [(c.keys, c.values) for c in pre.layers]
    with torch.no_grad():
        got = _hf.forward_tokens(tiny, full, prompt.question_ids, pos, biases=biases)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # and the bias changes something (the test can fail)
    with torch.no_grad():
        unbiased = _hf.forward_tokens(tiny, full, prompt.question_ids, pos)
    assert not torch.allclose(unbiased, ref, atol=1e-3)


def test_bias_of_the_wrong_length_is_refused(tiny, tokenizer, sample):
    engine = Engine(tiny, tokenizer)
    prompt = engine.encode(sample.context, sample.question)
    pre = engine.prefill(prompt)
    n = pre.n_tokens
    full = [(c.keys, c.values) for c in pre.layers]
    pos = torch.arange(n, n + prompt.question_ids.shape[1]).unsqueeze(0)
    with pytest.raises(ValueError, match=f"layer 2 has shape .*expected \\(B, heads, {n}\\)"):
        _hf.forward_tokens(tiny, full, prompt.question_ids, pos, biases={2: torch.zeros(1, 2, n - 1)})


# ---------------------------------------------------------------------------- gates and budgets


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(st.floats(-3, 3), min_size=2, max_size=12),
    mean=st.floats(1.0, 200.0),
    floor=st.floats(0.0, 0.9),
    n=st.integers(201, 400),
)
def test_budgets_keep_the_total_and_the_cap(logits, mean, floor, n):
    L = len(logits)
    gates = Gates(["tova", "knorm"], [True] * L, budget_floor=floor)
    with torch.no_grad():
        gates.beta.copy_(torch.tensor(logits) * 3)
    k = gates.budgets(mean, n).detach()
    assert float(k.sum()) == pytest.approx(mean * L, rel=1e-4)
    assert float(k.max()) <= n + 1e-3 and float(k.min()) >= floor * mean - 1e-4
    b = max(1, int(mean))
    hard = gates.harden(b, n).budgets  # tokens: integers with the exact total
    assert sum(hard) == b * L and max(hard) <= n and min(hard) >= 1


def test_fixed_layers_have_no_gate_and_keep_everything():
    gates = Gates(["tova", "knorm"], [True, False, True])
    ranks = torch.rand(3, 2, 2, 50)
    masks = gates.soft_masks(ranks, 10.0, temperature=1.0, tau=0.01)
    assert torch.equal(masks[1], torch.ones(2, 50))
    torch.testing.assert_close(masks[[0, 2]].sum(-1), torch.full((2, 2), 10.0), rtol=1e-3, atol=1e-3)
    assert float(gates.shares().detach()[1]) == 0.0


def test_init_route_shape_with_init_method(tmp_path):
    """init_route + init_method: the route's budget shape (its budgets per layer, up to the
    hardening's rounding) with the one method in every layer."""
    budgets = [0.02, 0.02, 0.16, 0.2]  # mean 0.1; fractions of the context
    route = Route([lr.route.LayerRoute("tova", b) for b in budgets])
    path = tmp_path / "shape.json"
    route.to_file(path)
    cfg = T.TrainConfig(methods=["snapkv", "tova", "keydiff"], init_route=str(path), init_method="keydiff",
                        learn="budgets", budget_floor=0.05)
    gates = T.build_gates(cfg, 4, [True] * 4)
    n = 1000
    assert gates.harden(100, n).budgets == [round(b * n) for b in budgets]
    assert gates.theta.argmax(-1).tolist() == [2] * 4  # keydiff


@pytest.mark.parametrize("pi", [0.3, 0.5, 0.9])
def test_init_pi_sets_the_start_methods_share_at_the_first_temperature(pi):
    cfg = T.TrainConfig(methods=["snapkv", "tova", "keydiff", "knorm"], init_method="tova", init_pi=pi,
                        gate_temperature=[0.2, 0.05])
    gates = T.build_gates(cfg, 3, [True] * 3)
    shares = torch.softmax(gates.theta.detach() / 0.2, -1)  # (L, M)
    torch.testing.assert_close(shares[:, 1], torch.full((3,), pi))
    with pytest.raises(ConfigError, match="init_pi"):
        load_config(T.TrainConfig, overrides=["init_pi=0.1"])  # below 1/M = 1/8 with the default candidates


@pytest.mark.parametrize("mixing", ["score", "mask"])
@pytest.mark.parametrize("learn", ["both", "methods", "budgets"])
def test_every_gate_gets_a_finite_gradient(tiny, tokenizer, mixing, learn):
    engine = Engine(tiny, tokenizer)
    s = make_samples("niah_single_1", tokenizer, 1, 200, "calibration")[0]
    methods = ["snapkv", "tova", "knorm"]
    with T.frozen(tiny):
        item = C.prepare_item(engine, "niah_single_1", s, methods, with_ref=True)
        gates = Gates(methods, [True] * 4, learn=learn, init_methods=["tova"] * 4 if learn == "budgets" else None)
        masks = gates.soft_masks(item.ranks, 0.25 * item.n_tokens, temperature=1.0, tau=0.05, mixing=mixing)
        loss, _ = T.answer_loss(tiny, item, masks, eps=1e-6, kl_weight=1.0)
        loss.backward()
    assert all(p.grad is None for p in tiny.parameters())  # the model stays frozen
    for p in (gates.theta, gates.beta):
        if p.requires_grad:
            assert p.grad is not None and bool(torch.isfinite(p.grad).all())
            assert bool((p.grad != 0).all()), p.grad  # every layer's gate is reached
        else:
            assert p.grad is None


# ---------------------------------------------------------------------------- training


@pytest.mark.slow
def test_planted_bad_method_is_avoided_in_exactly_its_layers(smol, tmp_path, planted):
    """Start every layer at the planted method (TOVA reversed in layer 18); training moves π
    off it in exactly that layer, and the hardened route answers like the
    planted best route (TOVA everywhere).

    The default model, because on a tiny random model no selection is clearly worse than
    another (attention is near uniform; measured: reversing H2O, TOVA, Knorm or recency in
    one layer changes the KL by -40 % to +30 %). Mask mixing: its gradient compares the
    methods' whole selections."""
    model, tokenizer = smol
    cfg = write_config(
        tmp_path,
        "null",
        methods=["tova", "planted_worst"],
        mixing="mask",
        learn="methods",
        init_method="planted_worst",
        init_logit=1.0,
        budgets=[0.5],
        context_tokens=300,
        steps=8,
        batch_size=3,
        lr=0.2,
        ce_weight=0.0,
        kl_weight=1.0,
        val_fraction=0.0,
        straight_through=0.0,
        gate_temperature=[1.0, 1.0],
        topk_scale="rank",  # sharp masks at half the cache (budget units would start at 0.25 ranks)
        topk_temperature=[0.02, 0.002],
        tasks={"niah_single_1": 3},
    )
    cfg.write_text(cfg.read_text().replace("model: 'null'", "model: null"))
    assert train(cfg) == 0
    out = tmp_path / "run"
    theta, _ = T.load_gates(out / "gates.safetensors")
    pi = torch.softmax(theta["theta"], -1)[:, 1]  # π of the planted method per layer
    start = float(torch.softmax(torch.tensor([0.0, 1.0]), -1)[1])
    for layer in range(len(pi)):
        if layer in BAD_LAYERS:
            assert pi[layer] < 0.5 < start, (layer, pi)  # moved off it, past even odds
        else:  # identical scores to TOVA there: zero gradient up to float noise (which Adam rescales)
            assert float(pi[layer]) == pytest.approx(start, abs=0.05), (layer, pi)
    route = Route.from_file(out / "route.json")
    assert [route.methods[i] for i in sorted(BAD_LAYERS)] == ["tova"]
    engine = Engine(model, tokenizer, max_new_tokens=12)
    s = make_samples("niah_single_1", tokenizer, 1, 300, "eval")[0]
    best = Route.homogeneous("tova", len(pi), 0.5)
    got, ref = engine.run(s.context, s.question, [route, best], s.answer_prefix, keep_logits=True)
    assert got.token_ids == ref.token_ids
    torch.testing.assert_close(got.first_logits, ref.first_logits)


def test_run_folder_resume_and_same_gates_as_uninterrupted(tiny_dir, tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    cfg = write_config(tmp_path / "a", tiny_dir)
    assert train(cfg) == 0
    out = tmp_path / "a" / "run"
    for name in ("config.yaml", "versions.json", "train.log", "history.jsonl", "split.json", "route.json",
                 "pi.png", "budgets.png", "gates.safetensors", "best.safetensors"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_000006.safetensors"
    split = json.loads((out / "split.json").read_text())
    assert len(split["val"]) == 1 and len(split["train"]) == 3 and not set(split["val"]) & set(split["train"])
    Route.from_file(out / "route.json").check_layers(4)

    # Interrupted after step 4 (a checkpoint at 4), then resumed.
    (tmp_path / "b").mkdir()
    cfg_b = write_config(tmp_path / "b", tiny_dir)
    real = T.answer_loss
    calls = {"n": 0}

    def dies(*a, **k):
        calls["n"] += 1
        if calls["n"] > 4 * 2:  # batch 2: steps 1-4 run, step 5 dies
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(T, "answer_loss", dies)
    with pytest.raises(KeyboardInterrupt):
        train(cfg_b)
    monkeypatch.setattr(T, "answer_loss", real)
    out_b = tmp_path / "b" / "run"
    assert not (out_b / "gates.safetensors").exists()
    assert train(cfg_b) == 0
    assert "resumed from" in (out_b / "train.log").read_text()
    a, _ = T.load_gates(out / "gates.safetensors")
    b, _ = T.load_gates(out_b / "gates.safetensors")
    assert torch.equal(a["theta"], b["theta"]) and torch.equal(a["beta"], b["beta"])
    rows = [r["step"] for r in read_jsonl(out_b / "history.jsonl") if "loss" in r]
    assert rows == list(range(1, 7))  # nothing logged twice after the resume


def test_a_second_run_on_the_same_samples_reuses_their_prefills(tiny_dir, tmp_path, monkeypatch):
    """A study trains many variants in one process: runs handed one calibration store make
    the calibration prefills once, and a run from reused ones ends with the same gates as
    one that prefilled."""
    from learnroute.engine import Engine

    store = C.CalibrationStore()

    def run(folder, **over):
        (tmp_path / folder).mkdir()
        config = load_config(T.TrainConfig, write_config(tmp_path / folder, tiny_dir, steps=3, save_every=3, **over))
        return T.run_train(config, progress=False, calibration=store)

    run("a")
    monkeypatch.setattr(Engine, "prefill", lambda *a, **k: (_ for _ in ()).throw(AssertionError("prefilled again")))
    run("b", lr=0.05)
    a, _ = T.load_gates(tmp_path / "a" / "run" / "gates.safetensors")
    b, _ = T.load_gates(tmp_path / "b" / "run" / "gates.safetensors")
    assert not torch.equal(a["theta"], b["theta"])  # a real second run (its lr differs)
    # another method set needs other scores: the store must not serve it
    with pytest.raises(AssertionError, match="prefilled again"):
        run("c", methods=["snapkv", "tova"])
    monkeypatch.undo()
    (tmp_path / "d").mkdir()
    assert train(write_config(tmp_path / "d", tiny_dir, steps=3, save_every=3, lr=0.05)) == 0
    d, _ = T.load_gates(tmp_path / "d" / "run" / "gates.safetensors")
    assert torch.equal(b["theta"], d["theta"]) and torch.equal(b["beta"], d["beta"])  # reused = fresh prefills


def test_seeds_train_what_separate_runs_train_and_prefill_once(tiny_dir, tmp_path, monkeypatch, capsys):
    """`learnroute train --seeds 0,2`: the runs of `train_seed=0` and `train_seed=2` trained
    alone, into <output>_seed<k>, with the calibration samples prefilled once for both."""
    made = []
    real = Engine.prefill
    monkeypatch.setattr(Engine, "prefill", lambda *a, **k: made.append(1) or real(*a, **k))
    (tmp_path / "both").mkdir()
    assert train(write_config(tmp_path / "both", tiny_dir, steps=3, save_every=3), "--seeds", "0,2") == 0
    per_run = len(made)
    assert per_run > 0
    for k in (0, 2):
        (tmp_path / f"alone{k}").mkdir()
        assert train(write_config(tmp_path / f"alone{k}", tiny_dir, steps=3, save_every=3, train_seed=k)) == 0
    assert len(made) == 3 * per_run  # each alone prefills what the two seeds prefilled together
    gates = {}
    for k in (0, 2):
        out = tmp_path / "both" / f"run_seed{k}"
        assert yaml.safe_load((out / "config.yaml").read_text())["train_seed"] == k
        gates[k], _ = T.load_gates(out / "gates.safetensors")
        alone, _ = T.load_gates(tmp_path / f"alone{k}" / "run" / "gates.safetensors")
        assert torch.equal(gates[k]["theta"], alone["theta"]) and torch.equal(gates[k]["beta"], alone["beta"])
        alone_route = Route.from_file(tmp_path / f"alone{k}" / "run" / "route.json")
        assert Route.from_file(out / "route.json").layers == alone_route.layers
    assert not torch.equal(gates[0]["beta"], gates[2]["beta"])  # the seed reached the optimisation
    assert "run_seed0" in capsys.readouterr().err

    # bad seeds, or a later seed's folder that holds another run: one error, before any training
    made.clear()
    for extra, match in (((), "train_seed=1 and --seeds"), (("train_seed=null",), "more than once")):
        cfg = write_config(tmp_path / "both", tiny_dir, steps=3, save_every=3, train_seed=1)
        with pytest.raises(SystemExit) as e:
            train(cfg, "--seeds", "3,3", *extra)
        assert e.value.code == 2 and match in capsys.readouterr().err
    cfg = write_config(tmp_path / "both", tiny_dir, steps=3, save_every=3)
    with pytest.raises(SystemExit):
        train(cfg, "--seeds", "5,2", "lr=0.5")
    err = capsys.readouterr().err
    assert "run_seed2 holds a run with a different config (differs in: lr" in err
    assert made == [] and not (tmp_path / "both" / "run_seed5").exists()
    with pytest.raises(SystemExit):
        train(cfg, "--seeds", "0 1")
    assert "e.g. --seeds 0,1,2; got '0 1'" in capsys.readouterr().err


def test_seeds_chain_a_first_stage_seed_by_seed(tiny_dir, tmp_path, monkeypatch, capsys):
    """`init_route=<first>_seed{seed}/route.json --seeds 0,2`: each seed starts from its own
    first-stage route and trains what a lone run given that file trains; a seed whose route
    is missing is named in one error, before any prefill."""
    first = tmp_path / "first"
    first.mkdir()
    stage1 = write_config(first, tiny_dir, steps=2, save_every=2, learn="budgets", init_method="tova",
                          select="last", lr=0.5)  # select the last step, so that the seeds' routes differ
    assert train(stage1, "--seeds", "0,2") == 0
    routes = {k: first / f"run_seed{k}" / "route.json" for k in (0, 2)}
    assert Route.from_file(routes[0]).layers != Route.from_file(routes[2]).layers  # the two starts differ
    second = tmp_path / "second"
    second.mkdir()
    template = str(first / "run_seed{seed}" / "route.json")
    over = dict(steps=2, save_every=2, learn="budgets", init_method="tova", init_route=template)
    assert train(write_config(second, tiny_dir, **over), "--seeds", "0,2") == 0
    alone = tmp_path / "alone"
    alone.mkdir()
    assert train(write_config(alone, tiny_dir, **{**over, "init_route": str(routes[2]), "train_seed": 2})) == 0
    out = second / "run_seed2"
    assert yaml.safe_load((out / "config.yaml").read_text())["init_route"] == str(routes[2])
    chained, _ = T.load_gates(out / "gates.safetensors")
    reference, _ = T.load_gates(alone / "run" / "gates.safetensors")
    assert torch.equal(chained["beta"], reference["beta"])
    assert Route.from_file(out / "route.json").layers == Route.from_file(alone / "run" / "route.json").layers

    made = []
    real = Engine.prefill
    monkeypatch.setattr(Engine, "prefill", lambda *a, **k: made.append(1) or real(*a, **k))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train(write_config(second, tiny_dir, **over), "--seeds", "0,7", "output=" + str(second / "other"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "seed 7: init_route" in err and "run_seed7" in err and "seed 0" not in err
    assert made == [] and not (second / "other_seed0").exists()


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_dir, tmp_path, monkeypatch):
    cfg = write_config(tmp_path, tiny_dir)
    real = T.answer_loss
    calls = {"n": 0}

    def goes_nan(*a, **k):
        loss, ce = real(*a, **k)
        calls["n"] += 1
        return (loss * float("nan"), ce) if calls["n"] > 3 * 2 else (loss, ce)

    monkeypatch.setattr(T, "answer_loss", goes_nan)
    with pytest.raises(T.TrainingError, match=r"NaN/inf at step 3 .*step_000002.safetensors"):
        T.run_train(load_config(T.TrainConfig, cfg), progress=False)
    ckpt, _ = T.load_gates(tmp_path / "run" / "checkpoints" / "step_000002.safetensors")
    assert bool(torch.isfinite(ckpt["theta"]).all())
    assert not (tmp_path / "run" / "checkpoints" / "step_000004.safetensors").exists()


def test_two_processes_train_like_one(tiny_dir, tmp_path):
    """accelerate data parallelism: 2 CPU processes split each step's batch and average
    gradients, ending where one process does (up to float summation order)."""
    cfg = write_config(tmp_path, tiny_dir, val_fraction=0.0, steps=4)
    assert train(cfg) == 0
    one, _ = T.load_gates(tmp_path / "run" / "gates.safetensors")
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", str(Path(__file__).parents[1] / "train" / "gates.py"),
         "--config", str(cfg), f"output={tmp_path / 'two'}"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two, _ = T.load_gates(tmp_path / "two" / "gates.safetensors")
    torch.testing.assert_close(two["theta"], one["theta"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(two["beta"], one["beta"], rtol=1e-4, atol=1e-5)
    assert not torch.equal(one["theta"], torch.zeros_like(one["theta"]))  # it did train


def test_seeds_under_torchrun_shard_each_run_across_the_ranks(tiny_dir, tmp_path):
    """`torchrun --nproc_per_node 2 ... train --seeds 0,1`: each seed's run is one run over
    two ranks (each history row written once, by rank 0), ending where one process does."""
    cfg = write_config(tmp_path, tiny_dir, val_fraction=0.0, steps=3, save_every=3)
    assert train(cfg, "--seeds", "0,1") == 0
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", str(Path(__file__).parents[1] / "train" / "gates.py"),
         "--config", str(cfg), "--seeds", "0,1", f"output={tmp_path / 'two'}"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k in (0, 1):
        steps = [r["step"] for r in read_jsonl(tmp_path / f"two_seed{k}" / "history.jsonl") if "loss" in r]
        assert steps == [1, 2, 3]
        one, _ = T.load_gates(tmp_path / f"run_seed{k}" / "gates.safetensors")
        two, _ = T.load_gates(tmp_path / f"two_seed{k}" / "gates.safetensors")
        torch.testing.assert_close(two["beta"], one["beta"], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    cfg = write_config(tmp, tiny_dir, steps=8, lr=0.2, select="last")
    assert train(cfg) == 0
    return tmp / "run"


def test_export_hardened_and_mixture_routes(trained, tiny, tokenizer, tmp_path):
    hard = export_cli(trained, tmp_path / "hard.json", budget="50")
    assert sum(hard.budgets) == 4 * 50 and all(isinstance(b, int) for b in hard.budgets)
    prov = hard.provenance
    assert prov["source"] == "learned" and prov["calibration_tasks"] == {"niah_single_1": 4}
    assert len(prov["pi"]) == 4 and len(prov["budget_shares"]) == 4 and "train_config" in prov
    frac = export_cli(trained, tmp_path / "frac.json")
    assert frac.budgets[0] <= 1.0 and sum(frac.budgets) == pytest.approx(4 * 0.25, rel=1e-4)
    # A mixture at a vanishing temperature is one-hot: same tokens, same answers as hardened.
    mix = export_cli(trained, tmp_path / "mix.json", budget="50", mixture=True, temperature=1e-4)
    assert mix.is_mixture and Route.from_file(tmp_path / "mix.json").is_mixture
    engine = Engine(tiny, tokenizer, max_new_tokens=8)
    s = make_samples("niah_single_2", tokenizer, 1, 200, "eval")[0]
    a, b = engine.run(s.context, s.question, [hard, mix], s.answer_prefix, keep_logits=True)
    assert a.token_ids == b.token_ids and a.kept_per_layer == b.kept_per_layer
    torch.testing.assert_close(a.first_logits, b.first_logits)
    # A soft mixture is a different route (it mixes the ranks of several methods).
    soft = export_cli(trained, tmp_path / "soft.json", budget="50", mixture=True, temperature=100.0)
    assert all(len(e.mixture) == 4 for e in soft.layers)
    # Read off the checkpoint file itself (safetensors, not learnroute's loader): each layer's
    # method is its argmax over theta, and its budget follows beta's order across layers.
    from safetensors.torch import load_file

    raw = load_file(str(trained / "gates.safetensors"))
    methods = yaml.safe_load((trained / "config.yaml").read_text())["methods"]
    assert [e.method for e in hard.layers] == [methods[int(i)] for i in raw["theta"].reshape(4, -1).argmax(-1)]
    beta = raw["beta"].reshape(4).tolist()
    for i in range(4):
        for j in range(4):
            if beta[i] > beta[j] + 1e-3:
                assert hard.budgets[i] >= hard.budgets[j], (i, j, beta, hard.budgets)
    # The exported routes load in bench and RoutedPress.
    assert main(["export", str(trained), "--out", str(tmp_path / "cli.json"), "--budget", "0.5"]) == 0
    lr.RoutedPress(Route.from_file(tmp_path / "cli.json"))


def test_exported_route_runs_in_bench(trained, tiny_dir, tmp_path):
    from learnroute.bench import BenchConfig, run_bench

    export_cli(trained, tmp_path / "r.json", budget="40")
    cfg = load_config(
        BenchConfig,
        overrides=[f"model={tiny_dir}", "tasks={niah_single_1: 1}", "context_tokens=200", "budgets=[30]",
                   f"routes=[{tmp_path / 'r.json'}]", "max_new_tokens=3", f"output={tmp_path / 'bench'}"],
    )
    run_bench(cfg)
    rows = read_jsonl(tmp_path / "bench" / "results.jsonl")
    assert len(rows) == 1 and rows[0]["kv_bytes"] > 0


def test_export_start_writes_the_untrained_route_a_warm_run_began_from(tiny_dir, tiny, tokenizer, tmp_path):
    """`export --start`: the control a learned route is benched beside. From uniform budgets
    over tova it is homogeneous tova, at the first training budget or the one asked for."""
    cfg = write_config(tmp_path, tiny_dir, steps=2, learn="budgets", init_method="tova", lr=0.5, eval_every=2)
    assert train(cfg) == 0
    assert main(["export", str(tmp_path / "run"), "--start", "--out", str(tmp_path / "start.json")]) == 0
    assert main(["export", str(tmp_path / "run"), "--start", "--budget", "40", "--out", str(tmp_path / "s40.json")]) == 0
    start, s40 = Route.from_file(tmp_path / "start.json"), Route.from_file(tmp_path / "s40.json")
    assert start.provenance["source"] == "start" and s40.budgets == [40] * 4
    engine = Engine(tiny, tokenizer, max_new_tokens=6)
    s = make_samples("niah_single_2", tokenizer, 1, 200, "eval")[0]
    routes = [start, Route.homogeneous("tova", 4, 0.25), s40, Route.homogeneous("tova", 4, 40)]
    a, b, c, d = engine.run(s.context, s.question, routes, s.answer_prefix, keep_logits=True)
    for ours, ref in ((a, b), (c, d)):  # the same kept tokens: the same logits, bit for bit
        assert (ours.token_ids, ours.kept_per_layer) == (ref.token_ids, ref.kept_per_layer)
        assert torch.equal(ours.first_logits, ref.first_logits)
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path / "run"), "--start", "--mixture", "--out", str(tmp_path / "x.json")])
    assert exit_.value.code == 2 and not (tmp_path / "x.json").exists()


def test_export_refuses_a_checkpoint_of_another_model_or_method_set(trained, tmp_path):
    with pytest.raises(RouteError, match="trained on model 'tiny-llama\d*', not 'SmolLM2-135M-Instruct'"):
        export_cli(trained, tmp_path / "x.json", model="SmolLM2-135M-Instruct")
    # a run folder whose config names other methods than its checkpoint
    other = tmp_path / "other"
    other.mkdir()
    cfg = yaml.safe_load((trained / "config.yaml").read_text())
    cfg["methods"] = ["snapkv", "tova", "knorm", "h2o"]
    (other / "config.yaml").write_text(yaml.safe_dump(cfg))
    (other / "gates.safetensors").write_bytes((trained / "gates.safetensors").read_bytes())
    with pytest.raises(RouteError, match="checkpoint gates methods"):
        export_cli(other, tmp_path / "x.json")
    # and a checkpoint with another layer count is refused for the model
    with pytest.raises(RouteError, match="checkpoint has 4 layers, the model has 30"):
        T.load_gates(trained / "gates.safetensors", n_layers=30)
    with pytest.raises(FileNotFoundError, match="neither a train run folder nor a gates checkpoint"):
        export_cli(tmp_path / "missing", tmp_path / "x.json")
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(trained), "--out", str(tmp_path / "x.json"), "--budget", "0"])
    assert exit_.value.code == 2 and not (tmp_path / "x.json").exists()


def test_bad_train_config_is_one_error_before_any_model_loads(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(
            T.TrainConfig,
            overrides=["methods=[snapkv, nosuch, critical_snapkv, full]", "budgets=[]", "steps=0",
                       "mixing=blend", "relaxation=magic", "learn=budgets", "init_method=null"],
        )
    msg = str(e.value)
    for part in ("'nosuch' cannot be a gate candidate (unknown)", "'critical_snapkv' cannot be a gate candidate",
                 "'full' cannot", "budgets is empty", "steps must be >= 1", "mixing: expected one of 'score', 'mask', got 'blend'",
                 "relaxation: expected one of 'sigmoid', 'sinkhorn'", "learn=budgets keeps the methods fixed"):
        assert part in msg, part
    with pytest.raises(ConfigError, match="not below context_tokens"):
        load_config(T.TrainConfig, overrides=["budgets=[4096]", "context_tokens=1024"])
    with pytest.raises(ConfigError, match="config file .* does not exist"):
        load_config(T.TrainConfig, tmp_path / "nope.yaml")


def test_mixture_route_in_kvpress_pipeline_equals_the_engine(tiny, tokenizer, sample):
    """A soft mixture route (several methods per layer) keeps the same tokens in RoutedPress
    as in the engine; and it is not just its argmax method (the mixture changes the answer's
    logits)."""
    from transformers import pipeline

    mixes = [{"snapkv": 0.5, "knorm": 0.5}, {"tova": 0.2, "keydiff": 0.8}, {"knorm": 1.0}, {"h2o": 0.6, "tova": 0.4}]
    methods = [max(m, key=m.get) for m in mixes]
    route = Route.from_layers(methods, [40, 0.3, 60, 0.5], mixtures=mixes)
    engine = Engine(tiny, tokenizer, max_new_tokens=6)
    res, hard = engine.run(sample.context, sample.question, [route, route.hardened()], sample.answer_prefix,
                           keep_logits=True)
    assert not torch.allclose(res.first_logits, hard.first_logits)
    pipe = pipeline("kv-press-text-generation", model=tiny, tokenizer=tokenizer, device="cpu")
    with lr.routed_attention(tiny):
        got = pipe(sample.context, question=sample.question, answer_prefix=sample.answer_prefix,
                   press=lr.RoutedPress(route), max_new_tokens=6)["answer"]
    assert got == res.answer


def test_budget_scaled_temperature_is_as_sharp_at_small_budgets():
    """topk_scale=budget: a layer keeping 5 of 1000 tokens keeps them almost fully (the
    rank-unit temperature smears them over dozens of tokens), and the sums stay exact."""
    gates = Gates(["tova", "knorm"], [True, True], budget_floor=0.0)
    with torch.no_grad():
        gates.beta.copy_(torch.tensor([0.0, 3.0]))  # layer 0 keeps ~5 tokens, layer 1 the rest
    ranks = torch.stack([torch.randperm(1000).float() / 999 for _ in range(2 * 2 * 3)]).view(2, 2, 3, 1000)
    k = gates.budgets(50.0, 1000).detach()
    assert 3 < float(k[0]) < 10
    top = ranks[0].mean(0).topk(int(k[0]), dim=-1).indices  # (H, k0): what the hard route keeps
    kept = {}
    for scale, tau in (("rank", 0.02), ("budget", 0.05)):
        m = gates.soft_masks(ranks, 50.0, temperature=1.0, tau=tau, tau_scale=scale).detach()
        torch.testing.assert_close(m.sum(-1), k[:, None].expand(2, 3), rtol=1e-4, atol=1e-4)
        kept[scale] = float(m[0].gather(-1, top).mean())
    # rank units smear the few kept tokens; budget units keep them almost whole
    assert kept["budget"] > 0.9 and kept["rank"] < kept["budget"] - 0.2, kept


# ---------------------------------------------------------------------------- validated = benched


def _kept_sets(masks: torch.Tensor) -> list[list[set[int]]]:
    """Per (layer, head) the kept positions of 0/1 masks (L, H, n)."""
    return [[set(torch.nonzero(masks[layer, h]).flatten().tolist()) for h in range(masks.shape[1])]
            for layer in range(masks.shape[0])]


@pytest.mark.parametrize("learn, granularity", [("budgets", "layer"), ("both", "layer"), ("both", "head")])
def test_validation_keeps_the_tokens_the_engine_keeps_for_the_exported_route(tiny_dir, tmp_path, learn, granularity):
    """The route validation scores is the route users run: for a trained run, the kept
    positions per (layer, KV head) that validation uses equal those the Engine keeps for
    the exported route.json, rescaled by bench, at a fractional budget (0.2), a token
    budget (50) and a budget where layers hit the whole context (0.6). Per-head gates
    export a per-head route whose heads the engine keeps one by one."""
    from learnroute.bench import BenchConfig, resolve_routes
    from learnroute.gates.export import chosen_checkpoint, gates_from_checkpoint
    from learnroute.models import load_model
    from learnroute.profile import teacher_forcing
    from learnroute.tasks.suite import load_tasks

    shape = tmp_path / "shape.json"
    Route.from_layers(["tova"] * 4, [0.05, 0.05, 0.4, 0.3]).to_file(shape)  # mean 0.2; layer 2 at 2x the mean
    budgets = [0.2, 50, 0.6]
    cfg = write_config(tmp_path, tiny_dir, budgets=budgets, steps=3, eval_every=1, learn=learn, init_route=str(shape),
                       init_method="tova" if learn == "budgets" else None, lr=0.2, granularity=granularity,
                       select="last" if granularity == "head" else "best_val")  # head: trained, so heads differ
    assert train(cfg) == 0
    run = tmp_path / "run"
    config = load_config(T.TrainConfig, run / "config.yaml")
    assert export_cli(run, tmp_path / "exported.json") == Route.from_file(run / "route.json")

    model, tok = load_model(str(tiny_dir))
    engine = Engine(model, tok)
    gates, _ = gates_from_checkpoint(chosen_checkpoint(run, config.select), config, None, 4)
    validated = T.validation_routes(gates, config)
    benched = {c.budget: c.route for c in resolve_routes(
        BenchConfig(routes=[str(run / "route.json")], budgets=budgets), 4, None)}
    assert max(benched[0.6].budgets) == 1.0  # the capped case is exercised
    assert all(isinstance(b, int) for b in benched[50].budgets)
    (task, sample), = load_tasks({"niah_single_1": 1}, tok, config.context_tokens, "calibration", 7)
    item = C.prepare_item(engine, task, sample, config.methods, False)
    prefill = engine.prefill(teacher_forcing(engine, sample).prompt)
    n = prefill.n_tokens
    assert benched[0.2].is_per_head == (granularity == "head")
    if granularity == "head":  # the heads learned budgets of their own
        assert any(len({h.budget for h in e.heads}) > 1 for e in benched[0.2].layers)
    for b in budgets:
        ours = _kept_sets(gates.hard_masks(item.ranks, validated[b]))
        route = benched[b]
        counts = engine.kept_head_counts(route, n, prefill.layer_tokens)
        for layer, e in enumerate(route.layers):
            kept = [set(engine.kept_indices(prefill, layer, x.method, k, x.mixture)[0, h].tolist())
                    for h, (x, k) in enumerate(zip(e.head_entries(2), counts[layer]))]  # each head's own
            assert kept == ours[layer], (b, layer)


def _one_sample(tok, n_tokens=200):
    from learnroute.tasks.suite import load_tasks

    (_, sample), = load_tasks({"niah_single_1": 1}, tok, n_tokens, "calibration", 3)
    return sample


def test_fixed_route_masks_keep_what_the_engine_keeps(tiny_dir):
    """learn: none trains against its route's hard masks: the same token counts (the
    engine floors a fraction of the context; rounding kept one more token before) and the
    same positions as the Engine."""
    from learnroute.gates.cotrain import FixedGates
    from learnroute.models import load_model

    model, tok = load_model(str(tiny_dir))
    engine = Engine(model, tok)
    methods = ["snapkv", "tova", "knorm", "streaming_llm"]
    route = Route.from_layers(["snapkv", "tova", "knorm", "streaming_llm"], [0.1, 0.3, 0.2, 0.2],
                              mixtures=[None, {"tova": 0.5, "knorm": 0.5}, None, None])
    fixed = FixedGates(methods, [True] * 4, route)
    sample = _one_sample(tok)
    item = C.prepare_item(engine, "niah", sample, methods, False)
    n = item.n_tokens
    for b in (0.2, 0.237, 33):
        r = fixed.harden(b, n)
        prefill = engine.prefill(engine.encode(sample.context, sample.question, sample.answer_prefix))
        counts = engine.kept_counts(r, n)
        ours = _kept_sets(fixed.hard_masks(item.ranks, r))
        for layer, e in enumerate(r.layers):
            idx = engine.kept_indices(prefill, layer, e.method, counts[layer], e.mixture)[0]
            assert [set(row.tolist()) for row in idx] == ours[layer], (b, layer)


def test_export_follows_select_last(tiny_dir, tmp_path):
    """select: last exports the final gates, as the run's own route.json does, even when a
    best.safetensors exists (it used to be preferred silently)."""
    assert train(write_config(tmp_path, tiny_dir, steps=4, eval_every=1, select="last", lr=0.3)) == 0
    run = tmp_path / "run"
    assert (run / "best.safetensors").is_file()
    exported = export_cli(run, tmp_path / "out.json")
    assert exported.provenance["checkpoint"].endswith("gates.safetensors")
    assert exported == Route.from_file(run / "route.json")


def test_first_token_weight_zero_with_a_one_token_answer_is_finite(tiny_dir):
    from learnroute.models import load_model

    model, tok = load_model(str(tiny_dir))
    engine = Engine(model, tok)
    item = C.prepare_item(engine, "niah", _one_sample(tok), ["tova", "knorm"], False)
    one = C.CalibItem(item.sample_id, item.task, item.kv, item.ranks, item.ids[:, : item.keep.start + 2],
                      item.positions[:, : item.keep.start + 2], slice(item.keep.start, item.keep.start + 1),
                      item.target[:1], None)
    gates = Gates(["tova", "knorm"], [True] * 4)
    masks = gates.soft_masks(one.ranks, 0.3 * one.n_tokens, temperature=1.0, tau=0.05)
    loss, ce = T.answer_loss(model, one, masks, eps=1e-6, first_token_weight=0.0)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.isfinite(gates.beta.grad).all()


def test_calibration_prefills_are_released_after_a_run(tiny_dir, tmp_path, monkeypatch):
    """A run given no calibration store keeps no calibration cache alive once it returns
    (a study's bench and placement stages used to carry every one in memory)."""
    import gc
    import weakref

    refs = []
    real = C.prepare_item

    def spy(*a, **k):
        item = real(*a, **k)
        refs.append(weakref.ref(item.kv[0][0]))
        return item

    monkeypatch.setattr(C, "prepare_item", spy)
    assert train(write_config(tmp_path, tiny_dir, steps=2)) == 0
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_init_route_shape_is_read_over_the_compressible_layers(tmp_path):
    """A fixed (never compressed) layer's nominal budget is not part of the shape: the
    warm start reproduces the free layers' budgets at their own mean."""
    path = tmp_path / "shape.json"
    Route.from_layers(["tova"] * 4, [0.1, 0.9, 0.2, 0.3]).to_file(path)  # layer 1 fixed; free mean 0.2
    cfg = T.TrainConfig(methods=["tova", "keydiff"], init_route=str(path), learn="budgets", budget_floor=0.05)
    gates = T.build_gates(cfg, 4, [True, False, True, True])
    got = gates.harden(0.2, 1000).budgets
    assert [got[i] for i in (0, 2, 3)] == pytest.approx([0.1, 0.2, 0.3], rel=1e-5)


# ---------------------------------------------------------------------------- the calibration stream


def test_stream_draws_fresh_calibration_samples_resumably(tiny_dir, tmp_path, monkeypatch):
    """stream: every step trains on fresh calibration samples (never a validation sample,
    never the eval split), drawn from the seed, so a run interrupted and resumed ends with
    the gates of an uninterrupted one; stream_pool reuses the pool's prefills."""
    seen = []
    real_item = C.prepare_item

    def spy(engine, task, sample, *a, **k):
        seen.append(sample)
        return real_item(engine, task, sample, *a, **k)

    monkeypatch.setattr(C, "prepare_item", spy)
    over = dict(tasks={"niah_single_1": 2, "niah_multikey": 2}, val_fraction=0.5, stream=2, steps=4, save_every=2)
    (tmp_path / "a").mkdir()
    assert train(write_config(tmp_path / "a", tiny_dir, **over)) == 0
    split = json.loads((tmp_path / "a" / "run" / "split.json").read_text())
    val, fresh = set(split["val"]), [s for s in seen if s.id not in split["val"]]
    assert len(val) == 2 and len(fresh) == 4 * 2 and len({s.id for s in fresh}) == 8  # 2 new per step
    assert all(s.split == "calibration" for s in seen) and not val & {s.id for s in fresh}
    assert {s.task for s in fresh} <= {"niah_single_1", "niah_multikey"}

    (tmp_path / "b").mkdir()
    real_loss, calls = T.answer_loss, {"n": 0}

    def dies(*a, **k):
        calls["n"] += 1
        if calls["n"] > 2 * 2 + 2:  # validation at step 0 (2 items), steps 1-2 (2 each); step 3 dies
            raise KeyboardInterrupt
        return real_loss(*a, **k)

    monkeypatch.setattr(T, "answer_loss", dies)
    with pytest.raises(KeyboardInterrupt):
        train(write_config(tmp_path / "b", tiny_dir, **over))
    monkeypatch.setattr(T, "answer_loss", real_loss)
    assert train(write_config(tmp_path / "b", tiny_dir, **over)) == 0
    a, _ = T.load_gates(tmp_path / "a" / "run" / "gates.safetensors")
    b, _ = T.load_gates(tmp_path / "b" / "run" / "gates.safetensors")
    assert torch.equal(a["theta"], b["theta"]) and torch.equal(a["beta"], b["beta"])

    seen.clear()
    (tmp_path / "c").mkdir()
    assert train(write_config(tmp_path / "c", tiny_dir, **{**over, "stream": 1, "stream_pool": 4, "batch_size": 3})) == 0
    assert len([s for s in seen if s.id not in split["val"]]) == 4  # one new prefill per step, the pool reused


def test_stream_settings_are_checked():
    with pytest.raises(ConfigError, match="stream_pool needs stream"):
        load_config(T.TrainConfig, overrides=["stream_pool=4"])
    with pytest.raises(ConfigError, match="must hold at least one step"):
        load_config(T.TrainConfig, overrides=["stream=4", "stream_pool=2"])


def test_val_tasks_validate_on_held_out_families(tiny_dir, tmp_path):
    """val_tasks: the step is chosen on other families' calibration samples; every sample
    of tasks trains."""
    assert train(write_config(tmp_path, tiny_dir, tasks={"niah_single_1": 3}, val_tasks={"niah_multikey": 2},
                              steps=2, eval_every=1)) == 0
    split = json.loads((tmp_path / "run" / "split.json").read_text())
    assert [i.split("/")[0] for i in split["val"]] == ["niah_multikey"] * 2
    assert len(split["train"]) == 3 and all(i.startswith("niah_single_1/calibration/") for i in split["train"])
    assert len([r for r in read_jsonl(tmp_path / "run" / "history.jsonl") if "val_ce" in r]) == 3  # steps 0, 1, 2


def test_train_run_saved_before_the_stream_keys_existed_resumes(tmp_path):
    """A run folder whose config.yaml predates stream, stream_pool and val_tasks resumes
    (a missing key reads as its default); a saved value that differs still refuses."""
    from learnroute.config import to_dict
    from learnroute.runs import prepare_folder

    config = T.TrainConfig(output=str(tmp_path / "run"))
    saved = to_dict(config)
    for key in ("stream", "stream_pool", "val_tasks"):
        saved.pop(key)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(saved))
    prepare_folder(config, overwrite=False, is_main=True)
    saved["stream"] = 3
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="differs in: stream"):
        prepare_folder(config, overwrite=False, is_main=True)


def test_share_divergence_is_kl_from_uniform():
    """KL(u || s) = mean_l log(u_l / s_l), computed by hand; 0 at uniform shares, and its
    gradient pulls a starved layer's logit up."""
    gates = Gates(["tova", "knorm"], [True, True, False, True])
    assert float(gates.share_divergence().detach()) == pytest.approx(0.0, abs=1e-7)
    with torch.no_grad():
        gates.beta.copy_(torch.tensor([2.0, 0.0, 5.0, -3.0]))
    e = [2.718281828 ** x for x in (2.0, 0.0, -3.0)]  # layer 2 is fixed: no share
    s = [x / sum(e) for x in e]
    want = sum(__import__("math").log((1 / 3) / x) for x in s) / 3
    d = gates.share_divergence()
    assert float(d.detach()) == pytest.approx(want, rel=1e-5)
    d.backward()
    assert float(gates.beta.grad[3]) < 0  # gradient descent raises the starved layer's logit


def test_two_stages_train_what_the_two_runs_by_hand_train(tiny_dir, tmp_path):
    """`stages: two` is the 4k recipe the studies ran as two commands: per-layer budgets into
    <output>/first_stage, then per-head budgets from its route with its layer totals fixed.
    One command gives the same routes as the two by hand, and each layer keeps the first
    stage's total; `auto` picks it from the context length; a recipe it cannot split is
    refused with why, before anything runs."""
    from learnroute.gates.config import TWO_STAGES_FROM_TOKENS, TrainConfig, resolved_stages

    common = dict(learn="budgets", init_method="tova", granularity="head", steps=2, save_every=2, select="last",
                  lr=0.5, budgets=[0.25])
    one = tmp_path / "one"
    one.mkdir()
    assert train(write_config(one, tiny_dir, **common, stages="two")) == 0
    hand = tmp_path / "hand"
    hand.mkdir()
    assert train(write_config(hand, tiny_dir, **{**common, "granularity": "layer"}, output=str(hand / "s1"))) == 0
    (hand / "b").mkdir()
    assert train(write_config(hand / "b", tiny_dir, **common, layer_totals="fixed",
                              init_route=str(hand / "s1" / "route.json"), output=str(hand / "s2"))) == 0
    first, second = Route.from_file(one / "run" / "first_stage" / "route.json"), Route.from_file(one / "run" / "route.json")
    assert not first.is_per_head and second.is_per_head
    assert first.layers == Route.from_file(hand / "s1" / "route.json").layers
    assert second.layers == Route.from_file(hand / "s2" / "route.json").layers
    n_heads = second.n_heads
    totals = [sum(h) for h in second.head_budgets(n_heads)]
    stage1 = [n_heads * layer[0] for layer in first.head_budgets(1)]
    assert totals == pytest.approx(stage1, rel=1e-5)  # each layer's total is stage 1's (float32 shares)
    assert train(write_config(one, tiny_dir, **common, stages="two")) == 0  # resumes: nothing to redo

    at = {n: load_config(TrainConfig, overrides=[f"context_tokens={n}"]) for n in (1024, TWO_STAGES_FROM_TOKENS)}
    assert resolved_stages(at[1024]) == 1 and resolved_stages(at[TWO_STAGES_FROM_TOKENS]) == 2
    per_layer = load_config(TrainConfig, overrides=[f"context_tokens={TWO_STAGES_FROM_TOKENS}", "granularity=layer"])
    assert resolved_stages(per_layer) == 1  # auto: a per-layer recipe has no second stage
    with pytest.raises(ConfigError, match="stages: two .* needs granularity: head"):
        load_config(TrainConfig, overrides=["stages=two", "granularity=layer"])
