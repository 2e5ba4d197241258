"""bfloat16 end to end, the path GPU users take: the engine, RoutedPress in kvpress's
pipeline, the bench and a training run, each in bf16 against an independent reference in
the same dtype (kvpress's own presses) and against float32 within a stated tolerance.
The bundled model's answers in both dtypes are compared by benchmarks/bf16.py."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import pipeline

from learnroute import Engine, Route, RoutedPress
from learnroute.cli import main
from learnroute.methods import KVPRESS_METHODS
from tests.conftest import PER_LAYER, make_tiny
from tests.test_press import assert_engine_keeps_what_kvpress_keeps

ROUTES = [Route.full(4), Route.homogeneous("snapkv", 4, 0.3), Route.homogeneous("keydiff", 4, 0.3),
          Route.from_layers(["snapkv", "tova", "knorm", "h2o"], [8, 40, 0.25, 100]),
          Route.from_dict({"schema": "learnroute.route/2", "n_layers": 4, "layers": [
              {"layer": i, "heads": [{"method": "keydiff", "budget": 30 + 20 * h}, {"method": "snapkv", "budget": 60}]}
              for i, h in enumerate(range(4))]}),
          Route.adakv("keydiff", 4, 0.3)]


@pytest.fixture(scope="module")
def bf16(tokenizer):
    return make_tiny(tokenizer).to(torch.bfloat16)


def ask(pipe, sample, press):
    return pipe(sample.context, question=sample.question, answer_prefix=sample.answer_prefix, press=press,
                max_new_tokens=6)["answer"]


@pytest.mark.parametrize("method", KVPRESS_METHODS)
def test_engine_in_bf16_keeps_what_kvpress_keeps_in_bf16(bf16, tokenizer, sample, method):
    """kvpress's own press on the bf16 model keeps the engine's tokens, up to ties at the
    threshold, which bf16 scores make common (SnapKV's pooled scores): torch.topk orders
    them its own way, the engine by position."""
    assert_engine_keeps_what_kvpress_keeps(bf16, tokenizer, sample, method)


def test_mixed_and_per_head_routes_in_bf16_press_as_in_the_engine(tokenizer, sample):
    model = make_tiny(tokenizer).to(torch.bfloat16)
    engine = Engine(model, tokenizer, max_new_tokens=6)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    for route in [Route.homogeneous("snapkv", 4, 0.4), *ROUTES[3:5]]:  # RoutedPress leaves adakv to kvpress
        (res,) = engine.run(sample.context, sample.question, [route], answer_prefix=sample.answer_prefix)
        press = RoutedPress(route)
        with press.scope(model):
            assert ask(pipe, sample, press) == res.answer, route.describe()


def test_bf16_halves_the_cache_and_stays_near_float32(bf16, tiny, tokenizer, sample):
    """Half the bytes for the same tokens kept (the same counts, but where Ada-KV splits a
    layer's budget by the sample's scores); the full cache's first-token logits within bf16's
    precision of float32's (relative error under 3 %, the same greedy token)."""
    runs = {}
    for name, model in (("fp32", tiny), ("bf16", bf16)):
        runs[name] = Engine(model, tokenizer, max_new_tokens=6).run(
            sample.context, sample.question, ROUTES, answer_prefix=sample.answer_prefix, keep_logits=True)
    for a, b in zip(runs["fp32"], runs["bf16"]):
        assert b.kv_bytes * 2 == a.kv_bytes, a.route.describe()
        assert a.kept_per_layer == b.kept_per_layer or a.route is ROUTES[-1]
    full32, full16 = runs["fp32"][0].first_logits, runs["bf16"][0].first_logits.float()
    assert (full16 - full32).norm() / full32.norm() < 0.03
    assert full16.argmax() == full32.argmax()


def _train(tmp_path, tiny_dir, dtype):
    cfg = {"model": str(tiny_dir), "tasks": {"niah_single_1": 4}, "context_tokens": 200,
           "methods": ["snapkv", "tova", "keydiff"], "budgets": [0.25], "steps": 3, "batch_size": 2, "lr": 0.5,
           "eval_every": 3, "save_every": 3, "select": "last", **PER_LAYER, "learn": "budgets",
           "init_method": "tova", "dtype": dtype, "output": str(tmp_path / dtype)}
    (tmp_path / f"{dtype}.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / f"{dtype}.yaml")]) == 0
    return [json.loads(line) for line in (tmp_path / dtype / "history.jsonl").read_text().splitlines()]


def test_training_in_bf16_moves_the_gates_as_float32_does(tiny_dir, tmp_path):
    """The loss through a bf16 model is float32's to bf16 precision, and the budgets it
    learns move away from uniform (gradients reach the float32 gates)."""
    runs = {dtype: _train(tmp_path, tiny_dir, dtype) for dtype in ("float32", "bfloat16")}
    ce = {d: [r["ce"] for r in h if "ce" in r] for d, h in runs.items()}
    assert all(torch.isfinite(torch.tensor(c)).all() for c in ce.values())
    assert ce["bfloat16"][0] == pytest.approx(ce["float32"][0], rel=0.01)  # the first step: the same gates
    for dtype in runs:
        budgets = Route.from_file(tmp_path / dtype / "route.json").head_budgets(1)
        assert len({round(b[0], 4) for b in budgets}) > 1, f"{dtype}: the budgets never left uniform"


def test_bench_loads_the_model_in_the_configs_dtype(tiny_dir, tmp_path, monkeypatch):
    import learnroute.models as models

    seen = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: seen.append(k.get("dtype")) or real(*a, **k))
    cfg = {"model": str(tiny_dir), "tasks": {"niah_single_1": 1}, "context_tokens": 200, "budgets": [0.3],
           "routes": ["full", "homogeneous:keydiff"], "max_new_tokens": 2, "dtype": "bfloat16",
           "output": str(tmp_path / "bench")}
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["bench", "--config", str(tmp_path / "bench.yaml")]) == 0
    assert seen == ["bfloat16"]
    model, _ = real(tiny_dir, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
