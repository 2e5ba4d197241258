import pytest
from kvpress import KnormPress, SnapKVPress, TOVAPress
from transformers import pipeline

import learnroute as lr
from learnroute import Engine, Route, RoutedPress, _hf
from learnroute.methods import KVPRESS_METHODS, kvpress_press, resolve_budget
from tests.conftest import make_tiny


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


MIXED_ROUTES = {
    "per-layer budgets": Route.from_layers(["snapkv", "tova", "knorm", "h2o"], [8, 40, 0.25, 100]),
    # one budget, but `full` keeps the whole context while the others compress
    "full next to compressed": Route.from_layers(["full", "snapkv", "full", "tova"], 0.3),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(MIXED_ROUTES))
def test_mixed_route_in_kvpress_pipeline_runs_in_the_press_scope_and_restores_the_model(
        tokenizer, sample, attn, name, monkeypatch):
    route = MIXED_ROUTES[name]
    model = make_tiny(tokenizer, attn=attn)
    (res,) = Engine(model, tokenizer, max_new_tokens=6).run(
        sample.context, sample.question, [route], answer_prefix=sample.answer_prefix
    )
    assert model.config._attn_implementation == attn  # the engine restores what it switches
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press = RoutedPress(route)
    with press.scope(model):
        first = ask(pipe, sample, press)
        second = ask(pipe, sample, press)
        assert model.config._attn_implementation == f"learnroute_{attn}"  # for kvpress's decoding
    assert first == second == res.answer
    assert model.config._attn_implementation == attn  # restored
    # Without the scope the route is refused before any forward, saying what to write.
    monkeypatch.setattr(model.model, "forward", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(lr.RouteError, match=r"different token counts.*with press.scope\(model\)"):
        ask(pipe, sample, press)
    assert model.config._attn_implementation == attn


def test_uniform_route_needs_no_scope_and_leaves_the_model_alone(tokenizer, sample):
    model = make_tiny(tokenizer)
    route = Route.from_layers(["snapkv", "tova", "knorm", "h2o"], 0.3)
    (res,) = Engine(model, tokenizer, max_new_tokens=6).run(
        sample.context, sample.question, [route], answer_prefix=sample.answer_prefix)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    assert ask(pipe, sample, RoutedPress(route)) == res.answer
    assert model.config._attn_implementation == "sdpa"
    assert not [a for m in _hf.attention_modules(model) for a in vars(m) if a.startswith("_learnroute")]


def test_routed_press_refuses_attention_it_cannot_route(tokenizer, sample):
    model = make_tiny(tokenizer)
    _hf._set_attn(model, "flash_attention_2")  # never run: refused before any forward
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press = RoutedPress(MIXED_ROUTES["per-layer budgets"])
    with pytest.raises(ValueError, match="'sdpa' or 'eager', got 'flash_attention_2'"), press.scope(model):
        ask(pipe, sample, press)


def test_mixed_route_with_the_scope_equals_the_engine_and_restores(pipe, tiny, tokenizer, sample):
    route = MIXED_ROUTES["per-layer budgets"]
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
    assert_engine_keeps_what_kvpress_keeps(tiny, tokenizer, sample, method)


def assert_engine_keeps_what_kvpress_keeps(model, tokenizer, sample, method: str) -> None:
    """kvpress's own press, run in ``model``'s dtype, keeps the engine's tokens in every
    layer (up to ties at the threshold); tests/test_bf16.py runs it in bfloat16."""
    import torch
    from transformers import DynamicCache

    engine = Engine(model, tokenizer)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    n = pre.n_tokens
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), kvpress_press(method, resolve_budget(0.35, n), n)(model):
        model.model(input_ids=pre.prompt.context_ids, past_key_values=cache)
    kept = engine.kept_counts(Route.homogeneous(method, 4, 0.35), n)
    for layer in range(4):
        assert cache.layers[layer].keys.dtype == model.dtype and cache.layers[layer].keys.shape[2] == kept[layer]
        theirs = kept_positions(cache.layers[layer].keys, pre.layers[layer].keys)
        ours = engine.kept_indices(pre, layer, method, kept[layer])[0]
        assert_same_up_to_ties(ours, theirs, engine.scores(pre, layer, method, kept[layer])[0], f"layer {layer}")


def assert_same_up_to_ties(ours, theirs, scores, where: str) -> None:
    """Equal kept sets per head (H_kv, k), except that among tokens whose scores tie at the
    threshold kvpress (torch.topk: order undocumented) may keep others than our rule (the
    later token). KnormPress ties in layer 0: a repeated token has the same key norm at
    every position (RoPE is a rotation)."""
    for h in range(ours.shape[0]):
        a, b = set(ours[h].tolist()), set(theirs[h].tolist())
        assert len(a) == len(b), where
        threshold = scores[h, sorted(a)].min()
        differ = a ^ b
        assert all(float(scores[h, i]) == float(threshold) for i in differ), (where, h, sorted(differ))
        # and our rule among the tied: the latest tied positions are the ones kept
        tied = [i for i in range(scores.shape[-1]) if float(scores[h, i]) == float(threshold)]
        n_tied_kept = sum(1 for i in tied if i in a)
        assert sorted(i for i in tied if i in a) == tied[len(tied) - n_tied_kept:], (where, h)


def test_kvpress_press_keeps_the_resolved_count_and_names_what_it_supports():
    from kvpress.utils import compute_n_kept

    for method in KVPRESS_METHODS:
        for n in range(65, 3000, 37):
            for budget in (1, 64, 256, 0.3, 0.35, 1.0):
                k = resolve_budget(budget, n)
                assert compute_n_kept(n, kvpress_press(method, k, n).compression_ratio) == k, (method, n, budget)
    with pytest.raises(ValueError, match="supported: snapkv, tova"):
        kvpress_press("h2o", 8, 100)
