"""Making method scores comparable across methods, and mixing them.

Raw scores live on unrelated scales (attention probabilities, minus key norms, cosine
distances, recency), so a weighted sum of raw scores would be decided by whichever method
has the widest range. Each method's scores are first turned into per-(layer, head) ranks
scaled to [0, 1] (the lowest score -> 0, the highest -> 1), then mixed with weights.
Learned gates train on these mixed ranks (soft top-k) and mixture routes evaluate them
(hard top-k), so training and evaluation share one definition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def rank_normalize(scores: torch.Tensor) -> torch.Tensor:
    """Ranks of ``scores`` (..., n) along the last dim, scaled to [0, 1].

    Ties are broken by position (the earlier token ranks lower), so the result is a
    deterministic permutation of ``{0, 1/(n-1), ..., 1}`` per row. A row of one token
    gets 1.
    """
    n = scores.shape[-1]
    order = torch.argsort(scores.float(), dim=-1, stable=True)  # (..., n): positions by increasing score
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(n, device=scores.device).expand_as(order))  # (..., n)
    return ranks.float() / max(n - 1, 1) if n > 1 else torch.ones_like(scores, dtype=torch.float32)


def mix_ranks(ranks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of per-method ranks: ``ranks`` (..., M, H, n), ``weights`` (..., M)
    -> (..., H, n). Differentiable in ``weights`` (the gates' mixture π)."""
    return torch.einsum("...mhn,...m->...hn", ranks, weights.to(ranks.dtype))


def mixed_scores(scores: Mapping[str, torch.Tensor], weights: Mapping[str, float] | Sequence[tuple[str, float]]) -> torch.Tensor:
    """Scores (B, H_kv, n) of a mixture: ``Σ_m w_m · rank_normalize(scores[m])``.

    ``scores`` maps each method in ``weights`` to its raw scores (B, H_kv, n). Keeping the
    top-k of the result is how a mixture route selects tokens (hard top-k at inference).
    """
    items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    ranks = torch.stack([rank_normalize(scores[m]) for m, _ in items], dim=-3)  # (B, M, H_kv, n)
    w = torch.tensor([float(x) for _, x in items], device=ranks.device)  # (M,)
    return mix_ranks(ranks, w)  # (B, H_kv, n)
