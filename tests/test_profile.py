"""Offline profiles: damage matrices, planted bad layers, routes from profiles."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

import learnroute as lr
from learnroute import _hf
from learnroute.config import ConfigError, load_config
from learnroute.engine import Engine
from learnroute.methods.base import Method
from learnroute.methods.registry import register_method, unregister_method
from learnroute.methods.scorers import H2O
from learnroute.profile import ProfileConfig, answer_text, build_routes, run_profile, sample_damage
from learnroute.route import RouteError
from learnroute.tasks import make_samples
from tests.test_architectures import tiny as tiny_arch

BAD_LAYERS = {1, 3}


@dataclass
class PlantedWorst(Method):
    """H2O, except in BAD_LAYERS where it keeps the *least* attended tokens (test only).

    At a budget of 0.9 H2O drops the tokens that received the least attention and this
    method drops those that received the most; on the tiny random models the KL damage
    of the latter is 4-10x larger (seeds 0-3 measured), a wide margin for the test.
    """

    name = "planted_worst"

    def score(self, layer, n_kept=None):
        s = H2O().score(layer)
        return -s if layer.module.layer_idx in BAD_LAYERS else s


@pytest.fixture
def planted():
    register_method(PlantedWorst)
    yield "planted_worst"
    unregister_method("planted_worst")


@pytest.fixture(scope="module")
def calib(tokenizer):
    return make_samples("niah_single_1", tokenizer, 2, 300, "calibration", seed=0)


def teacher_forced(engine, tokenizer, sample):
    """The reference pass's inputs: the prefill, the answer ids (1, a), question + answer
    ids (1, q + a) and their positions after the context."""
    prompt = engine.encode(sample.context, sample.question, sample.answer_prefix)
    prefill = engine.prefill(prompt)
    answer = tokenizer.encode(answer_text(sample), return_tensors="pt", add_special_tokens=False)
    ids = torch.cat([prompt.question_ids, answer], 1)
    n = prefill.n_tokens
    pos = torch.arange(n, n + ids.shape[1]).unsqueeze(0)
    return prefill, answer, ids, pos


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cell_equals_compressing_one_layer_in_a_full_forward(arch, tiny, tokenizer, calib):
    """The restart-at-layer shortcut gives the damage of a real forward with one layer compressed.

    Gemma3: its local layers (0 and 2, window shorter than the context) are never compressed
    (zero damage), and the layers above a compressed one attend within their windows.
    """
    model = tiny if arch == "llama" else tiny_arch(arch, tokenizer)
    engine = Engine(model, tokenizer)
    sample = calib[0]
    methods = ["snapkv", "knorm", "streaming_llm"]
    damage = sample_damage(engine, sample, [24], methods)
    assert damage["fixed_layers"] == ([0, 2] if arch == "gemma3" else [])
    prefill, answer, ids, pos = teacher_forced(engine, tokenizer, sample)
    q, a = prefill.prompt.question_ids.shape[1], answer.shape[1]

    def logp(route):
        cache = _hf.build_cache(model, engine.compress(prefill, [route]))
        with _hf.routed_attention(model), torch.no_grad():
            logits = model(input_ids=ids, past_key_values=cache, position_ids=pos).logits
        return torch.log_softmax(logits[0, q - 1 : q + a - 1].float(), -1)

    L = engine.n_layers
    ref = logp(lr.Route.full(L))
    for layer in range(L):
        for j, m in enumerate(methods):
            names = ["full"] * L
            names[layer] = m
            budgets = [1.0] * L
            budgets[layer] = 24
            got = logp(lr.Route.from_layers(names, budgets))
            kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
            assert damage["kl"]["24"][layer][j] == pytest.approx(kl, rel=1e-3, abs=1e-6)
            nll = (-got.gather(-1, answer[0][:, None]).mean() + ref.gather(-1, answer[0][:, None]).mean()).item()
            assert damage["nll"]["24"][layer][j] == pytest.approx(nll, rel=1e-3, abs=1e-5)
            if layer in damage["fixed_layers"]:
                assert damage["kl"]["24"][layer][j] == 0.0
            else:
                assert damage["kl"]["24"][layer][j] > 0.0  # a compressed layer changes something


def _profile_config(tmp_path, tiny_dir, **over):
    items = [
        f"model={tiny_dir}",
        "tasks={niah_single_1: 2}",
        "context_tokens=300",
        "budgets=[16]",
        f"output={tmp_path / 'profile'}",
    ] + [f"{k}={v}" for k, v in over.items()]
    return load_config(ProfileConfig, None, items)


def test_profile_avoids_a_method_exactly_where_it_is_bad(planted, tiny_dir, tmp_path):
    cfg = _profile_config(tmp_path, tiny_dir, methods=f"[{planted}, h2o]", budgets="[0.9, 16]")
    out = run_profile(cfg, progress=False)
    profile = json.loads((out / "profile.json").read_text())
    # Outside BAD_LAYERS both keep the same tokens (a tie, which goes to the first listed).
    expected = ["h2o" if layer in BAD_LAYERS else planted for layer in range(4)]
    assert profile["best"]["0.9"] == expected
    route = lr.Route.from_file(out / "profile_0.9.json")
    assert route.methods == expected and set(route.budgets) == {0.9}
    assert route.provenance["source"] == "profile"
    alloc = lr.Route.from_file(out / "profile_16_alloc.json")
    assert sum(alloc.budgets) == 16 * 4  # the same total, exactly
    sens = profile["sensitivity"]["16"]
    assert alloc.budgets.index(max(alloc.budgets)) == sens.index(max(sens))  # most sensitive gets most
    # the layers where the planted method is bad are exactly the ones with damage gaps
    kl = profile["damage"]["kl"]["0.9"]
    for layer in range(4):
        gap = kl[layer][0] - kl[layer][1]
        assert (gap > 0) == (layer in BAD_LAYERS)
    assert (out / "heatmap.png").is_file()
    ids = [json.loads(line)["id"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all("/calibration/" in i for i in ids)


def test_profile_routes_load_in_bench_and_routed_press(planted, tiny_dir, tmp_path, tokenizer):
    from learnroute.bench import BenchConfig, run_bench
    from learnroute.runs import read_jsonl

    out = run_profile(_profile_config(tmp_path, tiny_dir, methods="[knorm, h2o]"), progress=False)
    bench = load_config(
        BenchConfig,
        None,
        [
            f"model={tiny_dir}",
            "tasks={niah_single_1: 1}",
            "context_tokens=300",
            "budgets=[16]",
            f"routes=[{out}/profile_*.json]",
            "max_new_tokens=3",
            f"output={tmp_path / 'bench'}",
        ],
    )
    run_bench(bench)
    rows = read_jsonl(tmp_path / "bench" / "results.jsonl")
    assert {r["route"] for r in rows} == {f"{out}/profile_16.json", f"{out}/profile_16_alloc.json"}
    # and in kvpress's own pipeline
    from transformers import pipeline

    model, tok = lr.load_model(tiny_dir)
    route = lr.Route.from_file(out / "profile_16_alloc.json")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    sample = make_samples("niah_single_1", tok, 1, 300, "eval")[0]
    assert len(set(route.budgets)) > 1  # per-layer budgets: decoded inside the press's scope
    (ref,) = lr.Engine(model, tok, max_new_tokens=3).run(sample.context, sample.question, [route])
    press = lr.RoutedPress(route)
    with press.scope(model):
        res = pipe(sample.context, question=sample.question, press=press, max_new_tokens=3)
    assert res["answer"] == ref.answer


def test_profile_refused_for_another_model_or_method_set(planted, tiny_dir, tmp_path):
    out = run_profile(_profile_config(tmp_path, tiny_dir, methods="[knorm, h2o]"), progress=False)
    profile = json.loads((out / "profile.json").read_text())
    with pytest.raises(RouteError, match="profile has 4 layers but the model has 30"):
        build_routes(profile, model=profile["model"], n_layers=30)
    with pytest.raises(RouteError, match="made for model"):
        build_routes(profile, model="SmolLM2-135M-Instruct", n_layers=4)
    with pytest.raises(RouteError, match="covers methods"):
        build_routes(profile, model=profile["model"], n_layers=4, methods=["snapkv", "tova"])


def test_profile_bad_input():
    with pytest.raises(ConfigError, match="calibration set is empty"):
        load_config(ProfileConfig, None, ["tasks={}"])
    with pytest.raises(ConfigError) as e:
        load_config(ProfileConfig, None, ["methods=[snapkv, nope]", "select_by=loss", "tasks={longbench/trec: 2}"])
    msg = str(e.value)
    assert "unknown candidate method 'nope'" in msg and "select_by: expected one of 'kl', 'nll', got 'loss'" in msg
    assert "LongBench is evaluation data only" in msg


def test_placement_study_ranks_the_given_route(tiny_dir, tmp_path):
    from learnroute.runs import read_jsonl
    from learnroute.cli import main
    from learnroute.placement import draw_placements, n_distinct_placements
    from learnroute.report import summarize

    route = lr.Route.from_layers(["snapkv", "snapkv", "knorm", "streaming_llm"], 32, model="tiny", source="test")
    placements = draw_placements(route, 100, seed=3)
    # 4!/2! = 12 placements exist; the given one is excluded, the rest are distinct
    assert n_distinct_placements(route.methods) == 12 and len(placements) == 11
    assert len({tuple(p.methods) for p in placements} | {tuple(route.methods)}) == 12
    assert all(sorted(p.methods) == sorted(route.methods) and p.budgets == route.budgets for p in placements)
    assert [p.methods for p in draw_placements(route, 5, seed=3)] == [p.methods for p in placements[:5]]

    route.to_file(tmp_path / "given.json")
    out = tmp_path / "placement"
    argv = [
        "placement",
        f"route={tmp_path / 'given.json'}",
        "n_placements=5",
        f"model={tiny_dir}",
        "tasks={niah_single_1: 2}",
        "context_tokens=200",
        "max_new_tokens=3",
        f"output={out}",
    ]
    assert main(argv) == 0
    result = json.loads((out / "placement.json").read_text())
    assert result["of"] == 6 and 1 <= result["rank"] <= 6 and len(result["placement_scores"]) == 5
    # the rank is the given route's among the scores written beside it (ties share the better rank)
    given, others = result["given_score"], result["placement_scores"]
    assert result["rank"] == 1 + sum(s > given for s in others) and result["ties"] == others.count(given)
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 2 * (6 + 1)  # 2 samples x (given + 5 placements + full)
    assert (out / "placement.png").is_file() and "rank" in (out / "placement.md").read_text()
    before = (out / "summary.csv").read_text()
    summarize(out, rescore=True)  # a placement folder re-scores like any bench folder
    assert (out / "summary.csv").read_text() == before
    # a rerun resumes (nothing recomputed); another draw in the same folder is refused
    assert main(argv) == 0 and len(read_jsonl(out / "results.jsonl")) == len(rows)
    with pytest.raises(RouteError, match="exists with another route"):
        from learnroute.config import load_config as lc
        from learnroute.placement import PlacementConfig, run_placement

        run_placement(lc(PlacementConfig, None, argv[1:] + ["placement_seed=9"]))


@pytest.mark.parametrize(
    "scores, rank, ties, better_than",
    [
        # two better (e, a), two tied (b, d), one worse (c): rank 3 of 6, better than 1 of 5
        ({"given": 0.5, "a": 0.75, "b": 0.5, "c": 0.25, "d": 0.5, "e": 1.0}, 3, 2, 1 / 5),
        ({"given": 1.0, "a": 0.0, "b": 0.5}, 1, 0, 1.0),  # the best
        ({"given": 0.0, "a": 0.5, "b": 0.25}, 3, 0, 0.0),  # the worst
        ({"given": 0.25, "a": 0.25, "b": 0.25}, 1, 2, 0.0),  # all tied: rank 1, better than none
        ({"given": 0.25, "a": 0.5, "b": 0.5, "c": 0.25, "d": 0.0}, 3, 1, 1 / 4),  # ties above and at
        ({"given": 0.5}, 1, 0, 0.0),  # alone
    ],
)
def test_placement_rank_matches_a_hand_computed_ranking(scores, rank, ties, better_than):
    from learnroute.placement import rank_of

    got = rank_of(scores, "given")
    assert got == {"rank": rank, "of": len(scores), "ties": ties, "given_score": scores["given"],
                   "better_than_fraction": pytest.approx(better_than)}


def test_calibration_samples_never_equal_eval_samples(tokenizer):
    """What profile (calibration) and bench (eval) load for the same tasks and seed is disjoint."""
    from learnroute.tasks.suite import load_task

    for task in ["niah_single_2", "multihop_qa", "variable_tracking"]:
        calib = load_task(task, tokenizer, 4, 300, "calibration", seed=0)
        evals = load_task(task, tokenizer, 4, 300, "eval", seed=0)
        assert not {s.context for s in calib} & {s.context for s in evals}
        assert not {tuple(s.answers) for s in calib} & {tuple(s.answers) for s in evals}


def test_sensitivity_allocation_keeps_the_total_floor_and_cap():
    from learnroute.profile import allocate_by_sensitivity

    sens = [0.5, 0.0, 0.01, 2.0]
    alloc = allocate_by_sensitivity(sens, 100, cap=250)
    assert sum(alloc) == 400 and max(alloc) <= 250  # same total, never above the context
    assert min(alloc) >= 5  # floor: 5 % of the budget
    assert alloc[3] == 250 and alloc[0] > alloc[2] > alloc[1] - 1  # capped layer's excess went to the others
    frac = allocate_by_sensitivity(sens, 0.5)
    assert sum(frac) == pytest.approx(2.0) and max(frac) <= 1.0
    assert allocate_by_sensitivity([0.0] * 3, 7) == [7, 7, 7]  # no signal: uniform


def test_head_cell_equals_masking_that_heads_evicted_tokens_in_a_full_forward(tiny, tokenizer, calib):
    """granularity head: a cell compresses one KV head of one layer; its damage equals a
    plain full-cache forward with a -inf bias on the positions that head evicts there."""
    engine = Engine(tiny, tokenizer)
    sample = calib[0]
    methods = ["snapkv", "knorm"]
    damage = sample_damage(engine, sample, [24], methods, granularity="head")
    prefill, answer, ids, pos = teacher_forced(engine, tokenizer, sample)
    n, q, a = prefill.n_tokens, prefill.prompt.question_ids.shape[1], answer.shape[1]
    full_kv = [(c.keys, c.values) for c in prefill.layers]

    def logp(biases):
        with torch.no_grad(), _hf.attention_bias(tiny, biases):
            logits = tiny(input_ids=ids, past_key_values=_hf.build_cache(tiny, full_kv), position_ids=pos).logits
        return torch.log_softmax(logits[0, q - 1 : q + a - 1].float(), -1)

    ref = logp({})
    H = engine.n_kv_heads
    assert len(damage["kl"]["24"][0]) == H and len(damage["kl"]["24"][0][0]) == len(methods)
    for layer in range(engine.n_layers):
        for h in range(H):
            for j, m in enumerate(methods):
                bias = torch.zeros(1, H, n)
                bias[0, h] = float("-inf")
                bias[0, h, engine.kept_indices(prefill, layer, m, 24)[0, h]] = 0.0
                kl = (ref.exp() * (ref - logp({layer: bias}))).sum(-1).mean().item()
                assert damage["kl"]["24"][layer][h][j] == pytest.approx(kl, rel=1e-3, abs=1e-6), (layer, h, m)


def test_head_profile_gives_per_head_routes(tiny_dir, tmp_path):
    config = _profile_config(tmp_path, tiny_dir, granularity="head", budgets="[0.2]", methods="[snapkv, knorm, tova]")
    out = run_profile(config, progress=False)
    profile = json.loads((out / "profile.json").read_text())
    assert profile["n_heads"] == 2 and len(profile["best"]["0.2"][0]) == 2
    best = lr.Route.from_file(out / "profile_0.2.json")
    alloc = lr.Route.from_file(out / "profile_0.2_alloc.json")
    assert best.is_per_head and alloc.is_per_head
    rows = [row for layer in profile["damage"]["kl"]["0.2"] for row in layer]  # (layer, head) rows
    got = [h.method for e in best.layers for h in e.heads]
    assert got == [["snapkv", "knorm", "tova"][min(range(3), key=lambda i: (r[i], i))] for r in rows]
    budgets = [h.budget for e in alloc.layers for h in e.heads]
    assert sum(budgets) / len(budgets) == pytest.approx(0.2)
    sens = [min(r) for r in rows]  # the most sensitive head gets the most
    assert budgets[max(range(len(sens)), key=sens.__getitem__)] == max(budgets)
    with pytest.raises(ConfigError, match="granularity: expected one of 'layer', 'head', got 'kv'"):
        _profile_config(tmp_path, tiny_dir, granularity="kv")


def test_duo_route_keeps_the_heads_streaming_hurts_most_whole():
    from learnroute.profile import DUO_WINDOW, build_routes

    # 3 layers x 2 heads, methods [snapkv, streaming_llm]: streaming damage per (layer, head)
    streaming = [[0.9, 0.1], [0.2, 0.8], [0.05, 0.3]]
    damage = [[[0.01, s] for s in layer] for layer in streaming]
    profile = {"schema": "learnroute.profile/1", "model": None, "n_layers": 3, "methods": ["snapkv", "streaming_llm"],
               "select_by": "kl", "n_tokens_min": 1000, "fixed_layers": [], "damage": {"kl": {"0.2": damage}}}
    duo = build_routes(profile, model=None, n_layers=3)["profile_0.2_duo"]
    # 6 heads x 200 tokens = 1200 = n_full x 1000 + (6 - n_full) x 64  ->  n_full = round(6 x 136 / 936) = 1
    heads = [(h.method, h.budget) for e in duo.layers for h in e.heads]
    assert heads.count(("full", 1.0)) == 1 and heads[0] == ("full", 1.0)  # the 0.9 head
    assert heads.count(("streaming_llm", DUO_WINDOW / 1000)) == 5
    profile["damage"]["kl"] = {"0.5": damage}
    duo = build_routes(profile, model=None, n_layers=3)["profile_0.5_duo"]
    full = [i for i, h in enumerate(h for e in duo.layers for h in e.heads) if h.method == "full"]
    assert full == [0, 3, 5]  # round(6 x 436 / 936) = 3: the three most damaged (0.9, 0.8, 0.3)
