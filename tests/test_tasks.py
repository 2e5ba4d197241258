import pytest

from learnroute.tasks import TASKS, make_sample, make_samples, score, string_match_all, string_match_part


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_fill_the_target_length_and_contain_their_answers(task, tokenizer):
    s = make_sample(task, tokenizer, 1000, "eval", seed=0, index=0)
    n = len(tokenizer.encode(s.context, add_special_tokens=False))
    assert 800 <= n <= 1000, n
    assert s.answers and s.question and s.answer_prefix
    if task != "multihop_qa":  # its answer is reached through a second fact
        for ref in s.answers:
            assert ref in s.context
    else:
        person, town, country = s.meta["hops"]
        assert f"{person} lives in {town}." in s.context and f"{town} is a town in {country}." in s.context


@pytest.mark.parametrize("task", ["niah_single_2", "variable_tracking", "frequent_words"])
def test_same_seed_gives_byte_identical_samples(task, tokenizer):
    a = make_sample(task, tokenizer, 600, "calibration", seed=3, index=2)
    b = make_sample(task, tokenizer, 600, "calibration", seed=3, index=2)
    assert a.to_dict() == b.to_dict()


def test_calibration_and_eval_never_coincide(tokenizer):
    for task in TASKS:
        calib = make_samples(task, tokenizer, 4, 400, "calibration", seed=0)
        ev = make_samples(task, tokenizer, 4, 400, "eval", seed=0)
        calib_keys = {(s.context, s.question) for s in calib}
        assert not calib_keys & {(s.context, s.question) for s in ev}, task
        assert not {tuple(s.answers) for s in calib} & {tuple(s.answers) for s in ev}, task


def test_unknown_task_and_split_list_the_valid_ones(tokenizer):
    with pytest.raises(ValueError, match="unknown task 'niah'; valid: niah_single_1"):
        make_sample("niah", tokenizer, 500, "eval", 0, 0)
    with pytest.raises(ValueError, match="unknown split 'test'; valid: calibration, eval"):
        make_sample("niah_single_1", tokenizer, 500, "test", 0, 0)


def test_ruler_metrics_on_hand_computed_cases():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("UUID ABC-def", ["abc-DEF"]) == 1.0
    assert string_match_part("It is Norway.", ["Peru", "norway"]) == 1.0
    assert string_match_part("It is Norway.", ["Peru"]) == 0.0
    assert score("string_match_all", "x", ["y"]) == 0.0
    with pytest.raises(ValueError, match="valid: string_match_all, string_match_part"):
        score("f1", "x", ["y"])


def test_needle_depths_spread_over_the_context(tokenizer):
    depths = [make_sample("niah_single_1", tokenizer, 500, "eval", 0, i).meta["depths"][0] for i in range(20)]
    assert min(depths) < 0.25 and max(depths) > 0.75
