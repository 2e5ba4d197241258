import pytest
import torch

import learnroute as lr
from learnroute import Engine, Route
from learnroute._hf import attention_bias, build_cache
from tests.conftest import make_tiny

MIXED = ["snapkv", "tova", "knorm", "h2o"]


def mixed_route(n_layers=4):
    return Route.from_layers(MIXED[:n_layers], [8, 40, 0.25, 100], source="test")


def test_keep_everything_reproduces_full_cache_answer_and_logits(tiny, tokenizer, sample):
    engine = Engine(tiny, tokenizer, max_new_tokens=8)
    prompt = engine.encode(sample.context, sample.question, sample.answer_prefix)
    routes = [Route.full(4), Route.homogeneous("snapkv", 4, 1.0), Route.homogeneous("knorm", 4, 10_000)]
    results = engine.answer(engine.prefill(prompt), routes, keep_logits=True)
    # Reference: plain transformers, the whole prompt in one forward, then greedy generate.
    ids = torch.cat([prompt.context_ids, prompt.question_ids], dim=1)
    with torch.no_grad():
        ref_logits = tiny(ids).logits[0, -1]
        ref = tiny.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
    ref_tokens = ref[0, ids.shape[1] :].tolist()
    for r in results:
        assert r.kv_bytes == r.full_kv_bytes and r.kv_fraction == 1.0
        torch.testing.assert_close(r.first_logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert r.token_ids == ref_tokens


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_mixed_budgets_run_and_keep_exactly_the_route_bytes(tokenizer, sample, attn):
    model = make_tiny(tokenizer, attn=attn)
    engine = Engine(model, tokenizer, max_new_tokens=6)
    route = mixed_route()
    (res,) = engine.run(sample.context, sample.question, [route])
    n = engine.encode(sample.context, sample.question).context_ids.shape[1]
    expected_kept = [8, 40, int(n * 0.25), 100]
    assert res.kept_per_layer == expected_kept
    cfg = model.config
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, float32
    assert res.kv_bytes == per_token * sum(expected_kept)
    assert res.full_kv_bytes == per_token * n * 4
    assert model.config._attn_implementation == attn  # restored after decoding
    # The answer, independently: the model's own forward over a DynamicCache of the kept tokens.
    engine = Engine(model, tokenizer, max_new_tokens=6)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    kept = [engine.kept_indices(pre, i, e.method, k) for i, (e, k) in enumerate(zip(route.layers, expected_kept))]
    assert res.token_ids == greedy_from_kept(model, pre, kept, 6)


def greedy_from_kept(model, pre, kept_idx, max_new_tokens):
    """Greedy answer tokens from a plain DynamicCache holding each layer's kept positions
    (kept_idx[l]: (1, H_kv, k_l)), decoded with the model's own forward."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer, idx in enumerate(kept_idx):
        cap = pre.layers[layer]
        gather = idx.unsqueeze(-1).expand(-1, -1, -1, cap.keys.shape[-1])  # (1, H_kv, k, d)
        cache.update(cap.keys.gather(2, gather), cap.values.gather(2, gather), layer)
    ids = pre.prompt.question_ids
    pos = torch.arange(pre.n_tokens, pre.n_tokens + ids.shape[1])[None]
    eos = model.generation_config.eos_token_id
    tokens: list[int] = []
    with torch.no_grad(), lr.routed_attention(model):
        while len(tokens) < max_new_tokens and (not tokens or tokens[-1] != eos):
            nxt = int(model(input_ids=ids, past_key_values=cache, position_ids=pos).logits[0, -1].argmax())
            tokens.append(nxt)
            ids, pos = torch.tensor([[nxt]]), pos[:, -1:] + 1
    return tokens


def test_sdpa_and_eager_agree_on_mixed_routes(tokenizer, sample):
    results = {}
    for attn in ("sdpa", "eager"):
        engine = Engine(make_tiny(tokenizer, attn=attn), tokenizer, max_new_tokens=6)
        results[attn] = engine.run(sample.context, sample.question, [mixed_route()], keep_logits=True)[0]
    torch.testing.assert_close(results["sdpa"].first_logits, results["eager"].first_logits, rtol=1e-4, atol=1e-4)
    assert results["sdpa"].token_ids == results["eager"].token_ids


def test_stock_attention_crashes_on_per_layer_lengths_and_ours_does_not(tiny):
    """The bug we work around (background §6): one mask built from layer 0's length."""
    kv = [(torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)) for n in (5, 9, 7, 3)]
    ids = torch.tensor([[1, 2, 3]])
    pos = torch.tensor([[20, 21, 22]])
    with pytest.raises(RuntimeError, match="size of tensor"):
        with torch.no_grad():
            tiny(input_ids=ids, past_key_values=build_cache(tiny, kv), position_ids=pos)
    with torch.no_grad(), lr.routed_attention(tiny):
        out = tiny(input_ids=ids, past_key_values=build_cache(tiny, kv), position_ids=pos)
    assert torch.isfinite(out.logits).all()


def test_batched_decoding_matches_one_route_at_a_time(tiny, tokenizer, sample):
    routes = [Route.homogeneous(m, 4, 0.3) for m in ("snapkv", "tova", "knorm", "keydiff", "random")]
    routes.append(mixed_route())
    batched = Engine(tiny, tokenizer, max_new_tokens=6, max_batch=32).run(sample.context, sample.question, routes)
    single = Engine(tiny, tokenizer, max_new_tokens=6, max_batch=1).run(sample.context, sample.question, routes)
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]


def test_a_minus_infinity_bias_equals_evicting_the_token(tiny, tokenizer, sample):
    """The per-(layer, head) bias hook: masking tokens must equal physically removing them."""
    engine = Engine(tiny, tokenizer)
    prompt = engine.encode(sample.context, sample.question)
    pre = engine.prefill(prompt)
    n = pre.n_tokens
    route = Route.homogeneous("knorm", 4, n // 2)
    kv = engine.compress(pre, [route])
    kept = [engine.kept_indices(pre, layer, "knorm", n // 2) for layer in range(4)]  # (1, H_kv, k)
    biases = {}
    for layer in range(4):
        bias = torch.full((1, 2, n), float("-inf"))
        bias.scatter_(2, kept[layer], 0.0)
        biases[layer] = bias
    q = prompt.question_ids
    pos = torch.arange(n, n + q.shape[1]).unsqueeze(0)
    with torch.no_grad(), lr.routed_attention(tiny):
        evicted = tiny(input_ids=q, past_key_values=build_cache(tiny, kv), position_ids=pos).logits
    full_kv = [(c.keys, c.values) for c in pre.layers]
    with torch.no_grad(), attention_bias(tiny, biases):
        masked = tiny(input_ids=q, past_key_values=build_cache(tiny, full_kv), position_ids=pos).logits
    torch.testing.assert_close(masked, evicted, rtol=1e-4, atol=1e-4)


def test_query_aware_puts_the_question_in_the_prefill(tiny, tokenizer, sample):
    agnostic = Engine(tiny, tokenizer).encode(sample.context, sample.question)
    aware = Engine(tiny, tokenizer, query_aware=True).encode(sample.context, sample.question)
    assert aware.context_ids.shape[1] > agnostic.context_ids.shape[1]
    assert aware.question_ids.shape[1] < agnostic.question_ids.shape[1]
    res = Engine(tiny, tokenizer, query_aware=True, max_new_tokens=4).run(
        sample.context, sample.question, [Route.homogeneous("snapkv", 4, 64)]
    )
    assert res[0].kept_per_layer == [64] * 4


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, *args):
        self.calls += 1


@pytest.mark.parametrize(
    "context, route, match",
    [
        ("", Route.homogeneous("snapkv", 4, 8), "empty context"),
        ("   \n", Route.homogeneous("snapkv", 4, 8), "empty context"),
        ("word " * 5000, Route.homogeneous("snapkv", 4, 8), "exceeds the model's maximum position 4096"),
        ("word " * 100, Route.homogeneous("snapkv", 30, 8), "route has 30 layers but the model has 4"),
        ("word " * 20, Route.homogeneous("snapkv", 4, 8), "needs a context of at least 65 tokens"),
    ],
)
def test_bad_input_fails_before_any_forward(tiny, tokenizer, context, route, match):
    counter = ForwardCounter(tiny.model)
    try:
        with pytest.raises((ValueError, lr.RouteError), match=match):
            Engine(tiny, tokenizer).run(context, "Question?", [route])
    finally:
        counter.handle.remove()
    assert counter.calls == 0


@pytest.mark.parametrize("budget", [0, -4])
def test_non_positive_budgets_are_refused(budget):
    with pytest.raises(lr.RouteError, match=">= 1"):
        Route.homogeneous("tova", 4, budget)


def test_unknown_method_is_refused():
    with pytest.raises(lr.RouteError, match="unknown method 'snap-kv'"):
        Route.from_layers(["snapkv", "snap-kv"], 8)


def test_many_routes_share_one_prefill(tiny, tokenizer, sample):
    counter = ForwardCounter(tiny.model)
    try:
        routes = [Route.homogeneous(m, 4, b) for m in ("snapkv", "tova", "knorm") for b in (16, 0.5)]
        engine = Engine(tiny, tokenizer, max_new_tokens=1)
        engine.run(sample.context, sample.question, routes)
    finally:
        counter.handle.remove()
    # 1 prefill + one question forward per distinct cache shape (2 budgets); no re-prefill
    assert counter.calls == 1 + 2


def _question_pass_and_steps(model, cache, ids, pos, steps=3, select_after=None):
    """Logits of a multi-token pass and of ``steps`` greedy single-token steps."""
    outs = []
    with torch.no_grad(), lr.routed_attention(model):
        out = model(input_ids=ids, past_key_values=cache, position_ids=pos).logits
        outs.append(out)
        nxt, p = out[:, -1:].argmax(-1), pos[:, -1:] + 1
        for step in range(steps):
            if step == select_after:
                rows = torch.tensor([0, 2])
                cache.batch_select_indices(rows)
                nxt, p = nxt[rows], p[rows]
            out = model(input_ids=nxt, past_key_values=cache, position_ids=p).logits
            outs.append(out)
            nxt, p = out[:, -1:].argmax(-1), p + 1
    return outs


@pytest.mark.parametrize("extra", [20, 2])  # room for every token / must grow
def test_preallocated_cache_decodes_bit_identically_to_a_dynamic_cache(tiny, extra):
    torch.manual_seed(0)
    lengths = (5, 9, 7, 3)
    kv = [(torch.randn(3, 2, n, 16), torch.randn(3, 2, n, 16)) for n in lengths]
    ids = torch.randint(0, 100, (3, 4))
    pos = torch.arange(20, 24).expand(3, 4)
    ref = _question_pass_and_steps(tiny, build_cache(tiny, kv), ids, pos, select_after=1)
    ours = _question_pass_and_steps(tiny, build_cache(tiny, kv, extra=extra), ids, pos, select_after=1)
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)


def test_routed_sdpa_with_a_mask_is_bit_identical_to_stock_sdpa(tiny):
    """Our mask path skips transformers' repeat_kv (GQA via enable_gqa): same numbers."""
    torch.manual_seed(0)
    kv = [(torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)) for _ in range(4)]
    ids = torch.randint(0, 100, (2, 5))
    pos = torch.arange(30, 35).expand(2, 5)
    with torch.no_grad():
        stock = tiny(input_ids=ids, past_key_values=build_cache(tiny, kv), position_ids=pos).logits
        with lr.routed_attention(tiny):
            ours = tiny(input_ids=ids, past_key_values=build_cache(tiny, kv), position_ids=pos).logits
    assert tiny.config.num_attention_heads != tiny.config.num_key_value_heads  # GQA is exercised
    assert torch.equal(stock, ours)


def test_routes_that_stop_early_leave_the_batch_without_changing_the_others(tokenizer, sample, monkeypatch):
    """EOS mid-batch: finished rows are dropped (the batch is compacted), the rest go on."""
    model = make_tiny(tokenizer, seed=5)  # a seed whose routes answer with different tokens
    routes = [Route.homogeneous(m, 4, 0.3) for m in ("snapkv", "tova", "knorm", "keydiff", "random", "h2o")]
    free = Engine(model, tokenizer, max_new_tokens=8).run(sample.context, sample.question, routes)
    stop = free[1].token_ids[0]  # make one route's first token an end of sequence
    compactions = []

    def keep_rows(cache, rows):
        compactions.append(rows.tolist())
        cache.batch_select_indices(rows)

    monkeypatch.setattr(lr._hf, "keep_rows", keep_rows)
    monkeypatch.setattr(model.generation_config, "eos_token_id", stop)
    batched = Engine(model, tokenizer, max_new_tokens=8, max_batch=32).run(sample.context, sample.question, routes)
    single = Engine(model, tokenizer, max_new_tokens=8, max_batch=1).run(sample.context, sample.question, routes)
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    for r, f in zip(batched, free):
        cut = f.token_ids.index(stop) + 1 if stop in f.token_ids else len(f.token_ids)
        assert r.token_ids == f.token_ids[:cut]
    assert compactions and compactions[0] != list(range(len(compactions[0])))  # rows really moved


def test_stop_tokens_end_an_answer_and_min_new_tokens_delays_them(tiny, tokenizer, sample):
    engine = Engine(tiny, tokenizer, max_new_tokens=8)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    routes = [Route.homogeneous("knorm", 4, 0.5)]
    (free,) = engine.answer(pre, routes)
    first = free.token_ids[0]
    (stopped,) = engine.answer(pre, routes, stop_token_ids=(first,))
    assert stopped.token_ids == [first]  # the stop token ends the answer and is kept, like EOS
    (delayed,) = engine.answer(pre, routes, stop_token_ids=(first,), min_new_tokens=1)
    assert delayed.token_ids[0] != first  # not allowed as the first token
    assert first not in delayed.token_ids[:-1]  # and still a stop token after it


def test_preallocated_cache_crops_back_for_another_question(tiny):
    """crop(-t) forgets the last t tokens of every layer (kvpress's multi-question pattern)."""
    torch.manual_seed(0)
    kv = [(torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16)) for n in (5, 9, 7, 3)]
    ids = torch.randint(0, 100, (2, 4))
    pos = torch.arange(20, 24).expand(2, 4)
    cache = build_cache(tiny, kv, extra=8)
    with torch.no_grad(), lr.routed_attention(tiny):
        first = tiny(input_ids=ids, past_key_values=cache, position_ids=pos).logits
        cache.crop(-4)
        assert [layer.get_seq_length() for layer in cache.layers] == [5, 9, 7, 3]
        again = tiny(input_ids=ids, past_key_values=cache, position_ids=pos).logits
    assert torch.equal(first, again)


def test_pack_batches_groups_by_padding_cost_by_hand():
    shapes = [[4, 4], [2, 2], [4, 4], [3, 5], [20, 20]]
    # Sorted by (total, shape): [2,2] (4), [3,5] (8), [4,4] x2 (8), [20,20] (40).
    # max_padding 2: [2,2]+[3,5] pads to [3,5] = 8 <= 2*4; + [4,4] pads to [4,5] = 9 > 8 -> new
    # batch; the second [4,4] joins it (8 <= 16); [20,20] (40 > 16) starts another.
    assert lr.engine.pack_batches(shapes, max_batch=8, max_padding=2.0) == [[1, 3], [0, 2], [4]]
    # max_padding 1: identical shapes only.
    assert lr.engine.pack_batches(shapes, max_batch=8, max_padding=1.0) == [[1], [3], [0, 2], [4]]
    # max_batch caps a batch whatever the padding allows.
    assert lr.engine.pack_batches(shapes, max_batch=2, max_padding=100.0) == [[1, 3], [0, 2], [4]]
    with pytest.raises(ValueError, match="max_padding must be >= 1"):
        lr.engine.pack_batches(shapes, 8, 0.5)
    with pytest.raises(ValueError, match="max_padding must be >= 1"):
        Engine.__init__(object.__new__(Engine), None, None, max_padding=0.9)


def _shaped_routes():
    """Routes whose kept counts differ per layer (so a shared batch needs padding)."""
    return [
        mixed_route(),
        Route.homogeneous("snapkv", 4, 0.3),
        Route.from_layers(["tova", "keydiff", "snapkv", "knorm"], [60, 12, 0.5, 20], source="test"),
        Route.from_layers(["h2o", "random", "tova", "snapkv"], [0.4, 0.1, 30, 0.6], source="test"),
    ]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padded_batch_of_different_shapes_matches_each_route_alone(tokenizer, sample, attn):
    model = make_tiny(tokenizer, attn=attn)
    routes = _shaped_routes()
    engine = Engine(model, tokenizer, max_new_tokens=6, max_padding=100.0)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    counts = [engine.kept_counts(r, pre.n_tokens) for r in routes]
    assert len({tuple(c) for c in counts}) == len(routes)  # every layer shape differs
    assert lr.engine.pack_batches(counts, engine.max_batch, engine.max_padding) == [sorted(
        range(len(routes)), key=lambda i: (sum(counts[i]), counts[i]))]  # one padded batch
    padded = engine.answer(pre, routes, keep_logits=True)
    alone = Engine(model, tokenizer, max_new_tokens=6, max_batch=1).answer(pre, routes, keep_logits=True)
    for route, p, a, c in zip(routes, padded, alone, counts):
        assert p.kept_per_layer == c and p.kv_bytes == a.kv_bytes  # bytes of the route, not of the padding
        torch.testing.assert_close(p.first_logits, a.first_logits, rtol=1e-4, atol=1e-4)
        kept = [engine.kept_indices(pre, i, e.method, k) for i, (e, k) in enumerate(zip(route.layers, c))]
        assert p.token_ids == greedy_from_kept(model, pre, kept, 6)  # independent reference
    assert model.config._attn_implementation == attn
    assert not any(hasattr(m, "_learnroute_padding") for m in lr._hf.attention_modules(model))  # restored


def test_padding_slots_are_never_attended(tiny, tokenizer, sample, monkeypatch):
    """Poison the padding: huge keys/values there would dominate attention if it were seen."""
    engine = Engine(tiny, tokenizer, max_new_tokens=4, max_padding=100.0)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    routes = _shaped_routes()
    clean = engine.answer(pre, routes, keep_logits=True)
    from learnroute.engine import compress

    original = compress.gather_into

    def poisoned(prefill, picks, heads, layer, k, v):
        k.fill_(1e4)
        v.fill_(1e4)
        original(prefill, picks, heads, layer, k, v)
        longest = max(max(c[layer]) for c in heads)
        for row, c in enumerate(heads):  # rewrite each (row, head)'s padding slots after the real gather
            for h, kept in enumerate(c[layer]):
                k[row, h, kept:longest] = 1e4
                v[row, h, kept:longest] = 1e4

    monkeypatch.setattr(compress, "gather_into", poisoned)
    dirty = engine.answer(pre, routes, keep_logits=True)
    for a, b in zip(clean, dirty):
        torch.testing.assert_close(a.first_logits, b.first_logits)
        assert a.token_ids == b.token_ids


def test_padded_rows_that_stop_early_leave_the_batch_with_their_padding(tokenizer, sample, monkeypatch):
    model = make_tiny(tokenizer, seed=5)
    routes = _shaped_routes() + [Route.homogeneous(m, 4, 0.3) for m in ("tova", "knorm")]
    free = Engine(model, tokenizer, max_new_tokens=8, max_padding=100.0).run(sample.context, sample.question, routes)
    stop = free[1].token_ids[0]
    monkeypatch.setattr(model.generation_config, "eos_token_id", stop)
    batched = Engine(model, tokenizer, max_new_tokens=8, max_padding=100.0).run(sample.context, sample.question, routes)
    single = Engine(model, tokenizer, max_new_tokens=8, max_batch=1).run(sample.context, sample.question, routes)
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert any(len(r.token_ids) == 1 for r in batched) and any(len(r.token_ids) > 1 for r in batched)


@pytest.mark.parametrize("padding", [1.0, 100.0])
def test_parked_answers_finish_like_uninterrupted_decoding(tokenizer, sample, padding, monkeypatch):
    """Rows still decoding after park_after tokens leave their batch and finish in new
    batches with other batches' rows: the answers equal decoding each route alone."""
    model = make_tiny(tokenizer, seed=5)
    routes = _shaped_routes() + [Route.homogeneous(m, 4, b) for m in ("tova", "knorm") for b in (0.3, 12)]
    alone = Engine(model, tokenizer, max_new_tokens=10, max_batch=1, park_after=None)
    pre = alone.prefill(alone.encode(sample.context, sample.question))
    ref = alone.answer(pre, routes, keep_logits=True)
    stop = ref[1].token_ids[4]  # a token some answers produce mid-way: they end before or after parking
    monkeypatch.setattr(model.generation_config, "eos_token_id", stop)
    ref = alone.answer(pre, routes, keep_logits=True)
    from learnroute.engine import core

    resumed = []
    original = core.resume

    def spy(model, parked, *a, **k):
        resumed.append(len(parked))
        return original(model, parked, *a, **k)

    monkeypatch.setattr(core, "resume", spy)
    engine = Engine(model, tokenizer, max_new_tokens=10, max_batch=3, max_padding=padding, park_after=3)
    got = engine.answer(pre, routes, keep_logits=True)
    assert resumed and resumed[0] >= 2  # rows of several batches were parked and finished together
    assert any(len(r.token_ids) <= 3 for r in ref) and any(len(r.token_ids) > 3 for r in ref)
    for a, b in zip(ref, got):
        assert b.token_ids == a.token_ids and b.answer == a.answer
        torch.testing.assert_close(b.first_logits, a.first_logits, rtol=1e-4, atol=1e-4)
    # and against the independent reference for one parked route
    i = next(j for j, r in enumerate(ref) if len(r.token_ids) > 3)
    c = alone.kept_counts(routes[i], pre.n_tokens)
    kept = [alone.kept_indices(pre, layer, e.method, k) for layer, (e, k) in enumerate(zip(routes[i].layers, c))]
    assert got[i].token_ids == greedy_from_kept(model, pre, kept, 10)


def test_park_after_must_be_positive(tiny, tokenizer):
    with pytest.raises(ValueError, match="park_after must be >= 1"):
        Engine(tiny, tokenizer, park_after=0)


@pytest.mark.parametrize("park_after", [None, 3])
def test_answers_end_once_until_holds(tokenizer, sample, park_after):
    """``until``: each answer is the shortest prefix of its uninterrupted answer whose text
    satisfies the predicate (or all of it), also for rows parked and resumed elsewhere."""
    model = make_tiny(tokenizer, seed=5)
    routes = _shaped_routes() + [Route.homogeneous(m, 4, b) for m in ("tova", "knorm") for b in (0.3, 12)]
    alone = Engine(model, tokenizer, max_new_tokens=10, max_batch=1, park_after=None)
    pre = alone.prefill(alone.encode(sample.context, sample.question))
    ref = alone.answer(pre, routes)

    def until(text):  # the tiny model repeats one token per route: their lengths differ
        return len(text) >= 36

    want = []
    for r in ref:
        k = next((k for k in range(1, len(r.token_ids) + 1)
                  if until(tokenizer.decode(r.token_ids[:k], skip_special_tokens=True))), len(r.token_ids))
        want.append(r.token_ids[:k])
    assert any(len(w) < len(r.token_ids) for w, r in zip(want, ref))  # some answers do end early
    assert any(len(w) == len(r.token_ids) for w, r in zip(want, ref))  # and some never meet it
    engine = Engine(model, tokenizer, max_new_tokens=10, max_batch=3, max_padding=100.0, park_after=park_after)
    got = engine.answer(pre, routes, until=until)
    assert [g.token_ids for g in got] == want


# ---------------------------------------------------------------------------- prefills shared across stages

SHARED_ROUTES = ["snapkv", "expected_attention", "tova", "keydiff"]  # scorers that project with the module


def shared_answers(engine, prompt, routes):
    return [(r.token_ids, r.kept_per_layer, r.first_logits) for r in engine.answer(engine.prefill(prompt), routes,
                                                                                  keep_logits=True)]


def test_a_prefill_store_answers_as_separate_prefills_across_engines_and_models(tokenizer, sample, tiny_dir):
    from learnroute.engine import PrefillStore

    routes = [Route.homogeneous(m, 4, 0.3) for m in SHARED_ROUTES] + [mixed_route()]
    # The reference: a fresh model, engine and prefill per question, without a store.
    model, _ = lr.load_model(tiny_dir)
    plain = Engine(model, tokenizer, max_new_tokens=6)
    prompt = plain.encode(sample.context, sample.question, sample.answer_prefix)
    aware = Engine(model, tokenizer, max_new_tokens=6, query_aware=True)
    aware_prompt = aware.encode(sample.context, sample.question, sample.answer_prefix)
    reference = shared_answers(plain, prompt, routes)
    aware_reference = shared_answers(aware, aware_prompt, routes)
    shared = PrefillStore(2**30)  # handed to every engine below
    # A first stage: its own model object and engine, one method scored and decoded.
    first_model, _ = lr.load_model(tiny_dir)
    first = Engine(first_model, tokenizer, max_new_tokens=6, prefills=shared)
    first.answer(first.prefill(prompt), routes[:1])
    assert (shared.made, shared.hits) == (1, 0)
    # A later stage reloads the model: same weights, served from the block.
    later_model, _ = lr.load_model(tiny_dir)
    later = Engine(later_model, tokenizer, max_new_tokens=6, prefills=shared)
    got = shared_answers(later, prompt, routes)
    assert (shared.made, shared.hits) == (1, 1)
    # The question in the prefill is another context: prefilled anew.
    got_aware = shared_answers(Engine(later_model, tokenizer, max_new_tokens=6, query_aware=True, prefills=shared),
                               aware_prompt, routes)
    assert (shared.made, shared.hits) == (2, 1)
    # Other weights under the same name: never served another model's prefill.
    other = make_tiny(tokenizer, seed=1)
    other.config._name_or_path = later_model.config._name_or_path
    other_engine = Engine(other, tokenizer, max_new_tokens=6, prefills=shared)
    got_other = shared_answers(other_engine, prompt, routes)
    assert (shared.made, shared.hits) == (3, 1)
    # Other method options score differently: not shared either.
    windowed = Engine(later_model, tokenizer, max_new_tokens=6, method_options={"snapkv": {"window_size": 4}},
                      prefills=shared)
    windowed.prefill(prompt)
    assert (shared.made, shared.hits) == (4, 1)
    # Reused by a second answer on the same engine too (the first stage's scores kept).
    assert shared_answers(later, prompt, routes[:2])[0][0] == got[0][0]
    assert shared.hits == 2
    for mine, ref in zip(got + got_aware, reference + aware_reference):
        assert mine[:2] == ref[:2]
        assert torch.equal(mine[2], ref[2])  # bit for bit: the same prefill, the same scores
    other_ref = shared_answers(Engine(other, tokenizer, max_new_tokens=6), prompt, routes)
    assert all(torch.equal(a[2], b[2]) for a, b in zip(got_other, other_ref))
    assert any(not torch.equal(a[2], b[2]) for a, b in zip(got_other, reference))  # the test can tell models apart


def test_a_prefill_store_keeps_what_fits_and_releases_it_on_clear(tiny, tokenizer, sample):
    from learnroute.engine import PrefillStore, capture_bytes

    engine = Engine(tiny, tokenizer, max_new_tokens=4)
    prompts = [engine.encode(sample.context[: len(sample.context) - 40 * i], sample.question) for i in range(3)]
    size = capture_bytes(engine.prefill(prompts[0]).layers)
    n, d, h_kv = prompts[0].context_ids.shape[1], tiny.config.head_dim, tiny.config.num_key_value_heads
    # Keys, values and attention inputs per layer, one RoPE table (cos, sin): float32.
    assert size == 4 * (4 * n * (2 * h_kv * d + tiny.config.hidden_size) + 2 * n * d)
    shared = PrefillStore(int(1.5 * size))  # room for the first only: the first is kept
    engine = Engine(tiny, tokenizer, max_new_tokens=4, prefills=shared)
    for p in prompts + prompts:
        engine.prefill(p)
    assert (shared.hits, shared.made, shared.not_kept) == (1, 5, 4)
    shared.clear()
    assert (shared.entries, shared.bytes) == ({}, 0)
    engine.prefill(prompts[0])
    assert (shared.hits, shared.made) == (1, 6)  # released: made anew
    none = PrefillStore(0)
    engine = Engine(tiny, tokenizer, max_new_tokens=4, prefills=none)
    engine.prefill(prompts[0])
    engine.prefill(prompts[0])
    assert (none.hits, none.made, none.not_kept) == (0, 2, 2)
    assert Engine(tiny, tokenizer).prefills is None  # no store unless given one
