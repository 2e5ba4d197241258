"""The one inference engine every route runs through, in rooms:

- :mod:`~learnroute.engine.prompt`: tokenizing a sample as kvpress's pipeline does;
- :mod:`~learnroute.engine.prefill`: the full-cache prefill and :class:`PrefillStore`, its
  reuse across stages (an explicit object handed to each engine);
- :mod:`~learnroute.engine.compress`: a batch's compressed cache from the kept positions;
- :mod:`~learnroute.engine.batching`: which routes decode together, parked rows' re-layout;
- :mod:`~learnroute.engine.decode`: the greedy decode loop;
- :mod:`~learnroute.engine.core`: :class:`Engine`, the façade that scores, selects and
  runs all of the above.
"""

from learnroute.engine.batching import pack_batches, padded_shape, row_lengths
from learnroute.engine.compress import HEAD_LAYOUTS
from learnroute.engine.core import Engine, RouteResult
from learnroute.engine.prefill import Prefill, PrefillStore, capture_bytes
from learnroute.engine.prompt import Prompt, build_prompt

__all__ = [
    "HEAD_LAYOUTS", "Engine", "Prefill", "PrefillStore", "Prompt", "RouteResult", "build_prompt", "capture_bytes",
    "pack_batches", "padded_shape", "row_lengths",
]
