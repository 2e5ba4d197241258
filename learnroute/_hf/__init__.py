"""The only package that touches transformers internals.

Everything version-sensitive lives here, in four modules that can be read on their own:

- :mod:`~learnroute._hf.model`: where the decoder stack, layers and attention modules
  are, config fields, RoPE, the rotary embedding kvpress scorers expect;
- :mod:`~learnroute._hf.cache`: the prefill capture and caches assembled from kept
  keys/values (preallocated buffers), sliding-window layers;
- :mod:`~learnroute._hf.attention`: route-aware attention (per-layer cache lengths under
  sdpa and eager) and additive per-(layer, head) biases on the cached context;
- :mod:`~learnroute._hf.forward`: forwards over a cached prefix, among them
  :func:`forward_tokens`, the one grad-agnostic question/answer pass with optional
  biases that the profile, the engine and the gates' trainer share.

Every public name is re-exported here, so callers write ``_hf.name``.
"""

from learnroute._hf.attention import (
    ROUTED_PREFIX,
    _layer_mask,
    _set_attn,
    attention_bias,
    attn_implementation,
    is_routed,
    padded_keys,
    routed_attention,
    clear_press_padding,
    set_press_padding,
    switch_to_routed_attention,
)
from learnroute._hf.cache import (
    LayerCapture,
    _hidden_arg,
    _PreallocatedLayer,
    build_cache,
    cache_from_buffers,
    cache_windows,
    capture_prefill,
    keep_rows,
    local_attention_layers,
    windowed_layers,
)
from learnroute._hf.forward import fixed_layers, forward_from_layer, forward_tokens
from learnroute._hf.model import (
    SUPPORTED_MODEL_TYPES,
    apply_rope,
    attention_modules,
    decoder_layers,
    eos_token_ids,
    fingerprint,
    kv_heads,
    language_model,
    max_positions,
    model_type,
    quiet_loading,
    rotary_on_attention,
    text_config,
)

__all__ = [
    "ROUTED_PREFIX",
    "SUPPORTED_MODEL_TYPES",
    "LayerCapture",
    "_PreallocatedLayer",
    "_hidden_arg",
    "_layer_mask",
    "_set_attn",
    "apply_rope",
    "attention_bias",
    "attention_modules",
    "attn_implementation",
    "build_cache",
    "cache_from_buffers",
    "cache_windows",
    "capture_prefill",
    "decoder_layers",
    "eos_token_ids",
    "fingerprint",
    "kv_heads",
    "fixed_layers",
    "forward_from_layer",
    "forward_tokens",
    "is_routed",
    "keep_rows",
    "language_model",
    "local_attention_layers",
    "max_positions",
    "padded_keys",
    "model_type",
    "quiet_loading",
    "rotary_on_attention",
    "routed_attention",
    "clear_press_padding",
    "set_press_padding",
    "switch_to_routed_attention",
    "text_config",
    "windowed_layers",
]
