"""A few purposeful checks on the default model (SmolLM2-135M-Instruct, 30 layers)."""

import pytest
from kvpress import (
    CriticalKVPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import pipeline

from learnroute import Engine, Route, RoutedPress
from learnroute.demo import needle_sample

KEPT = 0.3  # fraction kept; kvpress compression_ratio = 0.7

KVPRESS = {
    "snapkv": lambda: SnapKVPress(compression_ratio=1 - KEPT),
    "tova": lambda: TOVAPress(compression_ratio=1 - KEPT),
    "knorm": lambda: KnormPress(compression_ratio=1 - KEPT),
    "expected_attention": lambda: ExpectedAttentionPress(compression_ratio=1 - KEPT),
    "keydiff": lambda: KeyDiffPress(compression_ratio=1 - KEPT),
    "streaming_llm": lambda: StreamingLLMPress(compression_ratio=1 - KEPT),
}


def critical():
    press = CriticalKVPress(SnapKVPress())
    press.compression_ratio = 1 - KEPT
    return press


KVPRESS["critical_snapkv"] = critical


@pytest.fixture(scope="module")
def pipe(smol):
    model, tok = smol
    return pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")


@pytest.fixture(scope="module")
def samples(tokenizer):
    return [needle_sample(tokenizer, 1000, depth=d, seed=s) for s, d in ((11, 0.3), (12, 0.7))]


def test_engine_is_token_identical_to_kvpress_pipeline(smol, pipe, samples):
    model, tok = smol
    engine = Engine(model, tok, max_new_tokens=12)
    routes = [Route.full(30)] + [Route.homogeneous(m, 30, KEPT) for m in KVPRESS]
    presses = [None] + [make() for make in KVPRESS.values()]
    for s in samples:
        results = engine.run(s.context, s.question, routes, answer_prefix=s.answer_prefix)
        for res, press in zip(results, presses):
            ref = pipe(s.context, question=s.question, answer_prefix=s.answer_prefix, press=press, max_new_tokens=12)
            assert res.answer == ref["answer"], res.route.describe()
        # full cache answers the needle at ~1k tokens
        assert s.answer in results[0].answer


def test_routed_press_homogeneous_matches_kvpress_on_the_default_model(pipe, samples):
    s = samples[0]
    for method in ("snapkv", "tova"):
        ours = pipe(s.context, question=s.question, answer_prefix=s.answer_prefix,
                    press=RoutedPress(Route.homogeneous(method, 30, KEPT)), max_new_tokens=12)
        theirs = pipe(s.context, question=s.question, answer_prefix=s.answer_prefix,
                      press=KVPRESS[method](), max_new_tokens=12)
        assert ours["answer"] == theirs["answer"]
