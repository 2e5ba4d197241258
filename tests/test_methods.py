import pytest
import torch
from kvpress import StreamingLLMPress

from learnroute import get_method, method_names
from learnroute._hf import capture_prefill, rotary_on_attention
from learnroute.engine import build_prompt
from learnroute.methods import keep_indices

CANDIDATES = [
    "snapkv", "streaming_llm", "h2o", "tova", "knorm",
    "expected_attention", "keydiff", "critical_snapkv", "lava", "random",
]


@pytest.fixture(scope="module")
def captures(tiny, tokenizer, sample):
    prompt = build_prompt(tokenizer, sample.context, sample.question)
    return capture_prefill(tiny, prompt.context_ids)


def test_all_ten_candidates_are_registered():
    assert set(CANDIDATES) <= set(method_names())


def test_unknown_method_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown method 'snap'; registered: snapkv, streaming_llm, h2o"):
        get_method("snap")


def test_registry_builds_a_fresh_object_each_time():
    assert get_method("snapkv") is not get_method("snapkv")
    assert get_method("snapkv", window_size=32).window_size == 32


@pytest.mark.parametrize("name", CANDIDATES)
def test_scores_have_one_value_per_kv_head_and_token(name, captures, tiny):
    layer = captures[1]
    b, h_kv, n, _ = layer.keys.shape
    with rotary_on_attention(tiny):
        scores = get_method(name).score(layer, n_kept=n // 4)
    assert scores.shape == (b, h_kv, n)
    assert torch.isfinite(scores).all()


@pytest.mark.parametrize("name", CANDIDATES)
def test_head_uniform_says_whether_every_kv_head_scores_alike(name, captures, tiny):
    """The study skips adakv:<method> for a head_uniform method (it would be the homogeneous
    route): the flag must match the scores, both ways."""
    layer = captures[1]
    assert layer.keys.shape[1] > 1  # GQA with several KV heads, or the check says nothing
    with rotary_on_attention(tiny):
        scores = get_method(name).score(layer, n_kept=layer.keys.shape[2] // 4)  # (B, H_kv, n)
    alike = torch.equal(scores, scores[:, :1].expand_as(scores))
    assert get_method(name).head_uniform == alike


@pytest.mark.parametrize("n_kept", [3, 4, 10, 150])
def test_streaming_llm_keeps_what_kvpress_keeps(captures, tiny, n_kept):
    layer = captures[0]
    n = layer.keys.shape[2]
    ours = keep_indices(get_method("streaming_llm").score(layer), n_kept)
    ratio = 1 - (n_kept + 0.5) / n
    press = StreamingLLMPress(compression_ratio=ratio)
    ref_scores = press.score(tiny.model.layers[0].self_attn, layer.hidden_states, layer.keys, layer.values, None, {})
    ref = keep_indices(ref_scores, n_kept)
    if n_kept >= 4:  # with fewer slots than sinks kvpress's choice among tied sinks is arbitrary
        assert torch.equal(ours, ref)
    assert set(ours[0, 0].tolist()) == set(range(min(4, n_kept))) | set(range(n - max(0, n_kept - 4), n))


def test_h2o_equals_summed_eager_attention(tokenizer, sample):
    """Our chunked sdpa-friendly H2O equals the column sums of eager attention weights."""
    from tests.conftest import make_tiny

    model = make_tiny(tokenizer, n_layers=2, attn="eager")
    prompt = build_prompt(tokenizer, sample.context, sample.question)
    with torch.no_grad():
        out = model(prompt.context_ids, output_attentions=True)
    caps = capture_prefill(model, prompt.context_ids)
    for layer_idx, attn in enumerate(out.attentions):  # (1, H_q, n, n)
        h_kv = caps[layer_idx].keys.shape[1]
        ref = attn.sum(dim=2).view(1, h_kv, -1, attn.shape[-1]).mean(dim=2)  # (1, H_kv, n)
        ours = get_method("h2o", chunk_size=64).score(caps[layer_idx])
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_random_differs_across_layers_and_is_seeded(captures):
    a0 = get_method("random", seed=1).score(captures[0])
    a1 = get_method("random", seed=1).score(captures[1])
    assert not torch.equal(a0, a1)
    assert torch.equal(a0, get_method("random", seed=1).score(captures[0]))


def test_window_methods_always_keep_their_window(captures, tiny):
    layer = captures[2]
    n = layer.keys.shape[2]
    for name, w in (("snapkv", 64), ("lava", 32)):
        idx = keep_indices(get_method(name).score(layer), w + 5)
        assert set(range(n - w, n)) <= set(idx[0, 0].tolist())
