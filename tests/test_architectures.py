"""The engine and RoutedPress on every architecture kvpress supports (tiny random models).

Gemma3 mixes local sliding-window layers with global ones: its local layers keep their
window uncompressed, as kvpress does for Gemma3, masks are rebuilt per layer, and
profiles skip the local layers.
"""

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    pipeline,
)

import learnroute as lr
from learnroute import Engine, Route, RoutedPress
from learnroute.profile import CANDIDATES

WINDOW = 64  # Gemma3's local window here, shorter than the ~330-token context
ARCHS = {
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"pad_token_id": 0}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ),
}


def tiny(arch: str, tokenizer):
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True, **extra,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model


MIXED = Route.from_layers(["snapkv", "tova", "h2o", "knorm"], [8, 40, 0.25, 100], source="test")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_method_runs_and_keeping_everything_reproduces_transformers(arch, tokenizer, sample):
    model = tiny(arch, tokenizer)
    engine = Engine(model, tokenizer, max_new_tokens=6)
    prompt = engine.encode(sample.context, sample.question)
    n = prompt.context_ids.shape[1]
    routes = [Route.full(4), *(Route.homogeneous(m, 4, 40) for m in CANDIDATES), MIXED]
    results = engine.answer(engine.prefill(prompt), routes, keep_logits=True)
    ids = torch.cat([prompt.context_ids, prompt.question_ids], dim=1)
    with torch.no_grad():
        ref_logits = model(ids).logits[0, -1]
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    full = results[0]
    torch.testing.assert_close(full.first_logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert full.token_ids == ref[0, ids.shape[1] :].tolist()
    local = arch == "gemma3"  # layers 0 and 2 keep their window (WINDOW - 1 tokens), untouched
    expected = [WINDOW - 1, 40, WINDOW - 1, 100] if local else [8, 40, int(n * 0.25), 100]
    assert results[-1].kept_per_layer == expected
    eos = model.generation_config.eos_token_id
    for r in results:  # every route decodes to the token limit or to EOS
        assert len(r.token_ids) == 6 or (r.token_ids and r.token_ids[-1] == eos), r.route.describe()
    # The mixed route, independently: RoutedPress inside kvpress's own pipeline and decode
    # (its scope holds route-aware attention for kvpress's decoding).
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press = RoutedPress(MIXED)
    with press.scope(model):
        answer = pipe(sample.context, question=sample.question, press=press, max_new_tokens=6)["answer"]
    assert answer == results[-1].answer


def test_gemma3_routed_press_in_kvpress_pipeline_gives_the_engine_answers(tokenizer, sample):
    model = tiny("gemma3", tokenizer)
    routes = [Route.homogeneous("expected_attention", 4, 40), MIXED]
    ours = Engine(model, tokenizer, max_new_tokens=6).run(sample.context, sample.question, routes)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    for route, res in zip(routes, ours):
        with lr.routed_attention(model):
            answer = pipe(sample.context, question=sample.question, press=RoutedPress(route), max_new_tokens=6)
        assert answer["answer"] == res.answer
        press = RoutedPress(route)  # the press's own scope does the same
        with press.scope(model):
            answer = pipe(sample.context, question=sample.question, press=press, max_new_tokens=6)
        assert answer["answer"] == res.answer
    assert model.config._attn_implementation == "sdpa"  # the scopes restored it
    # Local layers keep more tokens than the global ones, so even a uniform route needs
    # route-aware attention: without a scope it is refused.
    with pytest.raises(lr.RouteError, match="press.scope"):
        pipe(sample.context, question=sample.question, press=RoutedPress(routes[0]), max_new_tokens=6)


def test_profile_of_gemma3_skips_local_layers_and_allocates_among_the_global_ones(tokenizer, tmp_path):
    from learnroute.config import load_config
    from learnroute.profile import ProfileConfig, load_profile, run_profile

    folder = tmp_path / "tiny-gemma3"
    tiny("gemma3", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    cfg = load_config(ProfileConfig, None, [
        f"model={folder}", "tasks={niah_single_1: 2}", "context_tokens=300", "budgets=[16]",
        "methods=[knorm, snapkv]", f"output={tmp_path / 'profile'}",
    ])
    out = run_profile(cfg, progress=False)
    profile = load_profile(out)
    assert profile["fixed_layers"] == [0, 2]
    assert all(v == 0.0 for layer in (0, 2) for v in profile["damage"]["kl"]["16"][layer])
    alloc = Route.from_file(out / "profile_16_alloc.json")
    assert alloc.budgets[0] == alloc.budgets[2] == 16  # ignored by the engine on local layers
    assert alloc.budgets[1] + alloc.budgets[3] == 2 * 16  # the total is shared by the global layers


def test_bench_runs_a_gemma3_model_folder(tokenizer, tmp_path):
    """`learnroute bench` on a local Gemma3 folder: load, route, compress, score."""
    from learnroute.cli import main
    from learnroute.runs import read_jsonl

    folder = tmp_path / "tiny-gemma3"
    tiny("gemma3", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "run"
    main(["bench", f"model={folder}", "tasks={niah_single_1: 2}", "context_tokens=200", "budgets=[16]",
          "routes=[full, homogeneous:snapkv, pyramid:tova]", "max_new_tokens=3", f"output={out}"])
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 2 * 3
    full = {r["sample_id"]: r["kv_bytes"] for r in rows if r["route"] == "full"}
    assert all(r["kv_bytes"] < full[r["sample_id"]] for r in rows if r["route"] != "full")
