

def test_score_is_final_only_for_reference_matching_metrics_at_one():
    from learnroute.tasks.metrics import score_is_final

    two = {"metric": "string_match_all", "answers": ["123", "456"]}
    assert not score_is_final(two, "the numbers: 123")  # 0.5: a later 456 would raise it
    assert score_is_final(two, "the numbers: 123, 456")
    assert score_is_final({"metric": "string_match_part", "answers": ["a1", "b2"]}, "B2")
    assert not score_is_final({"metric": "string_match_part", "answers": ["a1"]}, "none")
    # F1 can fall with more text; a first-line cut ignores later lines: never final
    assert not score_is_final({"metric": "qa_f1_score", "answers": ["paris"]}, "paris")
    assert not score_is_final({"metric": "string_match_all", "answers": ["x"], "meta": {"first_line": True}}, "x")
