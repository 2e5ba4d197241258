"""Greedy decoding over a compressed cache: one loop (:func:`greedy_decode`) for a batch's
first pass over the question and every later step, and :func:`resume` for rows parked
after a few tokens and finished together in fresh batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from learnroute import _hf
from learnroute.engine.batching import Parked, pack_batches, parked_cache, unpadded_rows


def stop_tokens(model, stop_token_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """Token ids that end an answer: the model's EOS and ``stop_token_ids``."""
    ids = [*_hf.eos_token_ids(model), *stop_token_ids]
    return torch.tensor(ids, dtype=torch.long, device=model.device)


def greedy(logits: torch.Tensor, produced: int, stops: torch.Tensor, min_new_tokens: int) -> torch.Tensor:
    """The next token per row (R, vocab) -> (R,); stop tokens are barred until
    ``min_new_tokens`` tokens exist (transformers' ``min_new_tokens``)."""
    if produced < min_new_tokens and len(stops):
        logits = logits.index_fill(-1, stops, float("-inf"))
    return logits.argmax(-1)


@dataclass
class Decoded:
    """What :func:`greedy_decode` produced for a batch."""

    tokens: list[list[int]]  # per row, its new tokens (up to and including a stop token)
    first_logits: torch.Tensor  # (R, vocab) float32 logits of each row's first new token
    parked: list[Parked] = field(default_factory=list)  # rows set aside unfinished (park_after)
    next_pos: int = 0  # where the parked rows' next tokens are fed
    produced: int = 0  # tokens each parked row has produced


@torch.no_grad()
def greedy_decode(
    model,
    cache,
    ids: torch.Tensor,
    next_pos: int,
    *,
    max_new_tokens: int,
    stops: torch.Tensor,
    min_new_tokens: int = 0,
    produced: int = 0,
    park_after: int | None = None,
    done_if: Callable[[int, list[int]], bool] | None = None,
) -> Decoded:
    """Greedy decoding of R rows over ``cache``: feed ``ids`` (R, t) at positions
    ``next_pos``.. (original positions: the question after the kept context, or a parked
    row's last token), then one chosen token per row and step.

    ``produced`` tokens exist already (a resumed row); a row ends at ``max_new_tokens``, at
    a stop token (kept, as kvpress keeps EOS) or once ``done_if(row, its new tokens)``.
    Finished rows leave the batch (their cache rows are dropped) once half the batch has
    finished, so a batch costs what its unfinished rows cost. With ``park_after``, rows
    still unfinished once that many tokens exist are handed back in ``parked`` (their
    keys/values without padding) for :func:`resume`.
    """
    device = ids.device
    n_rows = ids.shape[0]
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    alive = torch.arange(n_rows, device=device)  # original row of each batch row
    done = torch.zeros(n_rows, dtype=torch.bool, device=device)  # batch rows that have produced a stop
    first = None
    with _hf.padded_keys(model, cache):  # the padding masked; also route-aware attention
        while True:
            t = ids.shape[1]
            pos = torch.arange(next_pos, next_pos + t, device=device).unsqueeze(0).expand(len(alive), t)  # (R_alive, t)
            logits = _hf.forward_tokens(model, cache, ids, pos, keep=1)[:, -1].float()  # (R_alive, vocab)
            first = logits if first is None else first
            nxt = greedy(logits, produced, stops, min_new_tokens)  # (R_alive,)
            next_pos += t
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
                return Decoded(rows, first)
            if park_after is not None and produced >= park_after:
                keep = (~done).nonzero().squeeze(1)  # (R_left,)
                parked = list(zip(alive[keep].tolist(), nxt[keep].tolist(), unpadded_rows(cache, keep)))
                return Decoded(rows, first, parked, next_pos, produced)
            # Dropping finished rows copies every unfinished row's cache; that pays off
            # only once enough rows have finished (their tokens are ignored until then).
            if 2 * int(done.sum()) >= len(alive):
                keep = ~done
                _hf.keep_rows(cache, keep.nonzero().squeeze(1))
                alive, nxt, done = alive[keep], nxt[keep], done[keep]
            ids = nxt.unsqueeze(1)  # (R_alive, 1)


def resume(
    model,
    parked: list[Parked],
    next_pos: int,
    produced: int,
    *,
    max_new_tokens: int,
    stops: torch.Tensor,
    min_new_tokens: int,
    max_batch: int,
    max_padding: float,
    done_if: Callable[[int, list[int]], bool] | None = None,
) -> list[list[int]]:
    """Go on decoding parked rows (from any batches, one question, ``produced`` tokens each,
    the next fed at ``next_pos``) in new batches (:func:`pack_batches`); their new tokens,
    in order. ``done_if(index in parked, its new tokens)`` ends a row early."""
    shapes = [[k.shape[1] for k, _ in kv] for _, _, kv in parked]
    tokens: list[list[int]] = [[] for _ in parked]
    for batch in pack_batches(shapes, max_batch, max_padding):
        rows = [parked[i] for i in batch]
        cache = parked_cache(model, rows, max_new_tokens - produced)  # room for what each row may still feed
        # The parked rows' last tokens are already in their answers: fed first.
        ids = torch.tensor([[nxt] for _, nxt, _ in rows], dtype=torch.long, device=model.device)  # (R, 1)
        local = None if done_if is None else (lambda r, toks, batch=batch: done_if(batch[r], toks))
        out = greedy_decode(model, cache, ids, next_pos, max_new_tokens=max_new_tokens, stops=stops,
                            min_new_tokens=min_new_tokens, produced=produced, done_if=local)
        for i, toks in zip(batch, out.tokens):
            tokens[i] = toks
    return tokens
