import pytest
from kvpress import KnormPress, SnapKVPress, TOVAPress
from transformers import pipeline

import learnroute as lr
from learnroute import Engine, Route, RoutedPress
from learnroute.methods import KVPRESS_METHODS, kvpress_press, resolve_budget


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


def kept_positions(cache_keys, full_keys):
    """Sorted positions (H_kv, k) of cached keys (1, H_kv, k, d) within full keys (1, H_kv, n, d)."""
    match = (cache_keys[0, :, :, None, :] == full_keys[0, :, None, :, :]).all(-1)  # (H_kv, k, n)
    return match.float().argmax(-1).sort(-1).values


@pytest.mark.parametrize("method", KVPRESS_METHODS)
def test_engine_keeps_the_same_tokens_as_kvpress(tiny, tokenizer, sample, method):
    import torch
    from transformers import DynamicCache

    engine = Engine(tiny, tokenizer)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    n = pre.n_tokens
    cache = DynamicCache(config=tiny.config)
    with torch.no_grad(), kvpress_press(method, resolve_budget(0.35, n), n)(tiny):
        tiny.model(input_ids=pre.prompt.context_ids, past_key_values=cache)
    kept = engine.kept_counts(Route.homogeneous(method, 4, 0.35), n)
    for layer in range(4):
        assert cache.layers[layer].keys.shape[2] == kept[layer]
        theirs = kept_positions(cache.layers[layer].keys, pre.layers[layer].keys)
        ours = engine.kept_indices(pre, layer, method, kept[layer])[0]
        assert torch.equal(ours, theirs), f"layer {layer}"


def test_kvpress_press_keeps_the_resolved_count_and_names_what_it_supports():
    from kvpress.utils import compute_n_kept

    for method in KVPRESS_METHODS:
        for n in range(65, 3000, 37):
            for budget in (1, 64, 256, 0.3, 0.35, 1.0):
                k = resolve_budget(budget, n)
                assert compute_n_kept(n, kvpress_press(method, k, n).compression_ratio) == k, (method, n, budget)
    with pytest.raises(ValueError, match="supported: snapkv, tova"):
        kvpress_press("h2o", 8, 100)
