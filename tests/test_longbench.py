"""LongBench loading (official prompts, splitting, truncation, errors) and LongBench metrics."""

import json
from pathlib import Path

import pytest

from learnroute.tasks import (
    LONGBENCH_TASKS,
    Sample,
    classification_score,
    code_sim_score,
    count_score,
    fit_prompt,
    load_longbench,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
    score,
    score_sample,
    truncate_middle,
)
from learnroute.tasks.longbench import ENV_VAR, default_data_dir

DATA = Path(__file__).parent / "data" / "longbench"
FIXTURE_TASKS = ["qasper", "multifieldqa_zh", "trec", "passage_retrieval_en", "lcc", "repobench-p", "gov_report"]


@pytest.fixture(scope="module")
def tok():
    """The default model's tokenizer alone (no model weights loaded)."""
    from transformers import AutoTokenizer

    from learnroute.models import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def rows(task: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()]


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- the official facts


def test_all_21_datasets_with_official_lengths_and_metrics():
    # config/dataset2maxlen.json and eval.py's dataset2metric
    maxlen = {
        "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
        "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
        "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
        "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
    }
    assert {k: t.max_new_tokens for k, t in LONGBENCH_TASKS.items()} == maxlen
    assert LONGBENCH_TASKS["dureader"].metric == "rouge_zh_score"
    assert LONGBENCH_TASKS["lsht"].metric == "classification_score"
    assert LONGBENCH_TASKS["passage_retrieval_zh"].metric == "retrieval_zh_score"
    assert LONGBENCH_TASKS["repobench-p"].metric == "code_sim_score"
    assert {k for k, t in LONGBENCH_TASKS.items() if t.language == "zh"} == {
        "multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"}


def test_chat_template_and_first_line_flags():
    no_chat = {k for k, t in LONGBENCH_TASKS.items() if not t.chat_template}
    assert no_chat == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert {k for k, t in LONGBENCH_TASKS.items() if t.first_line} == {"trec", "triviaqa", "samsum", "lsht"}
    assert [k for k, t in LONGBENCH_TASKS.items() if t.stop_at_newline] == ["samsum"]


def test_prompts_keep_the_official_text():
    # spot checks of dataset2prompt.json, typos and trailing spaces included
    assert "Answer the question asconcisely as you can" in LONGBENCH_TASKS["narrativeqa"].prompt
    assert LONGBENCH_TASKS["passage_count"].prompt.endswith("\n\nThe final answer is: ")
    assert LONGBENCH_TASKS["lcc"].prompt == "Please complete the code given below. \n{context}Next line of code:\n"
    assert LONGBENCH_TASKS["qasper"].prompt.startswith(
        'You are given a scientific article and a question. Answer the question as concisely as you can')
    assert "\n\nArticle: {context}\n\n Answer the question based on the above article" in (
        LONGBENCH_TASKS["qasper"].prompt)
    assert LONGBENCH_TASKS["vcsum"].prompt == "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结："
    for t in LONGBENCH_TASKS.values():
        assert t.prompt.count("{context}") == 1, t.name
        # in every v1 template the input comes after the context, so it is never compressed
        assert "{input}" not in t.prompt.partition("{context}")[0], t.name


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("task", FIXTURE_TASKS)
def test_context_plus_question_is_the_official_prompt(task):
    samples = load_longbench(task, data_dir=DATA)
    raw = rows(task)
    assert len(samples) == len(raw)
    spec = LONGBENCH_TASKS[task]
    for s, row in zip(samples, raw):
        assert s.context + s.question == spec.prompt.format(**row)
        assert s.context.endswith(row["context"]) and s.answer_prefix == ""
        assert s.id == f"longbench/{task}/{row['_id']}" and s.task == f"longbench_{task}" and s.split == "eval"
        assert s.answers == row["answers"] and s.metric == spec.metric
        assert s.meta["max_new_tokens"] == spec.max_new_tokens
        assert s.meta["chat_template"] is spec.chat_template and s.meta["first_line"] is spec.first_line
        assert s.meta["all_classes"] == row["all_classes"] and s.meta["length"] == row["length"]
        assert s.meta["_id"] == row["_id"] and s.meta["dataset"] == task and s.meta["truncated"] is False


def test_split_point_for_a_qa_and_a_few_shot_task():
    s = load_longbench("qasper", data_dir=DATA)[0]
    assert s.question.startswith("\n\n Answer the question based on the above article")
    assert s.question.endswith("\n\nQuestion: Which dataset do the authors use?\n\nAnswer:")
    assert "{curly}" in s.context  # braces in the data are not format fields
    t = load_longbench("trec", data_dir=DATA)[0]
    assert t.question == "\nQuestion: What city is the Eiffel Tower in?\nType:"
    r = load_longbench("repobench-p", data_dir=DATA)[0]
    assert r.question == "from utils import add\n\ndef main():\nNext line of code:\n"


def test_n_takes_the_first_rows_and_the_e_variant_loads():
    assert [s.meta["_id"] for s in load_longbench("qasper", data_dir=DATA, n=2)] == ["q001", "q002"]
    assert load_longbench("qasper", data_dir=DATA, n=0) == []
    (e,) = load_longbench("qasper_e", data_dir=DATA)
    assert e.task == "longbench_qasper_e" and e.metric == "qa_f1_score" and e.meta["max_new_tokens"] == 128


def test_data_dir_defaults_to_the_env_var(monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(DATA))
    assert default_data_dir() == DATA
    assert len(load_longbench("lcc")) == 1
    monkeypatch.delenv(ENV_VAR)
    assert default_data_dir() == Path.home() / ".cache" / "learnroute" / "longbench"


def test_missing_file_names_path_format_and_source(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_longbench("hotpotqa", data_dir=tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "hotpotqa.jsonl") in msg
    assert "one JSON object per line" in msg and "all_classes" in msg and "_id" in msg
    assert "THUDM/LongBench" in msg and "data.zip" in msg and ENV_VAR in msg


def test_malformed_lines_name_file_line_and_fields(tmp_path):
    good = rows("lcc")[0]
    bad = {k: v for k, v in good.items() if k not in ("answers", "_id")}
    (tmp_path / "lcc.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"lcc\.jsonl:2: missing field\(s\) answers, _id"):
        load_longbench("lcc", data_dir=tmp_path)
    (tmp_path / "lcc.jsonl").write_text(json.dumps(good) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"lcc\.jsonl:3: not valid JSON"):
        load_longbench("lcc", data_dir=tmp_path)
    (tmp_path / "lcc.jsonl").write_text(json.dumps({**good, "answers": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"lcc\.jsonl:1: field 'answers' must be a list of strings"):
        load_longbench("lcc", data_dir=tmp_path)


def test_unknown_task_split_and_bad_arguments(tok):
    with pytest.raises(ValueError, match=r"unknown LongBench task 'squad'; valid: narrativeqa, qasper, .*repobench-p"):
        load_longbench("squad", data_dir=DATA)
    with pytest.raises(ValueError, match="unknown LongBench task 'musique_e'"):  # LongBench-E has no musique
        load_longbench("musique_e", data_dir=DATA)
    with pytest.raises(ValueError, match="only a test set.*calibrate on RULER"):
        load_longbench("qasper", data_dir=DATA, split="calibration")
    with pytest.raises(ValueError, match="max_tokens needs a tokenizer"):
        load_longbench("qasper", data_dir=DATA, max_tokens=100)
    with pytest.raises(ValueError, match="n must be"):
        load_longbench("qasper", data_dir=DATA, n=-1)
    with pytest.raises(ValueError, match="the question alone has"):
        load_longbench("qasper", tok, data_dir=DATA, max_tokens=20)


# ---------------------------------------------------------------- truncation


def test_truncate_middle_keeps_first_and_last_halves(tok):
    text = " ".join(f"w{i}" for i in range(300))
    ids = tok.encode(text, add_special_tokens=False)
    assert truncate_middle(tok, text, len(ids)) == text  # fits: unchanged
    out = truncate_middle(tok, text, 50)
    # pred.py: decode(ids[:25]) + decode(ids[-25:])
    assert out == tok.decode(ids[:25], skip_special_tokens=True) + tok.decode(ids[-25:], skip_special_tokens=True)
    assert out.startswith("w0 w1 w2") and out.endswith("w298 w299")
    assert n_tokens(tok, out) <= 50
    assert n_tokens(tok, truncate_middle(tok, text, 51)) <= 50  # odd limit: 2 * 25 tokens, as pred.py
    with pytest.raises(ValueError, match="positive int"):
        truncate_middle(tok, text, 0)


def test_long_context_is_cut_in_the_middle_to_fit(tok):
    (full,) = load_longbench("gov_report", data_dir=DATA)
    n_full = n_tokens(tok, full.context + full.question)
    assert n_full > 400  # the fixture needs truncation at 300
    (cut,) = load_longbench("gov_report", tok, data_dir=DATA, max_tokens=300)
    assert cut.meta["truncated"] is True and cut.question == full.question
    assert n_tokens(tok, cut.context + cut.question) <= 300
    # the head of the prompt (template + report start) and the report's end survive, the middle is gone
    assert cut.context.startswith("You are given a report by a government agency.")
    assert "In fiscal year 2000," in cut.context and cut.context.endswith("END REPORT.")
    assert "In fiscal year 2030," not in cut.context
    # the head keeps max_tokens // 2 tokens, as pred.py's first half of the whole prompt
    ids = tok.encode(full.context, add_special_tokens=False)
    assert cut.context.startswith(tok.decode(ids[:150], skip_special_tokens=True))
    # a short sample under the same limit is left alone
    (short,) = load_longbench("lcc", tok, data_dir=DATA, max_tokens=300)
    assert short.meta["truncated"] is False
    ctx, truncated = fit_prompt(tok, "abc", "?", 10)
    assert (ctx, truncated) == ("abc", False)


# ---------------------------------------------------------------- metrics on hand-computed cases


def test_qa_f1():
    # normalized "cat sat" vs "cat sat down": P 2/2, R 2/3 -> 2 * 1 * 2/3 / (5/3) = 0.8
    assert qa_f1_score("The cat sat.", "a cat sat down") == pytest.approx(0.8)
    assert qa_f1_score("An Apple!", "apple") == 1.0  # articles and punctuation dropped
    assert qa_f1_score("the", "a") == 0.0  # both normalize to nothing
    # max over references: "WikiText-103" -> "wikitext103" matches the first exactly
    assert score("qa_f1_score", "WikiText-103", ["WikiText-103", "the WikiText-103 corpus"]) == 1.0


def test_qa_f1_zh():
    # jieba: 我/爱/北京/。 -> [我, 爱, 北京] ("。" normalizes away); 我/爱/天安门 -> P 2/3, R 2/3 -> 2/3
    assert qa_f1_zh_score("我爱北京。", "我爱天安门") == pytest.approx(2 / 3)
    # 会议/在/北京/举行 vs 北京: P 1/4, R 1 -> 2 * 1/4 / (5/4) = 0.4
    assert qa_f1_zh_score("会议在北京举行", "北京") == pytest.approx(0.4)


def test_rouge_l():
    # LCS(a b c d, a c e) = a c: R 2/3, P 2/4 -> F = 2 * (1/2 * 2/3) / (1/2 + 2/3) = 4/7
    assert rouge_score("a b c d", "a c e") == pytest.approx(4 / 7, abs=1e-6)
    # summary level: "the cat sat. the dog ran" is two sentences; union LCS with "the cat ran"
    # = {the, cat} | {the, ran} = 3 of 3 reference words, 3 of 5 distinct candidate words -> F 0.75
    assert rouge_score("the cat sat. the dog ran", "the cat ran") == pytest.approx(0.75, abs=1e-6)
    assert rouge_score("", "anything") == 0.0  # the package raises on an empty hypothesis
    # Chinese: 会议 在 北京 举行 vs 在 北京 举行 。 -> LCS 3, R 3/4, P 3/4 -> 0.75
    assert rouge_zh_score("会议在北京举行", "在北京举行。") == pytest.approx(0.75, abs=1e-6)


def test_classification_follows_the_official_quirk():
    classes = ["Other", "location", "Other location", "City"]
    assert classification_score("City", "City", all_classes=classes) == 1.0
    # found: City, Other location, Other, location; "Other" is removed (a part of the truth), which skips
    # "location" in the official loop: 3 remain -> 1/3
    assert classification_score("City or Other location", "Other location", all_classes=classes) == (
        pytest.approx(1 / 3))
    # found: Other, location, Other location; removing "Other" skips "location" -> 2 remain -> 1/2
    assert classification_score("Other location", "Other location", all_classes=classes) == 0.5
    assert classification_score("Country", "City", all_classes=classes) == 0.0
    with pytest.raises(ValueError, match="needs all_classes"):
        classification_score("City", "City")


def test_count_and_retrieval():
    assert count_score("There are 3 unique paragraphs out of 10.", "3") == 0.5  # numbers 3, 10
    assert count_score("none", "3") == 0.0
    assert retrieval_score("Paragraph 12, not paragraph 2", "Paragraph 12") == 0.5  # numbers 12, 2
    assert retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    assert retrieval_zh_score("答案是段落7", "段落7") == 1.0
    assert retrieval_zh_score("段落7或段落8", "段落7") == 0.5
    with pytest.raises(ValueError, match="names no paragraph"):
        retrieval_score("1", "the second one")


def test_code_similarity():
    # first line without ` # //: "    return total"; vs "return total": 2 * 12 / (16 + 12) = 0.857 -> 86
    assert code_sim_score("```python\n# done\n    return total\n", "return total") == 0.86
    # "return x + 1" vs "return x+1": matches "return x", "+", "1" = 10 chars, 2 * 10 / 22 = 90.9 -> 91
    assert code_sim_score("\nreturn x + 1", "return x+1") == 0.91
    assert code_sim_score("// only comments", "x = 1") == 0.0  # no usable line -> "" -> 0
    assert code_sim_score("x = 1", "x = 1") == 1.0


def test_score_sample_applies_first_line_and_classes():
    (t,) = load_longbench("trec", data_dir=DATA)
    assert score_sample(t, "City\nQuestion: What is NASA?\nType: Abbreviation") == 1.0
    assert score_sample(t, "\n\nCity and more") == 1.0  # leading newlines stripped before the cut
    assert score_sample(t.to_dict(), "Country") == 0.0
    (q,) = load_longbench("qasper", data_dir=DATA, n=1)
    # qasper keeps every line: "the\nWikiText-103" normalizes to "wikitext103", as the reference -> 1.0
    assert score_sample(q, "the\nWikiText-103") == 1.0
    (r,) = load_longbench("passage_retrieval_en", data_dir=DATA)
    assert score_sample(r, "Paragraph 2") == 1.0
    # RULER samples keep working: the whole reference list, no post-processing
    ruler = Sample("x", "niah", "eval", "c", "q", "p", ["123", "456"])
    assert score_sample(ruler, "123\n456") == 1.0
    assert score_sample(ruler.to_dict(), "only 123") == 0.5


def test_score_lists_valid_metrics():
    with pytest.raises(ValueError, match="unknown metric 'bleu'; valid: .*qa_f1_score.*code_sim_score"):
        score("bleu", "x", ["y"])
    assert score("count_score", "3", []) == 0.0  # no references: 0, as eval.py's max starting from 0
