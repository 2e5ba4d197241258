"""Forwards over a cached prefix: the question/answer pass with optional biases (the one
primitive the profile, the engine's first decode step and the gates' trainer share),
recorded layer inputs, and restarting the stack at a given layer."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from learnroute._hf.attention import _OWN_MASKS_ATTR, attention_bias, attn_implementation
from learnroute._hf.cache import _hidden_arg, build_cache, local_attention_layers
from learnroute._hf.model import decoder_layers, language_model, text_config


def fixed_layers(model: PreTrainedModel, cache: DynamicCache) -> list[bool]:
    """Per layer: is its cache fixed, i.e. never compressed by any route (Gemma3's local
    layers, any layer whose cache keeps a sliding window only)? Biases skip these."""
    local = local_attention_layers(model)
    return [local[i] or getattr(layer, "is_sliding", False) for i, layer in enumerate(cache.layers)]


def forward_tokens(
    model: PreTrainedModel,
    cache: DynamicCache | list[tuple[torch.Tensor, torch.Tensor]],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    biases: dict[int, torch.Tensor] | None = None,
    keep: int | slice | torch.Tensor | None = None,
    record_inputs: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run ``input_ids`` (B, t) at ``position_ids`` (B, t) after a cached prefix; return logits.

    The one question/answer pass shared by the profile (teacher forcing over a full or
    compressed prefix), the engine's first decode step and the learned gates' trainer.
    It is grad-agnostic: callers wrap it in ``torch.no_grad()`` or let gradients flow into
    ``biases``.

    - ``cache``: a DynamicCache (extended in place), or per-layer keys/values
      [(B or 1, H_kv, n_l, d)] from which a fresh cache is built (the tensors are not
      modified; layers may hold different lengths).
    - ``biases``: layer -> additive bias (B or 1, H_kv or H_q, n_l) on the logits of that
      layer's n_l cached keys, for every query (e.g. ``log(m + eps)`` of a soft keep-mask,
      or -inf to hide tokens). Its last dim must equal the layer's cached length; layers
      whose cache is fixed (:func:`fixed_layers`) are skipped.
    - ``keep``: which positions get logits: an int ``k`` keeps the last k (transformers'
      ``logits_to_keep``), a slice or index tensor those positions, None all.
    - ``record_inputs``: if a list is given, every decoder layer's input hidden states
      (B, t, D) are appended to it (the profile restarts cells from them).
    """
    if isinstance(cache, list):
        cache = build_cache(model, cache)
    n_layers = len(decoder_layers(model))
    biases = dict(biases or {})
    if biases:
        fixed = fixed_layers(model, cache)
        problems = []
        for layer, bias in list(biases.items()):
            if not 0 <= layer < n_layers:
                problems.append(f"bias for layer {layer}: the model has layers 0..{n_layers - 1}")
                continue
            if fixed[layer]:
                del biases[layer]  # a sliding-window cache is never compressed: nothing to bias
                continue
            held = cache.get_seq_length(layer)
            if bias.dim() != 3 or bias.shape[-1] != held:
                problems.append(
                    f"bias for layer {layer} has shape {tuple(bias.shape)}; expected (B, heads, {held}): "
                    f"one value per cached key of that layer"
                )
        if problems:
            raise ValueError("invalid attention biases:\n  " + "\n  ".join(problems))
    if keep is None:
        to_keep: int | torch.Tensor = 0
    elif isinstance(keep, slice):
        to_keep = torch.arange(input_ids.shape[1], device=input_ids.device)[keep]
    else:
        to_keep = keep
    handles = []
    if record_inputs is not None:

        def hook(module, args, kwargs):
            record_inputs.append(_hidden_arg(args, kwargs).clone())

        handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in decoder_layers(model)]
    try:
        with attention_bias(model, biases):  # also switches to route-aware attention
            out = model(
                input_ids=input_ids,
                past_key_values=cache,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=to_keep,
            )
    finally:
        for h in handles:
            h.remove()
    return out.logits


def forward_from_layer(
    model: PreTrainedModel,
    start: int,
    hidden: torch.Tensor,
    cache: DynamicCache,
    position_ids: torch.Tensor,
    keep: slice | torch.Tensor = slice(None),
    masks: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run decoder layers ``start..L-1`` on ``hidden`` (B, t, D), then the final norm and
    LM head on positions ``keep``; returns logits (B, t_kept, V).

    Layers below ``start`` are skipped: their outputs for these tokens are given by
    ``hidden`` (used when only layers >= start differ from a reference run). ``cache``
    needs entries for layers >= start only. ``masks(layer)`` may give each layer's
    boolean mask (B or 1, 1, t, keys), True = attend; without it the causal mask aligned
    to the end of the keys is used. Run inside :func:`routed_attention`.
    """
    lm = language_model(model)
    eager = attn_implementation(model).endswith("eager")
    rope = _position_embeddings(model, hidden, position_ids)
    layers = decoder_layers(model)[start:]
    # Masks given here are the caller's own: models with sliding windows must not swap them
    # for rebuilt ones (see routed_attention).
    own = [m.self_attn for m in layers if masks is not None and hasattr(m.self_attn, _OWN_MASKS_ATTR)]
    try:
        for m in own:
            setattr(m, _OWN_MASKS_ATTR, False)
        for i, layer in enumerate(layers, start):
            mask = None if masks is None else masks(i)
            if mask is not None and eager:  # eager attention adds its mask: make it additive
                mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device).masked_fill(
                    ~mask, torch.finfo(hidden.dtype).min
                )
            out = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=rope(layer),
            )
            hidden = out[0] if isinstance(out, tuple) else out  # transformers < 5 returns tuples
    finally:
        for m in own:
            setattr(m, _OWN_MASKS_ATTR, True)
    logits = model.lm_head(lm.norm(hidden[:, keep]))
    cap = getattr(text_config(model), "final_logit_softcapping", None)
    if cap is not None:  # Gemma-style soft-capping, as the model's own forward applies it
        logits = torch.tanh(logits / cap) * cap
    return logits


def _position_embeddings(model: PreTrainedModel, hidden: torch.Tensor, position_ids: torch.Tensor):
    """A function giving each decoder layer its RoPE tables (cos, sin: (B, t, d)).

    One table for most models; Gemma3 has one per layer type (local and global RoPE).
    """
    rotary = language_model(model).rotary_emb
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        table = rotary(hidden, position_ids=position_ids)
        return lambda layer: table
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def per_type(layer):
        kind = layer.attention_type
        if kind not in tables:
            tables[kind] = rotary(hidden, position_ids, kind)
        return tables[kind]

    return per_type
