"""Task metrics, fractions in [0, 1] (the papers report them x100).

RULER's metrics take the whole reference list. LongBench's (as in THUDM/LongBench
``metrics.py``) score one reference; :func:`score` takes the max over references, as
LongBench's ``eval.py`` does, and :func:`score_sample` adds its per-task post-processing
(first-line cut) from the sample's meta.

Libraries: ROUGE-L uses the ``rouge`` package, as LongBench does (its sentence split on
"." and set-based union LCS are quirky, so only the same code gives the same numbers);
Chinese tokenization uses ``jieba`` as LongBench does. Code similarity re-implements
``fuzzywuzzy.fuzz.ratio`` with difflib (what fuzzywuzzy runs without python-Levenshtein,
which LongBench's requirements do not install): fuzzywuzzy is unmaintained, warns on
import, and silently changes its numbers once python-Levenshtein is present.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from learnroute.tasks.ruler import Sample


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


# ---------------------------------------------------------------- LongBench (one reference each)

_ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_EN_PUNCT = frozenset(string.punctuation)
_ALL_PUNCT = frozenset(string.punctuation + _ZH_PUNCTUATION)


def normalize_answer(text: str) -> str:
    """SQuAD-style: lowercase, drop punctuation, drop articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Lowercase, drop English and Chinese punctuation, drop all whitespace."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ALL_PUNCT).split())


def _jieba_cut(text: str) -> list[str]:
    import jieba  # lazy: loads a dictionary (about a second) on first use

    jieba.setLogLevel(logging.WARNING)  # silence "Building prefix dict ..." on stderr
    return list(jieba.cut(text, cut_all=False))


def _token_f1(prediction: list[str], reference: list[str]) -> float:
    common = Counter(prediction) & Counter(reference)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 after :func:`normalize_answer`."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 over jieba words, each normalized by :func:`normalize_zh_answer`, empties dropped."""

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in _jieba_cut(text)) if w]

    return _token_f1(words(prediction), words(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F of the ``rouge`` package (0.0 where it raises, e.g. an empty prediction)."""
    from rouge import Rouge

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # noqa: BLE001 -- LongBench scores any failure (empty text, too deep a recursion) as 0
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F over jieba words joined by spaces."""
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


def classification_score(prediction: str, ground_truth: str, *, all_classes: list[str] | None = None,
                         **kwargs) -> float:
    """1/k if the ground truth is among the k class names found in the prediction, else 0.

    Class names that are substrings of the ground truth (but not it) are dropped first. The
    official code removes them from the list it is iterating over, which skips the entry
    right after each removal; that is replicated so that scores match LongBench's.
    """
    if all_classes is None:
        raise ValueError("classification_score needs all_classes (the sample's meta['all_classes'])")
    matches = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(matches):  # what ``for m in matches: matches.remove(m)`` does
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _fraction_equal(numbers: list[str], target: str) -> float:
    return sum(x == target for x in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Fraction of the numbers in the prediction that equal the ground truth."""
    return _fraction_equal(re.findall(r"\d+", prediction), str(ground_truth))


def _retrieval(prediction: str, ground_truth: str, pattern: str) -> float:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ValueError(f"reference {ground_truth!r} names no paragraph (expected {pattern!r})")
    return _fraction_equal(re.findall(r"\d+", prediction), found[0])


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Fraction of the numbers in the prediction equal to N of the reference's "Paragraph N"."""
    return _retrieval(prediction, ground_truth, r"Paragraph (\d+)")


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Fraction of the numbers in the prediction equal to N of the reference's "段落N"."""
    return _retrieval(prediction, ground_truth, r"段落(\d+)")


def fuzz_ratio(a: str, b: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` without python-Levenshtein: equal -> 100, an empty one -> 0,
    else ``round(100 * difflib.SequenceMatcher(None, a, b).ratio())``."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(100 * difflib.SequenceMatcher(None, a, b).ratio())


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Edit similarity of the first prediction line without '`', '#' or '//' (none: "") to the reference."""
    line = next(
        (ln for ln in prediction.lstrip("\n").split("\n") if "`" not in ln and "#" not in ln and "//" not in ln), ""
    )
    return fuzz_ratio(line, ground_truth) / 100


def first_line(prediction: str) -> str:
    """LongBench's cut for few-shot tasks: the first line after leading newlines."""
    return prediction.lstrip("\n").split("\n")[0]


# ---------------------------------------------------------------- registry

METRICS: dict[str, Callable[..., float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1_score": qa_f1_score,
    "qa_f1_zh_score": qa_f1_zh_score,
    "rouge_score": rouge_score,
    "rouge_zh_score": rouge_zh_score,
    "classification_score": classification_score,
    "count_score": count_score,
    "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score,
    "code_sim_score": code_sim_score,
}
# metrics that score one reference at a time (max over references, as LongBench's eval.py)
PER_REFERENCE = frozenset(METRICS) - {"string_match_all", "string_match_part"}


def score(metric: str, prediction: str, references: list[str], **kwargs) -> float:
    """Score one prediction with the named metric; an unknown name lists the valid ones.

    Per-reference (LongBench) metrics give the max over ``references`` (0.0 for none, as
    eval.py) and receive ``kwargs`` (``all_classes``); RULER metrics take the list whole.
    """
    try:
        fn = METRICS[metric]
    except KeyError:
        raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}") from None
    if metric in PER_REFERENCE:
        return max((float(fn(prediction, ref, **kwargs)) for ref in references), default=0.0)
    return fn(prediction, references, **kwargs)


def _metric_answers_meta(sample: Sample | dict) -> tuple[str, list[str], dict]:
    """A sample's metric, references and meta, from a ``Sample`` or its dict."""
    if isinstance(sample, dict):  # not asdict(): that would copy the long context
        return sample.get("metric", "string_match_all"), sample["answers"], sample.get("meta") or {}
    return sample.metric, sample.answers, sample.meta or {}


# Metrics that only ask whether references occur in the text: a longer answer can only
# find more of them, so once the score is 1 no later token changes it.
_PREFIX_MONOTONE = ("string_match_all", "string_match_part")


def score_is_final(sample: Sample | dict, prediction: str) -> bool:
    """True when no continuation of ``prediction`` can change its score: the sample's
    metric only looks for references in the text (RULER's string_match_all / _part, no
    first-line cut) and already finds them all (score 1)."""
    metric, _, meta = _metric_answers_meta(sample)
    if metric not in _PREFIX_MONOTONE or meta.get("first_line"):
        return False
    return score_sample(sample, prediction) == 1.0


def score_sample(sample: Sample | dict, prediction: str) -> float:
    """Score a prediction for a sample (a ``Sample`` or its dict) with its metric and post-processing.

    Applies the first-line cut where ``meta['first_line']`` says so and passes
    ``meta['all_classes']`` to LongBench metrics, as LongBench's eval.py does.
    """
    metric, answers, meta = _metric_answers_meta(sample)
    if meta.get("first_line"):
        prediction = first_line(prediction)
    if metric in PER_REFERENCE:
        return score(metric, prediction, answers, all_classes=meta.get("all_classes"))
    return score(metric, prediction, answers)
