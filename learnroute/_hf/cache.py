"""Caches: prefill capture, caches assembled from kept keys/values (preallocated buffers),
and which layers keep a sliding window."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from learnroute._hf.model import attention_modules, language_model, text_config


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


class _PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in buffers with room for more tokens.

    Why: DynamicLayer appends with ``torch.cat``, copying the whole layer cache at every
    decoding step; with a batch of routes that copy costs more than the step's attention.
    New tokens are written in place; ``keys``/``values`` stay views of the filled part,
    so everything that reads them (sequence length, masks, attention) sees exactly what a
    DynamicLayer would hold.
    """

    def __init__(
        self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int, valid: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.dtype, self.device = key_buffer.dtype, key_buffer.device
        self._k, self._v = key_buffer, value_buffer  # (B, H_kv, capacity, d) each
        self._len = length
        self._views()  # keys/values: (B, H_kv, length, d) views of the buffers
        self.is_initialized = True
        # Rows of different lengths share the buffer: row b holds valid[b] context tokens in
        # slots [0, valid[b]); slots [valid[b], pad_end) are padding that attention masks
        # (see attention.padded_keys); later tokens go after pad_end in every row.
        self.valid = valid  # (B,), (B, H_kv) per KV head, or None: no padding
        self.pad_end = length

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
        if self.valid is not None and self._len < self.pad_end:  # cut into the padded part
            self.pad_end = self._len
            self.valid = self.valid.clamp(max=self._len)
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k, self._v = self._k.repeat_interleave(repeats, 0), self._v.repeat_interleave(repeats, 0)
        if self.valid is not None:
            self.valid = self.valid.repeat_interleave(repeats, 0)
        self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._k, self._v = self._k.index_select(0, beam_idx), self._v.index_select(0, beam_idx)
        if self.valid is not None:
            self.valid = self.valid.index_select(0, beam_idx)
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (ascending), moved to the front of the same buffers.

        In place, so dropping finished routes allocates nothing; rows only move forward
        (indices[j] >= j), so no row is overwritten before it has been moved.
        """
        rows = indices.tolist()
        if self.valid is not None:
            self.valid = self.valid[indices]
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


class _SplitHeadsLayer(DynamicLayer):
    """A layer whose KV heads keep different numbers of tokens, each head in a buffer of its
    own length: what a per-head route keeps, with no padding between its heads.

    Why not one (B, H_kv, n, d) tensor: its heads would be padded to the longest head, and
    a learned per-head route that concentrates a layer on one head allocates up to H_kv
    times what it keeps. Attention runs once per KV head over that head's own keys, the
    tuples ``keys``/``values``; no varlen kernel is needed. ``update`` hands attention empty
    (B, H_kv, 0, d) stand-ins: attention functions take tensors (kvpress wraps every one and
    reads their shapes), and route-aware attention reads the heads from this layer instead
    (:func:`~learnroute._hf.attention.padded_keys` puts it on the module).

    Head h's buffer is (B, 1, capacity_h, d). Row b of head h holds ``valid[b, h]`` context
    tokens in slots [0, valid[b, h]); slots up to ``pad_ends[h]`` (the longest row of that
    head) are padding between rows of a batch, masked like a padded layer's; later tokens
    go after ``pad_ends[h]`` in every row.
    """

    split_heads = True  # route-aware attention's cue to attend per KV head

    def __init__(
        self, key_buffers: list[torch.Tensor], value_buffers: list[torch.Tensor], lengths: list[int],
        valid: torch.Tensor,
    ) -> None:
        super().__init__()
        self.dtype, self.device = key_buffers[0].dtype, key_buffers[0].device
        self._k, self._v = list(key_buffers), list(value_buffers)  # per head: (B, 1, capacity_h, d)
        self.valid = valid  # (B, H_kv)
        self.pad_ends = list(lengths)
        self._new = 0  # tokens written after the context, the same in every head
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        # The attention inputs: per head, (B, 1, pad_end_h + new, d) views of the buffers.
        self.keys = tuple(k[:, :, : e + self._new] for k, e in zip(self._k, self.pad_ends))
        self.values = tuple(v[:, :, : e + self._new] for v, e in zip(self._v, self.pad_ends))

    def get_seq_length(self) -> int:
        # What a padded layer of these heads would report (its longest head): used only for
        # positions and mask sizes, which route-aware attention rebuilds per head anyway.
        return max(self.pad_ends) + self._new

    def update(self, key_states, value_states, cache_kwargs=None):
        t = key_states.shape[-2]  # key_states: (B, H_kv, t, d)
        for h, end in enumerate(self.pad_ends):
            at = end + self._new
            if at + t > self._k[h].shape[-2]:  # out of room: grow this head like a DynamicLayer
                self._k[h] = torch.cat([self._k[h][:, :, :at], key_states[:, h : h + 1]], dim=-2)
                self._v[h] = torch.cat([self._v[h][:, :, :at], value_states[:, h : h + 1]], dim=-2)
            else:
                self._k[h][:, :, at : at + t].copy_(key_states[:, h : h + 1])  # (B, 1, t, d)
                self._v[h][:, :, at : at + t].copy_(value_states[:, h : h + 1])
        self._new += t
        self._views()
        return key_states[:, :, :0], value_states[:, :, :0]  # (B, H_kv, 0, d): the heads are on the layer

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a layer of split KV heads cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k = [k.repeat_interleave(repeats, 0) for k in self._k]
        self._v = [v.repeat_interleave(repeats, 0) for v in self._v]
        self.valid = self.valid.repeat_interleave(repeats, 0)
        self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        # Copies, unlike _PreallocatedLayer's in-place move: H_kv small buffers per layer,
        # and finished rows leave the batch only when half of them are done.
        self._k = [k[indices] for k in self._k]
        self._v = [v[indices] for v in self._v]
        self.valid = self.valid[indices]
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
    model: PreTrainedModel,
    buffers: list[tuple[torch.Tensor, torch.Tensor]],
    lengths: list[int],
    valid: list[torch.Tensor | None] | None = None,
) -> DynamicCache:
    """A DynamicCache over preallocated per-layer buffers (B, H_kv, capacity, d) whose first
    ``lengths[l]`` positions are filled; later tokens are written into the free room.

    ``valid[l]`` (B,) or (B, H_kv), where given, says how many of those positions each row
    (each KV head of each row: per-head routes) really holds
    (the rest is padding, masked inside :func:`~learnroute._hf.attention.padded_keys`).

    A layer whose KV heads keep different counts may instead come as split heads: lists of
    per-head buffers (B, 1, capacity_h, d), ``lengths[l]`` per head and ``valid[l]``
    (B, H_kv) (see :class:`_SplitHeadsLayer`).
    """
    cache = DynamicCache(config=model.config)
    valid = valid or [None] * len(buffers)
    for layer_idx, ((kb, vb), n, ok) in enumerate(zip(buffers, lengths, valid)):
        split = isinstance(kb, (list, tuple))
        windowed = type(cache.layers[layer_idx]) is not DynamicLayer
        if windowed and (ok is not None or split):
            raise ValueError(f"layer {layer_idx} keeps a sliding window: its rows cannot be padded")
        if split:
            if ok is None or ok.dim() != 2:
                raise ValueError(f"layer {layer_idx}: split heads need valid counts per (row, KV head)")
            cache.layers[layer_idx] = _SplitHeadsLayer(kb, vb, n, ok)
        elif windowed:
            # Sliding-window layers keep their own bookkeeping: hand them the tokens instead.
            cache.update(kb[:, :, :n], vb[:, :, :n], layer_idx)
        else:
            cache.layers[layer_idx] = _PreallocatedLayer(kb, vb, n, ok)
    return cache


def keep_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only batch ``rows`` of every layer's cache (finished routes leave the batch)."""
    cache.batch_select_indices(rows)
