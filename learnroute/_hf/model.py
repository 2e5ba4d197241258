"""Model access: where the decoder stack, its layers and attention modules live, config
fields, RoPE, and the rotary embedding some kvpress scorers expect on attention modules."""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import rotate_half

# Architectures kvpress 0.5.5 supports (its SUPPORTED_MODELS); model_type names.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gemma3_text")


def language_model(model: PreTrainedModel) -> nn.Module:
    """The decoder stack (``model.model`` or its ``language_model`` for multimodal wrappers)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """Every decoder layer, in order."""
    return list(language_model(model).layers)


def attention_modules(model: PreTrainedModel) -> list[nn.Module]:
    """Self-attention module of every decoder layer, in layer order."""
    return [layer.self_attn for layer in decoder_layers(model)]


def text_config(model: PreTrainedModel):
    """The text config (the model's own, or ``text_config`` for multimodal wrappers)."""
    cfg = model.config
    return getattr(cfg, "text_config", cfg)


def kv_heads(model: PreTrainedModel) -> int:
    """Key/value heads per layer (``num_key_value_heads``; the query heads without GQA)."""
    cfg = text_config(model)
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def fingerprint(model: PreTrainedModel) -> tuple:
    """What a prefill of this model depends on: where it came from, dtype, device, attention
    implementation, and a checksum of its first and last layers' query projections (two models
    loaded from one folder match; a retrained or re-initialised one does not). Memoised
    per model object: the checksum reads a few MB of weights."""
    memo = _FINGERPRINTS.get(model)
    if memo is None:
        modules = attention_modules(model)
        # The first parameter of each (its query projection): adapters attached later add theirs after it.
        checksum = tuple(float(next(m.parameters()).detach().double().sum()) for m in (modules[0], modules[-1]))
        memo = (str(getattr(model.config, "_name_or_path", "")), type(model).__name__, str(model.dtype), checksum)
        _FINGERPRINTS[model] = memo
    # Device and attention implementation can change on the same object (``.to``, routed attention).
    return (*memo, str(model.device), str(text_config(model)._attn_implementation))


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_type(model: PreTrainedModel) -> str:
    return str(getattr(model.config, "model_type", type(model).__name__))


def max_positions(model: PreTrainedModel) -> int:
    return int(getattr(text_config(model), "max_position_embeddings", 2**31 - 1))


def eos_token_ids(model: PreTrainedModel) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, t, d) with RoPE tables ``cos``/``sin`` (B, t, d)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Silence transformers' per-tensor progress bars while loading (restored after)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


_MISSING = object()  # "the module had no such attribute"


@contextlib.contextmanager
def rotary_on_attention(model: PreTrainedModel) -> Iterator[None]:
    """Give every attention module a ``rotary_emb`` attribute for the scope.

    Some kvpress scorers (ExpectedAttention) call ``module.rotary_emb(x, position_ids)``;
    kvpress sets it inside its own press context. Models whose rotary embedding takes a
    ``layer_type`` (Gemma3: local and global RoPE) get one bound to the module's own layer
    type, which kvpress 0.5.5 does not do (its call fails on Gemma3). Whatever the modules
    held before is restored on exit.
    """
    lm = language_model(model)
    rotary = lm.rotary_emb
    typed = "layer_type" in inspect.signature(rotary.forward).parameters
    saved: list[tuple[nn.Module, object]] = []
    try:
        for m in attention_modules(model):
            saved.append((m, m.__dict__.get("rotary_emb", m._modules.get("rotary_emb", _MISSING))))
            if typed and getattr(m, "layer_type", None) is not None:
                m._modules.pop("rotary_emb", None)  # a plain attribute may not shadow a submodule
                m.rotary_emb = functools.partial(rotary, layer_type=m.layer_type)
            elif typed or not hasattr(m, "rotary_emb"):
                m.rotary_emb = rotary
        yield
    finally:
        for m, old in saved:
            m._modules.pop("rotary_emb", None)
            m.__dict__.pop("rotary_emb", None)
            if old is not _MISSING:
                m.rotary_emb = old
