"""LongBench v1 (Bai et al. 2023, arXiv 2308.14508) from local JSONL files, never downloaded.

Prompts, maximum generation lengths, metrics and the chat-template / first-line rules are
those of THUDM/LongBench (``config/dataset2prompt.json``, ``config/dataset2maxlen.json``,
``pred.py``, ``eval.py``). Each formatted prompt is split at the compression point:
``Sample.context`` is the prompt up to and including the ``{context}`` text (everything
before it is prefilled and compressed with it), ``Sample.question`` is the rest (the
instruction after the context, ``{input}``, the trailing "Answer:"), ``answer_prefix`` is
"". So ``context + question`` is the official prompt. No v1 template puts ``{input}``
before ``{context}``; if one did, the input would land in the prefilled part.

Samples are named ``id = "longbench/{task}/{_id}"`` and ``task = "longbench_{task}"``
(``task`` as given, e.g. ``qasper`` or the LongBench-E variant ``qasper_e``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from learnroute.tasks.ruler import Sample, count_tokens

ENV_VAR = "LEARNROUTE_LONGBENCH"
FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
# pred.py builds no chat prompt for these ("chat models are better off without")
_NO_CHAT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
# eval.py scores only the first line of the prediction for these (few-shot tasks)
_FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
# the datasets LongBench-E ships as ``{name}_e`` (pred.py's --e list)
_HAS_E = frozenset({
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
})


@dataclass(frozen=True)
class LongBenchTask:
    """One LongBench dataset: the official prompt, generation length and scoring rules."""

    name: str
    prompt: str  # str.format template with {context} and (mostly) {input}
    max_new_tokens: int
    metric: str  # a key of learnroute.tasks.metrics.METRICS
    language: str  # "en" or "zh"
    chat_template: bool  # False where pred.py feeds the raw prompt to chat models
    first_line: bool  # eval.py cuts the prediction to its first line before scoring
    stop_at_newline: bool = False  # pred.py adds "\n" as an EOS token (samsum only)
    has_e: bool = False  # a LongBench-E variant ``{name}_e`` exists

    def split_prompt(self, row: dict) -> tuple[str, str]:
        """``(context, question)`` of the official prompt for ``row``; they concatenate to it."""
        head, _, tail = self.prompt.partition("{context}")
        # format each part separately: braces inside the row's text are never parsed
        return head.format(**row) + row["context"], tail.format(**row)


_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only "
    "give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
# Exact text of LongBench's config/dataset2prompt.json, typos included ("asconcisely"):
# a changed prompt changes the scores.
_PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        "article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
        "\"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based "
        "on the above article as concisely as you can, using a single phrase or sentence if possible. If the "
        "question cannot be answered based on the information in the article, write \"unanswerable\". If the "
        "question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any "
        "explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。"
        "\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        "the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", "
        "etc.\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n"
        "请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是："
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# config/dataset2maxlen.json
_MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}

# eval.py's dataset2metric
_METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1_score", "qasper": "qa_f1_score", "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score", "hotpotqa": "qa_f1_score", "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score", "dureader": "rouge_zh_score", "gov_report": "rouge_score", "qmsum": "rouge_score",
    "multi_news": "rouge_score", "vcsum": "rouge_zh_score", "trec": "classification_score",
    "triviaqa": "qa_f1_score", "samsum": "rouge_score", "lsht": "classification_score",
    "passage_count": "count_score", "passage_retrieval_en": "retrieval_score",
    "passage_retrieval_zh": "retrieval_zh_score", "lcc": "code_sim_score", "repobench-p": "code_sim_score",
}

_ZH = frozenset({"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"})

LONGBENCH_TASKS: dict[str, LongBenchTask] = {
    name: LongBenchTask(
        name=name,
        prompt=_PROMPTS[name],
        max_new_tokens=_MAXLEN[name],
        metric=_METRIC[name],
        language="zh" if name in _ZH else "en",
        chat_template=name not in _NO_CHAT,
        first_line=name in _FIRST_LINE,
        stop_at_newline=name == "samsum",
        has_e=name in _HAS_E,
    )
    for name in _PROMPTS
}


def default_data_dir() -> Path:
    """``$LEARNROUTE_LONGBENCH`` or ``~/.cache/learnroute/longbench``."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else Path.home() / ".cache" / "learnroute" / "longbench"


def _resolve(task: str) -> LongBenchTask:
    """The task's spec; ``name_e`` resolves to ``name`` where LongBench-E has it."""
    if task in LONGBENCH_TASKS:
        return LONGBENCH_TASKS[task]
    base = task.removesuffix("_e")
    if base != task and base in LONGBENCH_TASKS and LONGBENCH_TASKS[base].has_e:
        return LONGBENCH_TASKS[base]
    e_names = ", ".join(f"{n}_e" for n, t in LONGBENCH_TASKS.items() if t.has_e)
    raise ValueError(
        f"unknown LongBench task {task!r}; valid: {', '.join(LONGBENCH_TASKS)} (LongBench-E: {e_names})"
    )


def _keep_ends(tokenizer, ids: list[int], head: int, tail: int, budget: int, suffix: str = "") -> str:
    """``decode(ids[:head]) + decode(ids[-tail:])``, shrunk until ``text + suffix`` fits ``budget`` tokens."""
    for _ in range(32):
        text = tokenizer.decode(ids[:head], skip_special_tokens=True)
        if tail > 0:
            text += tokenizer.decode(ids[len(ids) - tail:], skip_special_tokens=True)
        over = count_tokens(tokenizer, text + suffix) - budget
        if over <= 0:
            return text
        if head == 0 and tail == 0:
            break
        # re-tokenizing across the cut can merge or split a few tokens: trim the longer end
        if tail >= head:
            tail = max(0, tail - over)
        else:
            head = max(0, head - over)
    raise ValueError(f"cannot fit the text into {budget} tokens (the part kept whole needs {over + budget})")


def truncate_middle(tokenizer, text: str, max_tokens: int) -> str:
    """LongBench's middle truncation: over ``max_tokens`` tokens, keep the first and last halves.

    As pred.py: ``half = max_tokens // 2``, ``decode(ids[:half]) + decode(ids[-half:])`` with
    special tokens skipped (so an odd limit keeps ``max_tokens - 1``). Tokens are counted
    without special tokens; the result re-encodes to at most ``max_tokens`` (an end is
    trimmed by the excess in the rare case the cut re-tokenizes longer).
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return _keep_ends(tokenizer, ids, half, half, max_tokens)


def fit_prompt(tokenizer, context: str, question: str, max_tokens: int) -> tuple[str, bool]:
    """Cut the middle of ``context`` so that ``context + question`` has at most ``max_tokens`` tokens.

    Mirrors pred.py on the whole prompt: it keeps the prompt's first ``max_tokens // 2``
    tokens (all context) and its last ``max_tokens // 2`` tokens, of which the question
    takes its own length, so the context keeps that many fewer at its end. The question is
    never cut (with a question longer than half the budget the context's tail goes first).
    Returns ``(context, truncated)``.
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if count_tokens(tokenizer, context + question) <= max_tokens:
        return context, False
    n_question = count_tokens(tokenizer, question)
    if n_question >= max_tokens:
        raise ValueError(f"the question alone has {n_question} tokens, max_tokens is {max_tokens}")
    head = max_tokens // 2
    tail = max_tokens // 2 - n_question
    if tail < 0:
        head, tail = max_tokens - n_question, 0
    ids = tokenizer.encode(context, add_special_tokens=False)
    return _keep_ends(tokenizer, ids, head, tail, max_tokens, suffix=question), True


def _missing_file(path: Path, task: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"LongBench file not found: {path}\n"
        f"Expected one JSON object per line with the fields {', '.join(FIELDS)} (the official LongBench v1 "
        f"format). Get data.zip from the THUDM/LongBench dataset on the Hugging Face hub, unzip it and point "
        f"${ENV_VAR} (or data_dir=) at the folder holding {task}.jsonl. Nothing is downloaded at run time."
    )


def _check_row(row: object, path: Path, lineno: int) -> dict:
    """The row if it has the official fields with usable types; else a ValueError naming file:line."""
    where = f"{path}:{lineno}"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)} (expected: {', '.join(FIELDS)})")
    for f in ("input", "context"):
        if not isinstance(row[f], str):
            raise ValueError(f"{where}: field {f!r} must be a string, got {type(row[f]).__name__}")
    if not isinstance(row["answers"], list) or not all(isinstance(a, str) for a in row["answers"]):
        raise ValueError(f"{where}: field 'answers' must be a list of strings")
    if row["all_classes"] is not None and not isinstance(row["all_classes"], list):
        raise ValueError(f"{where}: field 'all_classes' must be a list or null")
    return row


def read_rows(path: Path, n: int | None = None, task: str = "") -> list[dict]:
    """The first ``n`` (all if None) rows of an official LongBench JSONL file, checked."""
    if not path.is_file():
        raise _missing_file(path, task or path.stem)
    rows: list[dict] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if n is not None and len(rows) >= n:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            rows.append(_check_row(row, path, lineno))
    return rows


def load_longbench(
    task: str,
    tokenizer=None,
    *,
    data_dir: str | os.PathLike | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    split: str = "eval",
) -> list[Sample]:
    """Samples of one LongBench task from ``{data_dir}/{task}.jsonl`` (official format).

    ``task``: a v1 dataset name or, where LongBench-E has it, ``name_e``. ``data_dir``:
    defaults to :func:`default_data_dir`. ``max_tokens``: cut the context's middle so that
    context + question has at most that many tokens of ``tokenizer`` (text only: BOS and
    chat-template tokens come on top; leave room for them and the answer). ``n``: the first
    n rows in file order. LongBench is test-only: ``split`` must be "eval".
    """
    spec = _resolve(task)
    if split != "eval":
        raise ValueError(
            f"LongBench has only a test set: split must be 'eval', got {split!r}; calibrate on RULER tasks instead"
        )
    if n is not None and (not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be a non-negative int or None, got {n!r}")
    if max_tokens is not None and tokenizer is None:
        raise ValueError("max_tokens needs a tokenizer to count tokens")
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    path = root / f"{task}.jsonl"
    samples = []
    for row in read_rows(path, n, task):
        context, question = spec.split_prompt(row)
        truncated = False
        if max_tokens is not None:
            try:
                context, truncated = fit_prompt(tokenizer, context, question, max_tokens)
            except ValueError as e:
                raise ValueError(f"longbench/{task}/{row['_id']}: {e}") from None
        samples.append(Sample(
            id=f"longbench/{task}/{row['_id']}",
            task=f"longbench_{task}",
            split="eval",
            context=context,
            question=question,
            answer_prefix="",
            answers=list(row["answers"]),
            metric=spec.metric,
            meta={
                "dataset": row["dataset"],
                "language": row["language"],
                "all_classes": row["all_classes"],
                "length": row["length"],
                "_id": row["_id"],
                "max_new_tokens": spec.max_new_tokens,
                "chat_template": spec.chat_template,
                "first_line": spec.first_line,
                "stop_at_newline": spec.stop_at_newline,
                "truncated": truncated,
            },
        ))
    return samples
