"""`learnroute bench` on a tiny model: run folder, resume, refusal, re-scoring, sharding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoConfig, AutoTokenizer

import learnroute as lr
from learnroute.bench import BenchConfig, mode_mismatches, resolve_routes, run_bench
from learnroute.runs import read_jsonl
from learnroute.cli import main
from learnroute.config import ConfigError, load_config
from learnroute.report import summarize

ROUTES = ["full", "homogeneous:snapkv", "pyramid:tova", "homogeneous:streaming_llm"]


def config_for(tiny_dir, out, **over) -> BenchConfig:
    items = [
        f"model={tiny_dir}",
        "tasks={niah_single_1: 2, multihop_qa: 1}",
        "context_tokens=200",
        "budgets=[16, 0.5]",
        f"routes={json.dumps(ROUTES)}",
        "max_new_tokens=4",
        f"output={out}",
    ] + [f"{k}={v}" for k, v in over.items()]
    return load_config(BenchConfig, None, items)


def cells(rows):
    return sorted((r["sample_id"], r["route"], json.dumps(r["budget"])) for r in rows)


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "run"
    cfg = config_for(tiny_dir, out)
    run_bench(cfg)
    return cfg, out


def test_run_folder_contents(run):
    cfg, out = run
    for name in [
        "config.yaml",
        "versions.json",
        "samples.jsonl",
        "results.jsonl",
        "summary.csv",
        "summary.md",
        "plot.png",
    ]:
        assert (out / name).is_file(), name
    assert yaml.safe_load((out / "config.yaml").read_text())["budgets"] == [16, 0.5]
    assert json.loads((out / "versions.json").read_text())["kvpress"] == "0.5.5"
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 3 and all(s["split"] == "eval" for s in samples)
    rows = read_jsonl(out / "results.jsonl")
    # full once + 3 routes x 2 budgets, per sample
    assert len(rows) == 3 * (1 + 3 * 2) == len(set(cells(rows)))
    by = {(r["route"], json.dumps(r["budget"])): r for r in rows if r["sample_id"] == samples[0]["id"]}
    assert by[("full", "null")]["kv_fraction"] == 1.0
    n = by[("full", "null")]["n_tokens"]
    assert by[("homogeneous:snapkv", "0.5")]["kv_fraction"] == pytest.approx(int(n * 0.5) / n)  # kvpress's rounding
    assert by[("homogeneous:snapkv", "16")]["kv_fraction"] == pytest.approx(16 / n)
    md = (out / "summary.md").read_text()
    assert "## Budget 16" in md and "## Budget 0.5" in md and "pyramid:tova" in md
    # the random tiny model solves nothing: both tasks are flagged
    assert "**Flag:**" in md and "niah_single_1" in md


def test_rerun_skips_finished_cells_and_recovers_a_killed_run(run, tiny_dir):
    cfg, out = run
    results = out / "results.jsonl"
    before = read_jsonl(results)
    run_bench(cfg)
    assert read_jsonl(results) == before  # nothing recomputed, nothing duplicated
    # Simulate a run killed while writing its last sample: drop that sample's rows, leave a torn line.
    last = before[-1]["sample_id"]
    kept = [r for r in before if r["sample_id"] != last]
    results.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept) + '{"task": "niah_si')
    run_bench(cfg)
    after = read_jsonl(results)
    assert after[: len(kept)] == kept  # finished cells untouched
    assert cells(after) == cells(before)  # only the lost sample was redone


def test_different_config_refused_unless_overwrite(run, tiny_dir):
    cfg, out = run
    other = config_for(tiny_dir, out, budgets="[8]")
    with pytest.raises(ConfigError, match="differs in: budgets.*--overwrite"):
        run_bench(other)
    # a field that changes no result (batching) may differ and still resume
    run_bench(config_for(tiny_dir, out, max_batch=2))


def test_run_saved_before_a_null_default_field_existed_resumes(run, tiny_dir):
    """A config.yaml written before a field with a null default was added resumes; a field
    set to a value in the saved run and null now is still a different config. Every start
    is recorded in versions.json, the earlier ones kept."""
    cfg, out = run
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved.pop("longbench_dir") is None
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    before = read_jsonl(out / "results.jsonl")
    # versions.json as written before it kept a history of starts: kept as the first start
    legacy = {"learnroute": "0.0.1", "git_commit": "abc123", "kvpress": "0.5.5"}
    (out / "versions.json").write_text(json.dumps(legacy))
    run_bench(cfg)
    assert read_jsonl(out / "results.jsonl") == before
    versions = json.loads((out / "versions.json").read_text())
    assert versions["starts"][0] == legacy and len(versions["starts"]) == 2
    assert versions["starts"][1]["started"] and versions["kvpress"] == "0.5.5"
    saved["longbench_dir"] = "somewhere"
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="differs in: longbench_dir"):
        run_bench(cfg)
    saved["longbench_dir"] = None  # the fixture's run is shared: leave it as found
    (out / "config.yaml").write_text(yaml.safe_dump(saved))


def test_overwrite_moves_the_old_run_aside(tiny_dir, tmp_path):
    out = tmp_path / "run"
    run_bench(config_for(tiny_dir, out, tasks="{niah_single_1: 1}", routes="[full]"))
    run_bench(config_for(tiny_dir, out, tasks="{niah_single_1: 1}", routes="[full]", budgets="[8]"), overwrite=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and (aside[0] / "results.jsonl").is_file()
    assert yaml.safe_load((out / "config.yaml").read_text())["budgets"] == [8]


def test_rescored_summary_is_the_hand_computed_mean(tokenizer, tmp_path):
    """A results folder written by hand, re-scored from its JSONL files alone: each cell is
    the mean over samples of RULER's string_match_all (the share of references found in the
    prediction, case-insensitive), computed here by hand; stored scores are ignored."""
    from learnroute.tasks import make_samples

    multi = make_samples("niah_multivalue", tokenizer, 2, 200, "eval")  # 4 references each
    single = make_samples("niah_single_1", tokenizer, 2, 200, "eval")  # 1 reference each
    a, b = multi[0].answers, multi[1].answers
    predictions = {  # (route, budget) -> one prediction per sample: multi[0], multi[1], single[0], single[1]
        ("full", None): [" ".join(a), " ".join(b).upper(), single[0].answers[0], single[1].answers[0]],
        ("x", 0.1): [f"{a[0]} and {a[1]}", a[0], single[0].answers[0], "no idea"],
    }
    expected = {  # by hand: found / 4 for the multi-value samples, found / 1 for the single ones
        ("full", None): {"niah_multivalue": 1.0, "niah_single_1": 1.0},
        ("x", 0.1): {"niah_multivalue": (2 / 4 + 0 / 4) / 2, "niah_single_1": (1 + 0) / 2},
    }
    samples = multi + single
    rows = [{"route": route, "budget": budget, "sample_id": s.id, "task": s.task, "prediction": p, "score": 0.77,
             "kv_fraction": 1.0 if budget is None else budget, "seconds": 1.0}
            for (route, budget), preds in predictions.items() for s, p in zip(samples, preds)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s.to_dict()) + "\n" for s in samples))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = summarize(tmp_path, rescore=True)
    got = {(t["route"], t["budget"], t["task"]): t["score"] for t in table}
    for (route, budget), tasks in expected.items():
        for task, score in tasks.items():
            assert got[(route, budget, task)] == pytest.approx(score), (route, budget, task)
    assert got[("x", 0.1, "average")] == pytest.approx((0.25 + 0.5) / 2)
    csv = (tmp_path / "summary.csv").read_text()
    assert "niah_multivalue,x,0.1,2,0.25," in csv  # the file says what the table says


def test_rescore_uses_predictions_and_references(run, tmp_path):
    """A tampered stored score is ignored; a prediction that contains the answer scores 1."""
    _, out = run
    copy = tmp_path / "copy"
    copy.mkdir()
    samples = read_jsonl(out / "samples.jsonl")
    rows = read_jsonl(out / "results.jsonl")
    answer = {s["id"]: s["answers"] for s in samples}
    for r in rows:
        r["score"] = 0.77  # wrong on purpose
        if r["route"] == "full":
            r["prediction"] = " ".join(answer[r["sample_id"]])
    (copy / "samples.jsonl").write_bytes((out / "samples.jsonl").read_bytes())
    (copy / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = summarize(copy, rescore=True)
    full = {t["task"]: t["score"] for t in table if t["route"] == "full"}
    assert full == {
        "niah_single_1": 1.0,
        "multihop_qa": 1.0,
        "average": 1.0,
        "average (tasks the full cache solves)": 1.0,
    }
    others = {t["score"] for t in table if t["route"] != "full"}
    assert 0.77 not in others


def test_route_files_scaled_and_as_given(tiny_dir, tmp_path):
    route = lr.Route.from_layers(["snapkv", "tova", "knorm", "tova"], [8, 16, 16, 24], model="tiny", source="test")
    route.to_file(tmp_path / "routes" / "mix.json")
    out = tmp_path / "run"
    glob_spec = str(tmp_path / "routes" / "*.json")
    run_bench(config_for(tiny_dir, out, tasks="{niah_single_1: 1}", routes=f"[{glob_spec}]", budgets="[32]"))
    (row,) = read_jsonl(out / "results.jsonl")
    assert row["route"] == str(tmp_path / "routes" / "mix.json") and row["budget"] == 32
    n = row["n_tokens"]
    kept = 16 + 32 + 32 + 48  # the file's shape x2: mean 32
    cfg = AutoConfig.from_pretrained(tiny_dir)
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V per layer, float32
    assert row["kv_bytes"] == row["allocated_kv_bytes"] == per_token * kept  # a per-layer route: no head padding
    assert row["kv_fraction"] == pytest.approx(kept / (4 * n))
    out2 = tmp_path / "run2"
    run_bench(
        config_for(tiny_dir, out2, tasks="{niah_single_1: 1}", routes=f"[{glob_spec}]", route_file_budgets="file")
    )
    (row,) = read_jsonl(out2 / "results.jsonl")
    assert row["budget"] == 16 and row["kv_fraction"] == pytest.approx(64 / (4 * n))
    # FILE@BUDGET: that file at that budget only, next to other routes at every budget
    out3 = tmp_path / "run3"
    pinned = f"{tmp_path / 'routes' / 'mix.json'}@8"
    run_bench(config_for(tiny_dir, out3, tasks="{niah_single_1: 1}", routes=f"[full, '{pinned}']", budgets="[8, 32]"))
    rows = read_jsonl(out3 / "results.jsonl")
    assert {(r["route"], r["budget"]) for r in rows} == {("full", None), (str(tmp_path / "routes" / "mix.json"), 8)}
    (row,) = [r for r in rows if r["route"] != "full"]
    assert row["kv_fraction"] == pytest.approx((4 + 8 + 8 + 12) / (4 * n))  # the shape x1/2


def test_route_file_for_another_model_refused_before_any_work(tiny_dir, tmp_path):
    lr.Route.homogeneous("snapkv", 30, 64, model="SmolLM2-135M-Instruct").to_file(tmp_path / "smol.json")
    out = tmp_path / "run"
    code = None
    with pytest.raises(SystemExit) as e:
        main(
            [
                "bench",
                f"model={tiny_dir}",
                f"routes=[{tmp_path / 'smol.json'}]",
                f"output={out}",
                "tasks={niah_single_1: 1}",
            ]
        )
    code = e.value.code
    assert code == 2
    assert not (out / "results.jsonl").exists()


def test_cli_bad_config_lists_problems(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "tasks={nope: 1}", f"routes=[homogeneous:nosuch, '{__file__}@lots']", f"output={tmp_path}"])
    err = capsys.readouterr().err
    assert "unknown task 'nope'" in err and "unknown method 'nosuch'" in err and "@lots" in err


def test_budget_above_context_keeps_all_and_says_so(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run_bench(config_for(tiny_dir, out, tasks="{niah_single_1: 1}", routes="[homogeneous:snapkv]", budgets="[100000]"))
    (row,) = read_jsonl(out / "results.jsonl")
    assert row["kv_fraction"] == 1.0
    assert "the cache is kept whole" in capsys.readouterr().err


def test_two_processes_shard_and_merge(tiny_dir, tmp_path):
    """torchrun with 2 CPU processes: samples split across ranks, one merged folder."""
    out = tmp_path / "run"
    cfg = tmp_path / "bench.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_dir),
                "tasks": {"niah_single_1": 3, "multihop_qa": 1},
                "context_tokens": 200,
                "budgets": [16],
                "routes": ["full", "homogeneous:snapkv"],
                "max_new_tokens": 4,
                "output": str(out),
            }
        )
    )
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "-m", "learnroute.cli", "bench", "--config", str(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 4 * 2 == len(set(cells(rows)))
    assert {r["rank"] for r in rows} == {0, 1}
    assert len(read_jsonl(out / "samples.jsonl")) == 4
    assert (out / "summary.md").is_file()


def test_longbench_tasks_from_local_files(tiny_dir, tmp_path):
    """LongBench rows run through the same engine; non-chat tasks keep their raw prompt."""
    data = Path(__file__).parent / "data" / "longbench"
    out = tmp_path / "run"
    cfg = config_for(
        tiny_dir,
        out,
        tasks="{longbench/trec: 1, longbench/qasper: 1}",
        routes="[full, homogeneous:knorm]",
        budgets="[0.5]",
        longbench_dir=str(data),
    )
    run_bench(cfg)
    rows = read_jsonl(out / "results.jsonl")
    assert sorted({r["task"] for r in rows}) == ["longbench/qasper", "longbench/trec"] and len(rows) == 4
    samples = read_jsonl(out / "samples.jsonl")
    assert {s["metric"] for s in samples} == {"classification_score", "qa_f1_score"}


def test_missing_longbench_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="longbench/narrativeqa: LongBench file .*narrativeqa.jsonl not found"):
        load_config(BenchConfig, None, ["tasks={longbench/narrativeqa: 1}", f"longbench_dir={tmp_path}"])


def test_wandb_logging_is_optional_and_offline(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run_bench(config_for(tiny_dir, out, tasks="{niah_single_1: 1}", routes="[full]", wandb="true"))
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    out2 = tmp_path / "run2"
    run_bench(config_for(tiny_dir, out2, tasks="{niah_single_1: 1}", routes="[full]"))
    assert not (out2 / "wandb").exists()  # off by default


def test_samsum_stops_at_a_newline_after_at_least_one_token(tiny_dir, tmp_path, monkeypatch):
    """LongBench's pred.py decodes samsum with "\\n" as a second EOS and min_length + 1."""
    from learnroute.engine import Engine

    calls = []
    answer = Engine.answer

    def spy(self, prefill, routes, **kwargs):
        calls.append(kwargs)
        return answer(self, prefill, routes, **kwargs)

    monkeypatch.setattr(Engine, "answer", spy)
    data = Path(__file__).parent / "data" / "longbench"
    cfg = config_for(tiny_dir, tmp_path / "run", tasks="{longbench/samsum: 1, longbench/trec: 1}",
                     routes="[full]", budgets="[0.5]", longbench_dir=str(data))
    run_bench(cfg)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    newline = tok.encode("\n", add_special_tokens=False)[-1]
    stops = sorted((c["stop_token_ids"], c["min_new_tokens"]) for c in calls)
    assert stops == [((), 0), ((newline,), 1)]  # trec: model EOS only; samsum: newline too


def test_report_paired_differences_by_hand(tmp_path, capsys):
    """`report --paired`: route minus others over the same samples of the tasks the full cache
    solves, hand-computed. Task b (full cache 0) is left out; sample a/3 lacks route B."""
    rows = []
    full = {"a/0": 1, "a/1": 1, "a/2": 1, "a/3": 0, "b/0": 0, "b/1": 0}
    mine = {"a/0": 1, "a/1": 1, "a/2": 0, "a/3": 0, "b/0": 1, "b/1": 1}
    other = {"a/0": 0, "a/1": 0, "a/2": 0, "b/0": 0, "b/1": 0}
    same = dict(mine)
    for route, budget, scores in (("full", None, full), ("mine.json", 0.1, mine), ("B", 0.1, other), ("C", 0.1, same)):
        for sid, s in scores.items():
            rows.append({"sample_id": sid, "task": sid[0], "route": f"x/{route}" if route.endswith(".json") else route,
                         "budget": budget, "score": float(s), "prediction": ""})
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path), "--paired", "mine", "--bootstrap", "500"]) == 0
    out = capsys.readouterr().out
    assert "paired over the samples of a " in out and "full cache 75.0 on 4" in out
    # vs B: samples a/0-a/2 only (a/3 has no B): diffs 1, 1, 0 -> +66.7. A resample of three zeros
    # has probability 1/27 > 2.5 %, so the interval's lower end is 0: a tie
    assert "| 0.1 | B | 3 | 0.0 | 66.7 | +66.7 [+0.0, +100.0] | tie |" in out
    assert "| 0.1 | C | 4 | 50.0 | 50.0 | +0.0 [+0.0, +0.0] | tie |" in out
    # the full cache (no budget) pairs at every budget, as the paired route or in --against:
    # full minus mine over a/0-a/3, diffs 0, 0, 1, 0 -> +25.0 (a tie: all-zero resamples are 32 %)
    assert main(["report", str(tmp_path), "--paired", "full", "--bootstrap", "500"]) == 0
    out = capsys.readouterr().out
    assert "| 0.1 | mine | 4 | 50.0 | 75.0 | +25.0 [+0.0, " in out
    assert "| 0.1 | B | 3 | 0.0 | 100.0 | +100.0 [+100.0, +100.0] | win |" in out
    assert main(["report", str(tmp_path), "--paired", "mine", "--against", "full", "B", "--bootstrap", "500"]) == 0
    out = capsys.readouterr().out
    assert "| 0.1 | full | 4 | 75.0 | 50.0 | -25.0 [" in out and "| 0.1 | B | 3 |" in out
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--paired", "nope"])
    assert "no route called 'nope'" in capsys.readouterr().err
    # --tasks: one family split's samples only. Task a alone gives the rows above; task b
    # alone pairs its two samples (no task of the split reaches the full-cache floor, and then,
    # as everywhere, every task counts): mine 1, 1 against B 0, 0
    assert main(["report", str(tmp_path), "--paired", "mine", "--tasks", "a", "--bootstrap", "500"]) == 0
    assert "| 0.1 | B | 3 | 0.0 | 66.7 | +66.7 [+0.0, +100.0] | tie |" in capsys.readouterr().out
    assert main(["report", str(tmp_path), "--paired", "mine", "--tasks", "b", "--bootstrap", "500"]) == 0
    assert "| 0.1 | B | 2 | 0.0 | 100.0 | +100.0 [+100.0, +100.0] | win |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--paired", "mine", "--tasks", "a", "zz"])
    assert "no samples of zz in the results; tasks: a, b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--tasks", "a"])


def test_report_paired_flags_a_route_that_answers_worse_with_more_cache(tmp_path, capsys):
    """`report --paired R` ends with R at each budget minus R at the next smaller one (issue
    58), hand-made: 8 of 8 samples right at 10 %, 1 of 8 at 20 % (a drop whose interval lies
    below 0, flagged), 8 at 40 % (+87.5, a win). The full cache answers 4 of 8, so the route
    stands +50.0 above it at 10 % and -37.5 below it at 20 % (the last column)."""
    rows = []
    right = {0.1: set(range(8)), 0.2: {0}, 0.4: set(range(8))}
    for i in range(8):
        rows.append({"sample_id": f"a/{i}", "task": "a", "route": "full", "budget": None, "score": float(i < 4),
                     "prediction": ""})
        for b, ok in right.items():
            rows.append({"sample_id": f"a/{i}", "task": "a", "route": "x/mine.json", "budget": b,
                         "score": float(i in ok), "prediction": ""})
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path), "--paired", "mine", "--bootstrap", "500"]) == 0
    out = capsys.readouterr().out
    assert "More cache, never worse: mine at each budget minus mine at the next smaller one" in out
    assert "| 0.1 -> 0.2 | 8 | -87.5 [-100.0, -62.5] | **worse with more cache** | +50.0 |" in out
    assert "| 0.2 -> 0.4 | 8 | +87.5 [+62.5, +100.0] | win | -37.5 |" in out
    assert main(["report", str(tmp_path), "--paired", "full", "--bootstrap", "500"]) == 0
    assert "More cache" not in capsys.readouterr().out  # the full cache has no budgets


def test_report_pools_training_seeds_into_one_route_by_hand(tmp_path, capsys):
    """`report --paired --pool`: a pool is a route whose score on a sample is its members'
    mean, over the samples every member has (s1 lacks a/3); hand-computed, with each
    member's own average over those samples and the range beside it."""
    full = {"a/0": 1, "a/1": 1, "a/2": 1, "a/3": 1}
    s0 = {"a/0": 1, "a/1": 1, "a/2": 0, "a/3": 0}
    s1 = {"a/0": 1, "a/1": 0, "a/2": 0}
    base = {"a/0": 0, "a/1": 0, "a/2": 0, "a/3": 0}
    rows = [{"sample_id": sid, "task": "a", "route": route, "budget": None if route == "full" else 0.1,
             "score": float(x), "prediction": ""}
            for route, scores in (("full", full), ("r/s0.json", s0), ("r/s1.json", s1), ("B", base))
            for sid, x in scores.items()]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path), "--paired", "seeds", "--pool", "seeds=s0,s1", "--bootstrap", "500"]) == 0
    out = capsys.readouterr().out
    # pooled a/0-a/2: 1, 0.5, 0 -> 50.0; against B (0, 0, 0) +50.0 over 3 samples
    assert "| 0.1 | B | 3 | 0.0 | 50.0 | +50.0 [" in out
    assert "| s0 |" not in out and "| s1 |" not in out  # by default not against its own members
    assert "- 0.1: 66.7 / 33.3 (pool 50.0, range 33.3)" in out
    # the pool as a reference: s0 minus the pool, over the pool's samples
    assert main(["report", str(tmp_path), "--paired", "s0", "--pool", "seeds=s0,s1", "--against", "seeds",
                 "--bootstrap", "500"]) == 0
    out = capsys.readouterr().out
    assert "| 0.1 | seeds | 3 | 50.0 | 66.7 | +16.7 [" in out  # s0 on a/0-a/2: 1, 1, 0
    assert "Pool seeds:" in out
    # a pool the table does not use prints no spread
    assert main(["report", str(tmp_path), "--paired", "s0", "--pool", "seeds=s0,s1", "--against", "B",
                 "--bootstrap", "500"]) == 0
    assert "Pool seeds" not in capsys.readouterr().out
    for argv, msg in (
        (["--pool", "s0=s0,s1"], "--pool names s0 are routes in the results already"),
        (["--pool", "seeds=s0", "--pool", "x"], "bad --pool 'seeds=s0', 'x': each is NAME=ROUTE,ROUTE[,...]"),
        (["--pool", "seeds=s0,zz"], "no route called 'zz' in the results"),
    ):
        with pytest.raises(SystemExit):
            main(["report", str(tmp_path), "--paired", "B", *argv])
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--pool", "seeds=s0,s1"])
    assert "--pool need --paired" in capsys.readouterr().err


def test_report_joins_bench_folders_of_one_setting_by_hand(tmp_path, capsys):
    """`report A B --paired`: two bench folders (one per family split) read as one set of
    samples, hand-computed; folders whose settings change a score, or that hold a cell twice,
    are refused with every reason named."""

    def folder(name, scores, context=1024, extra=""):
        out = tmp_path / name
        out.mkdir()
        rows = [{"sample_id": sid, "task": sid[0], "route": route, "budget": None if route == "full" else 0.1,
                 "score": float(x), "prediction": ""} for route, by_id in scores.items() for sid, x in by_id.items()]
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "config.yaml").write_text(f"model: null\ncontext_tokens: {context}\nquery_aware: false\n{extra}")
        return str(out)

    a = folder("in", {"full": {"a/0": 1, "a/1": 1, "a/2": 1}, "mine": {"a/0": 1, "a/1": 1, "a/2": 0},
                      "B": {"a/0": 0, "a/1": 0, "a/2": 0}})
    # a key one config.yaml lacks (a field added since) counts at the bench's default
    b = folder("out", {"full": {"b/0": 1, "b/1": 1}, "mine": {"b/0": 1, "b/1": 1}, "B": {"b/0": 1, "b/1": 0}},
               extra="route_file_budgets: scale\n")
    assert main(["report", a, b, "--paired", "mine", "--bootstrap", "500"]) == 0
    out = capsys.readouterr().out
    # five samples: mine 1, 1, 0, 1, 1 (80.0) against B 0, 0, 0, 1, 0 (20.0)
    assert "paired over the samples of a, b " in out and "full cache 100.0 on 5" in out
    assert "| 0.1 | B | 5 | 20.0 | 80.0 | +60.0 [" in out
    assert main(["report", a, b, "--paired", "mine", "--tasks", "b", "--bootstrap", "500"]) == 0
    assert "| 0.1 | B | 2 | 50.0 | 100.0 | +50.0 [" in capsys.readouterr().out
    longer = folder("long", {"full": {"c/0": 1}, "mine": {"c/0": 1}}, context=4096)
    for folders, msg in (
        ([a, longer], f"context_tokens differs (1024 in {a}; 4096 in {longer})"),
        ([a, a], "a folder is given twice"),
        ([a, b, folder("again", {"mine": {"a/2": 1}})], "both hold sample a/2, route mine, budget 0.1"),
    ):
        with pytest.raises(SystemExit):
            main(["report", *folders, "--paired", "mine"])
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", a, b])
    assert "2 folders need --paired ROUTE" in capsys.readouterr().err


def test_stop_at_final_score_shortens_answers_and_resumes_any_setting(run, tiny_dir, tmp_path, monkeypatch):
    """The bench hands score_is_final to the engine: answers end where it first holds (a
    prefix of the full answer); the option may change when a run resumes."""
    from learnroute.tasks import metrics

    _, out = run
    full = {(r["sample_id"], r["route"], json.dumps(r["budget"])): r["prediction"]
            for r in read_jsonl(out / "results.jsonl")}
    seen = []

    def final(sample, text):  # the tiny random model never finds a needle: a stand-in rule
        seen.append(sample.id)
        return len(text) >= 12

    monkeypatch.setattr(metrics, "score_is_final", final)
    short_out = tmp_path / "short"
    run_bench(config_for(tiny_dir, short_out, max_new_tokens=12, stop_at_final_score="true"))
    long_out = tmp_path / "long"
    run_bench(config_for(tiny_dir, long_out, max_new_tokens=12))
    longs = {(r["sample_id"], r["route"], json.dumps(r["budget"])): r["prediction"]
             for r in read_jsonl(long_out / "results.jsonl")}
    shorts = read_jsonl(short_out / "results.jsonl")
    assert seen and len(shorts) == len(longs) == len(full)
    for r in shorts:
        whole = longs[(r["sample_id"], r["route"], json.dumps(r["budget"]))]
        assert whole.startswith(r["prediction"])
        assert r["prediction"] == whole or (len(r["prediction"]) >= 12 and r["prediction"] != whole)
    assert any(r["prediction"] != longs[(r["sample_id"], r["route"], json.dumps(r["budget"]))] for r in shorts)
    # resuming the first run with the option: not refused, nothing to redo
    before = (out / "results.jsonl").read_text()
    run_bench(config_for(tiny_dir, out, stop_at_final_score="true"))
    assert (out / "results.jsonl").read_text() == before


def test_a_bench_resumed_with_a_route_added_runs_only_its_cells(tiny_dir, tmp_path):
    """Routes may be added on a resume (a study that grows): the new route's cells run,
    every finished row stays as it was; dropping a route is still a different config."""
    out = tmp_path / "grow"
    run_bench(config_for(tiny_dir, out, routes=json.dumps(["full", "homogeneous:snapkv"])))
    before = read_jsonl(out / "results.jsonl")
    run_bench(config_for(tiny_dir, out, routes=json.dumps(["full", "homogeneous:snapkv", "adakv:snapkv"])))
    after = read_jsonl(out / "results.jsonl")
    assert after[: len(before)] == before
    assert {r["route"] for r in after[len(before):]} == {"adakv:snapkv"} and len(after) - len(before) == 3 * 2
    with pytest.raises(ConfigError, match="differs in: routes"):
        run_bench(config_for(tiny_dir, out, routes=json.dumps(["full"])))


def test_a_route_trained_in_the_other_prompt_mode_is_named(tiny_dir, tmp_path, capsys):
    # A learned route keeps its training config in provenance; one trained query-agnostic and
    # benched query-aware is named (that pairing dropped with more cache in docs/results.md).
    routes = tmp_path / "routes"
    for name, aware in (("agnostic", False), ("aware", True)):
        lr.Route.from_layers(["snapkv"] * 4, [16] * 4, model="tiny", source="learned",
                             train_config={"query_aware": aware}).to_file(routes / f"{name}.json")
    lr.Route.homogeneous("tova", 4, 16, model="tiny").to_file(routes / "hand.json")  # no training config
    run_bench(config_for(tiny_dir, tmp_path / "run", tasks="{niah_single_1: 1}", budgets="[16]",
                         routes=f"[{routes / '*.json'}]", query_aware="true"))
    notes = [line for line in capsys.readouterr().err.splitlines() if "was trained" in line]
    assert notes == [f"note: {routes / 'agnostic.json'} was trained query-agnostic and is benched query-aware; "
                     "to deploy it query-aware, train with query_aware=true"]
    cells = resolve_routes(config_for(tiny_dir, tmp_path / "x", routes=f"[{routes / '*.json'}]", budgets="[16]"), 4,
                           "tiny")
    assert [line.split(" was")[0] for line in mode_mismatches(cells, False)] == [str(routes / "aware.json")]
