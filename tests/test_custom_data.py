"""Your own data as a task (``jsonl:PATH``): the file format, its checks, the split rule, and
training and benching on it exactly as on a task by name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from learnroute.bench import BenchConfig
from learnroute.cli import main
from learnroute.config import ConfigError, load_config
from learnroute.gates.config import TrainConfig
from learnroute.route import Route
from learnroute.tasks.custom import write_jsonl
from learnroute.tasks.suite import load_tasks


def records(n: int, **extra) -> list[dict]:
    return [{"context": f"Record {i}. " + "The sky is blue. " * 30 + f"The code is {1000 + i}.",
             "question": "What is the code?", "answers": [str(1000 + i)], **extra} for i in range(n)]


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def hand_split(row: dict) -> str:
    """The documented rule, written out: sha256 of [context, question, answers] as compact
    JSON; eval when its first 8 bytes / 2**64 < 0.5."""
    blob = json.dumps([row["context"], row["question"], row["answers"]], ensure_ascii=False, separators=(",", ":"))
    return "eval" if int(hashlib.sha256(blob.encode()).hexdigest()[:16], 16) / 2**64 < 0.5 else "calibration"


def test_every_bad_line_is_named_with_its_file_and_line_before_any_model_loads(tmp_path):
    path = write(tmp_path / "mine.jsonl", [
        records(1)[0],
        "{not json",
        {"context": "c", "question": "q"},                                  # no answers
        {"context": "c", "question": "q", "answers": []},                   # empty answers
        {"context": "c", "question": "q", "answers": ["a"], "metric": "bleu"},
        {"context": "c", "question": "q", "answers": ["a"], "answer": "typo"},
    ])
    with pytest.raises(ConfigError) as e:  # a model path that does not exist: nothing was loaded
        load_config(TrainConfig, None, [f"tasks={{'jsonl:{path}': 1}}", "model=/nonexistent/model"])
    msg = str(e.value)
    for part in [f"{path}:2: not valid JSON", f"{path}:3: missing field(s) answers",
                 f"{path}:4: field 'answers' must hold at least one non-empty string",
                 f"{path}:5: unknown metric 'bleu'; valid: string_match_all", f"{path}:6: unknown field(s) answer"]:
        assert part in msg, (part, msg)


def test_fewer_records_than_asked_says_how_many_each_split_has(tmp_path):
    path = write(tmp_path / "small.jsonl", records(6, split="eval"))
    with pytest.raises(ConfigError, match=r"10 eval samples asked, the file has 6 \(of 6 records: calibration 0, eval 6"):
        load_config(BenchConfig, None, [f"tasks={{'jsonl:{path}': 10}}", "routes=[full]"])
    with pytest.raises(ConfigError, match="1 calibration samples asked, the file has 0"):
        load_config(TrainConfig, None, [f"tasks={{'jsonl:{path}': 1}}"])
    with pytest.raises(ConfigError, match="no such file"):
        load_config(TrainConfig, None, [f"tasks={{'jsonl:{tmp_path / 'missing.jsonl'}': 1}}"])


def test_records_without_split_follow_the_hash_rule_and_no_record_is_in_both(tmp_path, tokenizer):
    rows = records(40)
    path = write(tmp_path / "both.jsonl", rows)
    expected = {s: [r for r in rows if hand_split(r) == s] for s in ("calibration", "eval")}
    assert expected["calibration"] and expected["eval"]
    name = f"jsonl:{path}"
    got = {s: load_tasks({name: len(expected[s])}, tokenizer, 10_000, s) for s in expected}
    for split, pairs in got.items():
        assert [s.context for _, s in pairs] == [r["context"] for r in expected[split]]  # file order
        assert all(s.split == split and task == name for task, s in pairs)
    assert not {s.id for _, s in got["calibration"]} & {s.id for _, s in got["eval"]}
    assert not {s.context for _, s in got["calibration"]} & {s.context for _, s in got["eval"]}


def test_a_record_in_both_splits_or_twice_is_refused(tmp_path):
    row = records(1)[0]
    path = write(tmp_path / "dup.jsonl", [{**row, "split": "calibration"}, *records(3)[1:], {**row, "split": "eval"}])
    with pytest.raises(ConfigError, match=r"dup.jsonl:4: the same record as line 1, in both splits"):
        load_config(TrainConfig, None, [f"tasks={{'jsonl:{path}': 1}}"])


def test_long_contexts_are_cut_in_the_middle(tmp_path, tokenizer, caplog):
    long = {"context": "Start here. " + " ".join(f"w{i}" for i in range(600)) + " The end.",
            "question": "Q?", "answers": ["x"], "split": "eval"}
    path = write(tmp_path / "long.jsonl", [long, {**records(1)[0], "split": "eval"}])
    with caplog.at_level("WARNING"):
        (s, _), = [(s, t) for t, s in load_tasks({f"jsonl:{path}": 1}, tokenizer, 64, "eval")]
    ids = tokenizer.encode(long["context"], add_special_tokens=False)
    kept = tokenizer.encode(s.context, add_special_tokens=False)
    assert len(kept) <= 64 and s.meta["truncated"]
    assert s.context.startswith(tokenizer.decode(ids[:20])) and s.context.endswith("The end.")
    assert "1 of 1 eval contexts were longer than 64 tokens" in caplog.text


def _train_config(tmp_path: Path, model_dir, tasks: dict, out: str) -> Path:
    cfg = {"model": str(model_dir), "tasks": tasks, "context_tokens": 200, "methods": ["snapkv", "tova", "keydiff"],
           "budgets": [0.25, 0.4], "steps": 4, "batch_size": 2, "eval_every": 2, "save_every": 2,
           "output": str(tmp_path / out)}
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_family_exported_to_jsonl_trains_the_same_route_as_the_family_by_name(tmp_path, tiny_dir, tokenizer):
    """Same seed, same samples: the route depends on the records, not on where they came from."""
    from learnroute.tasks.suite import load_task

    family = load_task("niah_single_1", tokenizer, 6, 200, "calibration", seed=0)
    path = write_jsonl(family, tmp_path / "family.jsonl")
    assert main(["train", "--config", str(_train_config(tmp_path, tiny_dir, {"niah_single_1": 6}, "by_name"))]) == 0
    assert main(["train", "--config", str(_train_config(tmp_path, tiny_dir, {f"jsonl:{path}": 6}, "by_file"))]) == 0
    by_name = Route.from_file(tmp_path / "by_name" / "route.json")
    by_file = Route.from_file(tmp_path / "by_file" / "route.json")
    assert by_file.layers == by_name.layers
    assert by_name.is_per_head  # the recipe's default granularity: budgets per KV head
    split = json.loads((tmp_path / "by_file" / "split.json").read_text())
    assert set(split["train"]) | set(split["val"]) == {s.id for s in family}


def test_bench_on_the_held_back_split_of_the_same_file(tmp_path, tiny_dir):
    path = write(tmp_path / "mine.jsonl", records(12))
    n_eval = sum(hand_split(r) == "eval" for r in records(12))
    cfg = {"model": str(tiny_dir), "tasks": {f"jsonl:{path}": n_eval}, "context_tokens": 200, "budgets": [0.3],
           "routes": ["full", "homogeneous:keydiff"], "max_new_tokens": 4, "output": str(tmp_path / "bench")}
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["bench", "--config", str(tmp_path / "bench.yaml")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "bench" / "results.jsonl").read_text().splitlines()]
    evals = {r["context"] for r in records(12) if hand_split(r) == "eval"}
    samples = [json.loads(line) for line in (tmp_path / "bench" / "samples.jsonl").read_text().splitlines()]
    assert {s["context"] for s in samples} == evals  # only the eval split, every record of it
    assert len(rows) == 2 * n_eval


def test_profile_reads_the_calibration_split_of_the_same_file(tmp_path, tiny_dir):
    path = write(tmp_path / "mine.jsonl", records(12))
    calibration = {r["context"] for r in records(12) if hand_split(r) == "calibration"}
    cfg = {"model": str(tiny_dir), "tasks": {f"jsonl:{path}": len(calibration)}, "context_tokens": 200,
           "budgets": [0.3], "methods": ["keydiff", "streaming_llm"], "output": str(tmp_path / "profile")}
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["profile", "--config", str(tmp_path / "profile.yaml")]) == 0
    samples = [json.loads(line) for line in (tmp_path / "profile" / "samples.jsonl").read_text().splitlines()]
    assert {s["context"] for s in samples} == calibration  # never an eval record
