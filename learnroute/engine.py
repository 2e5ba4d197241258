"""The one inference engine every route runs through.

Per sample: one full-cache prefill of the context that captures what the scorers need
per layer; scores for every method from that capture; then, for each route, a physically
compressed cache (layers keep different token counts) and greedy decoding of the
question with the original positions. Routes decode together in batches, so R routes
cost one prefill plus about R / batch decodes: rows whose per-layer kept counts differ
are padded to the batch's longest in each layer and the padding is masked
(:func:`pack_batches` bounds what padding may cost).

A route may name a decode-time LoRA adapter (:mod:`learnroute.adapter`): the prefill runs
with every adapter off (the cache is the base model's), the route's question and answer
tokens with its adapter on. A batch holds routes of one adapter.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from learnroute import _hf
from learnroute import adapter as _adapter
from learnroute.methods.base import Method
from learnroute.methods.select import active_components, keep_indices, kept_count, select, stack_heads
from learnroute.methods.registry import get_method
from learnroute.route import ADAKV_SAFEGUARD, Route


@dataclass
class Prompt:
    """Token ids of one sample, split at the compression point."""

    context_ids: torch.Tensor  # (1, n): what the prefill sees (and compression cuts)
    question_ids: torch.Tensor  # (1, q): decoded after compression, positions n..n+q-1


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str,
    answer_prefix: str = "",
    query_aware: bool = False,
    chat: bool = True,
) -> Prompt:
    """Tokenize like kvpress's ``kv-press-text-generation`` pipeline.

    With a chat template, context and question form one user turn; the context part
    (template prefix + context) is prefilled, the rest (question, end of turn, assistant
    header, answer prefix) is decoded after compression. Query-aware puts the question
    in the prefill too, so scoring windows see it (SnapKV/PyramidKV harnesses).
    ``chat=False`` skips the chat template (LongBench's few-shot and code tasks).
    """
    if query_aware:
        context, question = context + question, ""
    if tokenizer.chat_template is None or not chat:
        context = (tokenizer.bos_token or "") + context
        # kvpress's pipeline ends a template-less question with a newline; a raw prompt
        # (chat=False, e.g. LongBench's few-shot and code tasks) is used exactly as given.
        suffix = "\n" if chat else ""
    else:
        separator = "#" * (len(context) + 10)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + separator}], add_generation_prompt=True, tokenize=False
        )
        context, suffix = text.split(separator)
    question = question + suffix + answer_prefix
    ctx = tokenizer.encode(context, return_tensors="pt", add_special_tokens=False)  # (1, n)
    qst = tokenizer.encode(question, return_tensors="pt", add_special_tokens=False)  # (1, q)
    return Prompt(ctx, qst)


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


# ---------------------------------------------------------------------------- prefills shared across stages


@dataclass
class SharedPrefills:
    """Prefills kept for reuse inside one :func:`shared_prefills` block, and what it did.

    Entries are keyed by the model (:func:`learnroute._hf.fingerprint`), the engine's
    ``method_options`` (scores depend on them) and the context's token ids, and hold the
    captures without their modules (a hit is bound to the asking engine's model), plus the
    method scores and kept indices computed from them so far (shared: a later stage reuses
    them too). ``max_bytes`` caps the captures kept (keys, values, attention inputs, RoPE);
    the scores add about 3 % on top.
    """

    max_bytes: int
    entries: dict[tuple, Prefill] = field(default_factory=dict)
    bytes: int = 0
    hits: int = 0  # prefills served from the block
    made: int = 0  # prefills run inside the block

    @property
    def not_kept(self) -> int:
        """Prefills made but not kept: the cap was reached (every miss is made once)."""
        return self.made - len(self.entries)

    def summary(self) -> str:
        return (f"prefills reused {self.hits}, made {self.made} ({self.not_kept} not kept: cap), "
                f"{self.bytes / 2**30:.2f} GiB kept")


_SHARED_PREFILLS: SharedPrefills | None = None


@contextlib.contextmanager
def shared_prefills(max_bytes: int):
    """Inside the block, an :class:`Engine` prefills each context once: a second prefill of
    the same tokens by the same model returns the first (and every score computed from it),
    whichever engine, run or stage asks. A study's stages go over the same samples (the
    profile and training over the calibration set; the bench, its controls and the
    placement over the eval set), and on CPUs the prefill and the scores are most of a
    bench cell's cost. Everything kept is released when the outermost block exits.
    Yields the :class:`SharedPrefills` (its counts); ``max_bytes`` 0 keeps nothing."""
    global _SHARED_PREFILLS
    outer = _SHARED_PREFILLS
    if outer is None:
        _SHARED_PREFILLS = SharedPrefills(int(max_bytes))
    try:
        yield _SHARED_PREFILLS
    finally:
        _SHARED_PREFILLS = outer


def _rebound(prefill: Prefill, prompt: Prompt, modules: list) -> Prefill:
    """``prefill`` with ``prompt`` and its captures bound to ``modules`` (None: to no model);
    the scores and indices dicts stay shared with it."""
    layers = [replace(cap, module=m) for cap, m in zip(prefill.layers, modules, strict=True)]
    return Prefill(prompt, layers, prefill.seconds, prefill._scores, prefill._indices)


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
class RouteResult:
    """What one route produced on one sample."""

    route: Route
    answer: str
    token_ids: list[int]
    kept_per_layer: list[int]  # tokens kept per KV head, per layer (per-head layers: their most-keeping head)
    kv_bytes: int  # bytes of keys + values kept for the context (what the route asks for)
    full_kv_bytes: int
    first_logits: torch.Tensor | None = None  # (vocab,) logits of the first answer token
    seconds: float = 0.0  # this route's share of the batched decode
    kept_per_head: list[tuple[int, ...]] | None = None  # per layer, per KV head (per-head routes)
    allocated_kv_bytes: int | None = None  # bytes the route's own cache occupies (padded heads: with their padding)

    @property
    def kv_fraction(self) -> float:
        return self.kv_bytes / self.full_kv_bytes


def padded_shape(shapes: list[list[int]]) -> list[int]:
    """Per layer, the most tokens any of ``shapes`` (kept counts per layer) keeps there."""
    return [max(per_layer) for per_layer in zip(*shapes)]


def row_lengths(per_row: list[int] | tuple[int, ...], device) -> torch.Tensor | None:
    """One layer's kept tokens per batch row as a (R,) tensor for the padding mask, or None
    when every row keeps the same number (no padding in that layer)."""
    if min(per_row) == max(per_row):
        return None
    return torch.tensor(per_row, dtype=torch.long, device=device)  # (R,)


def pack_batches(shapes: list[list[int]], max_batch: int, max_padding: float) -> list[list[int]]:
    """Group routes (their kept counts per layer, ``shapes``) into decode batches.

    Batching is what makes many routes cheap: on 2 CPU cores a greedy step of SmolLM2-135M
    costs about 50 ms for one row and 163 ms for 32 (``benchmarks/cpu_floor.py``). Routes are
    taken in order of total kept tokens (identical shapes next to each other); a batch
    closes at ``max_batch`` rows, or before a route that would make the batch's padded
    cache (per layer, the longest row) more than ``max_padding`` times its smallest
    route's. ``max_padding=1`` batches identical shapes only. Returns indices of
    ``shapes``, one list per batch.
    """
    if max_padding < 1:
        raise ValueError(f"max_padding must be >= 1, got {max_padding}")
    order = sorted(range(len(shapes)), key=lambda i: (sum(shapes[i]), shapes[i]))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_batch:
            batch = batches[-1]
            smallest = min(sum(shapes[j]) for j in batch)
            if sum(padded_shape([shapes[j] for j in batch] + [shapes[i]])) <= max_padding * smallest:
                batch.append(i)
                continue
        batches.append([i])
    return batches


HEAD_LAYOUTS = ("split", "padded")


class Engine:
    """Prefill once, score all methods, compress to any route, decode in batches.

    Parameters: ``max_new_tokens`` caps each answer; ``query_aware`` puts the question in
    the prefill; ``max_batch`` caps how many routes decode together;
    ``method_options`` passes constructor arguments per method name
    (e.g. ``{"snapkv": {"window_size": 32}}``); ``max_padding`` lets routes of different
    kept counts decode together when padding them costs at most that factor in cache size
    (:func:`pack_batches`; 1 = identical shapes only); ``park_after``: when routes need
    several batches, answers still unfinished after that many tokens are set aside and
    finished together in fresh batches (None: every batch decodes to its end);
    ``head_layout``: how a layer whose KV heads keep different counts (per-head routes) is
    laid out for decoding: ``"split"`` (default), each head in a buffer of its own length and
    attention once per KV head, so a route allocates exactly what it keeps; ``"padded"``, one
    (R, H_kv, n, d) tensor padded to the layer's longest head, the padding masked (one
    attention call per layer; allocates up to H_kv times what the layer keeps).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_new_tokens: int = 50,
        query_aware: bool = False,
        max_batch: int = 32,
        method_options: dict[str, dict] | None = None,
        max_padding: float = 4.0,
        park_after: int | None = 12,
        head_layout: str = "split",
    ) -> None:
        if head_layout not in HEAD_LAYOUTS:
            raise ValueError(f"head_layout must be one of {', '.join(HEAD_LAYOUTS)}, got {head_layout!r}")
        if max_padding < 1:
            raise ValueError(f"max_padding must be >= 1 (1 = batch identical shapes only), got {max_padding}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if park_after is not None and park_after < 1:
            raise ValueError(f"park_after must be >= 1 or None, got {park_after}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.query_aware = query_aware
        self.max_batch = max_batch
        self.max_padding = max_padding
        self.park_after = park_after
        self.head_layout = head_layout
        self.method_options = method_options or {}
        self._methods: dict[str, Method] = {}
        self._adapters: dict[Path, _adapter.Adapter] = {}
        self.n_layers = len(_hf.attention_modules(model))
        self.n_kv_heads = _hf.kv_heads(model)
        self._local = _hf.local_attention_layers(model)  # never compressed (Gemma3's local layers)
        # Parked rows are re-laid out from plain buffers, which sliding-window caches are not.
        self._windowed = any(_hf.windowed_layers(model))

    # ------------------------------------------------------------------ set-up

    def method(self, name: str) -> Method:
        if name not in self._methods:
            self._methods[name] = get_method(name, **self.method_options.get(name, {}))
        return self._methods[name]

    def adapter(self, route: Route) -> _adapter.Adapter | None:
        """The route's adapter (None without one), loaded once and checked against the model."""
        if route.adapter_path is None:
            return None
        key = route.adapter_path.resolve()
        if key not in self._adapters:
            from learnroute.models import model_name

            found = _adapter.Adapter.load(route.adapter_path)
            found.check(self.model, model_name(self.model))
            self._adapters[key] = found
        return self._adapters[key]

    def check_routes(self, routes: list[Route], n_tokens: int | None = None) -> None:
        """Validate routes against the model (and a context length) before any forward;
        adapters named by routes are loaded and checked against the model."""
        if not routes:
            raise ValueError("no routes to evaluate")
        for route in routes:
            route.check_layers(self.n_layers)
            route.check_heads(self.n_kv_heads)
            self.adapter(route)
            if n_tokens is None:
                continue
            for name in {m for e in route.layers for m in e.methods}:
                need = self.method(name).min_context()
                if n_tokens < need:
                    raise ValueError(f"method {name!r} needs a context of at least {need} tokens, got {n_tokens}")

    def encode(
        self,
        context: str,
        question: str,
        answer_prefix: str = "",
        *,
        chat: bool = True,
        max_new_tokens: int | None = None,
    ) -> Prompt:
        """Tokenize one sample and check it fits the model, before any forward."""
        if not context or not context.strip():
            raise ValueError("empty context: there is nothing to prefill or compress")
        prompt = build_prompt(self.tokenizer, context, question, answer_prefix, self.query_aware, chat=chat)
        max_new_tokens = max_new_tokens or self.max_new_tokens
        total = prompt.context_ids.shape[1] + prompt.question_ids.shape[1] + max_new_tokens
        limit = _hf.max_positions(self.model)
        if total > limit:
            raise ValueError(
                f"context ({prompt.context_ids.shape[1]} tokens) + question ({prompt.question_ids.shape[1]}) "
                f"+ max_new_tokens ({max_new_tokens}) = {total} exceeds the model's maximum position {limit}"
            )
        if prompt.question_ids.shape[1] == 0:
            raise ValueError("the question part is empty: nothing to decode from")
        return prompt

    # ------------------------------------------------------------------ prefill and scores

    def prefill(self, prompt: Prompt) -> Prefill:
        """One full-cache forward over the context, capturing every layer (inside
        :func:`shared_prefills`, a context prefilled before is served from there).
        ``seconds`` is what the prefill took when it was made."""
        shared = _SHARED_PREFILLS
        if shared is not None:
            ids = tuple(prompt.context_ids[0].tolist())
            key = (_hf.fingerprint(self.model), repr(sorted(self.method_options.items())), ids)
            if (kept := shared.entries.get(key)) is not None:
                shared.hits += 1
                # The asking engine's prompt (the question may differ) and its model's modules
                # (scorers project with them).
                return _rebound(kept, prompt, _hf.attention_modules(self.model))
        start = time.perf_counter()
        with _adapter.adapters_off(self.model):  # the cache is the base model's, whatever is attached
            layers = _hf.capture_prefill(self.model, prompt.context_ids.to(self.model.device))
        made = Prefill(prompt, layers, time.perf_counter() - start)
        if shared is not None:
            shared.made += 1
            size = capture_bytes(layers)
            # Keep the first ones that fit rather than the most recent: the stages go over
            # the same samples in the same order, and evicting the oldest would evict exactly
            # what the next stage asks for first.
            if shared.bytes + size <= shared.max_bytes:
                shared.bytes += size
                # Bound to no module: the block keeps no model alive.
                shared.entries[key] = _rebound(made, prompt, [None] * len(layers))
        return made

    @torch.no_grad()
    def scores(self, prefill: Prefill, layer: int, method: str, n_kept: int | None = None) -> torch.Tensor:
        """Scores (1, H_kv, n) of ``method`` at ``layer`` (cached per prefill)."""
        m = self.method(method)
        key = (layer, method, n_kept if m.budget_dependent else None)
        if key not in prefill._scores:
            # Scorers may run the model's projections (SnapKV's window queries): always the
            # base model's, even when scores are first needed inside an adapter's decode batch.
            with _hf.rotary_on_attention(self.model), _adapter.adapters_off(self.model):
                prefill._scores[key] = m.score(prefill.layers[layer], n_kept).float()
        return prefill._scores[key]

    def kept_indices(
        self, prefill: Prefill, layer: int, method: str, n_kept: int, mixture: tuple[tuple[str, float], ...] | None = None
    ) -> torch.Tensor:
        """Positions (1, H_kv, n_kept) kept by ``method`` at ``layer`` (cached per prefill).

        With ``mixture`` ((method, weight), ...), the top-k of the mixed ranks of those
        methods' scores (:func:`learnroute.methods.mixing.mixed_scores`) instead.
        """
        n = prefill.layer_tokens[layer]
        active = active_components(method, mixture)
        if len(active) == 1:  # one component: that method's own selection, cached as such
            method, mixture = active[0][0], None
        if mixture is None and self.method(method).keeps_all:
            n_kept = n
        key = (layer, method if mixture is None else tuple(mixture), n_kept)
        if key not in prefill._indices:
            idx = select(method, mixture, n_kept, n, lambda m: self.scores(prefill, layer, m, n_kept))
            if idx is None:  # the layer keeps everything
                ref = prefill.layers[layer].keys
                idx = torch.arange(n, device=ref.device).expand(ref.shape[0], ref.shape[1], n)  # (1, H_kv, n)
            prefill._indices[key] = idx
        return prefill._indices[key]

    def is_fixed(self, layer: int, held: int, n_tokens: int) -> bool:
        """Does no route compress ``layer``? So for local sliding-window layers (Gemma3's)
        and for a layer whose cache holds ``held`` < ``n_tokens`` context tokens (a window
        shorter than the context)."""
        return self._local[layer] or held < n_tokens

    def kept_counts(
        self, route: Route, n_tokens: int, layer_tokens: list[int] | None = None, prefill: Prefill | None = None
    ) -> list[int]:
        """Tokens kept per KV head in each layer for a context of ``n_tokens``.

        Local sliding-window layers (Gemma3's) are not compressed, whatever the route says,
        as kvpress does for Gemma3: they keep what their cache holds after the prefill,
        ``layer_tokens`` (:attr:`Prefill.layer_tokens`; their window, when the context is
        longer). So does any layer whose cache holds fewer tokens than the context.
        """
        return [max(heads) for heads in self.kept_head_counts(route, n_tokens, layer_tokens, prefill)]

    def kept_head_counts(
        self, route: Route, n_tokens: int, layer_tokens: list[int] | None = None, prefill: Prefill | None = None
    ) -> list[tuple[int, ...]]:
        """Tokens kept by each KV head in each layer (:meth:`kept_counts`, per head): the
        heads of a per-head layer keep their own budgets; the heads of a layer that shares
        its budget (``share="adakv"``) split it by the sample's scores, so ``prefill`` is
        needed then."""
        counts = []
        for layer, e in enumerate(route.layers):
            held = n_tokens if layer_tokens is None else layer_tokens[layer]
            fixed = self.is_fixed(layer, held, n_tokens)
            heads = tuple(
                kept_count(h.budget, n_tokens, keeps_all=self.method(h.method).keeps_all, fixed=fixed, held=held)
                for h in e.head_entries(self.n_kv_heads)
            )
            if e.share is not None and heads[0] < n_tokens:
                if prefill is None:
                    raise ValueError(f"layer {layer} shares its budget across heads by the sample's scores "
                                     f"(share={e.share!r}): its per-head counts need the prefill")
                heads = self._adakv_counts(prefill, layer, e.method, heads[0])
            counts.append(heads)
        return counts

    def _adakv_counts(self, prefill: Prefill, layer: int, method: str, n_kept: int) -> tuple[int, ...]:
        """Ada-KV's split of ``H_kv x n_kept`` tokens over a layer's KV heads (kvpress's
        AdaKVPress): each head's best ``max(1, int(n_kept x ADAKV_SAFEGUARD))`` positions
        first, then the top scores over all heads. Ties go to the later (head, position), as
        :func:`learnroute.methods.select.keep_indices` breaks them within a head, so each head
        keeps exactly its own top-k of that method's scores."""
        scores = self.scores(prefill, layer, method, n_kept)  # (1, H_kv, n)
        _, h, n = scores.shape
        safe = max(1, int(n_kept * ADAKV_SAFEGUARD))
        forced = scores.clone().scatter_(-1, keep_indices(scores, safe), float("inf"))  # (1, H_kv, n)
        top = keep_indices(forced.reshape(1, 1, h * n), h * n_kept)  # (1, 1, H_kv * n_kept) flat positions
        return tuple(torch.bincount(top.flatten() // n, minlength=h).tolist())

    def compress(
        self, prefill: Prefill, routes: list[Route], counts: list[list[int]] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer kept keys/values for a batch of same-shape routes: (R, H_kv, k_l, d) each.

        ``counts`` (per route, per layer) skips recomputing :meth:`kept_counts`. A per-head
        route whose heads keep different counts is refused: plain tensors cannot say which
        slots are padding (:meth:`answer` decodes it with the padding masked).
        """
        if counts is None:
            heads = [self.kept_head_counts(r, prefill.n_tokens, prefill.layer_tokens, prefill) for r in routes]
        else:
            heads = [[(k,) * self.n_kv_heads for k in c] for c in counts]
        if any(min(c) != max(c) for per_route in heads for c in per_route) or (
            counts is not None and any(r.is_per_head for r in routes)
        ):
            raise ValueError("compress: a per-head route whose heads keep different counts has padded heads; "
                             "decode it with Engine.answer, which masks the padding")
        return self._kept_kv(prefill, routes, heads)

    def _kept_kv(
        self,
        prefill: Prefill,
        routes: list[Route],
        heads: list[list[tuple[int, ...]]],
        extra: int = 0,
        workspace: torch.Tensor | None = None,
        split: list[bool] | None = None,
    ) -> list[tuple]:
        """Per layer (R, H_kv, k_l + extra, d) keys and values whose first slots hold each
        route's kept tokens, per KV head (``heads``: per route, per layer, per head; k_l: the
        most any route's head keeps there; a head that keeps fewer leaves padding after its
        own); carved one after another from ``workspace`` if given. A layer marked in
        ``split`` comes as lists of per-head (R, 1, k_lh + extra, d) buffers instead
        (k_lh: the most any route keeps in head h there; see :meth:`_split_kv`)."""
        offset, kv = 0, []
        for layer in range(len(prefill.layers)):
            out = None if workspace is None else workspace[offset:]
            if split is not None and split[layer]:
                k, v = self._split_kv(prefill, routes, heads, layer, extra, out)
                offset += sum(t.numel() for t in (*k, *v))
                kv.append((k, v))
                continue
            longest = max(max(c[layer]) for c in heads)
            k, v = self._empty_kv(prefill, layer, len(routes), longest + extra, out)
            offset += k.numel() + v.numel()
            self._gather_into(prefill, routes, heads, layer, k, v)
            kv.append((k, v))
        return kv

    def _split_kv(
        self, prefill: Prefill, routes: list[Route], heads: list[list[tuple[int, ...]]], layer: int, extra: int,
        out: torch.Tensor | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One layer's kept keys and values per KV head: head h's (R, 1, k_h + extra, d)
        buffers hold each route's kept tokens of that head first (k_h: the most any route
        keeps in head h; a route keeping fewer leaves padding after its own, position 0
        copies, as in :meth:`_gather_into`); carved one after another from ``out``."""
        cap = prefill.layers[layer]
        _, h, n, d = cap.keys.shape
        dv = cap.values.shape[-1]
        parts = [self._layer_indices(prefill, route, layer, kept[layer]) for route, kept in zip(routes, heads)]
        # (1, H_kv, max(kept)) each; head j's row holds its own positions, then position 0
        r, offset, ks, vs = len(routes), 0, [], []
        for j in range(h):
            longest = max(kept[layer][j] for kept in heads)
            idx = torch.cat([
                torch.nn.functional.pad(p[:, j : j + 1, :longest], (0, max(0, longest - p.shape[-1]))) for p in parts
            ])  # (R, 1, k_j)
            k, v = self._empty_kv(prefill, layer, r, longest + extra, None if out is None else out[offset:], 1)
            offset += k.numel() + v.numel()
            keys, values = cap.keys[:, j : j + 1], cap.values[:, j : j + 1]  # (1, 1, n, d)
            torch.gather(keys.expand(r, 1, n, d), 2, idx.unsqueeze(-1).expand(-1, -1, -1, d), out=k[:, :, :longest])
            torch.gather(values.expand(r, 1, n, dv), 2, idx.unsqueeze(-1).expand(-1, -1, -1, dv), out=v[:, :, :longest])
            ks.append(k)
            vs.append(v)
        return ks, vs

    def _empty_kv(
        self, prefill: Prefill, layer: int, rows: int, length: int, out: torch.Tensor | None = None,
        n_heads: int | None = None,
    ):
        """Uninitialised (rows, n_heads, length, d) keys and values (n_heads: H_kv unless
        given), carved from ``out`` if given."""
        cap = prefill.layers[layer]
        _, h, _, d = cap.keys.shape
        h = h if n_heads is None else n_heads
        dv = cap.values.shape[-1]
        if out is None:
            return cap.keys.new_empty(rows, h, length, d), cap.values.new_empty(rows, h, length, dv)
        k = out[: rows * h * length * d].view(rows, h, length, d)  # (R, H_kv, length, d)
        v = out[rows * h * length * d : rows * h * length * (d + dv)].view(rows, h, length, dv)
        return k, v

    def _layer_indices(self, prefill: Prefill, route: Route, layer: int, kept: tuple[int, ...]) -> torch.Tensor:
        """Kept positions (1, H_kv, max(kept)) of one route at ``layer``; a per-head layer's
        heads select on their own (each head's own method and count: its row of that
        method's selection at that count), the shorter padded with position 0."""
        entry = route.layers[layer]
        if min(kept) == max(kept) and entry.heads is None:
            return self.kept_indices(prefill, layer, entry.method, kept[0], entry.mixture)  # (1, H_kv, k)
        heads = entry.head_entries(len(kept))
        picks = [self.kept_indices(prefill, layer, x.method, k, x.mixture) for x, k in zip(heads, kept)]  # (1, H_kv, k_h)
        return stack_heads(picks, kept)  # (1, H_kv, max(kept))

    def _gather_into(
        self, prefill: Prefill, routes: list[Route], heads: list[list[tuple[int, ...]]], layer: int,
        k: torch.Tensor, v: torch.Tensor,
    ) -> None:
        """Write each route's kept keys/values at ``layer`` into the first slots of ``k``/``v``.

        A route (or KV head) that keeps fewer tokens than the longest gets copies of
        position 0 in its padding slots: any real key would do, attention never sees them.
        """
        cap = prefill.layers[layer]
        _, h, n, d = cap.keys.shape
        parts = [self._layer_indices(prefill, route, layer, kept[layer]) for route, kept in zip(routes, heads)]
        # (1, H_kv, k_r) each
        longest = max(p.shape[-1] for p in parts)
        idx = torch.cat([
            p if p.shape[-1] == longest else torch.nn.functional.pad(p, (0, longest - p.shape[-1]))
            for p in parts
        ])  # (R, H_kv, k_l)
        r, kept = len(routes), idx.shape[-1]
        # One gather per layer for the whole batch, from the shared (1, ...) capture, written
        # straight into the destination.
        torch.gather(cap.keys.expand(r, h, n, d), 2, idx.unsqueeze(-1).expand(-1, -1, -1, d), out=k[:, :, :kept])
        dv = cap.values.shape[-1]
        torch.gather(cap.values.expand(r, h, n, dv), 2, idx.unsqueeze(-1).expand(-1, -1, -1, dv), out=v[:, :, :kept])

    def _decode_cache(self, prefill: Prefill, routes: list[Route], heads: list[list[tuple[int, ...]]], extra: int,
                      workspace):
        """A cache for ``routes`` (kept ``heads`` per route, per layer, per KV head) with room
        for ``extra`` tokens per layer; where routes (or a route's heads) keep different counts
        in a layer, its rows are padded to the longest and the padding is recorded for
        masking: per row, or per (row, KV head) where a row's heads differ.

        Buffers are carved from ``workspace`` (a flat tensor reused by every batch of one
        :meth:`answer` call: fresh multi-MB allocations page-fault, which on a CPU VM can
        cost more than filling them).
        """
        split = self._split_layers(heads)
        buffers = self._kept_kv(prefill, routes, heads, extra, workspace, split)
        lengths, valid = [], []
        for layer, per_row in enumerate(zip(*heads)):  # one layer's head counts per route
            if all(min(c) == max(c) for c in per_row):
                valid.append(row_lengths([c[0] for c in per_row], self.model.device))
            else:
                valid.append(torch.tensor(per_row, dtype=torch.long, device=self.model.device))  # (R, H_kv)
            lengths.append([max(col) for col in zip(*per_row)] if split[layer] else max(map(max, per_row)))
        return _hf.cache_from_buffers(self.model, buffers, lengths, valid)

    def _split_layers(self, heads: list[list[tuple[int, ...]]]) -> list[bool]:
        """Per layer: are its KV heads laid out apart for this batch (``heads``: per route,
        per layer, per head)? Under ``head_layout="split"``, where some route's heads keep
        different counts."""
        if self.head_layout != "split":
            return [False] * len(heads[0])
        return [any(min(c) != max(c) for c in per_row) for per_row in zip(*heads)]

    def _slots(self, heads: list[list[tuple[int, ...]]], extra: int) -> int:
        """Token slots per KV head and row that :meth:`_decode_cache` carves for a batch
        (``heads``: per route, per layer, per head), over all layers."""
        total = 0
        for split, per_row in zip(self._split_layers(heads), zip(*heads)):
            if split:
                total += sum(max(col) + extra for col in zip(*per_row))
            else:
                total += len(per_row[0]) * (max(map(max, per_row)) + extra)
        return total

    # ------------------------------------------------------------------ decode

    def _stops(self, stop_token_ids: tuple[int, ...]) -> torch.Tensor:
        """Token ids that end an answer: the model's EOS and ``stop_token_ids``."""
        ids = [*_hf.eos_token_ids(self.model), *stop_token_ids]
        return torch.tensor(ids, dtype=torch.long, device=self.model.device)

    @staticmethod
    def _greedy(logits: torch.Tensor, produced: int, stops: torch.Tensor, min_new_tokens: int) -> torch.Tensor:
        """The next token per row (R, vocab) -> (R,); stop tokens are barred until
        ``min_new_tokens`` tokens exist (transformers' ``min_new_tokens``)."""
        if produced < min_new_tokens and len(stops):
            logits = logits.index_fill(-1, stops, float("-inf"))
        return logits.argmax(-1)

    @torch.no_grad()
    def _decode(
        self,
        cache,
        question_ids: torch.Tensor,
        n_ctx: int,
        n_rows: int,
        max_new_tokens: int,
        stop_token_ids: tuple[int, ...] = (),
        min_new_tokens: int = 0,
        park_after: int | None = None,
        done_if: Callable[[int, list[int]], bool] | None = None,
    ):
        """Greedy decoding for ``n_rows`` rows sharing one question; original positions.

        Returns (tokens per row, first-token logits (R, vocab), parked): with
        ``park_after``, rows still unfinished once that many tokens exist are handed back
        as (row, next token, keys/values per layer without padding) for :meth:`_resume`.
        """
        device = self.model.device
        q = question_ids.shape[1]
        ids = question_ids.to(device).expand(n_rows, q)  # (R, q)
        pos = torch.arange(n_ctx, n_ctx + q, device=device).unsqueeze(0).expand(n_rows, q)  # (R, q)
        stops = self._stops(stop_token_ids)
        with _hf.padded_keys(self.model, cache):  # also route-aware attention
            first_logits = _hf.forward_tokens(self.model, cache, ids, pos, keep=1)[:, -1].float()  # (R, vocab)
            nxt = self._greedy(first_logits, 0, stops, min_new_tokens)  # (R,)
            rows, left = self._steps(
                cache, nxt, n_ctx + q, max_new_tokens, stops, min_new_tokens, park_after, done_if=done_if
            )
        parked = None
        if left is not None:
            rows_left, nxt_left, batch_rows = left
            parked = list(zip(rows_left.tolist(), nxt_left.tolist(), self._unpadded_rows(cache, batch_rows)))
        return rows, first_logits, parked

    def _steps(
        self,
        cache,
        nxt: torch.Tensor,
        next_pos: int,
        max_new_tokens: int,
        stops: torch.Tensor,
        min_new_tokens: int,
        park_after: int | None = None,
        produced: int = 0,
        done_if: Callable[[int, list[int]], bool] | None = None,
    ):
        """Greedy steps from ``nxt`` (R,), the tokens just chosen, the ``produced + 1``-th of
        each row, fed at position ``next_pos``. A row also ends once ``done_if(row, its new
        tokens)`` is true.

        Rows that have produced a stop token leave the batch (their cache rows are
        dropped), so a batch costs what its unfinished rows cost. Returns (new tokens per
        row, None), or with ``park_after``, once that many tokens exist and some rows are
        unfinished: (tokens so far, (their rows, their next tokens, their batch rows)).
        """
        device = self.model.device
        n_rows = len(nxt)
        rows: list[list[int]] = [[] for _ in range(n_rows)]
        alive = torch.arange(n_rows, device=device)  # original row of each batch row
        done = torch.zeros(n_rows, dtype=torch.bool, device=device)  # batch rows that have produced a stop
        while True:
            for row, tok, finished in zip(alive.tolist(), nxt.tolist(), done.tolist()):
                if not finished:
                    rows[row].append(tok)  # up to and including EOS, as kvpress does
            done |= torch.isin(nxt, stops)
            if done_if is not None:
                for j, (row, finished) in enumerate(zip(alive.tolist(), done.tolist())):
                    if not finished and done_if(row, rows[row]):
                        done[j] = True
            produced += 1
            if produced >= max_new_tokens or bool(done.all()):
                return rows, None
            if park_after is not None and produced >= park_after:
                keep = (~done).nonzero().squeeze(1)  # (R_left,)
                return rows, (alive[keep], nxt[keep], keep)
            # Dropping finished rows copies every unfinished row's cache; that pays off
            # only once enough rows have finished (their tokens are ignored until then).
            if 2 * int(done.sum()) >= len(alive):
                keep = ~done
                _hf.keep_rows(cache, keep.nonzero().squeeze(1))
                alive, nxt, done = alive[keep], nxt[keep], done[keep]
            step_pos = torch.full((len(alive), 1), next_pos, dtype=torch.long, device=device)  # (R_alive, 1)
            out = self.model(input_ids=nxt.unsqueeze(1), past_key_values=cache, position_ids=step_pos)
            nxt = self._greedy(out.logits[:, -1], produced, stops, min_new_tokens)
            next_pos += 1

    @staticmethod
    def _unpadded_rows(cache, batch_rows: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per batch row, per layer, its keys/values (H_kv, n_l, d) without padding: its own
        context tokens, then the question and answer tokens. Copies (the batch's buffers
        are reused by the next batch)."""
        out = []
        for j in batch_rows.tolist():
            per_layer = []
            for layer in cache.layers:
                k, v = layer.keys[j], layer.values[j]  # (H_kv, L, d)
                valid = getattr(layer, "valid", None)
                if valid is not None:  # [own tokens | padding | new tokens] -> [own | new]
                    own, end = int(valid[j]), layer.pad_end
                    k = torch.cat([k[:, :own], k[:, end:]], dim=1)  # (H_kv, own + new, d)
                    v = torch.cat([v[:, :own], v[:, end:]], dim=1)
                else:
                    k, v = k.clone(), v.clone()
                per_layer.append((k, v))
            out.append(per_layer)
        return out

    @torch.no_grad()
    def _resume(
        self,
        parked: list[tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]],
        next_pos: int,
        produced: int,
        max_new_tokens: int,
        stops: torch.Tensor,
        min_new_tokens: int,
        done_if: Callable[[int, list[int]], bool] | None = None,
    ) -> list[list[int]]:
        """Go on decoding parked rows (from any batches, same question, ``produced`` tokens
        each, next fed at ``next_pos``) in new batches; their new tokens, in order.
        ``done_if(parked row, its new tokens)`` ends a row early."""
        shapes = [[k.shape[1] for k, _ in kv] for _, _, kv in parked]
        extra = max_new_tokens - produced  # tokens each row may still feed
        tokens: list[list[int]] = [[] for _ in parked]
        for batch in pack_batches(shapes, self.max_batch, self.max_padding):
            longest = padded_shape([shapes[i] for i in batch])
            buffers, valid = [], []
            for layer, n in enumerate(longest):
                k0, v0 = parked[batch[0]][2][layer]
                # Zeros, not garbage: a masked key still enters q.k, and a NaN there would
                # survive the mask (NaN + -inf is NaN).
                kb = k0.new_zeros(len(batch), k0.shape[0], n + extra, k0.shape[-1])  # (R, H_kv, n + extra, d)
                vb = v0.new_zeros(len(batch), v0.shape[0], n + extra, v0.shape[-1])
                for r, i in enumerate(batch):
                    k, v = parked[i][2][layer]
                    kb[r, :, : k.shape[1]] = k
                    vb[r, :, : v.shape[1]] = v
                buffers.append((kb, vb))
                own = [shapes[i][layer] for i in batch]
                valid.append(row_lengths(own, kb.device))
            cache = _hf.cache_from_buffers(self.model, buffers, longest, valid)
            nxt = torch.tensor([parked[i][1] for i in batch], dtype=torch.long, device=self.model.device)  # (R,)
            with _hf.padded_keys(self.model, cache):
                # The parked rows' last tokens are already in their answers: feed them first.
                step_pos = torch.full((len(batch), 1), next_pos, dtype=torch.long, device=nxt.device)  # (R, 1)
                out = self.model(input_ids=nxt.unsqueeze(1), past_key_values=cache, position_ids=step_pos)
                nxt = self._greedy(out.logits[:, -1], produced, stops, min_new_tokens)
                local = None if done_if is None else (lambda r, toks, batch=batch: done_if(batch[r], toks))
                rows, _ = self._steps(
                    cache, nxt, next_pos + 1, max_new_tokens, stops, min_new_tokens, None, produced, local
                )
            for i, toks in zip(batch, rows):
                tokens[i] = toks
        return tokens

    def answer(
        self,
        prefill: Prefill,
        routes: list[Route],
        keep_logits: bool = False,
        max_new_tokens: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
        min_new_tokens: int = 0,
        until: Callable[[str], bool] | None = None,
    ) -> list[RouteResult]:
        """Decode the question under every route; routes of similar kept counts share a batch
        (:func:`pack_batches`: padded to the longest per layer, padding masked).

        ``until(answer so far)``: an answer also ends once this is true of its text (the
        bench: once its score can no longer change), which saves the steps of answers that
        would only ramble on.

        Per-sample options: ``max_new_tokens`` overrides the engine's cap (per-task
        limits); ``stop_token_ids`` end an answer like EOS does (kept in ``token_ids``);
        stop tokens and EOS cannot be chosen before ``min_new_tokens`` tokens (LongBench's
        samsum: stop at a newline, after at least one token).
        """
        self.check_routes(routes, prefill.n_tokens)
        n = prefill.n_tokens
        cap0 = prefill.layers[0]
        # Bytes of keys + values per kept token per layer; the full cache is what the prefill
        # left in every layer (a sliding-window layer holds its window only).
        per_row = cap0.keys.shape[1] * (cap0.keys.shape[-1] + cap0.values.shape[-1])  # elements per kept token
        per_token = per_row * cap0.keys.element_size()
        per_head_token = per_token // cap0.keys.shape[1]  # one KV head's key + value
        full_bytes = per_token * sum(prefill.layer_tokens)
        # Batches share the model's weights, so one adapter each; within an adapter, routes
        # of similar kept counts share a batch (pack_batches).
        by_adapter: dict[Path | None, list[int]] = defaultdict(list)
        adapters: dict[Path | None, _adapter.Adapter | None] = {}
        heads = [self.kept_head_counts(route, n, prefill.layer_tokens, prefill) for route in routes]
        counts = [[max(c) for c in per_route] for per_route in heads]  # what each route's cache holds per layer
        for i, route in enumerate(routes):
            found = self.adapter(route)
            key = None if found is None else route.adapter_path.resolve()
            adapters[key] = found
            by_adapter[key].append(i)
        batches = [
            (key, [members[j] for j in batch])
            for key, members in by_adapter.items()
            for batch in pack_batches([counts[i] for i in members], self.max_batch, self.max_padding)
        ]
        max_new = max_new_tokens or self.max_new_tokens
        q = prefill.prompt.question_ids.shape[1]
        extra = q + max_new  # tokens each layer's cache grows by
        per_slot = per_row // cap0.keys.shape[1]  # elements of one KV head's kept token
        workspace = cap0.keys.new_empty(max(len(b) * per_slot * self._slots([heads[i] for i in b], extra)
                                            for _, b in batches))
        # Park unfinished rows after park_after tokens and finish them together (see _resume):
        # a batch's last few long answers would otherwise step on alone, batch by batch.
        # Parked rows are re-laid out per row; rows whose heads keep different counts are not
        # (their per-head padding would have to travel with them): they decode in their batch.
        uneven = any(min(c) != max(c) for per_route in heads for c in per_route)
        park = self.park_after if len(batches) > 1 and not self._windowed and not uneven else None
        stop_ids = tuple(stop_token_ids)
        tokens: list[list[int]] = [[] for _ in routes]
        logits: list[torch.Tensor | None] = [None] * len(routes)
        seconds = [0.0] * len(routes)
        parked: dict[Path | None, list] = defaultdict(list)  # adapter -> [(route index, next token, kv)]

        def ended(toks: list[int]) -> bool:  # the text the answer will have, as below
            return until(self.tokenizer.decode(toks, skip_special_tokens=True))

        needed = [a for a in adapters.values() if a is not None]
        with _adapter.attached(self.model, needed) if needed else contextlib.nullcontext():
            for key, batch in batches:
                with _adapter.using(self.model, adapters[key]):
                    t0 = time.perf_counter()
                    cache = self._decode_cache(prefill, [routes[i] for i in batch], [heads[i] for i in batch],
                                               extra, workspace)
                    done_if = None if until is None else (lambda r, toks: ended(toks))
                    rows, first, left = self._decode(
                        cache, prefill.prompt.question_ids, n, len(batch), max_new, stop_ids, min_new_tokens, park,
                        done_if,
                    )
                    parked[key] += [(batch[row], tok, kv) for row, tok, kv in left or []]
                share = (time.perf_counter() - t0) / len(batch)
                for j, (i, toks) in enumerate(zip(batch, rows)):
                    tokens[i], seconds[i] = toks, share
                    logits[i] = first[j].clone() if keep_logits else None
            for key, items in parked.items():
                if not items:
                    continue
                with _adapter.using(self.model, adapters[key]):
                    t0 = time.perf_counter()
                    done_if = None if until is None else (lambda r, toks, items=items: ended(tokens[items[r][0]] + toks))
                    tails = self._resume(
                        items, n + q + park - 1, park, max_new, self._stops(stop_ids), min_new_tokens, done_if
                    )
                share = (time.perf_counter() - t0) / len(items)
                for (i, _, _), toks in zip(items, tails):
                    tokens[i] = tokens[i] + toks
                    seconds[i] += share
        return [
            RouteResult(
                route=route,
                answer=self.tokenizer.decode(tokens[i], skip_special_tokens=True),
                token_ids=tokens[i],
                kept_per_layer=counts[i],
                kv_bytes=per_head_token * sum(sum(c) for c in heads[i]),
                full_kv_bytes=full_bytes,
                first_logits=logits[i],
                seconds=seconds[i],
                kept_per_head=heads[i] if route.is_per_head else None,
                allocated_kv_bytes=(per_head_token * sum(sum(c) for c in heads[i]) if self.head_layout == "split"
                                    else per_token * sum(counts[i])),
            )
            for i, route in enumerate(routes)
        ]

    def run(
        self, context: str, question: str, routes: list[Route], answer_prefix: str = "", keep_logits: bool = False
    ) -> list[RouteResult]:
        """Encode, validate, prefill once and answer under every route."""
        prompt = self.encode(context, question, answer_prefix)
        self.check_routes(routes, prompt.context_ids.shape[1])
        return self.answer(self.prefill(prompt), routes, keep_logits=keep_logits)
