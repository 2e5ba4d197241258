"""Per-head routes: one method and budget per KV head, kept physically by the engine."""

from __future__ import annotations

import json

import pytest
import torch

import learnroute as lr
from learnroute import Engine, Route
from learnroute._hf import attention_bias, build_cache
from learnroute.route import LayerRoute, RouteError
from tests.conftest import make_tiny

H = 2  # the tiny Llama's KV heads


def per_head_route() -> Route:
    """Heads that differ in method, budget, or both, beside an ordinary layer. (On the tiny
    random model SnapKV, TOVA and KeyDiff pick the same positions in both heads; knorm's
    differ, so a head given another head's positions shows.)"""
    return Route([
        LayerRoute.per_head([LayerRoute("snapkv", 40), LayerRoute("knorm", 15)]),
        LayerRoute("knorm", 0.3),
        LayerRoute.per_head([LayerRoute("keydiff", 0.5), LayerRoute("knorm", 0.1)]),
        LayerRoute.per_head([LayerRoute("h2o", 25), LayerRoute("tova", 25)]),
    ], provenance={"source": "test"})


def topk_positions(engine: Engine, pre, layer: int, method: str, k: int, head: int) -> list[int]:
    """Reference selection: the ``k`` highest of the method's raw scores for one head, ties
    to the later position (SnapKV scores its whole window alike), by plain sorted()."""
    with torch.no_grad():
        scores = engine.method(method).score(pre.layers[layer], k).float()[0, head].tolist()  # n floats
    return sorted(sorted(range(len(scores)), key=lambda i: (scores[i], i))[-k:])


def greedy_with_masks(model, pre, kept: list[list[list[int]]], max_new_tokens: int):
    """Greedy tokens and first logits of the full cache with every evicted (layer, KV head,
    position) hidden by a -inf bias: the attention-bias path, not the engine's padding."""
    n = pre.n_tokens
    biases = {}
    for layer, heads in enumerate(kept):
        bias = torch.full((1, H, n), float("-inf"))
        for h, positions in enumerate(heads):
            bias[0, h, positions] = 0.0
        biases[layer] = bias
    cache = build_cache(model, [(c.keys, c.values) for c in pre.layers])
    ids = pre.prompt.question_ids
    pos = torch.arange(n, n + ids.shape[1])[None]
    eos = model.generation_config.eos_token_id
    tokens, first = [], None
    with torch.no_grad(), attention_bias(model, biases):
        while len(tokens) < max_new_tokens and (not tokens or tokens[-1] != eos):
            logits = model(input_ids=ids, past_key_values=cache, position_ids=pos).logits[0, -1]
            first = logits if first is None else first
            tokens.append(int(logits.argmax()))
            ids, pos = torch.tensor([[tokens[-1]]]), pos[:, -1:] + 1
    return tokens, first


# ---------------------------------------------------------------------------- route files


def test_per_head_route_round_trips_and_version_1_files_still_read(tmp_path):
    route = per_head_route()
    path = route.to_file(tmp_path / "r.json")
    data = json.loads(path.read_text())
    assert data["schema"] == "learnroute.route/2"
    assert data["layers"][0] == {"layer": 0, "heads": [{"method": "snapkv", "budget": 40}, {"method": "knorm", "budget": 15}]}
    assert data["layers"][1] == {"layer": 1, "method": "knorm", "budget": 0.3}
    back = Route.from_file(path)
    assert back.layers == route.layers and back.n_heads == H
    # the per-layer summary: the heads' most common method (the first among ties), mean budget
    assert (back.layers[0].method, back.layers[0].budget) == ("snapkv", 28)
    assert back.layers[2].budget == pytest.approx(0.3)
    old = {"schema": "learnroute.route/1", "layers": [{"method": "snapkv", "budget": 8}] * 2}
    assert Route.from_dict(old).budgets == [8, 8] and not Route.from_dict(old).is_per_head


def test_bad_per_head_entries_are_all_named():
    bad = {"schema": "learnroute.route/2", "layers": [
        {"layer": 0, "heads": [{"method": "snapkv", "budget": 0}, {"method": "nope", "budget": 8}]},
        {"layer": 1, "heads": [{"method": "tova", "budget": 8}], "method": "tova"},
        {"layer": 2, "heads": []},
    ]}
    with pytest.raises(RouteError) as e:
        Route.from_dict(bad)
    msg = str(e.value)
    assert "layer 0 head 0: budget 0 must be >= 1" in msg and "layer 0 head 1: unknown method 'nope'" in msg
    assert "layer 1: unknown keys ['method']" in msg and "layer 2: 'heads' must be a non-empty list" in msg
    v1 = {"schema": "learnroute.route/1", "layers": [{"heads": [{"method": "tova", "budget": 8}]}]}
    with pytest.raises(RouteError, match="need schema 'learnroute.route/2'"):
        Route.from_dict(v1)
    with pytest.raises(RouteError, match=r"different numbers of heads \[1, 2\]"):
        Route([LayerRoute.per_head([LayerRoute("tova", 8)]), LayerRoute.per_head([LayerRoute("tova", 8)] * 2)])
    with pytest.raises(RouteError, match="mix token budgets"):
        Route([LayerRoute.per_head([LayerRoute("tova", 8), LayerRoute("tova", 0.5)])])


def test_per_head_budgets_rescale_with_the_one_budget_arithmetic():
    route = Route([LayerRoute.per_head([LayerRoute("snapkv", 30), LayerRoute("tova", 10)]), LayerRoute("knorm", 20)])
    down = route.rescaled(10)  # mean 10 tokens over the 4 (layer, head) entries: an exact total of 40
    heads = [[h.budget for h in e.head_entries(2)] for e in down.layers]
    assert sum(map(sum, heads)) == 40 and heads[0][0] > heads[0][1]
    assert down.layers[1].heads is None  # a layer whose heads were alike stays one entry
    assert route.rescaled(20).layers == route.layers  # already at its mean: unchanged
    frac = Route([LayerRoute.per_head([LayerRoute("snapkv", 0.9), LayerRoute("tova", 0.1)]), LayerRoute("knorm", 0.5)])
    up = frac.rescaled(0.8)  # the 0.9 head caps at 1.0; the excess goes to the others by water filling
    flat = [h.budget for e in up.layers for h in e.head_entries(2)]
    assert max(flat) == 1.0 and sum(flat) / 4 == pytest.approx(0.8)



def test_a_route_with_fixed_layer_totals_rescales_layers_first_by_hand():
    """Layer 0's heads at 0.8 / 0.1, layer 1's at 0.1 / 0.1 (mean 0.275). At mean 0.55 (x2):
    layer totals 1.8 / 0.4 as the per-layer route's; layer 0's first head caps at 1.0 and
    its excess 0.6 goes to its own second head (0.8), layer 1 keeps 0.2 / 0.2. One water fill
    over every head (layer_totals learn) spreads the excess over all three others in
    proportion 1:1:1 instead (0.4 each): layer 0 keeps 1.4, layer 1 gets 0.8."""
    layers = [LayerRoute.per_head([LayerRoute("tova", 0.8), LayerRoute("tova", 0.1)]),
              LayerRoute.per_head([LayerRoute("knorm", 0.1), LayerRoute("knorm", 0.1)])]
    fixed, learned = Route(layers, layer_totals="fixed"), Route(layers)
    assert [h for row in fixed.rescaled(0.55).head_budgets(2) for h in row] == pytest.approx([1.0, 0.8, 0.2, 0.2])
    assert [h for row in learned.rescaled(0.55).head_budgets(2) for h in row] == pytest.approx([1.0, 0.4, 0.4, 0.4])
    per_layer = Route.from_layers(["tova", "knorm"], [0.45, 0.1]).rescaled(0.55)  # the layers' own rescaling
    assert [2 * b for b in per_layer.budgets] == pytest.approx([sum(r) for r in fixed.rescaled(0.55).head_budgets(2)])
    # the flag survives the file, hardening, rescaling and an adapter; a wrong value is named
    back = Route.from_dict(json.loads(json.dumps(fixed.to_dict())))
    assert back.layer_totals == "fixed" and back.hardened().rescaled(0.3).with_adapter(None).layer_totals == "fixed"
    assert "layer_totals" not in learned.to_dict()  # a per-head route learned as a whole writes what it always did
    with pytest.raises(RouteError, match="'layer_totals' must be one of learn, fixed, got 'frozen'"):
        Route.from_dict({**fixed.to_dict(), "layer_totals": "frozen"})
    with pytest.raises(RouteError, match="it needs a per-head route"):
        Route([LayerRoute("tova", 0.4)], layer_totals="fixed")

# ---------------------------------------------------------------------------- engine


def test_a_per_head_route_whose_heads_agree_answers_like_the_per_layer_route(tiny, tokenizer, sample):
    layered = Route.from_layers(["snapkv", "tova", "knorm", "h2o"], [40, 0.3, 25, 0.2])
    headed = Route([LayerRoute.per_head([e] * H) for e in layered.layers])
    engine = Engine(tiny, tokenizer, max_new_tokens=6)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    a, b = engine.answer(pre, [layered, headed], keep_logits=True)
    assert a.token_ids == b.token_ids and a.kv_bytes == b.kv_bytes and a.kept_per_layer == b.kept_per_layer
    torch.testing.assert_close(a.first_logits, b.first_logits)


@pytest.mark.parametrize("layout", ["split", "padded"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_heads_keep_their_own_tokens_as_masking_the_evicted_ones_does(tokenizer, sample, attn, layout):
    """Independent reference: the full cache with a -inf bias on every position a head
    evicts, positions chosen by torch.topk over each head's own method's scores. Split heads
    (each in its own buffer, attention per KV head) allocate exactly what they keep; padded
    heads allocate the layer's longest head for every head."""
    model = make_tiny(tokenizer, attn=attn, seed=3)
    route = per_head_route()
    engine = Engine(model, tokenizer, max_new_tokens=6, max_padding=100.0, head_layout=layout)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    n = pre.n_tokens
    heads = engine.kept_head_counts(route, n)
    assert heads[0] == (40, 15) and heads[2] == (int(0.5 * n), int(0.1 * n))
    kept = [[topk_positions(engine, pre, layer, h.method, k, j) for j, (h, k) in enumerate(zip(e.head_entries(H), c))]
            for layer, (e, c) in enumerate(zip(route.layers, heads))]
    want_tokens, want_first = greedy_with_masks(model, pre, kept, 6)
    # alone, and padded into one batch with per-layer routes of other shapes
    others = [Route.homogeneous("snapkv", 4, 0.3), Route.from_layers(["tova", "keydiff", "snapkv", "knorm"], [60, 12, 0.5, 20])]
    for routes in ([route], [others[0], route, others[1]]):
        got = next(r for r in engine.answer(pre, routes, keep_logits=True) if r.route is route)
        assert got.token_ids == want_tokens
        torch.testing.assert_close(got.first_logits, want_first, rtol=1e-4, atol=1e-4)
        cap = pre.layers[0]
        per_head_token = (cap.keys.shape[-1] + cap.values.shape[-1]) * cap.keys.element_size()
        assert got.kept_per_head == heads and got.kept_per_layer == [max(c) for c in heads]
        assert got.kv_bytes == per_head_token * sum(map(sum, heads))  # what the route asks for
        allocated = sum(map(sum, heads)) if layout == "split" else H * sum(map(max, heads))  # padded: the longest head
        assert got.allocated_kv_bytes == per_head_token * allocated
    assert not any(hasattr(m, "_learnroute_padding") for m in lr._hf.attention_modules(model))


def test_split_heads_of_several_routes_share_a_batch_and_rows_leave_it(tokenizer, sample, monkeypatch):
    """Per-head routes of different shapes in one batch of split heads (each head padded
    across rows only), rows leaving the batch as they end: every answer is the masked full
    cache's answer (the reference above), cut where the route's answer ended."""
    from learnroute._hf.cache import _SplitHeadsLayer
    from learnroute.engine.compress import decode_cache
    from learnroute.engine.decode import greedy_decode, stop_tokens

    model = make_tiny(tokenizer, seed=3)
    engine = Engine(model, tokenizer, max_new_tokens=8, max_padding=100.0)
    routes = [per_head_route(), Route([
        LayerRoute.per_head([LayerRoute("knorm", 0.6), LayerRoute("snapkv", 0.2)]),
        LayerRoute.per_head([LayerRoute("tova", 10), LayerRoute("knorm", 70)]),
        LayerRoute("keydiff", 0.4),
        LayerRoute.per_head([LayerRoute("knorm", 0.05), LayerRoute("h2o", 0.3)]),
    ]), Route.homogeneous("knorm", 4, 0.25)]
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    selected = []
    select = _SplitHeadsLayer.batch_select_indices
    monkeypatch.setattr(_SplitHeadsLayer, "batch_select_indices",
                        lambda self, idx: (selected.append(len(idx)), select(self, idx))[1])
    heads = [engine.kept_head_counts(r, pre.n_tokens) for r in routes]
    q = pre.prompt.question_ids.shape[1]
    cache = decode_cache(model, pre, engine._picks(pre, routes, heads), heads, q + 8, None, "split")
    assert all(isinstance(x, _SplitHeadsLayer) for x in cache.layers)  # a per-head row in every layer
    ends = [2, 8, 3]  # rows end after these many tokens; two of three ended: they leave the batch
    tokens = greedy_decode(model, cache, pre.prompt.question_ids.expand(3, q), pre.n_tokens, max_new_tokens=8,
                           stops=stop_tokens(model), done_if=lambda row, toks: len(toks) >= ends[row]).tokens
    got = engine.answer(pre, routes)
    for route, result in zip(routes, got):
        heads = engine.kept_head_counts(route, pre.n_tokens)
        kept = [[topk_positions(engine, pre, layer, h.method, k, j) for j, (h, k) in enumerate(zip(e.head_entries(H), c))]
                for layer, (e, c) in enumerate(zip(route.layers, heads))]
        want, _ = greedy_with_masks(model, pre, kept, 8)
        assert result.token_ids == want  # batched together, to the end
        assert tokens[routes.index(route)] == want[: ends[routes.index(route)]]  # rows leaving the batch
        assert result.allocated_kv_bytes == result.kv_bytes
    assert selected == [1] * 4  # the batch went on with its last row, in each (split) layer


def test_a_per_head_route_for_another_head_count_is_refused_before_any_prefill(tiny, tokenizer, sample, monkeypatch):
    route = Route([LayerRoute.per_head([LayerRoute("tova", 8)] * 3)] * 4, model="elsewhere")
    engine = Engine(tiny, tokenizer)
    monkeypatch.setattr(Engine, "prefill", lambda *a: pytest.fail("prefilled before checking the route"))
    with pytest.raises(RouteError, match=r"3 heads per per-head layer \(made for elsewhere\) but the model has 2 KV heads"):
        engine.run(sample.context, sample.question, [route])


def test_compress_refuses_heads_it_cannot_mark_as_padding(tiny, tokenizer, sample):
    engine = Engine(tiny, tokenizer)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    with pytest.raises(ValueError, match="decode it with Engine.answer"):
        engine.compress(pre, [per_head_route()])


def test_show_draws_a_layers_by_heads_grid(tmp_path, capsys):
    from learnroute.cli import main

    path = per_head_route().to_file(tmp_path / "r.json")
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    grid = {line.split()[0]: line.split()[1:] for line in out if line.strip()[:1].isdigit()}
    assert grid["0"] == ["snapkv@40", "knorm@15"] and grid["1"] == ["knorm@0.3", "knorm@0.3", "(every", "head)"]
    assert "counts (layer x head entries): h2o=1, keydiff=1, knorm=4, snapkv=1, tova=1" in out


def test_what_runs_per_layer_only_refuses_per_head_routes_before_any_forward(tmp_path):
    from learnroute.config import ConfigError, from_dict
    from learnroute.gates.config import TrainConfig
    from learnroute.press import RoutedPress

    with pytest.raises(RouteError, match="share: adakv"):
        RoutedPress(Route.adakv("snapkv", 4, 0.2))
    path = per_head_route().to_file(tmp_path / "r.json")
    with pytest.raises(ConfigError, match="is a per-head route: with granularity .layer. gates are per layer"):
        from_dict(TrainConfig, {"init_route": str(path), "learn": "budgets", "granularity": "layer"})


# ---------------------------------------------------------------------------- Ada-KV


@pytest.mark.parametrize("method, press", [("knorm", "KnormPress"), ("snapkv", "SnapKVPress")])
def test_adakv_keeps_what_kvpress_adakvpress_keeps(tiny, tokenizer, sample, method, press):
    """kvpress's AdaKVPress masks the positions it prunes (``module.masked_key_indices``);
    the engine evicts them. Same kept positions per (layer, KV head), up to ties at the
    threshold. (The same answers through kvpress's pipeline: tests/test_real_model.py; on
    this random model kvpress cannot build the fake keys its masking needs.)"""
    import kvpress
    from transformers import DynamicCache

    from learnroute.methods import resolve_budget
    from tests.test_press import assert_same_up_to_ties

    fraction = 0.3
    engine = Engine(tiny, tokenizer, max_new_tokens=6)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    n = pre.n_tokens
    route = Route.adakv(method, 4, fraction)
    heads = engine.kept_head_counts(route, n, prefill=pre)
    k = resolve_budget(fraction, n)
    assert all(sum(c) == H * k for c in heads) and any(len(set(c)) > 1 for c in heads)  # heads really differ
    ada = kvpress.AdaKVPress(getattr(kvpress, press)(compression_ratio=1 - fraction))
    with torch.no_grad(), ada(tiny):
        tiny.model(input_ids=pre.prompt.context_ids, past_key_values=DynamicCache(config=tiny.config))
    for layer, module in enumerate(lr._hf.attention_modules(tiny)):
        _, head_idx, seq_idx = module.masked_key_indices
        pruned = [set(seq_idx[head_idx == h].tolist()) for h in range(H)]
        theirs = [sorted(set(range(n)) - p) for p in pruned]
        assert [len(t) for t in theirs] == list(heads[layer]), f"layer {layer}"
        for h in range(H):
            ours = engine.kept_indices(pre, layer, method, heads[layer][h])[:, h]  # (1, k_h)
            assert_same_up_to_ties(ours, torch.tensor([theirs[h]]), engine.scores(pre, layer, method, k)[:, h],
                                   f"layer {layer} head {h}")
        del module.masked_key_indices


def test_adakv_route_files_and_bench_specs():
    route = Route.adakv("snapkv", 4, 0.2)
    back = Route.from_dict(route.to_dict())
    assert back.layers == route.layers and back.describe() == "adakv:snapkv@0.2"
    # a fraction hardened in float32 reads back as 0.07500000298023224; the label shows 0.075
    assert Route.adakv("snapkv", 4, float(torch.tensor(0.075))).describe() == "adakv:snapkv@0.075"
    assert route.to_dict()["layers"][0] == {"layer": 0, "method": "snapkv", "budget": 0.2, "share": "adakv"}
    with pytest.raises(RouteError, match="share 'nope' is not one of adakv"):
        Route.from_dict({"layers": [{"method": "snapkv", "budget": 8, "share": "nope"}]})
    with pytest.raises(RouteError, match="'share' needs schema"):
        Route.from_dict({"schema": "learnroute.route/1", "layers": [{"method": "snapkv", "budget": 8, "share": "adakv"}]})
    from learnroute.bench import route_spec_problems

    assert route_spec_problems("adakv:snapkv") == [] and "unknown method 'nope'" in route_spec_problems("adakv:nope")[0]


def learned_like_route() -> Route:
    """A per-head route over one method whose heads' budgets differ, as learned ones do."""
    return Route([LayerRoute.per_head([LayerRoute("knorm", a), LayerRoute("knorm", b)])
                  for a, b in [(0.05, 0.35), (0.3, 0.1), (0.2, 0.2), (0.6, 0.1)]], provenance={"source": "test"})


@pytest.mark.parametrize("method", ["knorm", "keydiff"])
def test_more_budget_never_evicts_a_token_a_smaller_budget_kept(tiny, tokenizer, sample, method):
    """A learned-like per-head route rescaled to larger budgets (up to heads capped at the
    whole context, their excess water-filled to the others) keeps, in every KV head, a
    superset of the positions it kept at each smaller budget, for scorers whose scores do
    not depend on the budget (docs/log.md §5.4: a drop with more cache is then the model's,
    not the route's). Positions are each head's row of the method's own top-k."""
    base = Route([LayerRoute.per_head([LayerRoute(method, e.heads[0].budget), LayerRoute(method, e.heads[1].budget)])
                  for e in learned_like_route().layers])
    engine = Engine(tiny, tokenizer)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    n = pre.n_tokens

    def kept(budget: float) -> list[list[set[int]]]:
        route = base.rescaled(budget)
        counts = engine.kept_head_counts(route, n, pre.layer_tokens, pre)  # per layer: (k_0, k_1)
        return [[set(engine.kept_indices(pre, layer, method, k)[0, h, :k].tolist()) for h, k in enumerate(ks)]
                for layer, ks in enumerate(counts)]

    budgets = [0.05, 0.1, 0.2, 0.4, 0.8]  # at 0.8 the 0.6 head of the last layer is capped at n
    sets = [kept(b) for b in budgets]
    assert max(len(h) for h in sets[-1][3]) == n  # the cap was reached
    for small, large in zip(sets, sets[1:]):
        for layer_small, layer_large in zip(small, large):
            for a, b in zip(layer_small, layer_large):
                assert len(a) <= len(b) and a <= b


def reference_split(scores: list[list[float]], priors: list[int], safeguard: float) -> list[int]:
    """Ada-KV's per-head counts by plain Python: each head's best int(prior x safeguard)
    (at least 1) positions first, then the highest remaining scores of any head until the
    layer holds sum(priors); ties to the later (head, position)."""
    n = len(scores[0])
    ranked = [sorted(range(n), key=lambda i: (row[i], i)) for row in scores]  # ascending per head
    taken = {(h, i) for h, p in enumerate(priors) for i in ranked[h][n - max(1, int(p * safeguard)):]}
    rest = sorted(((scores[h][i], h * n + i) for h in range(len(scores)) for i in range(n) if (h, i) not in taken))
    taken |= {divmod(flat, n) for _, flat in rest[len(rest) - (sum(priors) - len(taken)):]}
    return [sum(1 for h, _ in taken if h == head) for head in range(len(scores))]


@pytest.mark.parametrize("priors, safeguard", [(False, None), (True, None), (True, 0.5), (True, 1.0), (True, 0.0)])
def test_shared_route_splits_each_layers_total_by_scores_as_a_reference_does(tiny, tokenizer, sample, priors, safeguard):
    """Ada-KV inside a learned route's layer totals (issue 58 part 3): each layer keeps the
    tokens its heads' budgets add up to, split over the heads per sample as the plain-Python
    reference splits them; with the priors at safeguard 1 every head keeps its own budget."""
    from learnroute.methods import resolve_budget

    engine = Engine(tiny, tokenizer, max_new_tokens=4)
    pre = engine.prefill(engine.encode(sample.context, sample.question))
    n, route = pre.n_tokens, learned_like_route()
    shared = route.shared(safeguard, priors=priors)
    got = engine.kept_head_counts(shared, n, prefill=pre)
    fixed = engine.kept_head_counts(route, n)
    for layer, e in enumerate(route.layers):
        own = [resolve_budget(h.budget, n) for h in e.heads]
        mean = [resolve_budget(sum(h.budget for h in e.heads) / H, n)] * H
        scores = engine.scores(pre, layer, "knorm")[0].tolist()  # H_kv lists of n floats
        want = reference_split(scores, own if priors else mean, 0.2 if safeguard is None else safeguard)
        assert list(got[layer]) == want, f"layer {layer}"
        assert sum(got[layer]) == sum(own if priors else mean)
    if safeguard == 1.0:
        assert got == fixed
    else:
        assert got != fixed  # the sample's scores move tokens between heads
    # decoding runs with the per-sample counts, and the cache holds what was counted
    result = engine.answer(pre, [shared])[0]
    cap = pre.layers[0]
    per_head_token = (cap.keys.shape[-1] + cap.values.shape[-1]) * cap.keys.element_size()
    assert result.kv_bytes == per_head_token * sum(map(sum, got))
    assert result.kept_per_layer == [max(c) for c in got]


def test_shared_route_files_round_trip_and_bad_shares_are_refused(tmp_path):
    from learnroute.budget_routes import BudgetRoutes, combine
    from learnroute.cli import main

    route = learned_like_route()
    shared = route.shared(0.5, priors=True)
    back = Route.from_dict(json.loads(json.dumps(shared.to_dict())))
    assert back.layers == shared.layers
    layer = shared.to_dict()["layers"][0]
    assert layer["share"] == "adakv" and layer["safeguard"] == 0.5 and len(layer["heads"]) == H
    assert Route.homogeneous("knorm", 4, 0.3).shared().layers == Route.adakv("knorm", 4, 0.3).layers
    plain = route.shared()  # every head's prior the layer's mean: per-layer entries
    assert not plain.is_per_head and plain.layers[3] == LayerRoute("knorm", 0.35, share="adakv")
    # rescaling keeps the share, and the heads' shape under it
    bigger = shared.rescaled(0.4)
    assert all(e.share == "adakv" and e.safeguard == 0.5 for e in bigger.layers)
    assert bigger.head_budgets(H)[1][0] > bigger.head_budgets(H)[1][1]
    with pytest.raises(RouteError, match=r"safeguard .* must be a number in \[0, 1\]"):
        Route.from_dict({"layers": [{"method": "knorm", "budget": 0.2, "share": "adakv", "safeguard": 2}]})
    with pytest.raises(RouteError, match=r"layer 0: safeguard .* on a layer with a share"):
        Route.from_dict({"layers": [{"method": "knorm", "budget": 0.2, "safeguard": 0.5}]})
    with pytest.raises(RouteError, match=r"layer 0: heads that share the layer's budget by scores need one method"):
        Route([LayerRoute.per_head([LayerRoute("knorm", 0.1), LayerRoute("snapkv", 0.2)], "adakv")])
    with pytest.raises(RouteError, match=r"layer 0: its heads use \['knorm', 'snapkv'\].*one method per layer"):
        per_head_route_mixed = Route([LayerRoute.per_head([LayerRoute("knorm", 0.1), LayerRoute("snapkv", 0.2)])])
        per_head_route_mixed.shared()
    with pytest.raises(RouteError, match="priors keep each head's own budget: they need a per-head route"):
        Route.homogeneous("knorm", 4, 0.2).shared(priors=True)
    # a budget-conditional file of shared allocations: interpolation keeps the share
    both = combine([shared, shared.rescaled(0.4)])
    between = both.at(0.3)
    assert all(e.share == "adakv" and e.safeguard == 0.5 for e in between.layers)
    # `learnroute reshape --adakv` on either kind of file
    both.to_file(tmp_path / "b.json")
    route.to_file(tmp_path / "r.json")
    assert main(["reshape", str(tmp_path / "r.json"), "--adakv", "layer", "--out", str(tmp_path / "s.json")]) == 0
    assert Route.from_file(tmp_path / "s.json").layers == plain.layers
    assert main(["reshape", str(tmp_path / "b.json"), "--adakv", "priors", "--safeguard", "1",
                 "--out", str(tmp_path / "t.json")]) == 0
    made = BudgetRoutes.from_file(tmp_path / "t.json")
    assert made.budgets == both.budgets and all(e.safeguard == 1.0 for r in made.routes for e in r.layers)
    with pytest.raises(SystemExit):
        main(["reshape", str(tmp_path / "r.json"), "--safeguard", "0.5", "--out", str(tmp_path / "u.json")])
    assert not (tmp_path / "u.json").exists()


# ---------------------------------------------------------------------------- per-head gates


def test_per_head_gates_harden_to_exact_per_head_budgets_and_keep_heads_apart():
    from learnroute.gates.gates import Gates

    free = [True, True, False, True]  # layer 2 is never compressed (a local layer)
    gates = Gates(["snapkv", "tova", "knorm"], free, n_heads=2, init_methods=["snapkv", "tova", "knorm", "tova"])
    with torch.no_grad():
        gates.theta[1, 2] = 9.0  # layer 0, head 1 -> knorm
        gates.beta.copy_(torch.tensor([0.0, 2.0, 0.0, -1.0, 0.0, 0.0, 1.0, 0.5]))
    route = gates.harden(30, 200)
    assert route.is_per_head and route.n_heads == 2 and route.layers[2].heads is None
    assert [h.method for h in route.layers[0].heads] == ["snapkv", "knorm"]
    heads = [h.budget for e in route.layers if e.heads for h in e.heads]
    assert sum(heads) == 30 * 6 and all(isinstance(b, int) for b in heads)  # exact total over 6 free units
    assert heads[1] > heads[0] and heads[2] > heads[3] and heads[4] > heads[5]  # each head its own share
    frac = gates.harden(0.2, 200)
    assert sum(h.budget for e in frac.layers if e.heads for h in e.heads) / 6 == pytest.approx(0.2)
    # score mixing: a head's mask depends on its own gate only
    ranks = torch.rand(4, 3, 2, 50)  # (L, M, H, n)
    gates.theta.requires_grad_(True)
    masks = gates.soft_masks(ranks, 10.0, temperature=1.0, tau=0.05)  # (L, H, n)
    assert masks.sum(-1)[[0, 1, 3]].flatten().tolist() == pytest.approx(gates.budgets(10.0, 50)[[0, 1, 2, 3, 6, 7]].tolist(), abs=1e-3)
    (grad,) = torch.autograd.grad(masks[0, 0].pow(2).sum(), gates.theta)
    assert grad[0].abs().sum() > 0 and grad[1:].abs().sum() == 0


def test_head_spread_caps_a_head_at_its_layers_mean_times_the_spread_by_hand():
    """Layer 0's shares 0.4 / 0.05 / 0.05 (weights 2.4 / 0.3 / 0.3, floor 0) exceed 1.5 x the
    mean: the top head is capped at 1.5 and its excess split 0.75 / 0.75; layer 1 (1.2 / 0.9 /
    0.9) is inside the cap and unchanged. At a mean of 10 tokens: 10 x those weights."""
    from learnroute.gates.gates import Gates

    gates = Gates(["snapkv"], [True, True], n_heads=3, budget_floor=0.0, head_spread=1.5,
                  init_methods=["snapkv"] * 2, init_shares=[0.4, 0.05, 0.05, 0.2, 0.15, 0.15])
    assert gates.budgets(10.0, 100).tolist() == pytest.approx([15.0, 7.5, 7.5, 12.0, 9.0, 9.0], abs=1e-4)
    free = Gates(["snapkv"], [True, True], n_heads=3, budget_floor=0.0,
                 init_methods=["snapkv"] * 2, init_shares=[0.4, 0.05, 0.05, 0.2, 0.15, 0.15])
    assert free.budgets(10.0, 100).tolist() == pytest.approx([24.0, 3.0, 3.0, 12.0, 9.0, 9.0], abs=1e-4)


@pytest.mark.parametrize("budget", [0.1, 0.45, 40])
def test_head_spread_bounds_allocated_over_kept_also_where_heads_hit_the_context(budget):
    """The engine pads a layer's heads to its largest: allocated/kept = H·max/sum per layer.
    With head_spread 1.5 no layer of the hardened route exceeds 1.5, also at a mean where
    the concentrated heads are capped at the whole context, and the total stays exact."""
    from learnroute.gates.gates import Gates

    torch.manual_seed(0)
    shares = torch.softmax(3 * torch.randn(5 * 3), 0).tolist()  # concentrated: some heads far above their layer
    for spread, limit in ((None, None), (1.5, 1.5)):
        gates = Gates(["snapkv"], [True] * 5, n_heads=3, init_methods=["snapkv"] * 5, init_shares=shares, head_spread=spread)
        route = gates.harden(budget, 100)
        heads = route.head_budgets(3)  # (L, H)
        ratios = [3 * max(h) / sum(h) for h in heads]
        total = sum(sum(h) for h in heads)
        assert total == (pytest.approx(budget * 15) if isinstance(budget, float) else budget * 15)
        if limit is None:
            assert max(ratios) > 1.6  # the case the cap is for
        elif isinstance(budget, float):
            assert max(ratios) <= limit + 1e-5
        else:  # exact integer totals move each head by less than a token
            assert all(3 * (max(h) - 1) <= limit * (sum(h) + 3) for h in heads)


def test_fixed_layer_totals_split_each_layers_start_budget_over_its_heads_by_hand():
    """Two layers of two heads start at layer shares 0.75 / 0.25 (floor 0, mean 10 tokens):
    heads at 4 x share = 1.5, 1.5, 0.5, 0.5 of the mean. Logits log 3, 0 in layer 0 split it
    3:1 (22.5 / 7.5) and leave layer 1 (5 / 5): the layer totals stay 30 / 10. Learned
    totals, the same logits give softmax over all four units: 3/6, 1/6, 1/6, 1/6."""
    import math

    from learnroute.gates.gates import Gates

    kw = dict(n_heads=2, budget_floor=0.0, init_methods=["snapkv"] * 2, init_shares=[0.75, 0.25])
    fixed, learned = Gates(["snapkv"], [True, True], layer_totals="fixed", **kw), Gates(["snapkv"], [True, True], **kw)
    assert fixed.budgets(10.0, 100).tolist() == pytest.approx([15.0, 15.0, 5.0, 5.0], abs=1e-4)
    with torch.no_grad():
        for g in (fixed, learned):
            g.beta.copy_(torch.tensor([math.log(3.0), 0.0, 0.0, 0.0]))
    assert fixed.budgets(10.0, 100).tolist() == pytest.approx([22.5, 7.5, 5.0, 5.0], abs=1e-4)
    assert learned.budgets(10.0, 100).tolist() == pytest.approx([20.0, 20 / 3, 20 / 3, 20 / 3], abs=1e-4)
    # a 20-token context caps the 22.5-token head: its 2.5 go to its own layer's other head
    # (20 / 10; the layer totals stay 30 / 10), not in proportion 7.5:5:5 over every head
    assert fixed.budgets(10.0, 20).tolist() == pytest.approx([20.0, 10.0, 5.0, 5.0], abs=1e-4)
    assert fixed.harden(0.5, 20).layer_totals == "fixed" and learned.harden(0.5, 20).layer_totals == "learn"
    with pytest.raises(ValueError, match="needs n_heads > 1"):
        Gates(["snapkv"], [True, True], layer_totals="fixed", init_methods=["snapkv"] * 2)


def test_training_with_fixed_layer_totals_keeps_the_start_routes_layer_budgets(tiny_dir, tmp_path):
    """Per-head gates from a per-layer route under layer_totals=fixed: after training, the
    exported route (and the one export rebuilds from the checkpoint) keeps every layer's
    total at the start route's budget, while heads within a layer learned to differ."""
    from learnroute.cli import main
    from tests.test_gates import write_config

    shape = Route.from_layers(["tova"] * 4, [0.05, 0.05, 0.4, 0.3]).to_file(tmp_path / "shape.json")  # mean 0.2
    cfg = write_config(tmp_path, tiny_dir, granularity="head", layer_totals="fixed", init_route=str(shape),
                       learn="budgets", init_method="tova", budgets=[0.2], steps=3, eval_every=3, save_every=3,
                       select="last", lr=0.5)
    assert main(["train", "--config", str(cfg)]) == 0
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "e.json")]) == 0
    for route in (Route.from_file(tmp_path / "run" / "route.json"), Route.from_file(tmp_path / "e.json")):
        heads = route.head_budgets(2)  # (L, H)
        assert [sum(h) / 2 for h in heads] == pytest.approx([0.05, 0.05, 0.4, 0.3], abs=1e-5)
        assert any(abs(h[0] - h[1]) > 1e-3 for h in heads)  # the split was learned
        assert route.layer_totals == "fixed"  # and bench rescales it layers first


def test_per_head_gates_start_from_a_per_head_route_or_a_per_layer_one(tmp_path):
    from learnroute.config import from_dict
    from learnroute.gates.config import TrainConfig
    from learnroute.gates.start import build_gates

    route = Route([LayerRoute.per_head([LayerRoute("snapkv", 0.3), LayerRoute("tova", 0.1)]), LayerRoute("knorm", 0.2),
                   LayerRoute.per_head([LayerRoute("tova", 0.25), LayerRoute("snapkv", 0.15)])])
    path = route.to_file(tmp_path / "r.json")
    cfg = from_dict(TrainConfig, {"init_route": str(path), "granularity": "head", "methods": ["snapkv", "tova", "knorm"],
                                  "init_method": None, "budget_floor": 0.0})
    start = build_gates(cfg, 3, [True] * 3, n_heads=2).harden(0.2, 1000)
    got = [[(h.method, round(h.budget, 6)) for h in e.head_entries(2)] for e in start.layers]
    assert got == [[(h.method, h.budget) for h in e.head_entries(2)] for e in route.layers]
    layered = Route.from_layers(["tova", "snapkv", "knorm"], [0.1, 0.3, 0.2]).to_file(tmp_path / "l.json")
    cfg = from_dict(TrainConfig, {"init_route": str(layered), "granularity": "head",
                                  "methods": ["snapkv", "tova", "knorm"], "init_method": None, "budget_floor": 0.0})
    start = build_gates(cfg, 3, [True] * 3, n_heads=2).harden(0.2, 1000)
    assert [h.budget for e in start.layers for h in e.head_entries(2)] == pytest.approx([0.1, 0.1, 0.3, 0.3, 0.2, 0.2])


def test_granularity_problems_are_named(tmp_path):
    from learnroute.config import ConfigError, from_dict
    from learnroute.gates.config import TrainConfig

    with pytest.raises(ConfigError, match="granularity: expected one of 'layer', 'head', got 'kv'"):
        from_dict(TrainConfig, {"granularity": "kv"})
    with pytest.raises(ConfigError, match=r"head_spread=1.5 limits per-head budgets: it needs granularity: head"):
        from_dict(TrainConfig, {"granularity": "layer", "head_spread": 1.5})
    with pytest.raises(ConfigError, match=r"head_spread must be >= 1"):
        from_dict(TrainConfig, {"granularity": "head", "head_spread": 0.5})
    # learn: none freezes the gates at a per-layer route: the recipe's granularity does not apply
    frozen = from_dict(TrainConfig, {"granularity": "head", "learn": "none", "init_method": "snapkv", "adapter": True})
    assert not frozen.per_head_gates
    with pytest.raises(ConfigError, match="layer_totals=fixed keeps per-layer budgets .* needs granularity: head"):
        from_dict(TrainConfig, {"granularity": "layer", "layer_totals": "fixed"})
    with pytest.raises(ConfigError, match="layer_totals: expected one of 'learn', 'fixed'"):
        from_dict(TrainConfig, {"granularity": "head", "layer_totals": "frozen"})
    ada = Route.adakv("snapkv", 4, 0.2).to_file(tmp_path / "a.json")
    with pytest.raises(ConfigError, match="shares layer budgets across heads"):
        from_dict(TrainConfig, {"init_route": str(ada)})


def test_per_head_training_runs_end_to_end_and_refuses_a_route_for_other_heads(tiny_dir, tmp_path, monkeypatch, capsys):
    from learnroute.cli import main
    from learnroute.engine import Engine as E
    from tests.test_gates import write_config

    cfg = write_config(tmp_path, tiny_dir, granularity="head", steps=2, eval_every=2, save_every=2, select="last",
                       head_spread=1.2)
    assert main(["train", "--config", str(cfg)]) == 0
    route = Route.from_file(tmp_path / "run" / "route.json")
    assert route.is_per_head and route.n_heads == 2
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "h.json")]) == 0  # the spread from the checkpoint
    for r in (route, Route.from_file(tmp_path / "h.json")):
        assert max(2 * max(h) / sum(h) for h in r.head_budgets(2)) <= 1.2 + 0.05
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x.json"), "--mixture"]) == 0
    mixed = Route.from_file(tmp_path / "x.json")
    assert mixed.is_per_head and all(h.mixture for e in mixed.layers for h in e.heads)
    wrong = Route([LayerRoute.per_head([LayerRoute("tova", 0.2)] * 3)] * 4).to_file(tmp_path / "w.json")
    cfg = write_config(tmp_path, tiny_dir, granularity="head", init_route=str(wrong), output=str(tmp_path / "run2"))
    monkeypatch.setattr(E, "prefill", lambda *a: pytest.fail("prefilled before checking the route"))
    with pytest.raises(SystemExit):
        main(["train", "--config", str(cfg)])
    assert "3 heads per per-head layer but the model has 2 KV heads" in capsys.readouterr().err


def test_per_head_route_runs_in_kvpress_pipeline_as_in_the_engine(tokenizer, sample):
    """RoutedPress inside kvpress's own pipeline: each head keeps its own tokens (padded and
    masked per head); the same answer as the engine. A later plain kvpress press on the same
    model is not touched by that padding (cleared at its prefill)."""
    from kvpress import SnapKVPress
    from transformers import pipeline

    from learnroute.press import RoutedPress
    from tests.test_press import ask

    model = make_tiny(tokenizer, seed=3)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    route = per_head_route()
    (want,) = Engine(model, tokenizer, max_new_tokens=6).run(sample.context, sample.question, [route],
                                                              answer_prefix=sample.answer_prefix)
    padded = lambda: [hasattr(m, "_learnroute_press_padding") for m in lr._hf.attention_modules(model)]  # noqa: E731
    with lr.routed_attention(model):
        assert ask(pipe, sample, RoutedPress(route)) == want.answer
        assert padded() == [True, False, True, False]  # layers 0 and 2: heads of different counts
        after = ask(pipe, sample, SnapKVPress(compression_ratio=0.6))
        assert not any(padded())  # the next prefill cleared them
    fresh = pipeline("kv-press-text-generation", model=make_tiny(tokenizer, seed=3), tokenizer=tokenizer, device="cpu")
    assert after == ask(fresh, sample, SnapKVPress(compression_ratio=0.6))
    with pytest.raises(RouteError, match="3 heads per per-head layer"):
        ask(pipe, sample, RoutedPress(Route([LayerRoute.per_head([LayerRoute("tova", 8)] * 3)] * 4)))
