"""The candidate methods.

kvpress-backed methods call the kvpress 0.5.5 press's own ``score()`` on the captured
layer (no re-implementation). Own implementations: ``h2o`` (kvpress's needs eager
attention weights), ``lava`` (not in kvpress), ``random`` (per-layer seeds),
``streaming_llm`` (see its docstring) and ``full`` (the reference: keep everything).

Shapes: keys/values (B, H_kv, n, d) with RoPE; hidden states (B, n, D); H_q query heads,
group g = H_q / H_kv; scores (B, H_kv, n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvpress import (
    CriticalKVPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    SnapKVPress,
    TOVAPress,
)
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import get_prerope_query_states

from learnroute._hf import LayerCapture, apply_rope
from learnroute.methods.base import Method


def _press_score(press: ScorerPress, layer: LayerCapture) -> torch.Tensor:
    """Call a kvpress scorer on a captured layer, as kvpress's forward hook would."""
    kwargs = {"position_embeddings": layer.position_embeddings}
    return press.score(layer.module, layer.hidden_states, layer.keys, layer.values, None, kwargs)


def _window_attention(layer: LayerCapture, window: int) -> torch.Tensor:
    """Softmax attention of the last ``window`` queries to the first n - window keys.

    Returns (B, H_q, window, n - window), via kvpress's own helper (causal within the window).
    """
    return SnapKVPress.compute_window_attention(
        layer.module, layer.hidden_states, layer.keys, window, layer.position_embeddings
    )


@dataclass
class SnapKV(Method):
    """SnapKV (Li et al. 2024, arXiv 2404.14469), via kvpress ``SnapKVPress``.

    Attention of the last ``window_size`` context queries, averaged over the window,
    avg-pooled with ``kernel_size``, averaged over each GQA group; the window itself is
    always kept. kvpress defaults: window 64, kernel 5 (the paper uses 32 / 7, max pool).
    """

    name = "snapkv"
    window_size: int = 64
    kernel_size: int = 5

    def min_context(self) -> int:
        return self.window_size + 1

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        return _snapkv_scores(layer, self.window_size, self.kernel_size)


def _snapkv_scores(layer: LayerCapture, window_size: int, kernel_size: int) -> torch.Tensor:
    """kvpress SnapKV scores (B, H_kv, n) of a layer, computed once per capture."""
    key = ("snapkv", window_size, kernel_size)
    if key not in layer.memo:
        layer.memo[key] = _press_score(SnapKVPress(window_size=window_size, kernel_size=kernel_size), layer)
    return layer.memo[key]


class _GivenScores(ScorerPress):
    """A kvpress scorer returning scores computed earlier, so kvpress's CriticalKVPress can
    rescale the layer's SnapKV scores without recomputing them."""

    def __init__(self, scores: torch.Tensor) -> None:
        super().__init__(compression_ratio=0.0)
        self.scores = scores

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        return self.scores.clone()  # CriticalKVPress writes into what it gets


@dataclass
class TOVA(Method):
    """TOVA (Oren et al. 2024, arXiv 2401.06104), via kvpress ``TOVAPress``.

    Attention of the last context query, averaged over all query heads (the same score
    for every KV head); the last token is always kept.
    """

    name = "tova"
    head_uniform = True

    def min_context(self) -> int:
        return 2

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        return _press_score(TOVAPress(), layer)


@dataclass
class Knorm(Method):
    """Key-norm (Devoto et al. 2024, arXiv 2406.11430), via kvpress ``KnormPress``: minus ||k||_2."""

    name = "knorm"

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        return _press_score(KnormPress(), layer)


@dataclass
class ExpectedAttention(Method):
    """Expected attention (kvpress ``ExpectedAttentionPress``, NVIDIA 2025).

    Closed-form expected attention of the next ``n_future_positions`` queries (Gaussian
    query statistics, averaged RoPE), times ||v||_2; ``n_sink`` first tokens kept.
    kvpress defaults: 512 future positions, 4 sinks, covariance on, value norm on.
    """

    name = "expected_attention"
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True

    def min_context(self) -> int:
        return self.n_sink + 1

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        press = ExpectedAttentionPress(
            n_future_positions=self.n_future_positions,
            n_sink=self.n_sink,
            use_covariance=self.use_covariance,
            use_vnorm=self.use_vnorm,
        )
        return _press_score(press, layer)


@dataclass
class KeyDiff(Method):
    """KeyDiff (Park et al. 2025, arXiv 2504.15364), via kvpress ``KeyDiffPress``:
    minus the cosine similarity of each key to the mean normalised key."""

    name = "keydiff"

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        return _press_score(KeyDiffPress(), layer)


@dataclass
class CriticalSnapKV(Method):
    """CriticalKV on SnapKV (Feng et al. 2025, arXiv 2502.03805), via kvpress
    ``CriticalKVPress(SnapKVPress())``.

    Stage 1 keeps the top ``first_stage_ratio`` of the budget by SnapKV score; stage 2
    rescales SnapKV scores by the L1 norm of W_o·V. Budget-dependent (stage 1 size).
    """

    name = "critical_snapkv"
    budget_dependent = True
    window_size: int = 64
    kernel_size: int = 5
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def min_context(self) -> int:
        return self.window_size + 1

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        n = layer.keys.shape[2]
        inner = _GivenScores(_snapkv_scores(layer, self.window_size, self.kernel_size))
        press = CriticalKVPress(inner, epsilon=self.epsilon, first_stage_ratio=self.first_stage_ratio)
        # kvpress sizes stage 1 from compression_ratio: int((1 - cr) * n * ratio). The
        # half-token offset makes (1 - cr) * n land on n_kept + 0.5, never just below n_kept.
        kept = n if n_kept is None else min(n_kept, n)
        press.compression_ratio = 0.0 if kept >= n else 1.0 - (kept + 0.5) / n
        return _press_score(press, layer)


@dataclass
class StreamingLLM(Method):
    """StreamingLLM (Xiao et al. 2024, arXiv 2309.17453): ``n_sink`` first tokens plus the
    most recent ones (kvpress ``StreamingLLMPress`` default: 4 sinks).

    Not delegated to kvpress on purpose: kvpress encodes the budget in its scores (the
    pruned span depends on ``compression_ratio``), while the engine needs one score per
    token for every budget. Recency as the score gives the same kept set for every
    budget (tested against ``StreamingLLMPress``).
    """

    name = "streaming_llm"
    head_uniform = True
    n_sink: int = 4

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        b, h, n, _ = layer.keys.shape
        pos = torch.arange(n, dtype=torch.float32, device=layer.keys.device)  # (n,)
        # Sinks rank above every other token, earliest first; the rest by recency.
        scores = torch.where(pos < self.n_sink, 2.0 * n - pos, pos)
        return scores.expand(b, h, n).clone()  # (B, H_kv, n)


def _all_query_states(layer: LayerCapture) -> torch.Tensor:
    """Post-RoPE queries for every context position: (B, H_q, n, d)."""
    q = get_prerope_query_states(layer.module, layer.hidden_states)  # (B, H_q, n, d)
    cos, sin = layer.position_embeddings
    return apply_rope(q, cos, sin)


@dataclass
class H2O(Method):
    """H2O heavy hitters (Zhang et al. 2023, arXiv 2306.14048).

    Score of key j = attention it received, summed over every context query (causal),
    averaged over each GQA group. Computed here in query chunks of ``chunk_size`` so it
    runs under sdpa (kvpress's ``ObservedAttentionPress`` needs eager attention weights
    and divides by the number of queries; H2O accumulates the plain sum). The recent
    window H2O adds on top is not part of the score. 128-query chunks keep each chunk's
    logits cache-sized on CPU (1.6x faster than 256 at 2k tokens).
    """

    name = "h2o"
    chunk_size: int = 128

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        keys = layer.keys  # (B, H_kv, n, d)
        b, h_kv, n, d = keys.shape
        query = _all_query_states(layer) / math.sqrt(d)  # (B, H_q, n, d)
        g = query.shape[1] // h_kv
        q = query.view(b, h_kv, g, n, d)  # (B, H_kv, g, n, d)
        k_t = keys.transpose(-1, -2).unsqueeze(2)  # (B, H_kv, 1, d, n)
        total = torch.zeros(b, h_kv, n, dtype=torch.float32, device=keys.device)  # (B, H_kv, n)
        for start in range(0, n, self.chunk_size):
            stop = min(n, start + self.chunk_size)
            # Only keys [0, stop) can be seen by this chunk: skipping the rest halves the work.
            logits = q[..., start:stop, :] @ k_t[..., :stop]  # (B, H_kv, g, c, stop)
            c = stop - start
            future = torch.ones(c, c, dtype=torch.bool, device=keys.device).triu(1)  # (c, c)
            logits[..., start:stop].masked_fill_(future, float("-inf"))
            total[..., :stop] += logits.softmax(dim=-1, dtype=torch.float32).sum(dim=(2, 3))
        return total / g  # (B, H_kv, n): mean over the GQA group of the summed attention


@dataclass
class LAVa(Method):
    """LAVa (arXiv 2509.09754, repo MGDDestiny/Lava) token scores.

    SnapKV-style attention of the last ``window_size`` (32) context queries, averaged over
    the window, max-pooled with ``kernel_size`` (7), max over each GQA group, multiplied by
    the head's value scale max_j ||v_j||_1. The window is always kept. With per-head top-k
    the value scale only rescales a head's scores; it matters when scores are compared
    across heads (LAVa's own budget allocation, score mixing).
    """

    name = "lava"
    window_size: int = 32
    kernel_size: int = 7

    def min_context(self) -> int:
        return self.window_size + 1

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        b, h_kv, n, _ = layer.keys.shape
        w = self.window_size
        attn = _window_attention(layer, w)  # (B, H_q, w, n - w)
        s = attn.mean(dim=-2)  # (B, H_q, n - w)
        s = F.max_pool1d(s, kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)
        s = s.view(b, h_kv, -1, n - w).amax(dim=2)  # (B, H_kv, n - w)
        v_scale = layer.values.abs().sum(dim=-1).amax(dim=-1, keepdim=True)  # (B, H_kv, 1)
        s = s * v_scale
        return F.pad(s, (0, w), value=float(s.detach().max()) + 1.0)  # (B, H_kv, n)


@dataclass
class Random(Method):
    """Uniform random scores (control). Seeded per layer, so layers evict different tokens
    (a seeded kvpress ``RandomPress`` draws the same scores in every layer)."""

    name = "random"
    seed: int = 0

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 100_003 + layer.module.layer_idx)
        return torch.rand(layer.keys.shape[:-1], generator=gen).to(layer.keys.device)  # (B, H_kv, n)


@dataclass
class FullCache(Method):
    """The reference: keep every cached token, whatever the budget says."""

    name = "full"
    keeps_all = True

    def score(self, layer: LayerCapture, n_kept: int | None = None) -> torch.Tensor:
        return torch.zeros(layer.keys.shape[:-1], device=layer.keys.device)
