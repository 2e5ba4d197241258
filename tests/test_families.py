"""The task families beyond needle retrieval (learnroute/tasks/families.py): fast, tokenizer only."""

import re

import pytest

from learnroute.tasks import TASKS, make_sample, make_samples, score_sample
from learnroute.tasks.families import FAMILIES, FAMILY_MAX_NEW_TOKENS
from learnroute.tasks.suite import calibration_problems, check_tasks, task_names

FAMILY_NAMES = list(FAMILIES)


def test_at_least_four_families_are_registered_with_the_ruler_tasks():
    assert len(FAMILY_NAMES) >= 4
    for name in FAMILY_NAMES:
        assert TASKS[name] is FAMILIES[name]
        assert name in task_names()
    assert check_tasks(FAMILY_NAMES, "eval") == []
    assert check_tasks(FAMILY_NAMES, "calibration") == []
    assert calibration_problems({name: 2 for name in FAMILY_NAMES}) == []


@pytest.mark.parametrize("task", FAMILY_NAMES)
def test_same_seed_gives_byte_identical_samples(task, tokenizer):
    a = make_sample(task, tokenizer, 600, "calibration", seed=3, index=2)
    b = make_sample(task, tokenizer, 600, "calibration", seed=3, index=2)
    assert a.to_dict() == b.to_dict()
    c = make_sample(task, tokenizer, 600, "calibration", seed=4, index=2)
    assert c.context != a.context


@pytest.mark.parametrize("task", FAMILY_NAMES)
def test_calibration_and_eval_never_coincide(task, tokenizer):
    calib = make_samples(task, tokenizer, 20, 200, "calibration", seed=0)
    ev = make_samples(task, tokenizer, 20, 200, "eval", seed=0)
    assert not {s.context for s in calib} & {s.context for s in ev}
    assert not {tuple(s.answers) for s in calib} & {tuple(s.answers) for s in ev}
    assert len({s.context for s in ev}) == 20  # and samples of one split differ from each other


@pytest.mark.parametrize("task", FAMILY_NAMES)
@pytest.mark.parametrize("n_tokens", [1024, 2048])
def test_context_fills_the_target_length_within_five_percent(task, n_tokens, tokenizer):
    for index in range(3):
        s = make_sample(task, tokenizer, n_tokens, "eval", seed=0, index=index)
        n = len(tokenizer.encode(s.context, add_special_tokens=False))
        assert 0.95 * n_tokens <= n <= n_tokens, (index, n)


def _evidence(s) -> list[str]:
    """The strings that answer the question, each of which must occur exactly once."""
    (answer,) = s.answers
    if s.task == "kv_json":
        return [f'"{s.meta["key"]}"', f'"{s.meta["key"]}": "{answer}"', answer]
    if s.task == "code_passkey":
        name = next(n for n, v in s.meta["constants"].items() if v == answer)
        assert name in s.question
        return [f"{name} =", f"\n{name} = {answer}\n", answer]
    if s.task == "chat_codes":
        who, kind = next(k for k, c in s.meta["codes"].items() if c == answer).split("/")
        assert who in s.question and kind in s.question
        return [f"\n{who}: My {kind} is {answer}.", f" {kind} is", answer]
    if s.task == "csv_lookup":
        item = s.meta["row"][0]
        return [f"\n{item},", "\n" + ",".join(s.meta["row"]) + "\n", answer]
    raise AssertionError(f"no evidence rule for {s.task}")


@pytest.mark.parametrize("task", FAMILY_NAMES)
def test_the_answer_is_in_the_context_exactly_once(task, tokenizer):
    for index in range(5):
        s = make_sample(task, tokenizer, 700, "eval", seed=0, index=index)
        for needed in _evidence(s):
            assert s.context.count(needed) == 1, (index, needed)
        assert s.answer_prefix and s.question.strip()
        assert s.answer_prefix not in s.context  # the prefix follows the question, never the data


@pytest.mark.parametrize("task", FAMILY_NAMES)
def test_metric_scores_the_reference_one_and_a_wrong_answer_below_one(task, tokenizer):
    s = make_sample(task, tokenizer, 500, "eval", seed=0, index=1)
    assert s.metric == "string_match_all"
    assert s.meta["max_new_tokens"] == FAMILY_MAX_NEW_TOKENS[task]
    (answer,) = s.answers
    assert score_sample(s, f" {answer}") == 1.0
    assert score_sample(s, f' {answer}".\n') == 1.0
    wrong = [v for v in re.findall(r"\b\d{7}\b", s.context) if v != answer]
    assert wrong, "every family has other 7-digit values to confuse"
    assert score_sample(s, f" {wrong[0]}") < 1.0
    assert score_sample(s, "") == 0.0


@pytest.mark.parametrize("task", FAMILY_NAMES)
def test_the_asked_item_sits_at_every_depth(task, tokenizer):
    where = []
    for index in range(20):
        s = make_sample(task, tokenizer, 300, "eval", seed=0, index=index)
        where.append(s.context.index(s.answers[0]) / len(s.context))
    assert min(where) < 0.35 and max(where) > 0.75
