"""RULER's metrics (fractions in [0, 1]; RULER reports them x100)."""

from __future__ import annotations


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of references found in the prediction, case-insensitive."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    pred = prediction.lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 if any reference is found in the prediction (case-insensitive), else 0.0."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    pred = prediction.lower()
    return float(any(ref.lower() in pred for ref in references))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(metric: str, prediction: str, references: list[str]) -> float:
    """Score one prediction with the named metric; an unknown name lists the valid ones."""
    try:
        fn = METRICS[metric]
    except KeyError:
        raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}") from None
    return fn(prediction, references)
