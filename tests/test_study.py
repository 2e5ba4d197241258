"""The study pipeline end to end on a tiny model, then again with nothing to redo."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from learnroute.report import paired
from learnroute.study import analysis as A
from learnroute.study import config as C
from learnroute.study import recipe as R
from learnroute.study import render as M
from learnroute.bench import BenchConfig, run_bench
from learnroute.cli import main
from learnroute.config import ConfigError, load_config
from learnroute.route import Route
from learnroute.runs import read_jsonl
from tests.conftest import PER_LAYER


def mean_difference(a: dict, b: dict) -> tuple[int, float]:
    """Plain python, not learnroute.report: the samples both routes answered, and the mean of
    their per-sample differences (what a paired difference's point estimate is)."""
    both = sorted(a.keys() & b.keys())
    return len(both), sum(a[k] - b[k] for k in both) / len(both)


def study_config(tmp_path, tiny_dir):
    cfg = {
        "model": str(tiny_dir),
        "context_tokens": 200,
        "calibration": {"niah_single_1": 2, "niah_multikey": 2},
        "eval_tasks": {"niah_single_1": 2, "niah_single_2": 2},
        "budgets": [0.25, 40],
        "aware_budgets": [0.25, 0.5],  # the aware protocol at its own budgets
        "protocols": ["agnostic", "aware"],
        "methods": ["snapkv", "tova", "knorm"],
        "pyramid": [],  # the control pyramid:<best homogeneous method> runs anyway
        "train": {**PER_LAYER, "steps": 3, "batch_size": 2, "eval_every": 3, "save_every": 3, "lr": 0.3,
                  "select": "last"},
        "variants": {
            "learned": {},
            "budgets_only": {"learn": "budgets", "init_method": "@profile_best"},
            "warm": {"init_route": "@profile_alloc", "lr": 0.01},
            "homog_adapter": {"learn": "none", "adapter": True, "init_method": "@profile_best", "lora_rank": 2},
            "per_head": {"learn": "budgets", "init_method": "@profile_best", "granularity": "head"},
            # a second stage: per-head splits of budgets_only's trained layer totals
            "split": {"learn": "budgets", "init_method": "@profile_best", "granularity": "head",
                      "layer_totals": "fixed", "init_route": "@variant:budgets_only"},
        },
        "mixture_of": ["learned"],
        # a route made elsewhere (say trained at another length), benched beside the study's own
        "imported_routes": {"mixed": str(tmp_path / "made_elsewhere.json")},
        "per_budget": True,
        "seeds": [1],  # the main variant once more, with optimisation seed 1
        "profile_all_budgets": True,
        "placement_variant": ["warm", "learned"],
        "placements": 3,
        "bootstrap": 200,
        "max_new_tokens": 3,
        "output": str(tmp_path / "study"),
    }
    Route.from_layers(["tova", "snapkv", "knorm", "tova"], 0.3, source="elsewhere").to_file(
        tmp_path / "made_elsewhere.json")
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def study(tiny_dir, tmp_path_factory):
    """The study of :func:`study_config` run once on the tiny model; the tests below read it."""
    import contextlib
    import io
    from types import SimpleNamespace

    tmp_path = tmp_path_factory.mktemp("study")
    path = study_config(tmp_path, tiny_dir)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["study", "--config", str(path)]) == 0
    out = tmp_path / "study"
    return SimpleNamespace(
        tmp=tmp_path, path=path, out=out, err=err.getvalue(), result=json.loads((out / "study.json").read_text()),
        raw=read_jsonl(out / "bench_agnostic" / "results.jsonl"),
        controls=read_jsonl(out / "bench_agnostic_controls" / "results.jsonl"),
    )


def own_scores(raw: list[dict], stem: str, budget) -> dict[str, float]:
    """sample -> score of the route file ``<stem>.json`` (or the spec ``stem``) at ``budget``."""
    return {r["sample_id"]: r["score"] for r in raw
            if (r["route"] == stem or r["route"].endswith(f"/{stem}.json")) and r["budget"] == budget}


def test_study_stages_share_their_prefills_and_answer_as_separate_runs(study, tmp_path):
    assert "| protocol | budget | Q1" in study.err
    # The stages share their prefills: 4 calibration + 4 eval samples x 2 protocols are
    # prefilled once each, then served again (training, controls, placement).
    reused, made = map(int, re.search(r"prefills reused (\d+), made (\d+) \(0 not kept", study.err).groups())
    assert made == 12 and reused >= made
    # The controls, whose samples all came from the store, answer as a bench of their own does.
    controls = load_config(BenchConfig, study.out / "bench_agnostic_controls" / "config.yaml",
                           [f"output={tmp_path / 'controls_alone'}"])
    run_bench(controls)
    alone = {(r["sample_id"], r["route"], json.dumps(r["budget"])): r["prediction"]
             for r in read_jsonl(tmp_path / "controls_alone" / "results.jsonl")}
    shared = {(r["sample_id"], r["route"], json.dumps(r["budget"])): r["prediction"] for r in study.controls}
    assert alone == shared and len(alone) >= 8
    for sub in ("profile/profile.json", "train/learned/route.json", "train/budgets_only/route.json",
                "train/warm/route.json", "routes/learned.json", "routes/learned_mixture.json",
                "bench_agnostic/summary.md", "bench_aware/summary.md", "study.json", "study.md"):
        assert (study.out / sub).is_file(), sub


def test_study_routes_are_described_by_the_manifest(study):
    """routes/manifest.json says what each route is; every route file it names exists, and
    every route file the export wrote is in it."""
    manifest = json.loads((study.out / "routes" / "manifest.json").read_text())
    entries = {e["name"]: e for e in manifest["routes"]}
    on_disk = {p.stem for p in (study.out / "routes").glob("*.json")} - {"manifest"}
    assert on_disk == set(entries)
    assert entries["learned"] == {"name": "learned", "kind": "learned", "variant": "learned"}  # cold: no start
    assert entries["learned_seed1"] == {"name": "learned_seed1", "kind": "seed", "variant": "learned", "seed": 1}
    assert entries["learned_warm"]["start"] == "learned_warm_start"
    assert entries["learned_warm_start"] == {"name": "learned_warm_start", "kind": "start", "variant": "warm",
                                             "start_of": "learned_warm"}
    assert entries["learned_at_40"] == {"name": "learned_at_40", "kind": "per_budget", "variant": "learned",
                                        "budget": 40}
    assert entries["learned_per_head"]["per_head"] is True and entries["learned_mixture"]["kind"] == "mixture"
    assert entries["imported_mixed"] == {"name": "imported_mixed", "kind": "imported"}
    # the adapter variant's start (the profile's best method, uniform budgets, no adapter) is
    # the budgets-only variant's: benched once, answering both variants' vs_start
    assert entries["learned_homog_adapter_start"]["benched_as"] == "learned_budgets_only_start"
    assert not any("benched_as" in e for n, e in entries.items() if n != "learned_homog_adapter_start")
    # a folder made before the manifest: the one its config implies is the one written
    config = load_config(C.StudyConfig, study.out / "config.yaml")
    from learnroute.study.manifest import build_manifest

    built = build_manifest(config, {"learned_homog_adapter_start": "learned_budgets_only_start"})
    assert [e.to_dict() for e in built] == manifest["routes"]


def test_study_compares_every_variant_with_the_main_route(study):
    result = study.result
    for protocol, want in (("agnostic", [0.25, 40]), ("aware", [0.25, 0.5])):
        budgets = result["protocols"][protocol]["budgets"]
        assert [b["budget"] for b in budgets] == want
        for b in budgets:
            assert b["vs_best_homogeneous"]["n"] == 4  # paired over the 4 eval samples
            assert set(b["variants_vs_main"]) == {
                "learned_budgets_only", "learned_warm", "learned_mixture", "learned_homog_adapter",
                "learned_per_head",  # granularity: head, a per-head route
                "learned_split",  # per-head splits of budgets_only's layer totals
                "learned_per_budget",  # learned@0.25 at 0.25, learned@40 at 40 (aware: @0.5): one row
                "imported_mixed",  # imported_routes
            }
    # per task: the learned route's mean over that task's samples, from the raw rows
    own = [r["score"] for r in study.raw if r["route"].endswith("/learned.json") and r["budget"] == 0.25
           and r["task"] == "niah_single_2"]
    by_task = result["protocols"]["agnostic"]["budgets"][0]["by_task"]["learned"]
    assert len(own) == 2 and by_task["niah_single_2"] == pytest.approx(sum(own) / 2)
    assert "| niah_single_1 (" in (study.out / "study.md").read_text()
    for b in result["protocols"]["agnostic"]["budgets"]:
        # the imported route: copied into routes/, benched at every budget, minus the main route
        mine, main_own = own_scores(study.raw, "imported_mixed", b["budget"]), own_scores(study.raw, "learned", b["budget"])
        assert len(mine) == 4 and b["variants_vs_main"]["imported_mixed"]["diff"] == pytest.approx(
            sum(mine[k] - main_own[k] for k in mine) / 4)
    copied = Route.from_file(study.out / "routes" / "imported_mixed.json")
    assert [x.method for x in copied.layers] == ["tova", "snapkv", "knorm", "tova"]
    assert copied.provenance["source"] == "elsewhere"


def test_study_placement_ranks_the_chosen_variant(study):
    out, result = study.out, study.result
    # placement_variant: the first of warm, learned whose route has two or more methods. The
    # warm variant starts from the profile's per-layer best methods, which differ by layer on
    # this model: placement runs (a study whose routes all use one method skips it).
    methods = {v: {layer["method"] for layer in json.loads((out / "routes" / f"{v}.json").read_text())["layers"]}
               for v in ("learned_warm", "learned")}
    chosen = next((v for v, m in methods.items() if len(m) > 1), None)
    assert chosen is not None, methods
    assert (out / "placement" / "placement.json").is_file() and (out / "placement" / "placement.md").is_file()
    q4 = result["placement"]
    assert q4["of"] == 4 and q4["variant"] == chosen
    placed = json.loads((out / "placement_route.json").read_text())
    assert {layer["method"] for layer in placed["layers"]} == methods[chosen]
    # the rank is the given route's among the placement scores the study wrote (ties share the better rank)
    placement = json.loads((out / "placement" / "placement.json").read_text())
    others = placement["placement_scores"]
    assert len(others) == 3 and q4["given_score"] == placement["given_score"]
    assert q4["rank"] == 1 + sum(s > q4["given_score"] for s in others)
    assert q4["ties"] == sum(s == q4["given_score"] for s in others)
    assert "## Q4: placement" in (out / "study.md").read_text()


def test_study_seeds_train_on_the_same_samples_and_report_their_spread(study):
    out = study.out
    seeded = yaml.safe_load((out / "train" / "learned_seed1" / "config.yaml").read_text())
    base = yaml.safe_load((out / "train" / "learned" / "config.yaml").read_text())
    assert seeded["train_seed"] == 1 and seeded["seed"] == base["seed"]
    assert json.loads((out / "train" / "learned_seed1" / "split.json").read_text()) == json.loads(
        (out / "train" / "learned" / "split.json").read_text())
    for b in study.result["protocols"]["agnostic"]["budgets"]:
        sd = b["seeds"]
        assert set(sd["routes"]) == {"learned", "learned_seed1"} and sd["min"] <= sd["max"]
        own = own_scores(study.raw, "learned_seed1", b["budget"])
        assert len(own) == 4 and sd["routes"]["learned_seed1"] == pytest.approx(sum(own.values()) / 4)
    assert not (out / "routes" / "learned_seed1_start.json").exists()


def test_study_benches_each_warm_variant_beside_its_untrained_start(study):
    out, result, raw = study.out, study.result, study.raw
    assert not (out / "routes" / "learned_start.json").exists()  # `learned` starts cold: no start to bench
    for b in result["protocols"]["agnostic"]["budgets"]:
        assert set(b["vs_start"]) == {"learned_budgets_only", "learned_warm", "learned_homog_adapter",
                                      "learned_per_head", "learned_split"}
    budgets_only = json.loads((out / "routes" / "learned_budgets_only.json").read_text())
    profile = json.loads((out / "profile" / "profile.json").read_text())
    # the budgets-only variant trained the profile's least damaging method in every layer
    assert len({layer["method"] for layer in budgets_only["layers"]}) == 1
    assert budgets_only["layers"][0]["method"] in profile["methods"]
    start = json.loads((out / "routes" / "learned_budgets_only_start.json").read_text())
    assert start["provenance"]["source"] == "start"
    # a shared start (see the manifest test): benched once, answering both variants' vs_start
    assert json.loads((out / "routes" / "learned_homog_adapter_start.json").read_text())["layers"] == start["layers"]
    assert not any(r["route"].endswith("learned_homog_adapter_start.json") for r in raw)
    for b in result["protocols"]["agnostic"]["budgets"]:
        n, want = mean_difference(own_scores(raw, "learned_homog_adapter", b["budget"]),
                                  own_scores(raw, "learned_budgets_only_start", b["budget"]))
        assert n == 4 and b["vs_start"]["learned_homog_adapter"]["diff"] == pytest.approx(want)
    # budgets only from @profile_best: untrained, that is the homogeneous route of that method,
    # so both decode the same answers on every eval sample
    method = budgets_only["layers"][0]["method"]
    assert {layer["method"] for layer in start["layers"]} == {method}
    assert [layer["budget"] for layer in start["layers"]] == pytest.approx([0.25] * 4)
    got = {(r["sample_id"], r["budget"]): r["prediction"] for r in raw if r["route"].endswith("learned_budgets_only_start.json")}
    want = {(r["sample_id"], r["budget"]): r["prediction"] for r in raw if r["route"] == f"homogeneous:{method}"}
    assert len(got) == 8 and got == want


def test_study_per_head_variants_against_the_main_route_and_adakv(study):
    out, result, raw = study.out, study.result, study.raw
    budgets_only = Route.from_file(out / "routes" / "learned_budgets_only.json")
    # the second stage kept budgets_only's trained layer totals (both exported at 0.25)
    split = Route.from_file(out / "routes" / "learned_split.json")
    assert len({e.budget for e in budgets_only.layers}) > 1  # trained away from uniform
    assert [sum(h) / 2 for h in split.head_budgets(2)] == pytest.approx([e.budget for e in budgets_only.layers])
    per_head = Route.from_file(out / "routes" / "learned_per_head.json")
    assert per_head.is_per_head and per_head.n_heads == 2  # the tiny Llama's KV heads
    for b in result["protocols"]["agnostic"]["budgets"]:  # per-head minus per-layer main and adakv
        q9 = b["per_head"]["learned_per_head"]
        assert q9["vs_main"]["n"] == 4 and q9["vs_adakv"]["n"] == 4
        # the cache it allocates over what it keeps, summed over its answers: split heads, nothing more
        mine = [r for r in raw if r["route"].endswith("/learned_per_head.json") and r["budget"] == b["budget"]]
        want = sum(r["allocated_kv_bytes"] for r in mine) / sum(r["kv_bytes"] for r in mine)
        assert len(mine) == 4 and want == 1.0 and q9["allocated_over_kept"] == pytest.approx(want)
    assert "Q9, per-head learning" in (out / "study.md").read_text()
    assert "| learned_per_head | allocated / kept bytes | x1.00 |" in (out / "study.md").read_text()
    # the per-head variant as the main route: it is not compared with itself, and the
    # per-layer main becomes a variants_vs_main row against it, paired over the same samples
    as_main = A.analyze(out, main_variant="per_head")["protocols"]["agnostic"]["budgets"]
    for b, b0 in zip(as_main, result["protocols"]["agnostic"]["budgets"]):
        assert b["per_head"]["learned_per_head"]["vs_main"] is None
        assert b["per_head"]["learned_per_head"]["vs_adakv"]["n"] == 4
        assert b["variants_vs_main"]["learned"]["diff"] == pytest.approx(
            -b0["per_head"]["learned_per_head"]["vs_main"]["diff"])
    assert "n/a for itself" in (out / "study_per_head.md").read_text()


def test_study_answers_in_and_out_of_family_against_their_own_controls(study):
    result, raw = study.result, study.raw
    fam = result["protocols"]["agnostic"]["families"]
    assert fam["in"]["full_by_task"].keys() == {"niah_single_1"} and fam["out"]["full_by_task"].keys() == {"niah_single_2"}
    out_scores = [r["score"] for r in raw if r["route"].endswith("/learned.json") and r["budget"] == 0.25
                  and r["task"] == "niah_single_2"]
    assert fam["out"]["budgets"][0]["avg"]["learned"] == pytest.approx(sum(out_scores) / 2)
    assert fam["out"]["budgets"][0]["vs_best_homogeneous"]["n"] == 2
    assert "out-of-family (tasks they never saw: niah_single_2" in (study.out / "study.md").read_text()
    # the controls pyramid: and adakv:<best homogeneous method>, per budget, on the same eval samples
    from statistics import mean
    for b in result["protocols"]["agnostic"]["budgets"]:
        homog = {r["route"] for r in raw if r["route"].startswith("homogeneous:")}
        avg = {h: mean(r["score"] for r in raw if r["route"] == h and r["budget"] == b["budget"]) for h in sorted(homog)}
        best = max(sorted(avg), key=avg.get)  # ties: the first by name
        assert b["best_homogeneous"] == best and b["pyramid_best"] == "pyramid:" + best.split(":")[1]
        assert b["adakv_best"] == "adakv:" + best.split(":")[1]  # Ada-KV's split of each layer over its heads
        for kind in ("pyramid", "adakv"):
            assert b[f"vs_{kind}_best"]["n"] == 4
            assert {r["sample_id"] for r in study.controls if r["route"] == b[f"{kind}_best"]
                    and r["budget"] == b["budget"]} == {r["sample_id"] for r in raw if r["route"] == "full"}
    # each family split compares against its own best homogeneous method's controls
    for split in ("in", "out"):
        for b in fam[split]["budgets"]:
            method = b["best_homogeneous"].split(":")[1]
            assert (b["pyramid_best"], b["adakv_best"]) == (f"pyramid:{method}", f"adakv:{method}"), (split, b["budget"])


def test_study_pins_per_budget_routes_and_protocol_budgets(study):
    out = study.out
    # the adapter variant: a fixed one-method route with its LoRA folder beside it
    adapted = json.loads((out / "routes" / "learned_homog_adapter.json").read_text())
    assert len({layer["method"] for layer in adapted["layers"]}) == 1
    assert (out / "routes" / adapted["provenance"]["adapter"] / "adapter_config.json").is_file()
    # profile_all_budgets: each budget's profile routes run at that budget only
    pinned = {(r["route"].rsplit("/", 1)[-1], r["budget"]) for r in study.raw if "/profile/" in r["route"]}
    assert pinned == {(f"profile_{b}{s}.json", b) for b in (0.25, 40) for s in ("", "_alloc")}
    # per_budget: each budget's own route runs at that budget only
    own = {(r["route"].rsplit("/", 1)[-1], r["budget"]) for r in study.raw if "learned_at_" in r["route"]}
    assert own == {("learned_at_0.25.json", 0.25), ("learned_at_40.json", 40)}
    # the aware protocol: its own budgets, the profile's and per-budget routes at those
    aware = read_jsonl(out / "bench_aware" / "results.jsonl")
    assert {r["budget"] for r in aware} == {None, 0.25, 0.5}  # None: the full cache
    assert {(r["route"].rsplit("/", 1)[-1], r["budget"]) for r in aware if "learned_at_" in r["route"]} == {
        ("learned_at_0.25.json", 0.25), ("learned_at_0.5.json", 0.5)}
    assert {(r["route"].rsplit("/", 1)[-1], r["budget"]) for r in aware if "/profile/" in r["route"]} == {
        (f"profile_{b}{s}.json", b) for b in (0.25, 0.5) for s in ("", "_alloc")}
    # the budget-robust route trained over every budget of both protocols
    trained = yaml.safe_load((out / "train" / "learned" / "config.yaml").read_text())
    assert trained["budgets"] == [0.25, 40, 0.5]


def test_report_rescore_recomputes_a_changed_prediction_from_the_references(study, tmp_path):
    """A copy of the study with one of the main route's wrong predictions replaced by the
    sample's answers (its stored score left as it was): ``report --rescore`` scores it 1
    from samples.jsonl, and the route's average at that budget rises by (1 - old) / n."""
    import shutil

    copy = tmp_path / "study"
    shutil.copytree(study.out, copy)
    path = copy / "bench_agnostic" / "results.jsonl"
    rows = read_jsonl(path)
    answers = {r["id"]: r["answers"] for r in read_jsonl(copy / "bench_agnostic" / "samples.jsonl")}
    first = study.result["protocols"]["agnostic"]["budgets"][0]
    valid = set(study.result["protocols"]["agnostic"]["valid_tasks"]) or {r["task"] for r in rows}
    mine = [j for j, r in enumerate(rows) if r["route"].endswith("/learned.json") and r["budget"] == 0.25
            and r["task"] in valid]
    i = next(j for j in mine if rows[j]["score"] < 1)
    old = rows[i]["score"]
    rows[i]["prediction"] = " ".join(answers[rows[i]["sample_id"]])  # the stored score untouched
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(copy)]) == 0  # without --rescore: the stored scores
    kept = json.loads((copy / "study.json").read_text())["protocols"]["agnostic"]["budgets"][0]["avg"]["learned"]
    assert kept == pytest.approx(first["avg"]["learned"])
    assert main(["report", str(copy), "--rescore"]) == 0
    got = json.loads((copy / "study.json").read_text())["protocols"]["agnostic"]["budgets"][0]["avg"]["learned"]
    assert got == pytest.approx(kept + (1 - old) / len(mine))


def test_study_run_again_redoes_nothing_and_the_report_rescores_to_the_same_answers(study, monkeypatch, capsys):
    from learnroute.engine import Engine
    from learnroute.gates import train as T

    def refuse(*a, **k):
        raise AssertionError("a finished stage was redone")

    rows = (study.out / "bench_agnostic" / "results.jsonl").read_text()
    before = (study.out / "study.json").read_text()
    monkeypatch.setattr(Engine, "prefill", refuse)
    monkeypatch.setattr(T, "run_train", refuse)
    assert main(["study", "--config", str(study.path)]) == 0
    assert (study.out / "bench_agnostic" / "results.jsonl").read_text() == rows
    assert (study.out / "study.json").read_text() == before
    assert main(["report", str(study.out), "--rescore"]) == 0
    assert (study.out / "study.json").read_text() == before
    # every comparison made with another variant as the main route, beside the study's own answers
    capsys.readouterr()
    assert main(["report", str(study.out), "--main", "budgets_only"]) == 0
    assert (study.out / "study.json").read_text() == before
    other = json.loads((study.out / "study_budgets_only.json").read_text())
    assert other["answers"] == "study_budgets_only.md"
    assert "Q1 learned_budgets_only - best homog." in capsys.readouterr().out
    for b in other["protocols"]["agnostic"]["budgets"]:
        _, want = mean_difference(own_scores(study.raw, "learned_budgets_only", b["budget"]),
                                  own_scores(study.raw, b["best_homogeneous"], b["budget"]))
        assert b["vs_best_homogeneous"]["diff"] == pytest.approx(want)


def test_per_budget_variants_start_from_that_budgets_profile(tmp_path):
    """With profile_all_budgets, a variant trained at one budget starts from the profile's
    route for that budget; the budget-robust variant from the profiled budget's."""
    cfg = C.StudyConfig(budgets=[0.1, 0.2], profile_all_budgets=True, per_budget=True,
                        variants={"learned": {"init_route": "@profile_alloc"}})
    prof = tmp_path / "profile"
    prof.mkdir()
    for b in (0.1, 0.2):
        (prof / f"profile_{b}_alloc.json").write_text("{}")
    starts = {name: data["init_route"] for name, data in cfg.variant_configs(tmp_path).items()}
    assert starts == {
        "learned": str(prof / "profile_0.1_alloc.json"),
        "learned@0.1": str(prof / "profile_0.1_alloc.json"),
        "learned@0.2": str(prof / "profile_0.2_alloc.json"),
    }
    cfg.profile_all_budgets = False
    assert {d["init_route"] for d in cfg.variant_configs(tmp_path).values()} == {str(prof / "profile_0.1_alloc.json")}


def test_paired_bootstrap_verdicts():
    a = {str(i): 1.0 for i in range(30)}
    b = {str(i): 0.0 for i in range(30)}
    assert paired(a, b, 500)["verdict"] == "win" and paired(b, a, 500)["verdict"] == "loss"
    c = {str(i): float(i % 2) for i in range(30)}
    d = {str(i): float((i + 1) % 2) for i in range(30)}
    r = paired(c, d, 500)
    assert r["verdict"] == "tie" and r["diff"] == 0 and r["lo"] < 0 < r["hi"]


def test_bad_study_config_is_one_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(C.StudyConfig, overrides=["protocols=[agnostic, sideways]", "main_variant=nope", "aware_budgets=[0.05]",
                                              "variants={learned: {context_tokens: 5}}", "eval_tasks={nosuch: 2}"])
    with pytest.raises(ConfigError, match="unknown study token '@profil'"):
        load_config(C.StudyConfig, overrides=["variants={learned: {init_route: '@profil'}}"])
    with pytest.raises(ConfigError, match=r"variant 'a': init_route '@variant:b' names no variant listed before it; "
                                          r"valid: none"):
        load_config(C.StudyConfig, overrides=["variants={a: {init_route: '@variant:b'}, b: {}}"])
    msg = str(e.value)
    for part in ("protocols must be", "main_variant 'nope'", "the study sets those", "unknown task 'nosuch'",
                 "aware_budgets is set but 'aware' is not in protocols"):
        assert part in msg, part


def test_imported_routes_must_be_route_files_with_plain_names(tmp_path):
    (tmp_path / "not_a_route.json").write_text('{"layers": 3}')
    with pytest.raises(ConfigError) as e:
        load_config(C.StudyConfig, overrides=[
            f"imported_routes={{gone: {tmp_path / 'gone.json'}, bad: {tmp_path / 'not_a_route.json'}, 'a/b': x.json}}"])
    msg = str(e.value)
    for part in ("imported_routes.gone", "is not a file", "imported_routes.bad", "is not a valid route",
                 "name 'a/b' must be letters"):
        assert part in msg, part


def test_placement_goes_to_the_first_listed_variant_with_two_methods(tmp_path):
    from learnroute import Route

    routes, profile = tmp_path / "routes", tmp_path / "profile"
    routes.mkdir(), profile.mkdir()
    Route.homogeneous("snapkv", 4, 0.2).to_file(routes / "learned_one.json")
    Route.from_layers(["snapkv", "tova", "tova", "knorm"], 0.2).to_file(routes / "learned_mixed.json")
    variants = {"learned": {}, "one": {}, "mixed": {}}
    cfg = C.StudyConfig(variants=variants, placement_variant=["one", "mixed"])
    assert cfg.placement_choice(routes) == "mixed"
    assert C.StudyConfig(variants=variants, placement_variant="one").placement_choice(routes) is None
    assert C.StudyConfig(variants=variants).placement_candidates == ["learned"]
    # '@profile': the profile's per-layer route at the profiled budget, when it mixes methods
    by_profile = C.StudyConfig(variants=variants, placement_variant=["one", "@profile"], profile_budget=0.1)
    assert by_profile.placement_choice(routes) is None  # no profile yet
    Route.from_layers(["knorm", "knorm", "tova", "knorm"], 0.1).to_file(profile / "profile_0.1.json")
    Route.from_layers(["tova"] * 4, 0.2).to_file(profile / "profile_0.2.json")  # another budget's: not this one
    assert by_profile.placement_choice(routes) == "@profile"
    assert by_profile.placement_path(routes, "@profile") == profile / "profile_0.1.json"
    with pytest.raises(ConfigError, match="placement_variant 'nope' is neither among the variants"):
        load_config(C.StudyConfig, overrides=["placement_variant=[one, nope]", "variants={learned: {}, one: {}}"])


def test_study_under_torchrun_shards_and_resumes(tiny_dir, tmp_path, monkeypatch):
    """torchrun with 2 CPU processes: the exports once (rank 0), the profile, bench and
    placement samples split across ranks into one folder each; the answers are those of a
    one-process bench, and a one-process rerun finds nothing left to do."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from learnroute.runs import read_jsonl

    cfg = yaml.safe_load(study_config(tmp_path, tiny_dir).read_text())
    cfg.update(
        budgets=[0.25], aware_budgets=None, protocols=["agnostic"], per_budget=False, mixture_of=[], eval_seed=0,
        variants={"learned": {}, "warm": {"init_route": "@profile_alloc", "lr": 0.01}},
        placement_variant="@profile",  # the profile's per-layer route, as the default study studies
    )
    path = tmp_path / "study2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = Path(cfg["output"])
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "-m", "learnroute.cli", "study", "--config", str(path)],
        check=False, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("| protocol | budget | Q1") == 1  # rank 0 prints the answers
    rows = read_jsonl(out / "bench_agnostic" / "results.jsonl")
    keys = [(r["sample_id"], r["route"], json.dumps(r["budget"])) for r in rows]
    assert len(keys) == len(set(keys)) == 4 * len({k[1:] for k in keys})  # every cell once, on 4 samples
    assert {r["rank"] for r in rows} == {0, 1}
    cells = read_jsonl(out / "profile" / "cells.jsonl")
    profiled = [c["sample_id"] for c in cells]
    assert len(profiled) == len(set(profiled)) == 4  # each sample profiled once, its shard's rank
    assert {c["rank"] for c in cells} == {0, 1}
    assert (out / "study.md").is_file() and (out / "routes" / "learned_warm.json").is_file()
    # the profile's route has two methods (see the end-to-end test): placement ran on it, sharded too
    placed = read_jsonl(out / "placement" / "results.jsonl")
    assert {r["rank"] for r in placed} == {0, 1} and (out / "placement" / "placement.json").is_file()
    profile_route = json.loads((out / "profile" / "profile_0.25.json").read_text())["layers"]
    given = json.loads((out / "placement_route.json").read_text())["layers"]
    assert [x["method"] for x in given] == [x["method"] for x in profile_route]
    assert json.loads((out / "study.json").read_text())["placement"]["variant"] == "profile_0.25"

    # The fixed routes answer as in a one-process bench of the same samples.
    ref = tmp_path / "ref"
    assert main(["bench", f"model={tiny_dir}", "context_tokens=200", "tasks={niah_single_1: 2, niah_single_2: 2}",
                 "routes=[full, homogeneous:snapkv, homogeneous:tova]", "budgets=[0.25]", "max_new_tokens=3",
                 "seed=0",
                 f"output={ref}"]) == 0
    want = {(r["sample_id"], r["route"]): r["prediction"] for r in read_jsonl(ref / "results.jsonl")}
    got = {(r["sample_id"], r["route"]): r["prediction"] for r in rows if (r["sample_id"], r["route"]) in want}
    assert got == want and len(want) == 4 * 3

    # The profile sharded over 2 ranks, rerun in one process from the config the study wrote
    # for it: the same damage to float rounding, the same per-layer routes.
    serial = tmp_path / "serial_profile"
    assert main(["profile", "--config", str(out / "profile" / "config.yaml"), f"output={serial}"]) == 0
    sharded, alone_profile = (json.loads((d / "profile.json").read_text()) for d in (out / "profile", serial))
    assert sharded["sample_ids"] == alone_profile["sample_ids"]
    for kind, by_budget in alone_profile["damage"].items():
        for b, matrix in by_budget.items():
            torch.testing.assert_close(torch.tensor(sharded["damage"][kind][b]), torch.tensor(matrix),
                                       rtol=1e-5, atol=1e-7, msg=f"{kind} at {b}")
    assert (out / "profile" / "profile_0.25.json").read_text() == (serial / "profile_0.25.json").read_text()

    # A variant the study trained on 2 ranks, retrained alone in one process from the config
    # the study wrote for it: the same losses, validation and route (issue 20's cold_start
    # question: a study's variant is reproduced by its own train/<variant>/config.yaml).
    alone = tmp_path / "alone"
    assert main(["train", "--config", str(out / "train" / "learned" / "config.yaml"), f"output={alone}"]) == 0
    history = [{k: v for k, v in r.items() if k != "seconds"} for r in read_jsonl(alone / "history.jsonl")]
    studied = [{k: v for k, v in r.items() if k != "seconds"} for r in read_jsonl(out / "train" / "learned" / "history.jsonl")]
    assert [r.keys() for r in history] == [r.keys() for r in studied]
    for a, b in zip(history, studied):  # numbers to float rounding (another reduction order), the rest exactly
        for k in a:
            assert a[k] == (pytest.approx(b[k], rel=1e-4) if isinstance(b[k], float) else b[k]), (k, a, b)
    mine, theirs = (Route.from_file(d / "route.json") for d in (alone, out / "train" / "learned"))
    assert [e.method for e in mine.layers] == [e.method for e in theirs.layers]
    assert [e.budget for e in mine.layers] == pytest.approx([e.budget for e in theirs.layers], rel=1e-4)

    from learnroute.engine import Engine
    from learnroute.gates import train as T

    def refuse(*a, **k):
        raise AssertionError("a finished stage was redone")

    monkeypatch.setattr(Engine, "prefill", refuse)
    monkeypatch.setattr(T, "run_train", refuse)
    before = (out / "bench_agnostic" / "results.jsonl").read_text()
    assert main(["study", "--config", str(path)]) == 0
    assert (out / "bench_agnostic" / "results.jsonl").read_text() == before


@pytest.mark.parametrize(
    "variant",
    [
        {"learn": "budgets", "init_route": "@profile_alloc"},
        {"learn": "budgets", "init_route": "@profile"},
        {"learn": "none", "adapter": True, "init_route": "@profile_alloc"},
        {"learn": "none", "adapter": True, "init_route": "@profile", "lora_rank": 2},
    ],
)
def test_study_accepts_a_fixed_method_variant_that_starts_from_a_profile_route(variant, tmp_path):
    """A profile route is a valid start for budgets-only and adapter-only variants: the
    check (before the profile exists) must not refuse it for lack of init_method."""
    cfg = load_config(C.StudyConfig, overrides=[f"variants={json.dumps({'learned': {}, 'v': variant})}"])
    assert cfg.validate() == []
    # once the profile has run, the variant starts from the profile's route, with no init_method
    data = cfg.variant_configs(tmp_path)["v"]
    suffix = "_alloc" if variant["init_route"] == "@profile_alloc" else ""
    assert data["init_route"] == str(tmp_path / "profile" / f"profile_0.1{suffix}.json")
    assert data.get("init_method") is None


def test_study_still_refuses_a_fixed_method_variant_with_no_start():
    with pytest.raises(ConfigError, match="learn=budgets keeps the methods fixed"):
        load_config(C.StudyConfig, overrides=["variants={learned: {}, v: {learn: budgets, init_method: null}}"])
    with pytest.raises(ConfigError, match="learn=none keeps the route fixed"):
        load_config(C.StudyConfig, overrides=["variants={learned: {}, v: {learn: none, adapter: true, init_method: null}}"])


def test_out_of_family_tasks_must_stay_unseen(tmp_path, tiny_dir):
    """heldout eval tasks in calibration, or an out-of-family task validating a variant: one
    error each, before anything runs."""
    path = study_config(tmp_path, tiny_dir)
    with pytest.raises(ConfigError) as e:
        load_config(C.StudyConfig, path, ["heldout=[niah_single_1, niah_multivalue]", "mixture_of=[]", "placement_variant=[learned]",
                                          "variants={learned: {}, warm: {val_tasks: {niah_single_2: 2}}}"])
    msg = str(e.value)
    assert "'niah_single_1' is also a calibration task" in msg
    assert "'niah_multivalue' is not an eval task" in msg
    assert "val_tasks ['niah_single_2'] are out-of-family eval tasks" in msg
    load_config(C.StudyConfig, path, ["heldout=[niah_single_2]", "variants={learned: {}, warm: {val_tasks: {niah_multivalue: 2}}}",
                                      "mixture_of=[]", "placement_variant=[learned]"])


def test_val_tasks_must_be_held_out_families():
    from learnroute.gates.config import TrainConfig

    with pytest.raises(ConfigError, match=r"val_tasks \['niah_multikey'\] are also training tasks"):
        load_config(TrainConfig, overrides=["val_tasks={niah_multikey: 2}"])


def test_a_study_grows_by_variants_seeds_and_protocols_but_never_changes_what_it_ran(tmp_path):
    """Resuming with a variant, a seed or a protocol added is allowed (they train and bench;
    finished cells stay); a changed or dropped one, or any other change, is refused."""
    from learnroute.runs import prepare_folder

    def config(**kw):
        base = {"output": str(tmp_path / "s"), "variants": {"a": {"lr": 0.01}}, "seeds": [1]}
        return C.StudyConfig(**{**base, **kw})

    prepare_folder(config(), False, True, growable=C.GROWABLE)
    grown = config(variants={"a": {"lr": 0.01}, "b": {"lr": 0.02}}, seeds=[1, 2], protocols=["agnostic", "aware"])
    prepare_folder(grown, False, True, growable=C.GROWABLE)
    saved = yaml.safe_load((tmp_path / "s" / "config.yaml").read_text())
    assert saved["variants"] == grown.variants and saved["protocols"] == ["agnostic", "aware"]
    # the trained variants' configs do not depend on the protocols: a grown protocol retrains nothing
    assert grown.variant_configs(tmp_path / "s")["a"] == config(protocols=["agnostic", "aware"]).variant_configs(
        tmp_path / "s")["a"] == config().variant_configs(tmp_path / "s")["a"]
    def changed_from_grown(**kw):
        return config(**{"variants": grown.variants, "seeds": [1, 2], "protocols": grown.protocols, **kw})

    for changed, what in ((changed_from_grown(variants={"a": {"lr": 0.02}, "b": {"lr": 0.02}}), "variants"),
                          (changed_from_grown(variants={"b": {"lr": 0.02}}), "variants"),
                          (changed_from_grown(seeds=[2]), "seeds"),
                          (changed_from_grown(protocols=["aware"]), "protocols"),
                          (changed_from_grown(aware_budgets=[0.3]), "aware_budgets"),
                          (changed_from_grown(eval_seed=3), "eval_seed")):
        with pytest.raises(ConfigError, match=rf"differs in: {what}\);"):
            prepare_folder(changed, False, True, growable=C.GROWABLE)


def test_controls_follow_each_family_splits_best_method(tmp_path, monkeypatch):
    """The in- and out-of-family answers compare against their own split's best homogeneous
    method: when the splits' best methods differ, both get their pyramid: and adakv: controls."""
    from learnroute import bench

    # in family (calibrated: niah_single_1) snapkv wins; out of family (kv_json) tova wins;
    # over all samples snapkv (4 in-family wins against 3 out-of-family ones)
    rows = []
    for task, n, best in (("niah_single_1", 4, "homogeneous:snapkv"), ("kv_json", 3, "homogeneous:tova")):
        for i in range(n):
            for route, score in (("full", 1.0), (best, 1.0),
                                 *((r, 0.0) for r in ("homogeneous:snapkv", "homogeneous:tova") if r != best)):
                rows.append({"sample_id": f"{task}/{i}", "task": task, "route": route,
                             "budget": None if route == "full" else 0.1, "score": score})
    folder = tmp_path / "study" / "bench_agnostic"
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(C.StudyConfig, overrides=[
        "calibration={niah_single_1: 4}", "eval_tasks={niah_single_1: 4, kv_json: 3}", "budgets=[0.1]",
        "methods=[snapkv, tova]", "pyramid=[]", f"output={tmp_path / 'study'}"])
    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda cfg, **_: ran.append(list(cfg.routes)))

    class Single:
        is_main_process = True

        def wait_for_everyone(self):
            pass

    R._Stages(config, tmp_path / "study", Single()).controls("agnostic")
    # tova scores every KV head alike (the last query's attention averaged over all query
    # heads), so adakv:tova would be homogeneous tova: not benched
    assert ran == [["adakv:snapkv", "pyramid:snapkv", "pyramid:tova"]]


def test_adakv_over_a_method_that_scores_heads_alike_is_answered_by_its_homogeneous_route():
    """adakv:tova is not benched (test above); the answers and study.md read homogeneous tova
    in its place, labelled so, while adakv:snapkv is read from its own rows."""
    config = load_config(C.StudyConfig, overrides=["variants={learned: {}}", "budgets=[0.1]"])
    rows = []
    for best, extra in (("homogeneous:tova", {}), ("homogeneous:snapkv", {"adakv:snapkv": [1, 1, 0, 0]})):
        scores = {"full": [1, 1, 1, 1], best: [1, 0, 0, 0], "learned": [1, 1, 1, 0], **extra}
        rows.append([{"sample_id": f"s{i}", "task": "niah_single_1", "route": route,
                      "budget": None if route == "full" else 0.1, "score": float(x)}
                     for route, xs in scores.items() for i, x in enumerate(xs)])
    tova, snap = (A._answers(config, r, A.roles(config), [0.1])["budgets"][0] for r in rows)
    assert tova["adakv_best"] == "homogeneous:tova" and tova["vs_adakv_best"]["diff"] == pytest.approx(0.5)
    assert snap["adakv_best"] == "adakv:snapkv" and snap["vs_adakv_best"]["diff"] == pytest.approx(0.25)
    md = "\n".join(M._control_lines({"budgets": [tova]}, "learned"))
    assert "| 0.1 | adakv:tova (= homogeneous:tova: every KV head scores alike) | 25.0 | +50.0" in md


def test_routes_are_told_apart_by_what_they_are_not_by_their_suffix():
    """A variant may be called cold_start (its route ends in _start, as an untrained start's
    does) or x_seed9 (like the main variant's seeds): Q6 still answers it, Q8 pairs each
    variant with its own start, and only the main variant's seeds go to the seed spread."""
    config = load_config(C.StudyConfig, overrides=[
        "variants={learned: {}, cold_start: {lr: 0.02}, warm: {init_method: snapkv}, x_seed9: {lr: 0.03}}",
        "seeds=[1]", "budgets=[0.1]"])
    scores = {"full": [1, 1, 1, 1], "homogeneous:snapkv": [0, 0, 0, 1], "learned": [1, 0, 0, 0],
              "learned_cold_start": [1, 1, 0, 0], "learned_warm": [1, 1, 1, 0], "learned_warm_start": [0, 0, 0, 0],
              "learned_x_seed9": [0, 1, 0, 0], "learned_seed1": [1, 1, 1, 1]}
    rows = [{"sample_id": f"s{i}", "task": "niah_single_1", "route": route, "budget": None if route == "full" else 0.1,
             "score": float(x)} for route, xs in scores.items() for i, x in enumerate(xs)]
    e = A._answers(config, rows, A.roles(config), [0.1])["budgets"][0]
    assert set(e["variants_vs_main"]) == {"learned_cold_start", "learned_warm", "learned_x_seed9"}
    assert e["variants_vs_main"]["learned_cold_start"]["diff"] == pytest.approx(0.25)  # (1+1+0+0)/4 - (1+0+0+0)/4
    assert set(e["vs_start"]) == {"learned_warm"} and e["vs_start"]["learned_warm"]["diff"] == pytest.approx(0.75)
    assert set(e["seeds"]["routes"]) == {"learned", "learned_seed1"}


def test_the_seeds_of_a_second_stage_main_variant_train_the_whole_recipe_again(tmp_path):
    """A main variant that starts from another's route (two stages) is a recipe of two
    trainings: its seed k trains the first stage with seed k and starts from that, not from
    the first stage of seed 0 (as `train --seeds` with {seed} in init_route does), and Q8
    pairs each seed with its own first stage; only the second stage's seeds make the spread.
    Hand-computed on four all-or-nothing samples."""
    config = load_config(C.StudyConfig, overrides=[
        "variants={first: {init_method: snapkv}, second: {init_route: '@variant:first', lr: 0.02}}",
        "main_variant=second", "seeds=[1, 2]", "budgets=[0.1]"])
    cfgs = config.variant_configs(tmp_path)
    assert list(cfgs) == ["first", "second", "first_seed1", "second_seed1", "first_seed2", "second_seed2"]
    for k in (1, 2):
        assert cfgs[f"first_seed{k}"]["train_seed"] == cfgs[f"second_seed{k}"]["train_seed"] == k
        assert cfgs[f"first_seed{k}"]["init_method"] == "snapkv" and cfgs[f"second_seed{k}"]["lr"] == 0.02
        assert cfgs[f"second_seed{k}"]["init_route"] == str(tmp_path / "train" / f"first_seed{k}" / "route.json")
    assert cfgs["second"]["init_route"] == str(tmp_path / "train" / "first" / "route.json")
    assert config.seed_variants == {"second_seed1", "second_seed2"}
    scores = {"full": [1, 1, 1, 1], "homogeneous:snapkv": [0, 0, 0, 1],
              "learned_second": [1, 1, 1, 0], "learned_second_start": [1, 0, 0, 0],
              "learned_second_seed1": [1, 1, 0, 0], "learned_second_seed2": [0, 1, 1, 1],
              "learned_first": [1, 0, 0, 0], "learned_first_seed1": [0, 0, 0, 0], "learned_first_seed2": [1, 1, 1, 1]}
    rows = [{"sample_id": f"s{i}", "task": "niah_single_1", "route": route, "budget": None if route == "full" else 0.1,
             "score": float(x)} for route, xs in scores.items() for i, x in enumerate(xs)]
    e = A._answers(config, rows, A.roles(config), [0.1])["budgets"][0]
    sd = e["seeds"]
    assert set(sd["routes"]) == {"learned_second", "learned_second_seed1", "learned_second_seed2"}
    assert sd["vs_start"]["learned_second"]["diff"] == pytest.approx(0.75 - 0.25)  # its own start
    assert sd["vs_start"]["learned_second_seed1"]["diff"] == pytest.approx(0.5 - 0.0)  # first_seed1
    assert sd["vs_start"]["learned_second_seed2"]["diff"] == pytest.approx(0.75 - 1.0)  # first_seed2
    # pooled: seeds (2/3, 1, 2/3, 1/3) against their starts pooled (2/3, 1/3, 1/3, 1/3)
    assert sd["pooled"]["vs_start"]["diff"] == pytest.approx((0 + 2 / 3 + 1 / 3 + 0) / 4)
    assert sd["vs_best_homogeneous"]["learned_second_seed2"]["diff"] == pytest.approx(0.75 - 0.25)
    # the first stage's seeds are the recipe's parts, not variants of their own to answer
    assert not {"learned_first_seed1", "learned_first_seed2"} & set(e["variants_vs_main"])


def test_a_second_stage_main_variant_with_seeds_runs_end_to_end(tiny_dir, tmp_path):
    """The two-stage recipe as a study's main variant with a seed: the first stage trains
    again with that seed, the second starts from that run's route, both are benched, and
    study.json pairs the seed with its own first stage."""
    cfg = {"model": str(tiny_dir), "context_tokens": 200,
           "calibration": {"niah_single_1": 2, "niah_multikey": 2}, "eval_tasks": {"niah_single_2": 2},
           "budgets": [0.25], "methods": ["snapkv", "tova"], "pyramid": [], "placements": 0, "bootstrap": 100,
           "max_new_tokens": 3, "seeds": [1], "main_variant": "split", "output": str(tmp_path / "s"),
           "train": {**PER_LAYER, "steps": 2, "batch_size": 2, "eval_every": 2, "save_every": 2, "lr": 0.3, "select": "last"},
           "variants": {"first": {"learn": "budgets", "init_method": "@profile_best"},
                        "split": {"learn": "budgets", "init_method": "@profile_best", "granularity": "head",
                                  "layer_totals": "fixed", "init_route": "@variant:first"}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["study", "--config", str(tmp_path / "s.yaml")]) == 0
    out = tmp_path / "s"
    seeded = yaml.safe_load((out / "train" / "split_seed1" / "config.yaml").read_text())
    assert seeded["train_seed"] == 1 and seeded["init_route"] == str(out / "train" / "first_seed1" / "route.json")
    assert yaml.safe_load((out / "train" / "first_seed1" / "config.yaml").read_text())["train_seed"] == 1
    benched = {r["route"].rsplit("/", 1)[-1] for r in read_jsonl(out / "bench_agnostic" / "results.jsonl")}
    assert {"learned_first_seed1.json", "learned_split_seed1.json"} <= benched
    assert "learned_first_seed1_start.json" not in benched and "learned_split_seed1_start.json" not in benched
    sd = json.loads((out / "study.json").read_text())["protocols"]["agnostic"]["budgets"][0]["seeds"]
    assert set(sd["routes"]) == {"learned_split", "learned_split_seed1"}
    rows = [r for r in read_jsonl(out / "bench_agnostic" / "results.jsonl") if r["budget"] == 0.25]
    mean_of = {name: sum(r["score"] for r in rows if r["route"].endswith(f"/{name}.json")) / 2
               for name in ("learned_split_seed1", "learned_first_seed1")}
    assert sd["vs_start"]["learned_split_seed1"]["diff"] == pytest.approx(
        mean_of["learned_split_seed1"] - mean_of["learned_first_seed1"])


def test_every_training_seed_is_answered_against_the_main_routes_start_and_the_profile_route():
    """The spread over seeds is read beside each seed's own paired differences: a seed of a
    warm-started main shares its start (train_seed changes the optimisation only), so Q8
    pairs every seed with that one start, and Q2 with the profile-allocated route.
    Hand-computed on four all-or-nothing samples; study.md prints them per family split."""
    config = load_config(C.StudyConfig, overrides=[
        "variants={warm: {init_method: snapkv}}", "main_variant=warm", "seeds=[1, 2]", "budgets=[0.1]"])
    scores = {"full": [1, 1, 1, 1], "homogeneous:snapkv": [0, 0, 0, 1], "profile_alloc": [1, 0, 0, 0],
              "learned_warm": [1, 1, 1, 0], "learned_warm_start": [0, 0, 0, 1],
              "learned_warm_seed1": [1, 1, 0, 0], "learned_warm_seed2": [0, 0, 0, 0]}
    rows = [{"sample_id": f"s{i}", "task": "niah_single_1", "route": route, "budget": None if route == "full" else 0.1,
             "score": float(x)} for route, xs in scores.items() for i, x in enumerate(xs)]
    sd = A._answers(config, rows, A.roles(config), [0.1])["budgets"][0]["seeds"]
    assert set(sd["vs_start"]) == set(sd["vs_profile_alloc"]) == {"learned_warm", "learned_warm_seed1", "learned_warm_seed2"}
    assert sd["vs_start"]["learned_warm"]["diff"] == pytest.approx(0.75 - 0.25)
    assert sd["vs_start"]["learned_warm_seed1"]["diff"] == pytest.approx(0.5 - 0.25)
    assert sd["vs_start"]["learned_warm_seed2"]["diff"] == pytest.approx(0.0 - 0.25)
    assert sd["vs_profile_alloc"]["learned_warm_seed1"]["diff"] == pytest.approx(0.5 - 0.25)
    assert (sd["min"], sd["max"]) == (0.0, 0.75)
    # pooled: a sample's score is the mean over the three seeds, 2/3, 2/3, 1/3, 0; paired
    # with the start (0, 0, 0, 1) it is the mean of the seeds' own differences, (0.5 + 0.25 - 0.25) / 3
    pool = sd["pooled"]
    assert pool["avg"] == pytest.approx(5 / 12) and pool["n"] == 4
    assert pool["vs_start"]["diff"] == pytest.approx(1 / 6)
    assert pool["vs_profile_alloc"]["diff"] == pytest.approx((-1 / 3 + 2 / 3 + 1 / 3 + 0) / 4)  # profile_alloc 1, 0, 0, 0
    res = {"budgets": [{"budget": 0.1, "seeds": sd}]}
    table = "\n".join(M._seed_lines(res, "learned_warm", " in-family (4 samples)"))
    assert "Training seeds of `learned_warm` in-family (4 samples)" in table
    assert "| 0.1 | learned_warm_seed1 | 50.0 | +25.0 [" in table  # Q1 vs homogeneous:snapkv (0.25)
    assert "| 0.1 | **seeds pooled** | 41.7 | +16.7 [" in table
    assert M._seed_lines({"budgets": [{"budget": 0.1}]}, "learned_warm") == []


def test_answers_mark_where_the_full_cache_itself_ties_the_reference():
    """The ceiling: where the full cache does not beat a reference (paired), a tie against it
    says little about the route; the answers hold full minus each reference and the tables
    mark those cells. Hand-computed on four all-or-nothing samples."""
    config = load_config(C.StudyConfig, overrides=["variants={learned: {}}", "budgets=[0.1]"])
    scores = {"full": [1, 1, 1, 0], "homogeneous:snapkv": [0, 0, 0, 0], "profile_alloc": [1, 1, 1, 0],
              "learned": [1, 1, 1, 0]}
    rows = [{"sample_id": f"s{i}", "task": "niah_single_1", "route": route, "budget": None if route == "full" else 0.1,
             "score": float(x)} for route, xs in scores.items() for i, x in enumerate(xs)]
    e = A._answers(config, rows, A.roles(config), [0.1])["budgets"][0]
    assert e["headroom"]["best_homogeneous"]["diff"] == pytest.approx(0.75)
    assert e["headroom"]["profile_alloc"]["diff"] == 0.0 and e["headroom"]["profile_alloc"]["verdict"] == "tie"
    q1, q2 = M._q12(e)
    assert "(ceiling)" not in q1 and q2 == "+0.0 [+0.0, +0.0] tie (ceiling)"
    table = M.summary_table({"config": {"main_variant": "learned"}, "protocols": {"agnostic": {"budgets": [e]}}})
    assert "| agnostic | 0.1 | +75.0 [" in table and "tie (ceiling) |" in table and M.CEILING_NOTE in table
    e.pop("headroom")  # a study.json written before the ceiling was measured: no mark, no note
    table = M.summary_table({"config": {"main_variant": "learned"}, "protocols": {"agnostic": {"budgets": [e]}}})
    assert "(ceiling)" not in table


def test_a_main_route_that_answers_worse_with_more_cache_is_flagged():
    """Issue 58's check: the main route at each budget minus itself at the next smaller one,
    paired over samples (here by hand: the mean of per-sample differences), in every split;
    a drop whose interval lies below 0 is flagged in study.md."""
    config = load_config(C.StudyConfig, overrides=["budgets=[0.1, 0.2, 0.4]", "bootstrap=500"])
    learned = {0.1: [1] * 10 + [0] * 10, 0.2: [0] * 20, 0.4: [1] * 20}  # 0.1 -> 0.2 loses 10 of 20 samples
    rows = [{"sample_id": f"s{i}", "task": "niah_single_1", "route": "full", "budget": None, "score": 1.0} for i in range(20)]
    rows += [{"sample_id": f"s{i}", "task": "niah_single_1", "route": "learned", "budget": b, "score": float(x)}
             for b, xs in learned.items() for i, x in enumerate(xs)]
    steps = A._answers(config, rows, A.roles(config), [0.4, 0.1, 0.2])["main_vs_smaller_budget"]  # any order in
    assert [(s["from"], s["to"]) for s in steps] == [(0.1, 0.2), (0.2, 0.4)]
    by_hand = [sum(b - a for a, b in zip(learned[x], learned[y])) / 20 for x, y in ((0.1, 0.2), (0.2, 0.4))]
    assert [s["vs_smaller_budget"]["diff"] for s in steps] == pytest.approx(by_hand)  # -0.5, +1.0
    assert [s["drop"] for s in steps] == [True, False]
    # the smaller budget against the full cache (1 everywhere): 10 of 20 right at 0.1, none at 0.2
    assert [s["smaller_minus_full"] for s in steps] == pytest.approx([-0.5, -1.0])
    md = M.to_markdown({"config": {"budgets": [0.1]}, "protocols": {"agnostic": {
        "n_eval_samples": 20, "valid_tasks": ["niah_single_1"], "left_out_tasks": [], "budgets": [],
        "main_vs_smaller_budget": steps}}}, "learned")
    assert "| all | 0.1 -> 0.2 | -50.0 [" in md and "**learned answers worse with more cache** at: all 0.1 -> 0.2." in md
    assert "| **drop** | -50.0 |" in md and "| no | -100.0 |" in md
