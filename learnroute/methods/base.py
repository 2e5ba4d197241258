"""Method base class, budget resolution and top-k selection shared by the engine and RoutedPress."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress.utils import compute_n_kept

from learnroute._hf import LayerCapture

Budget = int | float


def resolve_budget(budget: Budget, n: int) -> int:
    """Tokens kept per KV head for a context of ``n`` tokens.

    An integer is a token count (capped at ``n``: a budget above the context keeps
    everything). A float in (0, 1] is a fraction of the context, resolved exactly as
    kvpress resolves ``compression_ratio = 1 - fraction`` so kept counts match kvpress.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be an int >= 1 or a float in (0, 1], got {budget!r}")
    if isinstance(budget, int):
        if budget < 1:
            raise ValueError(f"budget must be an int >= 1 or a float in (0, 1], got {budget!r}")
        return min(budget, n)
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be an int >= 1 or a float in (0, 1], got {budget!r}")
    # max(1, ...): below 2**-53, 1 - budget rounds to 1.0, which kvpress reads as "evict the
    # whole layer"; a fraction > 0 never asks for that (found by a property test).
    return min(n, max(1, compute_n_kept(n, 1.0 - budget)))


def keep_indices(scores: torch.Tensor, n_kept: int) -> torch.Tensor:
    """Indices of the ``n_kept`` highest scores per (batch, head), in position order.

    scores: (B, H_kv, n) -> (B, H_kv, n_kept). Sorting keeps the cache in token order,
    which attention does not need but makes kept positions easy to inspect.
    """
    n = scores.shape[-1]
    if n_kept >= n:
        return torch.arange(n, device=scores.device).expand(*scores.shape[:-1], n)  # (B, H_kv, n)
    idx = scores.topk(n_kept, dim=-1).indices  # (B, H_kv, n_kept)
    return idx.sort(dim=-1).values


@dataclass
class Method:
    """Base class: score one layer's cached tokens, higher = keep.

    Subclasses set ``name`` and implement :meth:`score`. A ``budget_dependent`` method's
    scores depend on how many tokens will be kept (e.g. CriticalKV's two-stage selection);
    the engine then scores it once per distinct kept count.
    """

    name: ClassVar[str] = ""
    budget_dependent: ClassVar[bool] = False
    keeps_all: ClassVar[bool] = False

    def min_context(self) -> int:
        """Shortest context (tokens) this method can score."""
        return 1

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        """Scores (B, H_kv, n) for the captured layer."""
        raise NotImplementedError
