"""RoutedPress: a route inside kvpress's own ``kv-press-text-generation`` pipeline."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass, field

import torch
from kvpress import BasePress
from torch import nn
from transformers import PreTrainedModel

from learnroute import _hf
from learnroute import adapter as _adapter
from learnroute.methods.base import Method
from learnroute.methods.select import kept_count, select, stack_heads
from learnroute.methods.registry import get_method
from learnroute.route import Route, RouteError


@dataclass
class RoutedPress(BasePress):
    """A kvpress press applying ``route``: layer l scores with its method (or the mixed ranks
    of a mixture layer's methods), keeps its budget.

    A route whose layers all keep the same count works in kvpress's pipeline on CPU with
    sdpa or eager, in one line, and leaves the model as it found it::

        pipe(context, question=q, press=RoutedPress(route))

    kvpress decodes *after* the press context has closed. When layers keep different counts
    (per-layer or per-head budgets, ``full`` next to compressed layers, a model with local
    sliding-window layers such as Gemma3) the model must still run route-aware attention
    then, and a route naming an adapter (``provenance["adapter"]``, :mod:`learnroute.adapter`)
    must have it on; both outlast the press context, so they are asked for explicitly, and
    undone when the scope ends::

        press = RoutedPress(route)
        with press.scope(model):
            pipe(context, question=q, press=press)

    Without the scope such a route is refused before any forward, with this advice.
    Route-aware attention (``learnroute_sdpa`` / ``learnroute_eager``) is bit-identical to
    the stock one whenever every layer's cache has the same length; an adapter is off for
    the prefill (the cache is the base model's) and on for the decoding.
    """

    route: Route
    method_options: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if any(e.share is not None for e in self.route.layers):  # refused before the pipeline runs a forward
            raise RouteError("RoutedPress does not run layers that share their budget across heads by scores "
                             "(share: adakv); kvpress's own AdaKVPress does")
        names = {m for e in self.route.layers for m in e.methods}  # mixture layers need every component
        self._methods: dict[str, Method] = {name: get_method(name, **self.method_options.get(name, {})) for name in names}
        # A missing or malformed adapter folder is refused here, before any forward.
        self._adapter = None if self.route.adapter_path is None else _adapter.Adapter.load(self.route.adapter_path)

    def needs_routed_attention(self) -> bool:
        """Can layers end with different cache lengths? (Call inside the press context,
        which knows the model's local layers.)"""
        # A keep-everything method keeps the whole context whatever its budget says.
        kept = {None if self._methods[e.method].keeps_all else e.budget for e in self.route.layers}
        return len(kept) > 1 or any(self._local) or self.route.is_per_head  # per head: padded heads

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.route.layers[module.layer_idx]
        n = keys.shape[2]
        # Local sliding-window layers (Gemma3's) are left as they are, as kvpress does for
        # Gemma3, and so is any layer whose cache holds only a window of the context: the
        # engine's rule (Engine.is_fixed), through the same kept_count/select as the engine.
        fixed = self._local[module.layer_idx] or n < hidden_states.shape[1]
        capture = _hf.LayerCapture(module, hidden_states, keys, values, kwargs["position_embeddings"])
        if entry.heads is not None:
            return self._compress_heads(module, entry, capture, keys, values, fixed)
        n_kept = kept_count(entry.budget, n, keeps_all=self._methods[entry.method].keeps_all, fixed=fixed, held=n)
        idx = select(entry.method, entry.mixture, n_kept, n, lambda m: self._methods[m].score(capture, n_kept))
        if idx is None:  # the layer keeps everything
            return keys, values
        idx = idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])  # (B, H_kv, k, d)
        return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()

    def _compress_heads(self, module, entry, capture, keys, values, fixed: bool):
        """A per-head layer: each KV head keeps its own method's top-k at its own count (the
        engine's selection); heads are padded to the longest with position 0 and the padding
        is marked for route-aware attention (:func:`learnroute._hf.set_press_padding`)."""
        b, h, n, d = keys.shape
        counts = [kept_count(x.budget, n, keeps_all=self._methods[x.method].keeps_all, fixed=fixed, held=n)
                  for x in entry.heads]
        longest = max(counts)
        picks = []
        for x, k in zip(entry.heads, counts):
            idx = select(x.method, x.mixture, k, n, lambda m, k=k: self._methods[m].score(capture, k))  # (B, H_kv, k)
            picks.append(torch.arange(n, device=keys.device).expand(b, h, n) if idx is None else idx)
        idx = stack_heads(picks, counts).unsqueeze(-1).expand(-1, -1, -1, d)  # (B, H_kv, longest, d)
        if min(counts) < longest:
            valid = torch.tensor(counts, device=keys.device).expand(b, h)  # (B, H_kv)
            _hf.set_press_padding(module, valid, longest)
        return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()

    def _check(self, model: PreTrainedModel) -> None:
        """The route against the model (layers, heads, adapter shapes), before any forward."""
        self.route.check_layers(len(_hf.attention_modules(model)))
        self.route.check_heads(_hf.kv_heads(model))
        self._local = _hf.local_attention_layers(model)
        if self._adapter is not None:
            from learnroute.models import model_name

            self._adapter.check(model, model_name(model))

    @contextlib.contextmanager
    def scope(self, model: PreTrainedModel) -> Generator:
        """What decoding after the press context needs, held until the scope ends: the
        model's route-aware attention where layers (or heads) keep different counts, and the
        route's adapter attached (on for decoding). On exit the model's attention, its
        adapters and their on/off state are as before."""
        self._check(model)
        with contextlib.ExitStack() as stack:
            if self.needs_routed_attention():
                stack.enter_context(_hf.routed_attention(model))
            stack.enter_context(_adapter.adapter_scope(model))
            stack.callback(_hf.clear_press_padding, model)
            if self._adapter is not None:
                from learnroute.models import model_name

                _adapter.attach(model, self._adapter, model_name(model))
            self._scoped = model
            stack.callback(setattr, self, "_scoped", None)
            yield self

    @contextlib.contextmanager
    def __call__(self, model: PreTrainedModel) -> Generator:
        self._check(model)
        scoped = getattr(self, "_scoped", None) is model
        if not scoped:
            needs = []
            if self.needs_routed_attention() and not _hf.is_routed(model):
                needs.append("its layers (or KV heads) keep different token counts, so the model must decode "
                             "with route-aware attention")
            if self._adapter is not None:
                needs.append(f"it names the adapter {self.route.adapter_path}, which must be on for decoding")
            if needs:
                raise RouteError(
                    f"RoutedPress: {'; '.join(needs)}, after the press context closes (kvpress decodes after "
                    "it). Wrap the pipeline call: `press = RoutedPress(route)` then `with press.scope(model): "
                    "pipe(context, question=q, press=press)`; the scope restores the model afterwards")
        # kvpress's context sets each module's rotary_emb itself; ours goes second so that
        # layer-typed rotaries (Gemma3) get the module's own layer type.
        with super().__call__(model), _hf.rotary_on_attention(model), _adapter.adapters_off(model):
            yield
        if scoped:  # kvpress decodes next: with the route's adapter on, until the scope ends
            _adapter.set_active(model, self._adapter)
