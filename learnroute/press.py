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
from learnroute.methods.base import Method, keep_indices, resolve_budget
from learnroute.methods.registry import get_method
from learnroute.route import Route


@dataclass
class RoutedPress(BasePress):
    """A kvpress press applying ``route``: layer l scores with its method, keeps its budget.

    Works in kvpress's pipeline on CPU with sdpa or eager. kvpress decodes *after* the
    press context has closed, so when layers keep different counts the model must run
    route-aware attention during the pipeline call::

        with learnroute.routed_attention(model):
            pipe(context, question=q, press=RoutedPress(route))

    (Uniform budgets need no wrapper.) Entering the press without it raises a clear error
    before any forward.
    """

    route: Route
    method_options: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._methods: dict[str, Method] = {
            name: get_method(name, **self.method_options.get(name, {})) for name in set(self.route.methods)
        }

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
        method = self._methods[entry.method]
        n = keys.shape[2]
        if self._local[module.layer_idx] or n < hidden_states.shape[1]:
            # Local sliding-window layers (Gemma3's) are left as they are, as kvpress does for
            # Gemma3, and so is any layer whose cache holds only a window of the context.
            return keys, values
        n_kept = n if method.keeps_all else resolve_budget(entry.budget, n)
        if n_kept >= n:
            return keys, values
        capture = _hf.LayerCapture(module, hidden_states, keys, values, kwargs["position_embeddings"])
        idx = keep_indices(method.score(capture, n_kept), n_kept)  # (B, H_kv, k)
        idx = idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])  # (B, H_kv, k, d)
        return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()

    @contextlib.contextmanager
    def __call__(self, model: PreTrainedModel) -> Generator:
        self.route.check_layers(len(_hf.attention_modules(model)))
        self._local = _hf.local_attention_layers(model)
        if (len(set(self.route.budgets)) > 1 or any(self._local)) and not _hf.is_routed(model):
            raise RuntimeError(
                "this route keeps different token counts per layer (or the model has local sliding-window "
                "layers, which keep their cache); kvpress decodes after the press "
                "context closes, so wrap the pipeline call in `with learnroute.routed_attention(model):` "
                "(or load the model with attn_implementation='learnroute_sdpa')"
            )
        # kvpress's context sets each module's rotary_emb itself; ours goes second so that
        # layer-typed rotaries (Gemma3) get the module's own layer type.
        with super().__call__(model), _hf.rotary_on_attention(model):
            yield
