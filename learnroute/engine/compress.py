"""From a prefill's captures to a batch's compressed decode cache: each route's kept keys
and values gathered into buffers carved from one workspace, rows (and KV heads) that keep
fewer tokens padded and the padding recorded for masking.

Which positions a route keeps is the engine's business (:meth:`Engine.kept_indices`); here
it arrives as ``picks(route index, layer) -> (1, H_kv, k)`` positions, and ``heads`` says
how many tokens each route keeps per layer and KV head (per route, per layer, per head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from learnroute import _hf
from learnroute.engine.batching import row_lengths
from learnroute.engine.prefill import Prefill

Heads = list[list[tuple[int, ...]]]  # per route, per layer, tokens kept by each KV head
Picks = Callable[[int, int], torch.Tensor]  # (route index, layer) -> kept positions (1, H_kv, k)

HEAD_LAYOUTS = ("split", "padded")


def split_layers(heads: Heads, head_layout: str) -> list[bool]:
    """Per layer: are its KV heads laid out apart for this batch? Under
    ``head_layout="split"``, where some route's heads keep different counts."""
    if head_layout != "split":
        return [False] * len(heads[0])
    return [any(min(c) != max(c) for c in per_row) for per_row in zip(*heads)]


def cache_slots(heads: Heads, extra: int, head_layout: str) -> int:
    """Token slots per KV head and row that :func:`decode_cache` carves for a batch, over
    all layers (``extra``: room for the question and answer per layer)."""
    total = 0
    for split, per_row in zip(split_layers(heads, head_layout), zip(*heads)):
        if split:
            total += sum(max(col) + extra for col in zip(*per_row))
        else:
            total += len(per_row[0]) * (max(map(max, per_row)) + extra)
    return total


def decode_cache(model, prefill: Prefill, picks: Picks, heads: Heads, extra: int, workspace, head_layout: str):
    """A cache for a batch of routes with room for ``extra`` tokens per layer; where routes
    (or a route's heads) keep different counts in a layer, its rows are padded to the
    longest and the padding is recorded for masking: per row, or per (row, KV head) where a
    row's heads differ.

    Buffers are carved from ``workspace`` (a flat tensor reused by every batch of one
    :meth:`Engine.answer` call: fresh multi-MB allocations page-fault, which on a CPU VM can
    cost more than filling them).
    """
    split = split_layers(heads, head_layout)
    buffers = kept_kv(prefill, picks, heads, extra, workspace, split)
    lengths, valid = [], []
    for layer, per_row in enumerate(zip(*heads)):  # one layer's head counts per route
        if all(min(c) == max(c) for c in per_row):
            valid.append(row_lengths([c[0] for c in per_row], model.device))
        else:
            valid.append(torch.tensor(per_row, dtype=torch.long, device=model.device))  # (R, H_kv)
        lengths.append([max(col) for col in zip(*per_row)] if split[layer] else max(map(max, per_row)))
    return _hf.cache_from_buffers(model, buffers, lengths, valid)


def kept_kv(
    prefill: Prefill,
    picks: Picks,
    heads: Heads,
    extra: int = 0,
    workspace: torch.Tensor | None = None,
    split: list[bool] | None = None,
) -> list[tuple]:
    """Per layer (R, H_kv, k_l + extra, d) keys and values whose first slots hold each
    route's kept tokens, per KV head (k_l: the most any route's head keeps there; a head that
    keeps fewer leaves padding after its own); carved one after another from ``workspace``
    if given. A layer marked in ``split`` comes as lists of per-head (R, 1, k_lh + extra, d)
    buffers instead (k_lh: the most any route keeps in head h there; see :func:`split_kv`)."""
    offset, kv = 0, []
    for layer in range(len(prefill.layers)):
        out = None if workspace is None else workspace[offset:]
        if split is not None and split[layer]:
            k, v = split_kv(prefill, picks, heads, layer, extra, out)
            offset += sum(t.numel() for t in (*k, *v))
            kv.append((k, v))
            continue
        longest = max(max(c[layer]) for c in heads)
        k, v = empty_kv(prefill, layer, len(heads), longest + extra, out)
        offset += k.numel() + v.numel()
        gather_into(prefill, picks, heads, layer, k, v)
        kv.append((k, v))
    return kv


def split_kv(
    prefill: Prefill, picks: Picks, heads: Heads, layer: int, extra: int, out: torch.Tensor | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One layer's kept keys and values per KV head: head h's (R, 1, k_h + extra, d)
    buffers hold each route's kept tokens of that head first (k_h: the most any route
    keeps in head h; a route keeping fewer leaves padding after its own, position 0
    copies, as in :func:`gather_into`); carved one after another from ``out``."""
    cap = prefill.layers[layer]
    _, h, n, d = cap.keys.shape
    dv = cap.values.shape[-1]
    parts = [picks(r, layer) for r in range(len(heads))]
    # (1, H_kv, max(kept)) each; head j's row holds its own positions, then position 0
    r, offset, ks, vs = len(heads), 0, [], []
    for j in range(h):
        longest = max(kept[layer][j] for kept in heads)
        idx = torch.cat([
            torch.nn.functional.pad(p[:, j : j + 1, :longest], (0, max(0, longest - p.shape[-1]))) for p in parts
        ])  # (R, 1, k_j)
        k, v = empty_kv(prefill, layer, r, longest + extra, None if out is None else out[offset:], 1)
        offset += k.numel() + v.numel()
        keys, values = cap.keys[:, j : j + 1], cap.values[:, j : j + 1]  # (1, 1, n, d)
        torch.gather(keys.expand(r, 1, n, d), 2, idx.unsqueeze(-1).expand(-1, -1, -1, d), out=k[:, :, :longest])
        torch.gather(values.expand(r, 1, n, dv), 2, idx.unsqueeze(-1).expand(-1, -1, -1, dv), out=v[:, :, :longest])
        ks.append(k)
        vs.append(v)
    return ks, vs


def empty_kv(
    prefill: Prefill, layer: int, rows: int, length: int, out: torch.Tensor | None = None, n_heads: int | None = None
):
    """Uninitialised (rows, n_heads, length, d) keys and values (n_heads: H_kv unless
    given), carved from ``out`` if given."""
    cap = prefill.layers[layer]
    _, h, _, d = cap.keys.shape
    h = h if n_heads is None else n_heads
    dv = cap.values.shape[-1]
    if out is None:
        return cap.keys.new_empty(rows, h, length, d), cap.values.new_empty(rows, h, length, dv)
    k = out[: rows * h * length * d].view(rows, h, length, d)  # (R, H_kv, length, d)
    v = out[rows * h * length * d : rows * h * length * (d + dv)].view(rows, h, length, dv)
    return k, v


def gather_into(prefill: Prefill, picks: Picks, heads: Heads, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write each route's kept keys/values at ``layer`` into the first slots of ``k``/``v``.

    A route (or KV head) that keeps fewer tokens than the longest gets copies of
    position 0 in its padding slots: any real key would do, attention never sees them.
    """
    cap = prefill.layers[layer]
    _, h, n, d = cap.keys.shape
    parts = [picks(r, layer) for r in range(len(heads))]  # (1, H_kv, k_r) each
    longest = max(p.shape[-1] for p in parts)
    idx = torch.cat([
        p if p.shape[-1] == longest else torch.nn.functional.pad(p, (0, longest - p.shape[-1]))
        for p in parts
    ])  # (R, H_kv, k_l)
    r, kept = len(heads), idx.shape[-1]
    # One gather per layer for the whole batch, from the shared (1, ...) capture, written
    # straight into the destination.
    torch.gather(cap.keys.expand(r, h, n, d), 2, idx.unsqueeze(-1).expand(-1, -1, -1, d), out=k[:, :, :kept])
    dv = cap.values.shape[-1]
    torch.gather(cap.values.expand(r, h, n, dv), 2, idx.unsqueeze(-1).expand(-1, -1, -1, dv), out=v[:, :, :kept])
