"""Decode-time LoRA adapters: off during the prefill, on while decoding; trained with a route
(fixed or jointly with the gates), saved in peft's format beside the route, run by the
engine, bench and RoutedPress; bad input refused before any forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import DynamicCache

import learnroute as lr
from learnroute import _hf
from learnroute import adapter as A
from learnroute.cli import main
from learnroute.config import ConfigError, load_config
from learnroute.engine import Engine
from learnroute.gates import cotrain
from learnroute.gates import calibration as C
from learnroute.gates import train as T
from learnroute.gates.export import export_cli
from learnroute.route import Route
from learnroute.runs import read_jsonl
from tests.conftest import PER_LAYER, make_tiny

TARGETS = A.ATTENTION_TARGETS + A.MLP_TARGETS


def make_adapter(tokenizer, folder: Path, *, seed: int = 0, random_b: bool = True, base: str | None = "auto",
                 rank: int = 4, **model_kw) -> A.Adapter:
    """An adapter folder for the tiny model: LoRA init, or with random B (it changes outputs)."""
    model = lr.tiny_llama(len(tokenizer), 4, seed=0, eos_token_id=tokenizer.eos_token_id, **model_kw)
    adapter = A.Adapter.new(rank, 2 * rank, TARGETS, base_model=lr.model_name(model) if base == "auto" else base)
    torch.manual_seed(seed)
    A.attach(model, adapter)
    if random_b:
        with torch.no_grad():
            for key, p in A.trainable_params(model, adapter).items():
                if ".lora_B." in key:
                    p.normal_(0, 0.2)
    adapter.save(folder, model)
    return A.Adapter.load(folder)


def plain(model) -> bool:
    """No adapter left in the model: every projection is a plain nn.Linear again."""
    return not A.attached_names(model) and all(type(m) is torch.nn.Linear for m in model.modules()
                                                if isinstance(m, torch.nn.Linear))


def route_at() -> Route:
    return Route.from_layers(["snapkv", "tova", "knorm", "h2o"], [40, 0.3, 60, 0.5])


# ---------------------------------------------------------------------------- switching


def test_lora_at_init_gives_the_routes_answers_and_logits(tiny, tokenizer, sample, tmp_path):
    folder = tmp_path / "init.adapter"
    adapter = make_adapter(tokenizer, folder, random_b=False)
    assert all(bool((v == 0).all()) == (".lora_B." in k) for k, v in adapter.state.items())  # A random, B = 0
    route = route_at()
    engine = Engine(tiny, tokenizer, max_new_tokens=8)
    base, adapted = engine.run(sample.context, sample.question, [route, route.with_adapter(folder)],
                               sample.answer_prefix, keep_logits=True)
    assert adapted.token_ids == base.token_ids and adapted.answer == base.answer
    assert torch.equal(adapted.first_logits, base.first_logits)
    assert plain(tiny)  # the engine detached what it attached


def test_prefill_is_bit_identical_with_an_adapter_loaded_and_on(tiny, tokenizer, sample, tmp_path):
    adapter = make_adapter(tokenizer, tmp_path / "a")
    engine = Engine(tiny, tokenizer, max_new_tokens=4)
    prompt = engine.encode(sample.context, sample.question, sample.answer_prefix)
    ref = engine.prefill(prompt)
    A.attach(tiny, adapter)
    try:
        A.set_active(tiny, adapter)  # even switched on by the user, the prefill runs without it
        got = engine.prefill(prompt)
        with torch.no_grad():
            on = tiny(prompt.context_ids).logits
        A.set_active(tiny, None)
        with torch.no_grad():
            off = tiny(prompt.context_ids).logits
    finally:
        A.detach(tiny, adapter)
    assert plain(tiny)
    for a, b in zip(ref.layers, got.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert not torch.allclose(on, off, atol=1e-3)  # the adapter is real: it changes the model when on


def test_routes_are_batched_by_adapter_and_decode_with_it(tiny, tokenizer, sample, tmp_path):
    """Three same-shape routes (no adapter, adapter a, adapter b) in one call give what each
    gives alone; a route's adapter is on while decoding: its first logits are peft's own
    PeftModel over a DynamicCache of the kept tokens."""
    from peft import PeftModel

    fa, fb = tmp_path / "a", tmp_path / "b"
    make_adapter(tokenizer, fa, seed=1)
    make_adapter(tokenizer, fb, seed=2)
    route = route_at()
    routes = [route, route.with_adapter(fa), route.with_adapter(fb), route.with_adapter(fa)]
    engine = Engine(tiny, tokenizer, max_new_tokens=6)
    together = engine.run(sample.context, sample.question, routes, sample.answer_prefix, keep_logits=True)
    for r, got in zip(routes, together):
        alone = engine.run(sample.context, sample.question, [r], sample.answer_prefix, keep_logits=True)[0]
        assert got.token_ids == alone.token_ids
        torch.testing.assert_close(got.first_logits, alone.first_logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(together[1].first_logits, together[0].first_logits, atol=1e-3)
    assert not torch.allclose(together[1].first_logits, together[2].first_logits, atol=1e-3)
    assert torch.equal(together[1].first_logits, together[3].first_logits)
    # Reference: peft's own loader on a fresh copy, over transformers' cache of the kept tokens.
    prompt = engine.encode(sample.context, sample.question, sample.answer_prefix)
    pre = engine.prefill(prompt)
    counts = engine.kept_counts(route, pre.n_tokens, pre.layer_tokens)
    cache = DynamicCache(config=tiny.config)
    for layer, k in enumerate(counts):
        idx = engine.kept_indices(pre, layer, route.layers[layer].method, k)
        cap = pre.layers[layer]
        g = idx.unsqueeze(-1).expand(-1, -1, -1, cap.keys.shape[-1])
        cache.update(cap.keys.gather(2, g), cap.values.gather(2, g), layer)
    n, q = pre.n_tokens, prompt.question_ids.shape[1]
    peft_model = PeftModel.from_pretrained(make_tiny(tokenizer), str(fa))
    with torch.no_grad(), lr.routed_attention(peft_model.base_model.model):
        ref = peft_model(input_ids=prompt.question_ids, past_key_values=cache,
                         position_ids=torch.arange(n, n + q).unsqueeze(0)).logits[0, -1]
    torch.testing.assert_close(together[1].first_logits, ref, rtol=1e-4, atol=1e-4)
    assert plain(tiny)


def test_routed_press_runs_the_adapter_for_decoding_only(tiny, tokenizer, sample, tmp_path):
    from transformers import pipeline

    folder = tmp_path / "a"
    make_adapter(tokenizer, folder)
    route = route_at().with_adapter(folder)
    path = route.to_file(tmp_path / "routes" / "r.json")
    loaded = Route.from_file(path)
    assert loaded.provenance["adapter"] == "../a" and loaded.adapter_path.resolve() == folder.resolve()
    res, base = Engine(tiny, tokenizer, max_new_tokens=6).run(
        sample.context, sample.question, [loaded, route_at()], sample.answer_prefix
    )
    assert res.token_ids != base.token_ids  # the random adapter changes the answer
    pipe = pipeline("kv-press-text-generation", model=tiny, tokenizer=tokenizer, device="cpu")
    press = lr.RoutedPress(loaded)
    with pytest.raises(lr.RouteError, match="names the adapter .* on for decoding.*press.scope"):
        pipe(sample.context, question=sample.question, press=press, max_new_tokens=6)
    with press.scope(tiny):
        got = pipe(sample.context, question=sample.question, answer_prefix=sample.answer_prefix,
                   press=press, max_new_tokens=6)["answer"]
        assert A.attached_names(tiny)  # on for kvpress's decoding, after the press context
    assert plain(tiny)  # the scope detached it
    other = lr.RoutedPress(route_at())
    with other.scope(tiny):
        plain_answer = pipe(sample.context, question=sample.question, answer_prefix=sample.answer_prefix,
                            press=other, max_new_tokens=6)["answer"]
    assert got == res.answer and plain_answer == base.answer
    assert plain(tiny) and tiny.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------- bad input


def test_bad_adapters_are_refused_before_any_forward(tiny, tokenizer, sample, tmp_path, monkeypatch):
    engine = Engine(tiny, tokenizer, max_new_tokens=4)
    monkeypatch.setattr(_hf, "capture_prefill", lambda *a, **k: pytest.fail("a forward ran"))
    route = route_at()
    # a route naming a missing folder
    missing = route.with_adapter(tmp_path / "nope")
    with pytest.raises(A.AdapterError, match="adapter folder .*nope does not exist"):
        engine.run(sample.context, sample.question, [missing])
    with pytest.raises(A.AdapterError, match="does not exist"):
        lr.RoutedPress(missing)
    # an adapter made for a model with other shapes, and one naming another base model
    make_adapter(tokenizer, tmp_path / "wide", hidden_size=32)
    with pytest.raises(A.AdapterError, match=r"does not fit the model:\n  .*lora_A.weight: shape \(4, 64\) does not fit .* \(128 inputs\)"):
        engine.run(sample.context, sample.question, [route.with_adapter(tmp_path / "wide")])
    make_adapter(tokenizer, tmp_path / "other", base="SmolLM2-135M-Instruct")
    with pytest.raises(A.AdapterError, match="made for model 'SmolLM2-135M-Instruct', not 'tiny"):
        engine.run(sample.context, sample.question, [route.with_adapter(tmp_path / "other")])
    # a folder that is not a peft adapter
    (tmp_path / "empty").mkdir()
    with pytest.raises(A.AdapterError, match="adapter_config.json is missing"):
        engine.check_routes([route.with_adapter(tmp_path / "empty")])
    # RoutedPress checks against the model when it is applied, before the prefill
    press = lr.RoutedPress(route.with_adapter(tmp_path / "wide"))
    with pytest.raises(A.AdapterError, match="does not fit"), press(tiny):
        pytest.fail("the press context opened")
    assert plain(tiny)
    # bench: a route file naming a missing folder is a config error, before any model loads
    from learnroute.bench import BenchConfig

    missing.to_file(tmp_path / "m.json")
    with pytest.raises(ConfigError, match="names adapter folder .*nope, which does not exist"):
        load_config(BenchConfig, overrides=[f"routes=[{tmp_path / 'm.json'}]"])


def test_bench_runs_route_files_with_their_adapters_and_refuses_another_models(tiny_dir, tokenizer, tmp_path):
    from learnroute.bench import BenchConfig, run_bench

    make_adapter(tokenizer, tmp_path / "a", base=None)
    route = route_at()
    route.to_file(tmp_path / "plain.json")
    route.with_adapter(tmp_path / "a").to_file(tmp_path / "adapted.json")
    over = [f"model={tiny_dir}", "tasks={niah_single_1: 1}", "context_tokens=200", "budgets=[30]",
            "route_file_budgets=file", "max_new_tokens=4"]
    cfg = load_config(BenchConfig, overrides=over + [f"routes=[{tmp_path / 'plain.json'}, {tmp_path / 'adapted.json'}]",
                                                     f"output={tmp_path / 'bench'}"])
    run_bench(cfg)
    rows = {Path(r["route"]).name: r for r in read_jsonl(tmp_path / "bench" / "results.jsonl")}
    assert set(rows) == {"plain.json", "adapted.json"}
    assert rows["plain.json"]["kv_bytes"] == rows["adapted.json"]["kv_bytes"]
    assert rows["plain.json"]["prediction"] != rows["adapted.json"]["prediction"]
    make_adapter(tokenizer, tmp_path / "wide", hidden_size=32, base=None)
    route.with_adapter(tmp_path / "wide").to_file(tmp_path / "wide.json")
    cfg = load_config(BenchConfig, overrides=over + [f"routes=[{tmp_path / 'wide.json'}]", f"output={tmp_path / 'b2'}"])
    with pytest.raises(A.AdapterError, match="does not fit the model"):
        run_bench(cfg)
    assert not read_jsonl(tmp_path / "b2" / "results.jsonl")


# ---------------------------------------------------------------------------- training


def write_config(tmp_path: Path, model_dir, **over) -> Path:
    cfg = {
        "model": str(model_dir),
        "tasks": {"niah_single_1": 4},
        "context_tokens": 200,
        "methods": ["snapkv", "tova", "knorm", "streaming_llm"],
        "budgets": [0.2],
        "steps": 8,
        "batch_size": 3,
        "eval_every": 4,
        "save_every": 4,
        "adapter": True,
        "lora_rank": 4,
        "lora_targets": TARGETS,
        "adapter_lr": 0.01,
        "output": str(tmp_path / "run"),
        **PER_LAYER,
    }
    cfg.update(over)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def fixed_run(tiny_dir, tmp_path_factory):
    """The adapter trained for a fixed homogeneous route (learn=none), 8 steps."""
    tmp = tmp_path_factory.mktemp("fixed")
    assert main(["train", "--config", str(write_config(tmp, tiny_dir, learn="none", init_method="snapkv",
                                                         select="last"))]) == 0
    return tmp / "run"


def test_training_for_a_fixed_route_lowers_its_loss(fixed_run):
    losses = [r["loss"] for r in read_jsonl(fixed_run / "history.jsonl") if "loss" in r]
    assert len(losses) == 8
    # Every step sees the same 3 training samples, so losses are comparable (a random tiny
    # model: CE starts near ln(vocab) = 10.8; 8 steps of rank 4 took off 0.65 when written).
    assert losses[-1] < losses[0] - 0.3, losses
    vals = [r["val_ce"] for r in read_jsonl(fixed_run / "history.jsonl") if "val_ce" in r]
    assert len(vals) == 3 and vals[-1] < vals[0]  # steps 0 (= the route without adapter), 4, 8
    tensors, _ = T.load_gates(fixed_run / "checkpoints" / "step_000008.safetensors")
    assert cotrain.has_adapter(tensors) and any(k.startswith("opt.lora.") for k in tensors)  # resumable


def test_exported_adapter_reloads_to_the_training_logits(fixed_run, tiny_dir, tmp_path):
    """route.json + route.adapter/ side by side; reloaded from the folder, the adapter gives
    the validation CE the run logged at its last step (same masks, same weights), and the
    engine runs the exported route with it."""
    from learnroute.models import load_model
    from learnroute.tasks.suite import load_tasks

    route = Route.from_file(fixed_run / "route.json")
    assert route.provenance["adapter"] == "route.adapter"
    assert route.provenance["adapter_trained_for"] == "homogeneous" and route.methods == ["snapkv"] * 4
    assert (fixed_run / "route.adapter" / "adapter_config.json").is_file()
    assert (fixed_run / "route.adapter" / "adapter_model.safetensors").is_file()
    config = load_config(T.TrainConfig, fixed_run / "config.yaml")
    model, tok = load_model(str(tiny_dir))
    engine = Engine(model, tok, max_new_tokens=4)
    split = json.loads((fixed_run / "split.json").read_text())
    pairs = load_tasks(config.tasks, tok, config.context_tokens, "calibration", config.seed)
    val = [C.prepare_item(engine, t, s, config.methods, False) for t, s in pairs if s.id in split["val"]]
    gates = T.build_gates(config, 4, [True] * 4)
    logged = [r["val_ce"] for r in read_jsonl(fixed_run / "history.jsonl") if "val_ce" in r]
    with A.using(model, A.Adapter.load(fixed_run / "route.adapter")):
        again = T.validate_hard(model, gates, val, T.validation_routes(gates, config), config.eps)
    without = T.validate_hard(model, gates, val, T.validation_routes(gates, config), config.eps)
    assert again == pytest.approx(logged[-1], abs=1e-5) and without == pytest.approx(logged[0], abs=1e-5)
    assert again != pytest.approx(without, abs=1e-4)
    s = pairs[0][1]
    with_adapter, plain_route = engine.run(s.context, s.question, [route, route.with_adapter(None)], s.answer_prefix,
                                           keep_logits=True)
    assert not torch.allclose(with_adapter.first_logits, plain_route.first_logits, atol=1e-4)
    assert plain(model)
    # learnroute export writes both again, beside its output
    out = export_cli(fixed_run, tmp_path / "x" / "fixed.json", budget="30")
    assert out.budgets == [30] * 4 and Route.from_file(tmp_path / "x" / "fixed.json").adapter_path.is_dir()
    assert (tmp_path / "x" / "fixed.adapter" / "adapter_model.safetensors").is_file()


def test_joint_training_resumes_like_an_uninterrupted_run(tiny_dir, tmp_path, monkeypatch):
    """Gates and adapter together (learn=both); interrupted after step 4 and resumed, the
    gates and the adapter end bit-identical to an uninterrupted run."""
    over = {"steps": 6, "batch_size": 2, "eval_every": 3, "save_every": 2, "budgets": [0.25, 40],
            "lora_targets": ["q_proj", "v_proj"]}
    (tmp_path / "a").mkdir()
    assert main(["train", "--config", str(write_config(tmp_path / "a", tiny_dir, **over))]) == 0
    (tmp_path / "b").mkdir()
    cfg_b = write_config(tmp_path / "b", tiny_dir, **over)
    real = T.answer_loss
    calls = {"n": 0}

    def dies(*a, **k):
        calls["n"] += 1
        if calls["n"] > 4 * 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(T, "answer_loss", dies)
    with pytest.raises(KeyboardInterrupt):
        main(["train", "--config", str(cfg_b)])
    monkeypatch.setattr(T, "answer_loss", real)
    assert main(["train", "--config", str(cfg_b)]) == 0
    a, _ = T.load_gates(tmp_path / "a" / "run" / "gates.safetensors")
    b, _ = T.load_gates(tmp_path / "b" / "run" / "gates.safetensors")
    assert set(a) == set(b) and cotrain.has_adapter(a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(a["theta"], torch.zeros_like(a["theta"]))  # the gates trained
    assert any(bool(a[k].abs().sum() > 0) for k in a if k.startswith("lora.") and ".lora_B." in k)  # so did B
    route = Route.from_file(tmp_path / "a" / "run" / "route.json")
    assert route.provenance["source"] == "learned" and route.adapter_path.is_dir()


def test_bad_adapter_train_config_is_one_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(T.TrainConfig, overrides=["learn=none", "init_method=null", "lora_rank=0", "adapter_lr=0", "lora_targets=[]"])
    msg = str(e.value)
    for part in ("learn=none trains nothing but an adapter", "learn=none keeps the route fixed"):
        assert part in msg, part
    with pytest.raises(ConfigError) as e:
        load_config(T.TrainConfig, overrides=["adapter=true", "lora_rank=0", "adapter_lr=0", "lora_targets=[]"])
    for part in ("lora_rank must be >= 1", "adapter_lr must be > 0", "lora_targets must name linear modules"):
        assert part in str(e.value), part
