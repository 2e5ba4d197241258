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


def kept_positions(cache_keys, full_keys):
    """Sorted positions (H_kv, k) of cached keys (1, H_kv, k, d) within full keys (1, H_kv, n, d)."""
    match = (cache_keys[0, :, :, None, :] == full_keys[0, :, None, :, :]).all(-1)  # (H_kv, k, n)
    return match.float().argmax(-1).sort(-1).values


KVPRESS_BACKED = {
    "snapkv": lambda r: SnapKVPress(compression_ratio=r),
    "tova": lambda r: TOVAPress(compression_ratio=r),
    "knorm": lambda r: KnormPress(compression_ratio=r),
}


@pytest.mark.parametrize("method", ["snapkv", "tova", "knorm", "expected_attention", "keydiff", "critical_snapkv",
                                    "streaming_llm"])
def test_engine_keeps_the_same_tokens_as_kvpress(tiny, tokenizer, sample, method):
    import kvpress
    import torch
    from transformers import DynamicCache

    makers = {
        "expected_attention": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
        "keydiff": lambda r: kvpress.KeyDiffPress(compression_ratio=r),
        "streaming_llm": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
        **KVPRESS_BACKED,
    }

    def critical(r):
        press = kvpress.CriticalKVPress(SnapKVPress())
        press.compression_ratio = r
        return press

    makers["critical_snapkv"] = critical
    engine = Engine(tiny, tokenizer)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    n = pre.n_tokens
    cache = DynamicCache(config=tiny.config)
    with torch.no_grad(), makers[method](0.65)(tiny):
        tiny.model(input_ids=pre.prompt.context_ids, past_key_values=cache)
    n_kept = Route.homogeneous(method, 4, 0.35)
    kept = engine.kept_counts(n_kept, n)
    for layer in range(4):
        assert cache.layers[layer].keys.shape[2] == kept[layer]
        theirs = kept_positions(cache.layers[layer].keys, pre.layers[layer].keys)
        ours = engine.kept_indices(pre, layer, method, kept[layer])[0]
        assert torch.equal(ours, theirs), f"layer {layer}"
