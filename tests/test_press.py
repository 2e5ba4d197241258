import pytest
from kvpress import KnormPress, SnapKVPress, TOVAPress
from transformers import pipeline

import learnroute as lr
from learnroute import Engine, Route, RoutedPress


@pytest.fixture(scope="module")
def pipe(tiny, tokenizer):
    return pipeline("kv-press-text-generation", model=tiny, tokenizer=tokenizer, device="cpu")


def ask(pipe, sample, press, max_new_tokens=6):
    return pipe(
        sample.context, question=sample.question, answer_prefix=sample.answer_prefix,
        press=press, max_new_tokens=max_new_tokens,
    )["answer"]


@pytest.mark.parametrize(
    "method, press", [("snapkv", SnapKVPress), ("tova", TOVAPress), ("knorm", KnormPress)]
)
def test_homogeneous_routed_press_equals_the_kvpress_press(pipe, sample, method, press):
    ours = ask(pipe, sample, RoutedPress(Route.homogeneous(method, 4, 0.4)))
    theirs = ask(pipe, sample, press(compression_ratio=0.6))
    assert ours == theirs


def test_mixed_budgets_need_route_aware_attention(pipe, tiny, sample):
    press = RoutedPress(Route.from_layers(["snapkv", "tova", "knorm", "h2o"], [8, 40, 0.25, 100]))
    with pytest.raises(RuntimeError, match="routed_attention"):
        ask(pipe, sample, press)
    assert tiny.config._attn_implementation == "sdpa"


def test_mixed_route_in_kvpress_pipeline_equals_the_engine(pipe, tiny, tokenizer, sample):
    route = Route.from_layers(["snapkv", "tova", "knorm", "h2o"], [8, 40, 0.25, 100])
    with lr.routed_attention(tiny):
        ours = ask(pipe, sample, RoutedPress(route))
    engine = Engine(tiny, tokenizer, max_new_tokens=6)
    (res,) = engine.run(sample.context, sample.question, [route], answer_prefix=sample.answer_prefix)
    assert ours == res.answer
    assert tiny.config._attn_implementation == "sdpa"


def test_routed_press_refuses_a_route_for_another_model(pipe, sample):
    with pytest.raises(lr.RouteError, match="30 layers"):
        ask(pipe, sample, RoutedPress(Route.homogeneous("snapkv", 30, 0.5)))
