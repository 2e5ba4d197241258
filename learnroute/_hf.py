"""The only module that touches transformers internals.

Everything version-sensitive lives here: how decoder layers and attention modules
are found, how the prefill is captured, how a compressed cache is assembled, and the
route-aware attention functions that make per-layer cache lengths work under sdpa
and eager attention.

Why route-aware attention is needed: transformers (5.2) builds *one* attention mask
per forward from layer 0's cache length and hands it to every layer. When layers keep
different numbers of tokens, every other layer crashes ("The size of tensor a (...)
must match ..."). We register two attention functions through transformers'
``AttentionInterface`` ("learnroute_sdpa", "learnroute_eager"). They pass straight
through to the stock function when the mask fits the layer's keys (bit-identical
results), and otherwise rebuild the causal mask for this layer, aligned to the end of
its keys (new tokens are always the last ``q`` keys). The same functions apply optional
per-(layer, head) additive biases on the cached context keys; see
:func:`attention_bias`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import rotate_half

ROUTED_PREFIX = "learnroute_"
_BIAS_ATTR = "_learnroute_bias"
_OWN_MASKS_ATTR = "_learnroute_own_masks"

# Architectures kvpress 0.5.5 supports (its SUPPORTED_MODELS); model_type names.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gemma3_text")


# --------------------------------------------------------------------------- model access


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


# --------------------------------------------------------------------------- prefill capture


@dataclass
class LayerCapture:
    """What the scorers need from one layer after a full-cache prefill.

    ``hidden_states`` is the attention input (after the layer norm), ``keys`` carry RoPE,
    exactly what kvpress hands its presses.
    """

    module: nn.Module
    hidden_states: torch.Tensor  # (B, n, D)
    keys: torch.Tensor  # (B, H_kv, n, d)
    values: torch.Tensor  # (B, H_kv, n, d)
    position_embeddings: tuple[torch.Tensor, torch.Tensor]  # cos, sin: (B, n, d) each
    # Intermediate results scorers share on this layer (e.g. SnapKV scores that
    # CriticalKV rescales), so one capture never computes them twice.
    memo: dict = field(default_factory=dict)


def _hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a forward pre-hook sees (passed by keyword or first positional)."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


@torch.no_grad()
def capture_prefill(model: PreTrainedModel, input_ids: torch.Tensor) -> list[LayerCapture]:
    """Run one full-cache forward over ``input_ids`` (B, n) and capture every layer."""
    modules = attention_modules(model)
    b, n = input_ids.shape
    # One preallocated buffer for every layer's attention input: retaining 30 separately
    # allocated activations fragments the heap and measurably slows the prefill on CPU.
    hidden_buf = torch.empty(
        len(modules), b, n, text_config(model).hidden_size, dtype=model.dtype, device=input_ids.device
    )  # (L, B, n, D)
    positions: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(module, args, kwargs):
        hidden_buf[module.layer_idx].copy_(_hidden_arg(args, kwargs))
        positions[module.layer_idx] = kwargs["position_embeddings"]

    cache = DynamicCache(config=model.config)
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        # The decoder stack without the LM head: the prefill's logits are never needed.
        language_model(model)(input_ids=input_ids, past_key_values=cache, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    captures = []
    for i, module in enumerate(modules):
        layer = cache.layers[i]
        captures.append(LayerCapture(module, hidden_buf[i], layer.keys, layer.values, positions[i]))
    return captures


@torch.no_grad()
def layer_inputs(
    model: PreTrainedModel, cache: DynamicCache, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Forward ``input_ids`` (B, t) after ``cache``; return every decoder layer's input
    hidden states [(B, t, D)] and the logits (B, t, V). The cache is extended in place."""
    inputs: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        inputs.append(_hidden_arg(args, kwargs).clone())

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in decoder_layers(model)]
    try:
        out = model(input_ids=input_ids, past_key_values=cache, position_ids=position_ids, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return inputs, out.logits


@torch.no_grad()
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


class _PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in buffers with room for more tokens.

    Why: DynamicLayer appends with ``torch.cat``, copying the whole layer cache at every
    decoding step; with a batch of routes that copy costs more than the step's attention.
    New tokens are written in place; ``keys``/``values`` stay views of the filled part,
    so everything that reads them (sequence length, masks, attention) sees exactly what a
    DynamicLayer would hold.
    """

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        super().__init__()
        self.dtype, self.device = key_buffer.dtype, key_buffer.device
        self._k, self._v = key_buffer, value_buffer  # (B, H_kv, capacity, d) each
        self._len = length
        self._views()  # keys/values: (B, H_kv, length, d) views of the buffers
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None):
        t = key_states.shape[-2]
        if self._len + t > self._k.shape[-2]:  # out of room: grow like a DynamicLayer
            self._k = torch.cat([self.keys, key_states], dim=-2)
            self._v = torch.cat([self.values, value_states], dim=-2)
        else:
            self._k[:, :, self._len : self._len + t].copy_(key_states)
            self._v[:, :, self._len : self._len + t].copy_(value_states)
        self._len += t
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self._len], self._v[:, :, : self._len]

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self._len + max_length
        self._len = min(self._len, max(max_length, 0))
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k, self._v = self._k.repeat_interleave(repeats, 0), self._v.repeat_interleave(repeats, 0)
        self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._k, self._v = self._k.index_select(0, beam_idx), self._v.index_select(0, beam_idx)
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (ascending), moved to the front of the same buffers.

        In place, so dropping finished routes allocates nothing; rows only move forward
        (indices[j] >= j), so no row is overwritten before it has been moved.
        """
        rows = indices.tolist()
        if any(b <= a for a, b in itertools.pairwise(rows)):  # not ascending: plain copy
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()
            return
        for j, src in enumerate(rows):
            if src != j:
                self._k[j, :, : self._len].copy_(self._k[src, :, : self._len])
                self._v[j, :, : self._len].copy_(self._v[src, :, : self._len])
        self._k, self._v = self._k[: len(indices)], self._v[: len(indices)]
        self._views()


def local_attention_layers(model: PreTrainedModel) -> list[bool]:
    """Per layer: is it a local (sliding-window) attention layer of a model that mixes
    local and global layers (Gemma3)? kvpress never compresses those; neither do we."""
    return [bool(getattr(m, "is_sliding", False)) for m in attention_modules(model)]


def cache_windows(model: PreTrainedModel) -> list[int | None]:
    """Per layer: the sliding window of its cache, or None for a full cache (transformers'
    own layer types: Gemma3's local layers, every layer of a Mistral with
    ``sliding_window`` set). Such a cache holds the last ``window - 1`` tokens."""
    layers = DynamicCache(config=model.config).layers
    return [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None for layer in layers]


def windowed_layers(model: PreTrainedModel) -> list[bool]:
    """Per layer: does its cache keep a sliding window only (see :func:`cache_windows`)."""
    return [w is not None for w in cache_windows(model)]


def build_cache(model: PreTrainedModel, kv: list[tuple[torch.Tensor, torch.Tensor]], extra: int = 0) -> DynamicCache:
    """A DynamicCache holding the given per-layer keys/values, each (B, H_kv, n_l, d).

    ``extra`` > 0 reserves room for that many more tokens per layer, written in place.
    """
    if extra > 0:
        buffers = []
        for k, v in kv:
            kb = k.new_empty(*k.shape[:2], k.shape[2] + extra, k.shape[3])  # (B, H_kv, n_l + extra, d)
            vb = v.new_empty(*v.shape[:2], v.shape[2] + extra, v.shape[3])
            kb[:, :, : k.shape[2]].copy_(k)
            vb[:, :, : v.shape[2]].copy_(v)
            buffers.append((kb, vb))
        return cache_from_buffers(model, buffers, [k.shape[2] for k, _ in kv])
    cache = DynamicCache(config=model.config)
    for layer_idx, (k, v) in enumerate(kv):
        cache.update(k, v, layer_idx)
    return cache


def cache_from_buffers(
    model: PreTrainedModel, buffers: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int]
) -> DynamicCache:
    """A DynamicCache over preallocated per-layer buffers (B, H_kv, capacity, d) whose first
    ``lengths[l]`` positions are filled; later tokens are written into the free room."""
    cache = DynamicCache(config=model.config)
    for layer_idx, ((kb, vb), n) in enumerate(zip(buffers, lengths)):
        if type(cache.layers[layer_idx]) is not DynamicLayer:
            # Sliding-window layers keep their own bookkeeping: hand them the tokens instead.
            cache.update(kb[:, :, :n], vb[:, :, :n], layer_idx)
        else:
            cache.layers[layer_idx] = _PreallocatedLayer(kb, vb, n)
    return cache


def keep_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only batch ``rows`` of every layer's cache (finished routes leave the batch)."""
    cache.batch_select_indices(rows)


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


# --------------------------------------------------------------------------- route-aware attention


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
) -> torch.Tensor | None:
    """The mask for a layer with ``kv`` keys whose last ``q`` are the current queries.

    ``rebuild`` (models with sliding-window layers): the stock masks are built from one
    layer's length and offset, which per-layer cache lengths break even when the shapes
    happen to match, so the mask is always rebuilt from this layer's own geometry. A
    sliding layer (``window`` w) also hides keys w or more positions behind the query;
    its cached keys are contiguous and end-aligned, so relative positions are exact.
    """
    if rebuild:
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
    if attention_mask is None and bias is None and window is None and (q == 1 or q == kv) and not eager:
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
    if bias is None:
        if eager and attention_mask.dtype == torch.bool:
            return torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min
            )
        return attention_mask
    # Additive bias on the first n_ctx keys (the cached context), for every query.
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    b, h, n_ctx = bias.shape
    h_q = query.shape[1]
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


def _routed(eager: bool):
    def attention(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
        q, kv = query.shape[2], key.shape[2]
        bias = getattr(module, _BIAS_ATTR, None)
        # Models with sliding-window layers rebuild every mask (see _layer_mask).
        rebuild = getattr(module, _OWN_MASKS_ATTR, False)
        # Without a mask, several queries over a longer cache need one aligned to the end of
        # the keys (sdpa's is_causal would align it to the start); see forward_from_layer.
        if (
            bias is not None
            or rebuild
            or (attention_mask is not None and attention_mask.shape[-1] != kv)
            or (attention_mask is None and (eager or 1 < q != kv))
        ):
            attention_mask = _layer_mask(
                attention_mask, q, kv, query, bias, eager, rebuild, kwargs.get("sliding_window")
            )
        if eager:
            return _eager_function(module)(module, query, key, value, attention_mask, dropout=dropout, **kwargs)
        if attention_mask is not None and query.device.type == "cpu" and key.shape[1] != query.shape[1]:
            return _sdpa_gqa(query, key, value, attention_mask, dropout, kwargs.get("scaling"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, **kwargs)

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
