"""Route-aware attention: per-layer cache lengths under sdpa and eager, and additive
per-(layer, head) biases on the cached context keys.

Why route-aware attention is needed: transformers (5.2) builds *one* attention mask
per forward from layer 0's cache length and hands it to every layer. When layers keep
different numbers of tokens, every other layer crashes ("The size of tensor a (...)
must match ..."). We register two attention functions through transformers'
``AttentionInterface`` ("learnroute_sdpa", "learnroute_eager"). They pass straight
through to the stock function when the mask fits the layer's keys (bit-identical
results), and otherwise rebuild the causal mask for this layer, aligned to the end of
its keys (new tokens are always the last ``q`` keys). The same functions apply optional
per-(layer, head) additive biases on the cached context keys (:func:`attention_bias`);
biases may require grad (learned gates train through them).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from learnroute._hf.cache import windowed_layers
from learnroute._hf.model import attention_modules, text_config

ROUTED_PREFIX = "learnroute_"
_BIAS_ATTR = "_learnroute_bias"
_OWN_MASKS_ATTR = "_learnroute_own_masks"
_PAD_ATTR = "_learnroute_padding"
_PRESS_PAD_ATTR = "_learnroute_press_padding"  # RoutedPress's per-head padding, until the next prefill


def _eager_function(module: nn.Module):
    """The model's own eager attention (``eager_attention_forward`` of its modeling file)."""
    fn = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if fn is None:
        raise NotImplementedError(f"no eager attention found for {type(module).__name__}")
    return fn


def _layer_mask(
    attention_mask: torch.Tensor | None,
    q: int,
    kv: int,
    query: torch.Tensor,
    bias: torch.Tensor | None,
    eager: bool,
    rebuild: bool = False,
    window: int | None = None,
    padding: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor | None:
    """The mask for a layer with ``kv`` keys whose last ``q`` are the current queries.

    ``rebuild`` (models with sliding-window layers): the stock masks are built from one
    layer's length and offset, which per-layer cache lengths break even when the shapes
    happen to match, so the mask is always rebuilt from this layer's own geometry. A
    sliding layer (``window`` w) also hides keys w or more positions behind the query;
    its cached keys are contiguous and end-aligned, so relative positions are exact.

    ``padding`` (valid (B,) or (B, H_kv), pad_end): rows (or, per KV head, a row's heads:
    per-head routes) of different lengths share the cache; row b's keys in
    [valid[b], pad_end) (head h's: [valid[b, h], pad_end)) are padding and hidden from
    every query (of every query head in that KV head's group).
    """
    if rebuild or padding is not None:
        attention_mask = None
        if window is not None and window >= kv:
            window = None  # every key is inside the window
    elif attention_mask is not None and attention_mask.shape[-1] != kv:
        # The stock mask was built for layer 0's length. Padding cannot be mapped onto a
        # compressed cache, so refuse it rather than attend to the wrong keys.
        past0 = attention_mask.shape[-1] - q
        ctx = attention_mask[..., :past0]
        blocked = ~ctx if ctx.dtype == torch.bool else ctx < 0
        if past0 > 0 and bool(blocked.any()):
            raise ValueError("padded batches are not supported with per-layer cache lengths")
        attention_mask = None
    if (
        attention_mask is None
        and bias is None
        and window is None
        and padding is None
        and (q == 1 or q == kv)
        and not eager
    ):
        return None  # sdpa: no mask (q == 1) or is_causal (q == kv), as stock transformers does
    if attention_mask is None:
        # Key j is visible to query i iff j <= kv - q + i (new tokens are the last q keys),
        # and, in a sliding layer, iff it is less than ``window`` positions behind.
        i = torch.arange(q, device=query.device).unsqueeze(1)
        j = torch.arange(kv, device=query.device).unsqueeze(0)
        allowed = j <= kv - q + i  # (q, kv)
        if window is not None:
            allowed &= (kv - q + i) - j < window
        attention_mask = allowed[None, None]  # (1, 1, q, kv)
    if padding is not None:
        attention_mask = _hide_padding(attention_mask, padding, query, kv)
    if bias is None:
        if eager and attention_mask.dtype == torch.bool:
            return torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min
            )
        return attention_mask
    return _add_bias(attention_mask, bias, query, q, kv)


def _hide_padding(attention_mask: torch.Tensor, padding: tuple[torch.Tensor, int], query: torch.Tensor,
                  kv: int) -> torch.Tensor:
    """``attention_mask`` (bool) with each row's (or row's KV head's) padding slots hidden
    (see :func:`_layer_mask`)."""
    valid, pad_end = padding
    j = torch.arange(kv, device=query.device)  # (kv,)
    if valid.dim() == 1:
        hidden = (j >= valid.unsqueeze(1)) & (j < pad_end)  # (B, kv): each row's padding slots
        attention_mask = attention_mask & ~hidden[:, None, None, :]  # (B, 1, q, kv)
    else:  # per KV head; query heads h_q * H_kv / H_q .. share KV head h (GQA grouping)
        hidden = (j >= valid.unsqueeze(-1)) & (j < pad_end)  # (B, H_kv, kv)
        hidden = hidden.repeat_interleave(query.shape[1] // valid.shape[1], dim=1)  # (B, H_q, kv)
        attention_mask = attention_mask & ~hidden[:, :, None, :]  # (B, H_q, q, kv)
    return attention_mask


def _add_bias(attention_mask: torch.Tensor, bias: torch.Tensor, query: torch.Tensor, q: int, kv: int) -> torch.Tensor:
    """The additive mask with ``bias`` (B, H_kv or H_q, n_ctx) on the first n_ctx keys (the
    cached context), for every query: (B, H_q, q, kv)."""
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    b, h, n_ctx = bias.shape
    h_q = query.shape[1]
    if n_ctx > kv - q:  # the bias covers cached context keys only, never the new tokens
        raise ValueError(f"attention bias covers {n_ctx} keys but this layer caches only {kv - q} before the queries")
    if h != h_q:  # per KV head -> per query head: (B, H_kv, n) -> (B, H_q, n)
        bias = bias.repeat_interleave(h_q // h, dim=1)
    full = attention_mask.expand(query.shape[0], h_q, q, kv).clone()  # (B, H_q, q, kv)
    full[..., :n_ctx] = full[..., :n_ctx] + bias.unsqueeze(2).to(full.dtype)
    return full


def _sdpa_gqa(query, key, value, mask, dropout: float, scaling: float | None):
    """sdpa with a mask and grouped KV heads, without materialising repeated keys/values.

    Stock transformers repeats K/V to every query head whenever a mask is given
    (``repeat_kv``): with a batch of routes that copy costs more than the attention. On
    CPU, ``enable_gqa`` with a mask runs the same flash kernel on the shared heads and
    gives bit-identical outputs (checked in the tests); on CUDA it would fall back to
    the math kernel, so this path is CPU-only.
    """
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (B, H_q, q, d)
    return out.transpose(1, 2).contiguous(), None  # (B, q, H_q, d)


def _attend(module, query, key, value, attention_mask, padding, bias, eager: bool, dropout, kwargs):
    """Attention of ``query`` (B, H_q, q, d) over ``key``/``value`` (B, H_kv, kv, d), with
    this layer's own mask where the stock one does not fit (see :func:`_layer_mask`)."""
    q, kv = query.shape[2], key.shape[2]
    rebuild = getattr(module, _OWN_MASKS_ATTR, False)  # models with sliding-window layers
    # Without a mask, several queries over a longer cache need one aligned to the end of
    # the keys (sdpa's is_causal would align it to the start); see forward_from_layer.
    if (
        bias is not None
        or rebuild
        or padding is not None
        or (attention_mask is not None and attention_mask.shape[-1] != kv)
        or (attention_mask is None and (eager or 1 < q != kv))
    ):
        attention_mask = _layer_mask(
            attention_mask, q, kv, query, bias, eager, rebuild, kwargs.get("sliding_window"), padding
        )
    if eager:
        return _eager_function(module)(module, query, key, value, attention_mask, dropout=dropout, **kwargs)
    if attention_mask is not None and query.device.type == "cpu" and key.shape[1] != query.shape[1]:
        return _sdpa_gqa(query, key, value, attention_mask, dropout, kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, **kwargs)


def _split_heads(module, query, keys, values, layer, bias, eager: bool, dropout, kwargs):
    """Attention over a layer of split KV heads (``keys``/``values``: per KV head
    (B, 1, n_h, d), from :class:`~learnroute._hf.cache._SplitHeadsLayer`): each KV head's
    group of query heads attends to that head's own keys, its rows' padding masked; the
    outputs are joined in head order, as one grouped attention would give them."""
    h_kv = len(keys)
    g = query.shape[1] // h_kv  # query heads per KV head (GQA grouping)
    if bias is not None and bias.shape[1] not in (h_kv, query.shape[1]):
        raise ValueError(f"attention bias has {bias.shape[1]} heads; this layer has {h_kv} KV heads")
    outs = []
    for h, (k, v) in enumerate(zip(keys, values)):
        part = None
        if bias is not None:  # (B, H_kv or H_q, n) -> this KV head's (B, 1 or g, n)
            part = bias[:, h : h + 1] if bias.shape[1] == h_kv else bias[:, h * g : (h + 1) * g]
        out, _ = _attend(
            module, query[:, h * g : (h + 1) * g], k, v, None, (layer.valid[:, h], layer.pad_ends[h]), part, eager,
            dropout, kwargs,
        )  # (B, q, g, d)
        outs.append(out)
    return torch.cat(outs, dim=2), None  # (B, q, H_q, d)


def _routed(eager: bool):
    def attention(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
        bias = getattr(module, _BIAS_ATTR, None)
        layer = getattr(module, _PAD_ATTR, None)  # a padded cache layer (padded_keys)
        if getattr(layer, "split_heads", False):  # one attention per KV head, over the layer's own heads
            return _split_heads(module, query, layer.keys, layer.values, layer, bias, eager, dropout, kwargs)
        if key.shape[2] == 0:
            raise ValueError("a layer of split KV heads decodes inside padded_keys only")
        q, kv = query.shape[2], key.shape[2]
        padding = None if layer is None or layer.valid is None else (layer.valid, layer.pad_end)
        press = getattr(module, _PRESS_PAD_ATTR, None)  # set by RoutedPress for a per-head layer
        if press is not None:
            if q == kv:  # a prefill starts a new sequence: the padding was the last one's (as kvpress
                delattr(module, _PRESS_PAD_ATTR)  # resets its masked_key_indices)
            elif padding is None:
                padding = press
        return _attend(module, query, key, value, attention_mask, padding, bias, eager, dropout, kwargs)

    return attention


AttentionInterface.register(ROUTED_PREFIX + "sdpa", _routed(eager=False))
AttentionInterface.register(ROUTED_PREFIX + "eager", _routed(eager=True))
AttentionMaskInterface.register(ROUTED_PREFIX + "sdpa", sdpa_mask)
AttentionMaskInterface.register(ROUTED_PREFIX + "eager", eager_mask)


def attn_implementation(model: PreTrainedModel) -> str:
    return str(text_config(model)._attn_implementation)


def _set_attn(model: PreTrainedModel, name: str) -> None:
    model.config._attn_implementation = name
    cfg = text_config(model)
    if cfg is not model.config:
        cfg._attn_implementation = name


def is_routed(model: PreTrainedModel) -> bool:
    return attn_implementation(model).startswith(ROUTED_PREFIX)


@contextlib.contextmanager
def routed_attention(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Let ``model`` run with per-layer cache lengths (sdpa or eager) inside the scope.

    Switches the model to the route-aware variant of its attention implementation and
    restores the original one on exit. Identical to the stock function whenever every
    layer's cache has the same length.
    """
    original = attn_implementation(model)
    if original.startswith(ROUTED_PREFIX):
        yield model
        return
    if original not in ("sdpa", "eager"):
        raise ValueError(
            f"per-layer cache lengths need attn_implementation 'sdpa' or 'eager', got {original!r}"
        )
    modules = attention_modules(model) if any(windowed_layers(model)) else []
    try:
        _set_attn(model, ROUTED_PREFIX + original)
        for m in modules:
            setattr(m, _OWN_MASKS_ATTR, True)
        yield model
    finally:
        _set_attn(model, original)
        for m in modules:
            if hasattr(m, _OWN_MASKS_ATTR):
                delattr(m, _OWN_MASKS_ATTR)


@contextlib.contextmanager
def padded_keys(model: PreTrainedModel, cache: DynamicCache) -> Iterator[None]:
    """Hide the padding of ``cache``'s padded layers (rows of different lengths, built by
    :func:`~learnroute._hf.cache.cache_from_buffers` with ``valid``) from attention.

    Inside the scope every forward over ``cache`` masks each row's padding slots; rows
    dropped or reordered on the cache keep their padding (it lives on the cache layers).
    Padding slots must hold finite values: a masked key still enters q.k, and NaN + -inf
    is NaN. Switches to route-aware attention too.
    """
    modules = attention_modules(model)
    try:
        for module, layer in zip(modules, cache.layers):
            if getattr(layer, "valid", None) is not None:
                setattr(module, _PAD_ATTR, layer)
        with routed_attention(model):
            yield
    finally:
        for m in modules:
            if hasattr(m, _PAD_ATTR):
                delattr(m, _PAD_ATTR)


def set_press_padding(module: nn.Module, valid: torch.Tensor, pad_end: int) -> None:
    """Mark a layer compressed inside kvpress's pipeline as padded per KV head: head h of row
    b holds ``valid[b, h]`` kept tokens in slots [0, valid[b, h]) of ``pad_end``; the rest of
    those slots is hidden from attention (route-aware attention only) until the next prefill
    over this module, which clears the mark."""
    setattr(module, _PRESS_PAD_ATTR, (valid, pad_end))


def clear_press_padding(model: PreTrainedModel) -> None:
    """Drop every mark :func:`set_press_padding` left on ``model``'s layers."""
    for m in attention_modules(model):
        if hasattr(m, _PRESS_PAD_ATTR):
            delattr(m, _PRESS_PAD_ATTR)


@contextlib.contextmanager
def attention_bias(model: PreTrainedModel, biases: dict[int, torch.Tensor]) -> Iterator[None]:
    """Add ``biases[layer]`` (B, H_kv or H_q, n_ctx) to the logits of the first n_ctx keys.

    Applies to every query of every forward inside the scope (decode-time queries come
    after the compression point). Used by learned gates (soft masks ``log(m + eps)``)
    and to check that masking a token equals evicting it.
    """
    modules = attention_modules(model)
    try:
        for layer_idx, bias in biases.items():
            setattr(modules[layer_idx], _BIAS_ATTR, bias)
        with routed_attention(model):
            yield
    finally:
        for m in modules:
            if hasattr(m, _BIAS_ATTR):
                delattr(m, _BIAS_ATTR)


def switch_to_routed_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` to route-aware attention for good (what :func:`routed_attention`
    does on entry, without the restore on exit).

    kvpress's pipeline decodes after the press context closes, so a scope opened by a
    press would end too early. Raises ValueError for attention other than sdpa / eager.
    """
    original = attn_implementation(model)
    if original.startswith(ROUTED_PREFIX):
        return
    if original not in ("sdpa", "eager"):
        raise ValueError(
            f"RoutedPress with per-layer cache lengths needs attn_implementation 'sdpa' or 'eager', got {original!r}"
        )
    _set_attn(model, ROUTED_PREFIX + original)
    if any(windowed_layers(model)):
        # Stock masks take their offsets from layer 0 (a local layer on Gemma3), wrong for
        # compressed global layers: every layer rebuilds its mask from its own cache.
        for m in attention_modules(model):
            setattr(m, _OWN_MASKS_ATTR, True)
