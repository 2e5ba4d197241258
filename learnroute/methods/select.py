"""THE token selection: how many tokens a layer keeps and which, for one route entry.

The engine, RoutedPress and the trainer's validation all call :func:`kept_count` and
:func:`select`, so a route keeps the same positions wherever it runs. Ties between equal
scores go to the **later** token, the order :func:`learnroute.methods.mixing.rank_normalize`
gives (SnapKV and LAVa score their whole observation window alike): selecting from a
method's raw scores or from its ranks keeps the same set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from learnroute.methods.budgets import Budget, resolve_budget
from learnroute.methods.mixing import mixed_scores


def keep_indices(scores: torch.Tensor, n_kept: int) -> torch.Tensor:
    """Indices of the ``n_kept`` highest scores per (batch, head), in position order.

    scores: (B, H_kv, n) -> (B, H_kv, n_kept). Ties: the later position is kept (a stable
    ascending sort puts it after the earlier one). Sorting the result keeps the cache in
    token order, which attention does not need but makes kept positions easy to inspect.
    """
    n = scores.shape[-1]
    if n_kept >= n:
        return torch.arange(n, device=scores.device).expand(*scores.shape[:-1], n)  # (B, H_kv, n)
    order = torch.argsort(scores.float(), dim=-1, stable=True)  # (B, H_kv, n): increasing score, ties by position
    return order[..., n - n_kept :].sort(dim=-1).values  # (B, H_kv, n_kept)


def kept_count(budget: Budget, n: int, *, keeps_all: bool = False, fixed: bool = False, held: int | None = None) -> int:
    """Tokens kept per KV head by one layer entry at a context of ``n`` tokens.

    A ``fixed`` layer (a local sliding-window layer, or one whose cache holds only
    ``held`` < ``n`` tokens) keeps what it holds; a keep-everything method keeps ``n``;
    otherwise the budget resolves by :func:`learnroute.methods.budgets.resolve_budget`.
    """
    if fixed:
        return n if held is None else held
    if keeps_all:
        return n
    return resolve_budget(budget, n)


def active_components(method: str, mixture: Sequence[tuple[str, float]] | None) -> list[tuple[str, float]]:
    """The methods whose scores decide a layer: its mixture's components of weight > 0,
    or its one method. A one-component mixture is that method (ties broken as it breaks them)."""
    active = [(m, float(w)) for m, w in mixture or () if w > 0]
    return active or [(method, 1.0)]


def select(
    method: str,
    mixture: Sequence[tuple[str, float]] | None,
    n_kept: int,
    n: int,
    scores: Callable[[str], torch.Tensor],
) -> torch.Tensor | None:
    """Kept positions (B, H_kv, n_kept) of one layer entry, or None when it keeps all
    ``n`` tokens (no scores are computed then). ``scores(name)`` gives a method's scores
    (B, H_kv, n): raw scores or their ranks, the same set is kept."""
    if n_kept >= n:
        return None
    active = active_components(method, mixture)
    if len(active) > 1:  # a mixture layer: top-k of the mixed ranks
        return keep_indices(mixed_scores({m: scores(m) for m, _ in active}, active), n_kept)
    return keep_indices(scores(active[0][0]), n_kept)


def stack_heads(picks: Sequence[torch.Tensor], counts: Sequence[int]) -> torch.Tensor:
    """Kept positions (B, H_kv, max(counts)) of a layer whose KV heads select on their own:
    head h keeps row h of ``picks[h]`` (its own entry's selection (B, H_kv, counts[h]) at its
    own count), the shorter heads padded with position 0 (a real key: the engine and
    RoutedPress mask the padding)."""
    longest = max(counts)
    rows = [torch.nn.functional.pad(pick[:, h], (0, longest - k)) for h, (pick, k) in enumerate(zip(picks, counts))]
    return torch.stack(rows, dim=1)  # (B, H_kv, longest)
