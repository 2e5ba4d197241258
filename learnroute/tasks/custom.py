"""Your own data as a task: ``jsonl:PATH``, usable wherever a task name is.

One JSON object per line (blank lines are skipped)::

    {"context": "...", "question": "...", "answers": ["42"],          # required
     "answer_prefix": "The answer is", "metric": "string_match_all",   # optional
     "split": "calibration", "id": "doc-17", "max_new_tokens": 32}     # optional

- ``context``: the text that is prefilled and compressed; ``question``: asked after it
  (query-agnostic: compression never sees it); ``answers``: the references, a non-empty
  list of non-empty strings; ``answer_prefix``: text the answer continues (default none).
- ``metric``: how an answer counts, one of :data:`learnroute.tasks.METRICS` (default
  ``string_match_all``: the fraction of references found, case-insensitive, RULER's).
- ``split``: ``calibration`` (profile, training, validation) or ``eval`` (bench). Without
  it a record's split is fixed by a hash of its content (:func:`record_split`): about
  half of the records calibrate, the other half evaluate, the same ones on every machine
  and in every order of the file, so that one file serves both and no record is in both.
- ``id``: a name for the record (default: a hash of its content); ``max_new_tokens``: the
  answer cap of this record (default 32).

The ``n`` samples asked of a split are its first ``n`` records in file order (the
``seed`` of generated tasks does not apply). A context longer than ``context_tokens``
tokens is cut in the middle (its first and last halves kept, as LongBench does) and the
number cut is logged. Every problem of a file (not JSON, a missing or ill-typed field, an
empty ``answers``, an unknown metric, a record in both splits, fewer records than asked)
is reported with the file, the line and what is valid, before any model is loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from learnroute.tasks.metrics import METRICS
from learnroute.tasks.ruler import SPLITS, Sample, count_tokens

logger = logging.getLogger(__name__)

PREFIX = "jsonl:"
REQUIRED = ("context", "question", "answers")
OPTIONAL = ("answer_prefix", "metric", "split", "id", "max_new_tokens")
DEFAULT_METRIC = "string_match_all"
DEFAULT_MAX_NEW_TOKENS = 32
EVAL_SHARE = 0.5  # share of records without a split field that evaluate (by content hash)
_MAX_LISTED = 20  # problems listed per file before "... and N more"


class CustomDataError(ValueError):
    """A custom data file that cannot be used; the message lists its problems."""


@dataclass(frozen=True)
class Record:
    """One checked line of a custom data file."""

    line: int
    id: str
    split: str
    context: str
    question: str
    answers: tuple[str, ...]
    answer_prefix: str
    metric: str
    max_new_tokens: int


def is_custom(name: str) -> bool:
    """Is ``name`` a custom data task (``jsonl:PATH``)?"""
    return name.startswith(PREFIX)


def custom_path(name: str) -> Path:
    """The file a ``jsonl:PATH`` task reads (relative paths from the working directory)."""
    return Path(os.path.expanduser(name[len(PREFIX):]))


def content_hash(context: str, question: str, answers: list[str] | tuple[str, ...]) -> str:
    """SHA-256 of a record's content (context, question, answers): its default id and split."""
    blob = json.dumps([context, question, list(answers)], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def record_split(context: str, question: str, answers: list[str] | tuple[str, ...]) -> str:
    """The split of a record without a ``split`` field: ``eval`` when the first 8 bytes of its
    content hash, read as a fraction of 2**64, fall below :data:`EVAL_SHARE`, else
    ``calibration``. Identical records land in the same split."""
    fraction = int(content_hash(context, question, answers)[:16], 16) / 2**64
    return "eval" if fraction < EVAL_SHARE else "calibration"


def _check_line(row: object, where: str) -> tuple[dict | None, list[str]]:
    """The row's fields with defaults filled in, or None and what is wrong with it."""
    if not isinstance(row, dict):
        return None, [f"{where}: expected a JSON object, got {type(row).__name__}"]
    problems = []
    if missing := [f for f in REQUIRED if f not in row]:
        problems.append(f"{where}: missing field(s) {', '.join(missing)} (required: {', '.join(REQUIRED)})")
    if unknown := sorted(set(row) - set(REQUIRED) - set(OPTIONAL)):
        problems.append(f"{where}: unknown field(s) {', '.join(unknown)}; valid: {', '.join(REQUIRED + OPTIONAL)}")
    for f in ("context", "question", "answer_prefix", "id"):
        if f in row and not isinstance(row[f], str):
            problems.append(f"{where}: field {f!r} must be a string, got {type(row[f]).__name__}")
    if "answers" in row:
        answers = row["answers"]
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            problems.append(f"{where}: field 'answers' must be a list of strings, got {answers!r:.80}")
        elif not answers or not all(a.strip() for a in answers):
            problems.append(f"{where}: field 'answers' must hold at least one non-empty string, got {answers!r}")
    if "metric" in row and row["metric"] not in METRICS:
        problems.append(f"{where}: unknown metric {row['metric']!r}; valid: {', '.join(METRICS)}")
    if "split" in row and row["split"] not in SPLITS:
        problems.append(f"{where}: split must be one of {', '.join(SPLITS)}, got {row['split']!r}")
    if "max_new_tokens" in row:
        m = row["max_new_tokens"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            problems.append(f"{where}: max_new_tokens must be an integer >= 1, got {m!r}")
    if isinstance(row.get("context"), str) and not row["context"].strip():
        problems.append(f"{where}: field 'context' is empty")
    return (None if problems else row), problems


_CACHE: dict[tuple[str, int, int], tuple[list[Record], list[str]]] = {}


def read_records(path: Path) -> tuple[list[Record], list[str]]:
    """Every usable record of a custom data file and the problems of the others.

    Read once per file version (path, size, modification time): the config check and the
    loader read the same file.
    """
    path = Path(path)
    if not path.is_file():
        return [], [f"{path}: no such file (a custom data task is jsonl:PATH, one JSON record per line)"]
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _CACHE:
        records, problems = _CACHE[key]
        return list(records), list(problems)
    records: list[Record] = []
    problems: list[str] = []
    seen: dict[str, tuple[int, str]] = {}  # content hash -> (line, split)
    ids: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{where}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            row, bad = _check_line(row, where)
            problems += bad
            if row is None:
                continue
            digest = content_hash(row["context"], row["question"], row["answers"])
            split = row.get("split") or record_split(row["context"], row["question"], row["answers"])
            if digest in seen:
                first, first_split = seen[digest]
                why = (f"in both splits ({first_split} there, {split} here): calibration and eval must not "
                       "share a record" if first_split != split else "a duplicate would count twice")
                problems.append(f"{where}: the same record as line {first}, {why}")
                continue
            seen[digest] = (lineno, split)
            rid = row.get("id") or f"{path.stem}/{digest[:12]}"
            if rid in ids:
                problems.append(f"{where}: id {rid!r} is also line {ids[rid]}'s; ids must be unique")
                continue
            ids[rid] = lineno
            records.append(Record(
                line=lineno, id=rid, split=split, context=row["context"], question=row["question"],
                answers=tuple(row["answers"]), answer_prefix=row.get("answer_prefix", ""),
                metric=row.get("metric", DEFAULT_METRIC),
                max_new_tokens=row.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
            ))
    _CACHE[key] = (records, problems)
    return list(records), list(problems)


def custom_problems(name: str, split: str, n: int | None = None) -> list[str]:
    """Problems of ``jsonl:PATH`` as a task of ``split`` asked for ``n`` samples (None: any),
    without loading a model."""
    path = custom_path(name)
    records, problems = read_records(path)
    problems = list(problems)  # the cached list stays as read
    if len(problems) > _MAX_LISTED:
        problems = problems[:_MAX_LISTED] + [f"{path}: ... and {len(problems) - _MAX_LISTED} more problems"]
    if not problems and n is not None:
        have = sum(r.split == split for r in records)
        if have < n:
            counts = ", ".join(f"{s} {sum(r.split == s for r in records)}" for s in SPLITS)
            problems.append(
                f"{name}: {n} {split} samples asked, the file has {have} (of {len(records)} records: {counts}; "
                f"records without a 'split' field go {EVAL_SHARE:.0%} to eval by a hash of their content)"
            )
    return problems


def load_custom(name: str, tokenizer, n: int, n_tokens: int, split: str) -> list[Sample]:
    """The first ``n`` records of ``split`` in ``jsonl:PATH`` as samples, each context cut in
    the middle to at most ``n_tokens`` tokens of ``tokenizer``."""
    from learnroute.tasks.longbench import truncate_middle

    if problems := custom_problems(name, split, n):
        raise CustomDataError("\n  ".join([f"cannot use {name}:"] + problems))
    records = [r for r in read_records(custom_path(name))[0] if r.split == split][:n]
    samples, cut = [], 0
    for r in records:
        context = r.context
        if count_tokens(tokenizer, context) > n_tokens:
            context, cut = truncate_middle(tokenizer, context, n_tokens), cut + 1
        samples.append(Sample(
            id=r.id, task=name, split=split, context=context, question=r.question,
            answer_prefix=r.answer_prefix, answers=list(r.answers), metric=r.metric,
            meta={"max_new_tokens": r.max_new_tokens, "line": r.line, "truncated": context != r.context},
        ))
    if cut:
        logger.warning("%s: %d of %d %s contexts were longer than %d tokens and were cut in the middle",
                       name, cut, len(samples), split, n_tokens)
    return samples


def write_jsonl(samples: list[Sample], path: str | os.PathLike, split: bool = True) -> Path:
    """Write samples as a custom data file (``jsonl:PATH`` reads it back as the same samples):
    their ids, and their split unless ``split`` is False (then the content hash decides)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in samples:
        row = {"id": s.id, "context": s.context, "question": s.question, "answers": list(s.answers),
               "answer_prefix": s.answer_prefix, "metric": s.metric}
        if split:
            row["split"] = s.split
        if "max_new_tokens" in s.meta:
            row["max_new_tokens"] = s.meta["max_new_tokens"]
        lines.append(json.dumps(row, ensure_ascii=False))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path
