"""A sample's token ids, split where the cache is compressed, tokenized as kvpress's pipeline does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase


@dataclass
class Prompt:
    """Token ids of one sample, split at the compression point."""

    context_ids: torch.Tensor  # (1, n): what the prefill sees (and compression cuts)
    question_ids: torch.Tensor  # (1, q): decoded after compression, positions n..n+q-1


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str,
    answer_prefix: str = "",
    query_aware: bool = False,
    chat: bool = True,
) -> Prompt:
    """Tokenize like kvpress's ``kv-press-text-generation`` pipeline.

    With a chat template, context and question form one user turn; the context part
    (template prefix + context) is prefilled, the rest (question, end of turn, assistant
    header, answer prefix) is decoded after compression. Query-aware puts the question
    in the prefill too, so scoring windows see it (SnapKV/PyramidKV harnesses).
    ``chat=False`` skips the chat template (LongBench's few-shot and code tasks).
    """
    if query_aware:
        context, question = context + question, ""
    if tokenizer.chat_template is None or not chat:
        context = (tokenizer.bos_token or "") + context
        # kvpress's pipeline ends a template-less question with a newline; a raw prompt
        # (chat=False, e.g. LongBench's few-shot and code tasks) is used exactly as given.
        suffix = "\n" if chat else ""
    else:
        separator = "#" * (len(context) + 10)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + separator}], add_generation_prompt=True, tokenize=False
        )
        context, suffix = text.split(separator)
    question = question + suffix + answer_prefix
    ctx = tokenizer.encode(context, return_tensors="pt", add_special_tokens=False)  # (1, n)
    qst = tokenizer.encode(question, return_tensors="pt", add_special_tokens=False)  # (1, q)
    return Prompt(ctx, qst)

