"""Long-context tasks: RULER-style synthetic generators (offline), LongBench from local files, metrics."""

from learnroute.tasks.longbench import (
    LONGBENCH_TASKS,
    LongBenchTask,
    fit_prompt,
    load_longbench,
    truncate_middle,
)
from learnroute.tasks.metrics import (
    METRICS,
    classification_score,
    code_sim_score,
    count_score,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
    score,
    score_sample,
    string_match_all,
    string_match_part,
)
from learnroute.tasks.ruler import SPLITS, TASKS, Sample, make_sample, make_samples
from learnroute.tasks import families as _families  # noqa: F401  (registers its tasks in TASKS)

__all__ = [
    "LONGBENCH_TASKS",
    "METRICS",
    "SPLITS",
    "TASKS",
    "LongBenchTask",
    "Sample",
    "classification_score",
    "code_sim_score",
    "count_score",
    "fit_prompt",
    "load_longbench",
    "make_sample",
    "make_samples",
    "qa_f1_score",
    "qa_f1_zh_score",
    "retrieval_score",
    "retrieval_zh_score",
    "rouge_score",
    "rouge_zh_score",
    "score",
    "score_sample",
    "string_match_all",
    "string_match_part",
    "truncate_middle",
]
