"""kvpress's own press for a learnroute method at a given kept count (for comparisons).

The engine and :class:`learnroute.RoutedPress` never need this: it exists so tests and
benchmarks can run kvpress's press next to a learnroute route and expect the same kept
tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import kvpress

# learnroute method name -> kvpress press at a compression ratio. Only methods whose
# learnroute scorer keeps the same tokens as this press (tested) are listed.
_PRESSES: dict[str, Callable[[float], kvpress.BasePress]] = {
    "snapkv": lambda ratio: kvpress.SnapKVPress(compression_ratio=ratio),
    "tova": lambda ratio: kvpress.TOVAPress(compression_ratio=ratio),
    "knorm": lambda ratio: kvpress.KnormPress(compression_ratio=ratio),
    "expected_attention": lambda ratio: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
    "keydiff": lambda ratio: kvpress.KeyDiffPress(compression_ratio=ratio),
    "streaming_llm": lambda ratio: kvpress.StreamingLLMPress(compression_ratio=ratio),
}


def _critical_snapkv(ratio: float) -> kvpress.BasePress:
    # CriticalKVPress has no compression_ratio argument: it forwards the attribute to the
    # wrapped press, and sizes its first stage from it.
    press = kvpress.CriticalKVPress(kvpress.SnapKVPress())
    press.compression_ratio = ratio
    return press


_PRESSES["critical_snapkv"] = _critical_snapkv

KVPRESS_METHODS: tuple[str, ...] = tuple(_PRESSES)


def kvpress_ratio(n_kept: int, n: int) -> float:
    """The ``compression_ratio`` with which kvpress keeps exactly ``n_kept`` of ``n`` tokens.

    kvpress keeps ``int(n * (1 - ratio))`` tokens (``kvpress.utils.compute_n_kept``), so
    ``ratio = 1 - (n_kept + 0.5) / n`` lands ``n * (1 - ratio)`` on ``n_kept + 0.5``, never
    just below ``n_kept`` by rounding. ``n_kept >= n`` gives 0.0 (keep everything, as
    :func:`learnroute.methods.resolve_budget` caps a budget above the context).
    """
    if isinstance(n_kept, bool) or not isinstance(n_kept, int) or n_kept < 1:
        raise ValueError(f"n_kept must be an int >= 1, got {n_kept!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (context tokens) must be an int >= 1, got {n!r}")
    return 0.0 if n_kept >= n else 1.0 - (n_kept + 0.5) / n


def kvpress_press(method: str, n_kept: int, n: int) -> kvpress.BasePress:
    """kvpress's press equivalent to learnroute's ``method`` keeping ``n_kept`` of ``n`` tokens.

    ``n_kept`` is what :func:`learnroute.methods.resolve_budget` gives for a budget (an
    int budget capped at ``n``; a fraction ``f`` resolved as kvpress resolves
    ``compression_ratio = 1 - f``), so a route at that budget and the returned press keep
    the same number of tokens per KV head. The ratio is :func:`kvpress_ratio`, the same
    rule :class:`learnroute.methods.scorers.CriticalSnapKV` uses to size CriticalKV's
    first stage; ``critical_snapkv`` is ``CriticalKVPress(SnapKVPress())`` with kvpress's
    defaults (window 64, kernel 5, epsilon 1e-4, first-stage ratio 0.5) and the ratio set
    on it afterwards.

    Raises ValueError, listing the supported names, for a method kvpress has no press for
    (``h2o``, ``lava``, ``random``, ``full`` …: use :class:`learnroute.RoutedPress`).
    """
    make = _PRESSES.get(method)
    if make is None:
        raise ValueError(
            f"no kvpress press for method {method!r}; supported: {', '.join(KVPRESS_METHODS)} "
            "(use learnroute.RoutedPress for the others)"
        )
    return make(kvpress_ratio(n_kept, n))
