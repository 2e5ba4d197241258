"""Which routes decode together (:func:`pack_batches`), and the re-layout of parked rows:
answers still unfinished after a few tokens leave their batch and finish together in
fresh batches (:func:`unpadded_rows`, :func:`parked_cache`)."""

from __future__ import annotations

import torch

from learnroute import _hf

# One parked row: (its index, its next token, per layer its keys/values (H_kv, n_l, d)).
Parked = tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]


def padded_shape(shapes: list[list[int]]) -> list[int]:
    """Per layer, the most tokens any of ``shapes`` (kept counts per layer) keeps there."""
    return [max(per_layer) for per_layer in zip(*shapes)]


def row_lengths(per_row: list[int] | tuple[int, ...], device) -> torch.Tensor | None:
    """One layer's kept tokens per batch row as a (R,) tensor for the padding mask, or None
    when every row keeps the same number (no padding in that layer)."""
    if min(per_row) == max(per_row):
        return None
    return torch.tensor(per_row, dtype=torch.long, device=device)  # (R,)


def pack_batches(shapes: list[list[int]], max_batch: int, max_padding: float) -> list[list[int]]:
    """Group routes (their kept counts per layer, ``shapes``) into decode batches.

    Batching is what makes many routes cheap: on 2 CPU cores a greedy step of SmolLM2-135M
    costs about 50 ms for one row and 163 ms for 32 (``benchmarks/cpu_floor.py``). Routes are
    taken in order of total kept tokens (identical shapes next to each other); a batch
    closes at ``max_batch`` rows, or before a route that would make the batch's padded
    cache (per layer, the longest row) more than ``max_padding`` times its smallest
    route's. ``max_padding=1`` batches identical shapes only. Returns indices of
    ``shapes``, one list per batch.
    """
    if max_padding < 1:
        raise ValueError(f"max_padding must be >= 1, got {max_padding}")
    order = sorted(range(len(shapes)), key=lambda i: (sum(shapes[i]), shapes[i]))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_batch:
            batch = batches[-1]
            smallest = min(sum(shapes[j]) for j in batch)
            if sum(padded_shape([shapes[j] for j in batch] + [shapes[i]])) <= max_padding * smallest:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def unpadded_rows(cache, batch_rows: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per batch row, per layer, its keys/values (H_kv, n_l, d) without padding: its own
    context tokens, then the question and answer tokens. Copies (the batch's buffers
    are reused by the next batch)."""
    out = []
    for j in batch_rows.tolist():
        per_layer = []
        for layer in cache.layers:
            k, v = layer.keys[j], layer.values[j]  # (H_kv, L, d)
            valid = getattr(layer, "valid", None)
            if valid is not None:  # [own tokens | padding | new tokens] -> [own | new]
                own, end = int(valid[j]), layer.pad_end
                k = torch.cat([k[:, :own], k[:, end:]], dim=1)  # (H_kv, own + new, d)
                v = torch.cat([v[:, :own], v[:, end:]], dim=1)
            else:
                k, v = k.clone(), v.clone()
            per_layer.append((k, v))
        out.append(per_layer)
    return out


def parked_cache(model, rows: list[Parked], extra: int):
    """One decode cache for parked ``rows`` (from any batches), each layer padded to its
    longest row, the padding masked, with room for ``extra`` more tokens per layer."""
    shapes = [[k.shape[1] for k, _ in kv] for _, _, kv in rows]
    longest = padded_shape(shapes)
    buffers, valid = [], []
    for layer, n in enumerate(longest):
        k0, v0 = rows[0][2][layer]
        # Zeros, not garbage: a masked key still enters q.k, and a NaN there would survive
        # the mask (NaN + -inf is NaN).
        kb = k0.new_zeros(len(rows), k0.shape[0], n + extra, k0.shape[-1])  # (R, H_kv, n + extra, d)
        vb = v0.new_zeros(len(rows), v0.shape[0], n + extra, v0.shape[-1])
        for r, (_, _, kv) in enumerate(rows):
            k, v = kv[layer]
            kb[r, :, : k.shape[1]] = k
            vb[r, :, : v.shape[1]] = v
        buffers.append((kb, vb))
        valid.append(row_lengths([s[layer] for s in shapes], kb.device))
    return _hf.cache_from_buffers(model, buffers, longest, valid)
