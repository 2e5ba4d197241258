"""Long-context tasks: RULER-style synthetic generators (offline) and their metrics."""

from learnroute.tasks.metrics import METRICS, score, string_match_all, string_match_part
from learnroute.tasks.ruler import SPLITS, TASKS, Sample, make_sample, make_samples

__all__ = [
    "METRICS",
    "SPLITS",
    "TASKS",
    "Sample",
    "make_sample",
    "make_samples",
    "score",
    "string_match_all",
    "string_match_part",
]
