"""A sample's full-cache prefill (:class:`Prefill`), and :class:`PrefillStore`, which lets
engines of several stages reuse one prefill of the same context."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from learnroute import _hf
from learnroute.engine.prompt import Prompt


@dataclass
class Prefill:
    """One sample after its full-cache prefill: captures plus lazily computed scores."""

    prompt: Prompt
    layers: list[_hf.LayerCapture]
    seconds: float
    _scores: dict[tuple[int, str, int | None], torch.Tensor] = field(default_factory=dict)
    _indices: dict[tuple[int, str, int], torch.Tensor] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.prompt.context_ids.shape[1])

    @property
    def layer_tokens(self) -> list[int]:
        """Tokens each layer's cache holds after the prefill: ``n_tokens``, or fewer in
        sliding-window layers whose window is shorter than the context."""
        return [int(cap.keys.shape[2]) for cap in self.layers]

    def bound(self, prompt: Prompt, modules: list) -> Prefill:
        """This prefill with ``prompt`` and its captures bound to ``modules`` (None: to no
        model); the scores and indices dicts stay shared with it."""
        layers = [replace(cap, module=m) for cap, m in zip(self.layers, modules, strict=True)]
        return Prefill(prompt, layers, self.seconds, self._scores, self._indices)


def capture_bytes(layers: list[_hf.LayerCapture]) -> int:
    """Bytes held by captures (each storage once: the attention inputs share one buffer,
    the layers one RoPE table)."""
    storages: dict[int, int] = {}
    for cap in layers:
        for t in (cap.hidden_states, cap.keys, cap.values, *cap.position_embeddings):
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


@dataclass
class PrefillStore:
    """Prefills kept for reuse by every :class:`~learnroute.engine.Engine` given this store
    (``Engine(..., prefills=store)``), and what it did.

    A study's stages go over the same samples (the profile and training over the
    calibration set; the bench, its controls and the placement over the eval set), and on
    CPUs the prefill and the scores are most of a bench cell's cost: with one store passed
    to every stage, each context is prefilled once. A second prefill of the same tokens by
    the same model returns the first, and every score computed from it so far, whichever
    engine asks; answers are those of separate prefills.

    Entries are keyed by the model (:func:`learnroute._hf.fingerprint`), the engine's
    ``method_options`` (scores depend on them) and the context's token ids, and hold the
    captures without their modules (a hit is bound to the asking engine's model: the store
    keeps no model alive). ``max_bytes`` caps the captures kept (keys, values, attention
    inputs, RoPE; the scores add about 3 % on top); 0 keeps nothing. :meth:`clear`
    releases everything.
    """

    max_bytes: int
    entries: dict[tuple, Prefill] = field(default_factory=dict)
    bytes: int = 0
    hits: int = 0  # prefills served from the store
    made: int = 0  # prefills run by engines using the store
    kept: int = 0  # of those, kept (they fitted)

    @staticmethod
    def key(model, method_options: dict, prompt: Prompt) -> tuple:
        """What makes two prefills the same: the weights, the scorers' options, the tokens."""
        ids = tuple(prompt.context_ids[0].tolist())
        return (_hf.fingerprint(model), repr(sorted(method_options.items())), ids)

    def get(self, key: tuple, prompt: Prompt, modules: list) -> Prefill | None:
        """The kept prefill for ``key`` bound to the asking engine's ``prompt`` (its question
        may differ) and attention ``modules`` (scorers project with them), or None."""
        kept = self.entries.get(key)
        if kept is None:
            return None
        self.hits += 1
        return kept.bound(prompt, modules)

    def add(self, key: tuple, prefill: Prefill) -> None:
        """Count a prefill just made, and keep it if it fits under ``max_bytes``."""
        self.made += 1
        size = capture_bytes(prefill.layers)
        # Keep the first ones that fit rather than the most recent: the stages go over the
        # same samples in the same order, and evicting the oldest would evict exactly what
        # the next stage asks for first.
        if self.bytes + size <= self.max_bytes:
            self.bytes += size
            self.kept += 1
            self.entries[key] = prefill.bound(prefill.prompt, [None] * len(prefill.layers))

    def clear(self) -> None:
        """Release every kept prefill (the counts stay)."""
        self.entries.clear()
        self.bytes = 0

    @property
    def not_kept(self) -> int:
        """Prefills made but not kept: the cap was reached (every miss is made once)."""
        return self.made - self.kept

    def summary(self) -> str:
        return (f"prefills reused {self.hits}, made {self.made} ({self.not_kept} not kept: cap), "
                f"{self.bytes / 2**30:.2f} GiB kept")
