"""Method base class. Budget resolution lives in :mod:`learnroute.methods.budgets`, token
selection in :mod:`learnroute.methods.select`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from learnroute._hf import LayerCapture


@dataclass
class Method:
    """Base class: score one layer's cached tokens, higher = keep.

    Subclasses set ``name`` and implement :meth:`score`. A ``budget_dependent`` method's
    scores depend on how many tokens will be kept (e.g. CriticalKV's two-stage selection);
    the engine then scores it once per distinct kept count. A ``head_uniform`` method gives
    every KV head of a layer the same scores (position only, or attention averaged over all
    query heads): Ada-KV's split of a layer's budget over its heads then keeps the same
    tokens in every head, so ``adakv:<method>`` is the homogeneous route.
    """

    name: ClassVar[str] = ""
    budget_dependent: ClassVar[bool] = False
    keeps_all: ClassVar[bool] = False
    head_uniform: ClassVar[bool] = False

    def min_context(self) -> int:
        """Shortest context (tokens) this method can score."""
        return 1

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        """Scores (B, H_kv, n) for the captured layer."""
        raise NotImplementedError
