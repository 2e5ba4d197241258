"""The one inference engine every route runs through (:class:`Engine`, the public façade).

Per sample: one full-cache prefill of the context that captures what the scorers need
per layer (:mod:`~learnroute.engine.prefill`, reusable across stages through a
:class:`PrefillStore`); scores for every method from that capture; then, for each route, a
physically compressed cache (layers keep different token counts;
:mod:`~learnroute.engine.compress`) and greedy decoding of the question with the original
positions (:mod:`~learnroute.engine.decode`). Routes decode together in batches
(:mod:`~learnroute.engine.batching`), so R routes cost one prefill plus about R / batch
decodes: rows whose per-layer kept counts differ are padded to the batch's longest in each
layer and the padding is masked.

A route may name a decode-time LoRA adapter (:mod:`learnroute.adapter`): the prefill runs
with every adapter off (the cache is the base model's), the route's question and answer
tokens with its adapter on. A batch holds routes of one adapter.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from learnroute import _hf
from learnroute import adapter as _adapter
from learnroute.engine import compress as _compress
from learnroute.engine.batching import pack_batches
from learnroute.engine.compress import HEAD_LAYOUTS, Heads
from learnroute.engine.decode import greedy_decode, resume, stop_tokens
from learnroute.engine.prefill import Prefill, PrefillStore
from learnroute.engine.prompt import Prompt, build_prompt
from learnroute.methods.base import Method
from learnroute.methods.select import active_components, kept_count, keep_indices, select, stack_heads
from learnroute.methods.registry import get_method
from learnroute.route import ADAKV_SAFEGUARD, Route


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



@dataclass
class _Plan:
    """How one :meth:`Engine.answer` call decodes its routes."""

    heads: Heads  # per route, per layer, tokens kept by each KV head
    counts: list[list[int]]  # per route, per layer, the most any head keeps (what the cache holds)
    batches: list[tuple[Path | None, list[int]]]  # (adapter key, route indices) per decode batch
    adapters: dict[Path | None, _adapter.Adapter | None]
    max_new: int  # answer tokens at most
    extra: int  # tokens each layer's cache grows by (question + answer)
    workspace: torch.Tensor  # flat buffer every batch's cache is carved from
    park: int | None  # park rows unfinished after this many tokens (None: never)


@dataclass
class _Decoding:
    """What :meth:`Engine.answer` has decoded so far, per route."""

    stops: torch.Tensor  # token ids that end an answer
    min_new_tokens: int
    n: int  # routes
    ended: Callable[[list[int]], bool] | None = None  # ``until`` on an answer's tokens
    tokens: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor | None] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    parked: dict[Path | None, list] = field(default_factory=lambda: defaultdict(list))  # adapter -> parked rows
    resume_at: tuple[int, int] = (0, 0)  # (next position, tokens produced) of parked rows

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in range(self.n)]
        self.logits = [None] * self.n
        self.seconds = [0.0] * self.n


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
    attention call per layer; allocates up to H_kv times what the layer keeps);
    ``prefills``: a :class:`PrefillStore` shared with other engines (other stages, other
    model objects of the same weights), so that each context is prefilled once.
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
        prefills: PrefillStore | None = None,
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
        self.prefills = prefills
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
        """One full-cache forward over the context, capturing every layer; with a
        :class:`PrefillStore` (``prefills``), a context prefilled before by any engine sharing
        the store is served from there. ``seconds`` is what the prefill took when it was made."""
        store = self.prefills
        key = None if store is None else store.key(self.model, self.method_options, prompt)
        if store is not None and (kept := store.get(key, prompt, _hf.attention_modules(self.model))) is not None:
            return kept
        start = time.perf_counter()
        with _adapter.adapters_off(self.model):  # the cache is the base model's, whatever is attached
            layers = _hf.capture_prefill(self.model, prompt.context_ids.to(self.model.device))
        made = Prefill(prompt, layers, time.perf_counter() - start)
        if store is not None:
            store.add(key, made)
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
            if e.share is not None and min(heads) < n_tokens:
                if prefill is None:
                    raise ValueError(f"layer {layer} shares its budget across heads by the sample's scores "
                                     f"(share={e.share!r}): its per-head counts need the prefill")
                safeguard = ADAKV_SAFEGUARD if e.safeguard is None else e.safeguard
                heads = self._adakv_counts(prefill, layer, e.method, heads, safeguard)
            counts.append(heads)
        return counts

    def _adakv_counts(
        self, prefill: Prefill, layer: int, method: str, priors: tuple[int, ...], safeguard: float = ADAKV_SAFEGUARD
    ) -> tuple[int, ...]:
        """Ada-KV's split of ``sum(priors)`` tokens over a layer's KV heads (kvpress's
        AdaKVPress, where every prior is the layer's budget): head h's best
        ``max(1, int(priors[h] x safeguard))`` positions first, then the top scores over all
        heads. Ties go to the later (head, position), as
        :func:`learnroute.methods.select.keep_indices` breaks them within a head, so each head
        keeps exactly its own top-k of that method's scores."""
        scores = self.scores(prefill, layer, method, max(priors))  # (1, H_kv, n)
        _, h, n = scores.shape
        forced = scores.clone()  # (1, H_kv, n)
        for head, prior in enumerate(priors):  # a head's floor: its own top positions first
            safe = min(n, max(1, int(prior * safeguard)))
            forced[:, head].scatter_(-1, keep_indices(scores[:, head : head + 1], safe)[:, 0], float("inf"))
        top = keep_indices(forced.reshape(1, 1, h * n), min(h * n, sum(priors)))  # (1, 1, sum) flat positions
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
        return _compress.kept_kv(prefill, self._picks(prefill, routes, heads), heads)

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

    def _picks(self, prefill: Prefill, routes: list[Route], heads: Heads) -> _compress.Picks:
        """Kept positions of route ``r`` at ``layer`` (:meth:`_layer_indices`), for
        :mod:`~learnroute.engine.compress`."""
        return lambda r, layer: self._layer_indices(prefill, routes[r], layer, heads[r][layer])

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
        plan = self._plan(prefill, routes, max_new_tokens or self.max_new_tokens)
        out = _Decoding(stop_tokens(self.model, tuple(stop_token_ids)), min_new_tokens, len(routes))
        if until is not None:  # on the text the answer will have (as RouteResult.answer)
            out.ended = lambda toks: until(self.tokenizer.decode(toks, skip_special_tokens=True))
        needed = [a for a in plan.adapters.values() if a is not None]
        with _adapter.attached(self.model, needed) if needed else contextlib.nullcontext():
            for key, batch in plan.batches:
                with _adapter.using(self.model, plan.adapters[key]):
                    self._decode_batch(prefill, routes, plan, key, batch, out, keep_logits)
            for key, items in out.parked.items():
                with _adapter.using(self.model, plan.adapters[key]):
                    self._finish_parked(plan, items, out)
        return self._results(prefill, routes, plan, out)

    def _plan(self, prefill: Prefill, routes: list[Route], max_new: int) -> _Plan:
        """Kept counts, decode batches, the shared workspace and whether rows park."""
        heads = [self.kept_head_counts(route, prefill.n_tokens, prefill.layer_tokens, prefill) for route in routes]
        counts = [[max(c) for c in per_route] for per_route in heads]  # what each route's cache holds per layer
        # Batches share the model's weights, so one adapter each; within an adapter, routes
        # of similar kept counts share a batch (pack_batches).
        by_adapter: dict[Path | None, list[int]] = defaultdict(list)
        adapters: dict[Path | None, _adapter.Adapter | None] = {}
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
        extra = prefill.prompt.question_ids.shape[1] + max_new  # tokens each layer's cache grows by
        cap0 = prefill.layers[0]
        per_slot = cap0.keys.shape[-1] + cap0.values.shape[-1]  # elements of one KV head's kept token
        workspace = cap0.keys.new_empty(max(
            len(b) * per_slot * _compress.cache_slots([heads[i] for i in b], extra, self.head_layout)
            for _, b in batches
        ))
        # Park unfinished rows after park_after tokens and finish them together (see resume):
        # a batch's last few long answers would otherwise step on alone, batch by batch.
        # Parked rows are re-laid out per row; rows whose heads keep different counts are not
        # (their per-head padding would have to travel with them): they decode in their batch.
        uneven = any(min(c) != max(c) for per_route in heads for c in per_route)
        park = self.park_after if len(batches) > 1 and not self._windowed and not uneven else None
        return _Plan(heads, counts, batches, adapters, max_new, extra, workspace, park)

    def _decode_batch(
        self, prefill: Prefill, routes: list[Route], plan: _Plan, key, batch: list[int], out: _Decoding,
        keep_logits: bool,
    ) -> None:
        """Compress and decode one batch of routes (indices ``batch``) into ``out``; rows
        still unfinished after ``plan.park`` tokens are parked there."""
        t0 = time.perf_counter()
        members = [routes[i] for i in batch]
        heads = [plan.heads[i] for i in batch]
        cache = _compress.decode_cache(self.model, prefill, self._picks(prefill, members, heads), heads, plan.extra,
                                       plan.workspace, self.head_layout)
        q = prefill.prompt.question_ids.to(self.model.device)  # (1, q)
        done_if = None if out.ended is None else (lambda r, toks: out.ended(toks))
        got = greedy_decode(self.model, cache, q.expand(len(batch), q.shape[1]), prefill.n_tokens,
                            max_new_tokens=plan.max_new, stops=out.stops, min_new_tokens=out.min_new_tokens,
                            park_after=plan.park, done_if=done_if)
        out.parked[key] += [(batch[row], tok, kv) for row, tok, kv in got.parked]
        out.resume_at = (got.next_pos, got.produced) if got.parked else out.resume_at
        share = (time.perf_counter() - t0) / len(batch)
        for j, (i, toks) in enumerate(zip(batch, got.tokens)):
            out.tokens[i], out.seconds[i] = toks, share
            out.logits[i] = got.first_logits[j].clone() if keep_logits else None

    def _finish_parked(self, plan: _Plan, items: list, out: _Decoding) -> None:
        """Finish the parked rows of one adapter together (:func:`resume`)."""
        if not items:
            return
        t0 = time.perf_counter()
        done_if = None if out.ended is None else (lambda r, toks: out.ended(out.tokens[items[r][0]] + toks))
        next_pos, produced = out.resume_at
        tails = resume(self.model, items, next_pos, produced, max_new_tokens=plan.max_new, stops=out.stops,
                       min_new_tokens=out.min_new_tokens, max_batch=self.max_batch, max_padding=self.max_padding,
                       done_if=done_if)
        share = (time.perf_counter() - t0) / len(items)
        for (i, _, _), toks in zip(items, tails):
            out.tokens[i] = out.tokens[i] + toks
            out.seconds[i] += share

    def _results(self, prefill: Prefill, routes: list[Route], plan: _Plan, out: _Decoding) -> list[RouteResult]:
        cap0 = prefill.layers[0]
        # Bytes of keys + values per kept token per layer; the full cache is what the prefill
        # left in every layer (a sliding-window layer holds its window only).
        per_token = cap0.keys.shape[1] * (cap0.keys.shape[-1] + cap0.values.shape[-1]) * cap0.keys.element_size()
        per_head_token = per_token // cap0.keys.shape[1]  # one KV head's key + value
        full_bytes = per_token * sum(prefill.layer_tokens)
        results = []
        for i, route in enumerate(routes):
            kept_bytes = per_head_token * sum(sum(c) for c in plan.heads[i])
            results.append(RouteResult(
                route=route,
                answer=self.tokenizer.decode(out.tokens[i], skip_special_tokens=True),
                token_ids=out.tokens[i],
                kept_per_layer=plan.counts[i],
                kv_bytes=kept_bytes,
                full_kv_bytes=full_bytes,
                first_logits=out.logits[i],
                seconds=out.seconds[i],
                kept_per_head=plan.heads[i] if route.is_per_head else None,
                allocated_kv_bytes=kept_bytes if self.head_layout == "split" else per_token * sum(plan.counts[i]),
            ))
        return results

    def run(
        self, context: str, question: str, routes: list[Route], answer_prefix: str = "", keep_logits: bool = False
    ) -> list[RouteResult]:
        """Encode, validate, prefill once and answer under every route."""
        prompt = self.encode(context, question, answer_prefix)
        self.check_routes(routes, prompt.context_ids.shape[1])
        return self.answer(self.prefill(prompt), routes, keep_logits=keep_logits)
