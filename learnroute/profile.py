"""Offline per-layer profiles and the routes built from them (background.md §3).

For every layer ``l`` and method ``m`` at budget ``k``, only layer ``l`` is compressed
with ``m`` (every other layer keeps its full cache) and the damage on the reference
answer is measured with teacher forcing: KL(full ‖ compressed) of the next-token
distributions over the answer tokens, and the answer's NLL increase. Averaged over
calibration samples this gives an L x M damage matrix per budget.

Cost: one prefill per sample serves all L x M cells. A full-cache forward over question
+ answer records every layer's input hidden states; since compressing layer ``l`` leaves
layers below it unchanged, each cell restarts from layer ``l`` with that recorded input
and runs only layers ``l..L-1``. The M methods of one layer share a batch; methods that
keep exactly the same tokens at a layer share one row (and get the same damage).

Route files: ``profile_<budget>.json`` picks per layer the least damaging method (ties go
to the method listed first); ``profile_<budget>_alloc.json`` also shares the total budget
across layers in proportion to each layer's sensitivity (its damage with its best method).

``granularity: head``: the same per (layer, KV head): only head ``h`` of layer ``l`` is
compressed (the layer's other heads keep the whole context), an L x H_kv x M damage
tensor, and per-head routes (each head's least damaging method; budgets shared over
every (layer, head) by sensitivity). H_kv times the cells of a per-layer profile.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
import typing
from typing import Any, Literal

import torch

from learnroute.config import to_dict
from learnroute.methods.budgets import allocate_shares, resolve_budget
from learnroute.methods.registry import METHODS
from learnroute.route import Granularity, LayerRoute, Route, RouteError, budget_problem
from learnroute.runs import DTYPE_HELP, Dtype, device_problem, dtype_problem
from learnroute.tasks.ruler import Sample
from learnroute.tasks.suite import calibration_problems, load_tasks

Budget = int | float
SCHEMA = "learnroute.profile/1"
CANDIDATES = [
    "snapkv",
    "streaming_llm",
    "h2o",
    "tova",
    "knorm",
    "expected_attention",
    "keydiff",
    "critical_snapkv",
    "lava",
    "random",
]
Damage = Literal["kl", "nll"]
DAMAGES = typing.get_args(Damage)
GRANULARITY = typing.get_args(Granularity)


@dataclass
class ProfileConfig:
    """What ``learnroute profile`` measures (calibration samples only)."""

    model: str | None = field(default=None, metadata={"help": "HF model folder or hub id; null = bundled SmolLM2"})
    tasks: dict[str, int] = field(
        default_factory=lambda: {"niah_single_2": 4, "niah_multikey": 4},
        metadata={"help": "task -> number of calibration samples: a generated family or jsonl:PATH (your records' calibration split)"},
    )
    context_tokens: int = field(default=2048, metadata={"help": "context length of the samples (tokens)"})
    budgets: list[Budget] = field(default_factory=lambda: [64], metadata={"help": "budgets to profile"})
    methods: list[str] = field(default_factory=lambda: list(CANDIDATES), metadata={"help": "candidate methods"})
    select_by: Damage = field(default="kl", metadata={"help": "damage used to pick methods: kl or nll"})
    granularity: Granularity = field(
        default="layer",
        metadata={"help": "layer: compress one layer per cell | head: one KV head of one layer per cell "
                          "(H_kv times the cells; per-head routes)"},
    )
    query_aware: bool = field(default=False, metadata={"help": "put the question in the prefill (scored)"})
    seed: int = field(default=0, metadata={"help": "seed of the calibration sample stream"})
    dtype: Dtype = field(default="float32", metadata={"help": DTYPE_HELP})
    device: str = field(
        default="auto", metadata={"help": "auto (CUDA when available) | cpu | cuda (refused without CUDA)"}
    )
    output: str = field(default="runs/profile", metadata={"help": "run folder"})

    def validate(self) -> list[str]:
        problems = []
        problems += calibration_problems(self.tasks)
        if not self.budgets:
            problems.append("budgets is empty")
        for b in self.budgets:
            if (p := budget_problem(b)) is not None:
                problems.append(f"budgets: {p}")
        if len(self.methods) < 1:
            problems.append("methods is empty; registered: " + ", ".join(METHODS))
        for m in self.methods:
            if m not in METHODS or m == "full":
                problems.append(
                    f"unknown candidate method {m!r}; registered: {', '.join(x for x in METHODS if x != 'full')}"
                )
        if len(set(self.methods)) != len(self.methods):
            problems.append("methods lists a method twice")
        if self.granularity not in GRANULARITY:
            problems.append(f"granularity must be one of {', '.join(GRANULARITY)}, got {self.granularity!r}")
        if self.select_by not in DAMAGES:
            problems.append(f"select_by must be one of {', '.join(DAMAGES)}, got {self.select_by!r}")
        if self.context_tokens < 16:
            problems.append(f"context_tokens must be >= 16, got {self.context_tokens}")
        if (p := device_problem(self.device)) is not None:
            problems.append(p)
        if (p := dtype_problem(self.dtype)) is not None:
            problems.append(p)
        return problems


# ---------------------------------------------------------------------------- damage of one sample


def answer_text(sample: Sample) -> str:
    """The reference answer to teacher-force: the references joined, after the prefix."""
    text = ", ".join(sample.answers)
    return text if not sample.answer_prefix or sample.answer_prefix.endswith((" ", "\n")) else " " + text


@dataclass
class TeacherForcing:
    """One sample split for teacher forcing: the context prompt, then the question and the
    reference answer decoded after it at their original positions (profile and gates)."""

    prompt: Any  # learnroute.engine.Prompt
    answer: torch.Tensor  # (1, a) reference answer ids
    ids: torch.Tensor  # (1, q + a): question then answer
    positions: torch.Tensor  # (1, q + a): n .. n + q + a - 1, after the n context tokens
    keep: slice  # logits at q-1 .. q+a-2 predict the a answer tokens


def teacher_forcing(engine, sample: Sample) -> TeacherForcing:
    """Tokenize ``sample`` like the engine and append its reference answer (on the model's
    device); an empty answer is refused before any forward."""
    prompt = engine.encode(
        sample.context, sample.question, sample.answer_prefix, chat=sample.meta.get("chat_template", True)
    )
    device = engine.model.device
    answer = engine.tokenizer.encode(answer_text(sample), return_tensors="pt", add_special_tokens=False)  # (1, a)
    if answer.shape[1] == 0:
        raise ValueError(f"sample {sample.id} has an empty reference answer: nothing to teacher-force")
    n, q, a = prompt.context_ids.shape[1], prompt.question_ids.shape[1], answer.shape[1]
    ids = torch.cat([prompt.question_ids, answer], dim=1).to(device)  # (1, q + a)
    pos = torch.arange(n, n + q + a, device=device).unsqueeze(0)  # (1, q + a)
    return TeacherForcing(prompt, answer.to(device), ids, pos, slice(q - 1, q + a - 1))


@torch.no_grad()
def sample_damage(
    engine, sample: Sample, budgets: list[Budget], methods: list[str], granularity: str = "layer"
) -> dict[str, Any]:
    """Damage matrices of one sample: ``{"kl": {budget: L x M}, "nll": {...}, ...}``
    (``granularity="head"``: L x H_kv x M, one KV head compressed per cell).

    ``engine`` is a :class:`learnroute.engine.Engine`; its prefill and method scores are
    reused for every cell.
    """
    from learnroute import _hf

    model = engine.model
    tf = teacher_forcing(engine, sample)
    prefill = engine.prefill(tf.prompt)
    n, a = prefill.n_tokens, tf.answer.shape[1]
    engine.check_routes([Route.homogeneous(m, engine.n_layers, budgets[0]) for m in methods], n)
    ids, pos, keep = tf.ids, tf.positions, tf.keep
    target = tf.answer[0]  # (a,)
    full_kv = [(c.keys, c.values) for c in prefill.layers]
    inputs: list[torch.Tensor] = []  # every layer's input over question + answer: (1, t, D) each
    logits = _hf.forward_tokens(model, full_kv, ids, pos, keep=keep, record_inputs=inputs)  # (1, a, V)
    ref_logp = torch.log_softmax(logits[0].float(), -1)  # (a, V)
    ref_nll = -ref_logp.gather(-1, target[:, None]).mean()
    L, M = engine.n_layers, len(methods)
    # Layers the engine never compresses (Gemma3's local layers, windows shorter than the
    # context): no cells, zero damage.
    fixed = [layer for layer in range(L) if engine.is_fixed(layer, prefill.layer_tokens[layer], n)]
    t_scores = time.perf_counter()
    kept = {
        (layer, m, budget): engine.kept_indices(prefill, layer, m, resolve_budget(budget, n))  # (1, H_kv, k)
        for budget in budgets
        for layer in range(L)
        if layer not in fixed
        for m in methods
    }
    t_cells = time.perf_counter()
    out: dict[str, Any] = {"kl": {}, "nll": {}, "n_tokens": n, "answer_tokens": a, "fixed_layers": fixed}
    heads = [None] if granularity == "layer" else list(range(engine.n_kv_heads))
    for budget in budgets:
        kl = torch.zeros(L, len(heads), M)
        nll = torch.zeros(L, len(heads), M)
        for layer in range(L):
            if layer in fixed:
                continue
            for j, head in enumerate(heads):
                # Distinct kept-index sets among the methods (identical sets share one row);
                # per head, only that head's set matters.
                rows: list[torch.Tensor] = []
                row_of: list[int] = []
                for m in methods:
                    idx = kept[(layer, m, budget)]  # (1, H_kv, k)
                    mine = idx if head is None else idx[:, head]
                    for r, other in enumerate(rows):
                        theirs = other if head is None else other[:, head]
                        if theirs.shape == mine.shape and torch.equal(theirs, mine):
                            row_of.append(r)
                            break
                    else:
                        row_of.append(len(rows))
                        rows.append(idx)
                R = len(rows)
                cell_logits = _packed_cells(model, prefill, full_kv, layer, rows, inputs[layer], pos, keep, head)
                logp = torch.log_softmax(cell_logits.float(), -1)  # (R, a, V)
                row_kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean(-1)  # (R,)
                row_nll = -logp.gather(-1, target[None, :, None].expand(R, -1, 1)).squeeze(-1).mean(-1) - ref_nll
                kl[layer, j] = row_kl[row_of].cpu()
                nll[layer, j] = row_nll[row_of].cpu()
        if granularity == "layer":
            kl, nll = kl[:, 0], nll[:, 0]  # (L, M)
        out["kl"][json.dumps(budget)] = kl.tolist()
        out["nll"][json.dumps(budget)] = nll.tolist()
    out["seconds"] = {
        "prefill": prefill.seconds,
        "scores": t_cells - t_scores,
        "cells": time.perf_counter() - t_cells,
    }
    return out


def _packed_cells(
    model, prefill, full_kv, layer: int, rows: list[torch.Tensor], hidden, pos, keep: slice, head: int | None = None
):
    """Logits (R, a, V) of R cells that compress ``layer`` with R kept-index sets (1, H_kv, k);
    with ``head``, only that KV head is compressed (its row of each set; the other heads
    keep the whole context).

    The R cells run as ONE sequence of R x t tokens rather than a batch of R: every layer
    above ``layer`` then holds the shared full context once instead of R copies (copying
    it dominated the cost), and a block mask keeps the cells apart: a cell's tokens see the
    context (at ``layer``: only its own kept tokens) and the earlier tokens of the same
    cell. Positions repeat per cell, so each cell sees exactly what a separate run would.
    Per head, ``layer`` holds every cell's whole context and the mask hides, for the query
    heads of KV head ``head`` only, the tokens that head evicts in that cell.
    """
    from learnroute import _hf

    R, t = len(rows), hidden.shape[1]
    cap = prefill.layers[layer]
    _, h_kv, n, d = cap.keys.shape
    dev = hidden.device  # the masks and offsets live with the model
    cell = torch.arange(R, device=dev).repeat_interleave(t)  # (R*t,) cell of each packed token
    step = torch.arange(t, device=dev).repeat(R)  # (R*t,) position inside its cell
    own = (cell[:, None] == cell[None, :]) & (step[None, :] <= step[:, None])  # (R*t, R*t) causal per cell
    kept_k, kept_v, mask_layer = _compressed_layer(model, cap, rows, cell, own, head)
    kv = []
    for j, (keys, values) in enumerate(full_kv):
        if j < layer:
            kv.append((keys[:, :, :0], values[:, :, :0]))  # (1, H_kv, 0, d): never read
        elif j == layer:
            kv.append((kept_k, kept_v))
        else:
            kv.append((keys, values))  # (1, H_kv, n, d), shared by every cell
    ctx_full = torch.ones(R * t, n, dtype=torch.bool, device=dev)  # (R*t, n)
    mask_full = torch.cat([ctx_full, own], 1)[None, None]  # (1, 1, R*t, n + R*t)
    windows = _hf.cache_windows(model)
    held = prefill.layer_tokens
    window_masks: dict[tuple[int, int], torch.Tensor] = {}

    def upper_mask(j: int) -> torch.Tensor:
        """Mask of an unchanged layer above ``layer``; a sliding-window layer holds the last
        c context tokens (positions n-c..n-1) and sees w positions back from each query."""
        w = windows[j]
        if w is None:
            return mask_full
        if (w, held[j]) not in window_masks:
            c = held[j]
            ctx = torch.arange(c, device=dev)[None, :] > step[:, None] + c - w  # (R*t, c): n+s - (n-c+i) < w
            near = own & (step[:, None] - step[None, :] < w)  # (R*t, R*t)
            window_masks[(w, c)] = torch.cat([ctx, near], 1)[None, None]  # (1, 1, R*t, c + R*t)
        return window_masks[(w, held[j])]

    packed = hidden.expand(R, -1, -1).reshape(1, R * t, -1)  # (1, R*t, D)
    positions = pos.repeat(1, R)  # (1, R*t)
    offsets = (  # (R*a,)
        torch.arange(R, device=dev)[:, None] * t + torch.arange(keep.start, keep.stop, device=dev)[None, :]
    ).reshape(-1)
    with _hf.routed_attention(model):
        logits = _hf.forward_from_layer(
            model,
            layer,
            packed,
            _hf.build_cache(model, kv),
            positions,
            offsets,
            masks=lambda i: mask_layer if i == layer else upper_mask(i),
        )  # (1, R*a, V)
    return logits.view(R, keep.stop - keep.start, -1)  # (R, a, V)


def _compressed_layer(model, cap, rows: list[torch.Tensor], cell: torch.Tensor, own: torch.Tensor, head: int | None):
    """:func:`_packed_cells`' compressed layer for R packed cells: its keys and values
    (1, H_kv, ., d) and its attention mask (``cell``: the cell of each packed token; ``own``
    (R*t, R*t): causal within a cell)."""
    from learnroute import _hf

    R, dev = len(rows), cell.device
    _, h_kv, n, d = cap.keys.shape
    if head is None:
        k = rows[0].shape[-1]
        gidx = torch.cat(rows).unsqueeze(-1).expand(-1, -1, -1, d)  # (R, H_kv, k, d)
        # (R, H_kv, k, d) -> (1, H_kv, R*k, d): cell r's kept tokens are keys r*k .. r*k+k-1
        kept_k = cap.keys.expand(R, -1, -1, -1).gather(2, gidx).transpose(0, 1).reshape(1, h_kv, R * k, d)
        kept_v = cap.values.expand(R, -1, -1, -1).gather(2, gidx).transpose(0, 1).reshape(1, h_kv, R * k, d)
        ctx_kept = cell[:, None] == torch.arange(R, device=dev).repeat_interleave(k)[None, :]  # (R*t, R*k)
        mask_layer = torch.cat([ctx_kept, own], 1)[None, None]  # (1, 1, R*t, R*k + R*t)
    else:
        kept_k = cap.keys.repeat(1, 1, R, 1)  # (1, H_kv, R*n, d): cell r's context is keys r*n .. r*n+n-1
        kept_v = cap.values.repeat(1, 1, R, 1)
        same = cell[:, None] == torch.arange(R, device=dev).repeat_interleave(n)[None, :]  # (R*t, R*n)
        kept = torch.zeros(R, n, dtype=torch.bool, device=dev)  # (R, n): what ``head`` keeps per cell
        for r, idx in enumerate(rows):
            kept[r, idx[0, head]] = True
        h_q = int(_hf.text_config(model).num_attention_heads)
        group = h_q // h_kv  # query heads per KV head (GQA)
        ctx = same[None].repeat(h_q, 1, 1)  # (H_q, R*t, R*n)
        ctx[head * group : (head + 1) * group] &= kept.reshape(1, 1, R * n)
        mask_layer = torch.cat([ctx, own[None].expand(h_q, -1, -1)], 2)[None]  # (1, H_q, R*t, R*n + R*t)
    return kept_k, kept_v, mask_layer


# ---------------------------------------------------------------------------- routes from a profile


def unit_rows(damage: list) -> tuple[list[list[float]], int]:
    """A damage matrix as one row of M per unit, and the heads per layer: L x M (per-layer
    profile, 1) or L x H x M flattened layer-major to L·H rows (per-head profile, H)."""
    if damage and damage[0] and isinstance(damage[0][0], list):
        return [row for layer in damage for row in layer], len(damage[0])
    return damage, 1


def best_methods(damage: list[list[float]], methods: list[str]) -> list[str]:
    """Per layer the least damaging method; ties go to the method listed first."""
    return [methods[min(range(len(row)), key=lambda i: (row[i], i))] for row in damage]


def sensitivity(damage: list[list[float]]) -> list[float]:
    """Per layer: the damage of compressing it alone with its best method."""
    return [min(row) for row in damage]


def allocate_by_sensitivity(
    sens: list[float], budget: Budget, cap: int | None = None, floor_share: float = 0.05
) -> list[Budget]:
    """Per-layer budgets: a floor for every layer, the rest shared in proportion to
    sensitivity, with the same total ``L x budget``.

    Every layer gets at least ``floor_share x budget`` (PyramidKV's smallest layer keeps
    about budget / 20 as well): a layer that looked insensitive on calibration data is
    not left with nothing. No layer gets more than ``cap`` (the profiled context length
    for token budgets, 1.0 for fractions). The arithmetic (floor, water filling, exact
    integer totals) is :func:`learnroute.methods.budgets.allocate_shares`.
    """
    if (problem := budget_problem(budget)) is not None:
        raise ValueError(problem)
    return allocate_shares([max(s, 0.0) for s in sens], budget, cap=cap, floor=floor_share)


def build_routes(
    profile: dict[str, Any], *, model: str | None, n_layers: int, methods: list[str] | None = None
) -> dict[str, Route]:
    """Route files of a profile: ``profile_<b>`` and ``profile_<b>_alloc`` per budget.

    Refuses a profile made for another model (name or layer count) or whose methods are
    not the requested ``methods`` (when given).
    """
    problems = []
    if profile.get("schema") != SCHEMA:
        problems.append(f"not a learnroute profile (schema {profile.get('schema')!r}, expected {SCHEMA!r})")
    if model is not None and profile.get("model") not in (None, model):
        problems.append(f"profile was made for model {profile.get('model')!r}, not {model!r}")
    if profile.get("n_layers") != n_layers:
        problems.append(f"profile has {profile.get('n_layers')} layers but the model has {n_layers}")
    if methods is not None and list(profile.get("methods", [])) != list(methods):
        problems.append(f"profile covers methods {profile.get('methods')}, not the requested {methods}")
    if problems:
        raise RouteError("cannot build routes from this profile:\n  " + "\n  ".join(problems))
    methods = list(profile["methods"])
    select = profile.get("select_by", "kl")
    routes = {}
    for key, damage in profile["damage"][select].items():
        budget = json.loads(key)
        rows, H = unit_rows(damage)  # one row per layer, or per (layer, KV head)
        chosen = best_methods(rows, methods)
        sens = sensitivity(rows)
        prov = {"source": "profile", "budget": budget, "select_by": select, "samples": profile.get("n_samples")}
        if H > 1:
            prov["granularity"] = "head"
        # Share the budget among the units routes can compress; fixed layers keep the
        # nominal budget, which the engine ignores there.
        fixed = set(profile.get("fixed_layers", []))
        free = [u for u in range(len(sens)) if u // H not in fixed]
        alloc = [budget] * len(sens)
        for u, b in zip(free, allocate_by_sensitivity([sens[u] for u in free], budget, cap=profile.get("n_tokens_min"))):
            alloc[u] = b
        for stem, budgets, extra in ((f"profile_{budget}", [budget] * len(sens), {}),
                                     (f"profile_{budget}_alloc", alloc, {"allocator": "sensitivity"})):
            if H == 1:
                routes[stem] = Route.from_layers(chosen, budgets, model=profile.get("model"), **prov, **extra)
                continue
            layers = [LayerRoute(chosen[l * H], budget) if l in fixed else
                      LayerRoute.per_head([LayerRoute(chosen[u], budgets[u]) for u in range(l * H, (l + 1) * H)])
                      for l in range(len(sens) // H)]
            routes[stem] = Route(layers, model=profile.get("model"), provenance={**prov, **extra})
        if H > 1 and "streaming_llm" in methods:
            routes[f"profile_{budget}_duo"] = duo_route(rows, methods, budget, H, fixed, profile)
    return routes


DUO_WINDOW = 64  # tokens a streaming head keeps (attention sinks + recent window) in the duo routes


def duo_route(rows: list[list[float]], methods: list[str], budget: Budget, H: int, fixed: set[int],
              profile: dict[str, Any]) -> Route:
    """DuoAttention's split (Xiao et al., 2024) from a per-head profile: retrieval heads keep
    the whole context, streaming heads keep ``DUO_WINDOW`` tokens (StreamingLLM's sinks +
    recent window). The retrieval heads are those StreamingLLM damages most (DuoAttention
    learns them by distillation; the profile measures the same loss of each head's
    long-range reads), and the budget decides how many: ``n_full`` of the ``U`` free heads
    with ``n_full·n + (U - n_full)·w ≈ U·b`` at the profiled context ``n``."""
    n = int(profile["n_tokens_min"])
    mean_k = resolve_budget(budget, n)
    w = min(DUO_WINDOW, mean_k)
    free = [u for u in range(len(rows)) if u // H not in fixed]
    U = len(free)
    n_full = 0 if n <= w else max(0, min(U, round(U * (mean_k - w) / (n - w))))
    damage = [rows[u][methods.index("streaming_llm")] for u in free]
    full = {free[i] for i in sorted(range(U), key=lambda i: (-damage[i], i))[:n_full]}
    whole, window = (1.0, w / n) if isinstance(budget, float) else (n, w)
    layers = []
    for l in range(len(rows) // H):
        if l in fixed:
            layers.append(LayerRoute("streaming_llm", budget))
            continue
        layers.append(LayerRoute.per_head([LayerRoute("full", whole) if u in full else LayerRoute("streaming_llm", window)
                                           for u in range(l * H, (l + 1) * H)]))
    achieved = (n_full * n + (U - n_full) * w) / max(U, 1)
    prov = {"source": "duo", "budget": budget, "retrieval_heads": n_full, "heads": U, "window": w,
            "profiled_tokens": n, "mean_tokens_at_profiled_length": achieved, "samples": profile.get("n_samples")}
    return Route(layers, model=profile.get("model"), provenance=prov)


def heatmap(profile: dict[str, Any], path: Path) -> None:
    """Layers x methods damage, one panel per budget (log colour scale of KL or NLL)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    select = profile.get("select_by", "kl")
    panels = profile["damage"][select]
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(1.2 + 0.55 * len(profile["methods"]) * len(panels),
                 0.22 * profile["n_layers"] * profile.get("n_heads", 1) + 2),
        squeeze=False,
    )
    for ax, (key, damage) in zip(axes[0], panels.items()):
        damage, H = unit_rows(damage)  # per-head profiles: one row per (layer, head)
        data = torch.tensor(damage).clamp_min(1e-6).numpy()
        im = ax.imshow(
            data, aspect="auto", cmap="viridis", norm=LogNorm(vmin=data.min(), vmax=max(data.max(), data.min() * 1.01))
        )
        best = best_methods(damage, profile["methods"])
        for layer, m in enumerate(best):
            ax.add_patch(
                plt.Rectangle((profile["methods"].index(m) - 0.5, layer - 0.5), 1, 1, fill=False, ec="red", lw=1)
            )
        ax.set_xticks(range(len(profile["methods"])), profile["methods"], rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("layer" if H == 1 else f"layer x head ({H} KV heads per layer)")
        ax.set_title(f"{select} damage, budget {json.loads(key)}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- the run


def aggregate(config: ProfileConfig, model: str, n_layers: int, cells: list[dict]) -> dict[str, Any]:
    """The profile document from per-sample damage rows (means over samples)."""
    damage: dict[str, dict[str, list[list[float]]]] = {}
    for kind in DAMAGES:
        damage[kind] = {}
        for b in config.budgets:
            key = json.dumps(b)
            mats = torch.tensor([c[kind][key] for c in cells])  # (S, L, M), or (S, L, H, M) per head
            damage[kind][key] = mats.mean(0).tolist()
    sens, best = {}, {}
    for key, d in damage[config.select_by].items():  # per layer, or per (layer, head): nested per layer
        rows, H = unit_rows(d)
        flat_s, flat_b = sensitivity(rows), best_methods(rows, config.methods)
        sens[key] = flat_s if H == 1 else [flat_s[i : i + H] for i in range(0, len(flat_s), H)]
        best[key] = flat_b if H == 1 else [flat_b[i : i + H] for i in range(0, len(flat_b), H)]
    heads = unit_rows(next(iter(damage[config.select_by].values())))[1]
    return {
        "schema": SCHEMA,
        "model": model,
        "n_layers": n_layers,
        "granularity": config.granularity,
        "n_heads": heads,  # damage per (layer, KV head) when > 1
        "methods": list(config.methods),
        "budgets": list(config.budgets),
        "select_by": config.select_by,
        "n_samples": len(cells),
        "n_tokens_min": min(c["n_tokens"] for c in cells),  # shortest context profiled
        # layers no route compresses (Gemma3's local layers): zero damage, no cells
        "fixed_layers": sorted({layer for c in cells for layer in c.get("fixed_layers", [])}),
        "sample_ids": [c["sample_id"] for c in cells],
        "damage": damage,
        "sensitivity": sens,
        "best": best,
        "config": to_dict(config),
    }


def run_profile(config: ProfileConfig, overwrite: bool = False, progress: bool = True, *, prefills=None) -> Path:
    """Profile every (layer, method, budget) on the calibration samples; resumable.
    ``prefills``: a :class:`~learnroute.engine.PrefillStore` shared with other stages.

    Under torchrun / accelerate launch the samples are sharded across ranks (each appends
    its rows to ``cells.jsonl``); rank 0 aggregates once every rank is done. One sample's
    cells run in one process, so a sharded profile holds the same rows as a serial one.
    """
    from tqdm import tqdm

    from learnroute import _hf
    from learnroute.runs import atomic_write, append_jsonl, prepare_folder, process_state, read_jsonl, resolve_device
    from learnroute.engine import Engine
    from learnroute.models import load_model, model_name

    device = resolve_device(config.device)  # cuda without CUDA is refused before anything is written
    state = process_state()
    rank, world = state.process_index, state.num_processes
    out = prepare_folder(config, overwrite, is_main=state.is_main_process)
    state.wait_for_everyone()
    model, tokenizer = load_model(config.model, dtype=config.dtype)
    # Under torchrun each rank's own GPU; one process: the resolved device (accelerate's
    # state is a per-process singleton and may predate this call's device choice).
    model.to(state.device if device == "cuda" and world > 1 else device)
    name = model_name(model)
    n_layers = len(_hf.attention_modules(model))
    samples = [s for _, s in load_tasks(config.tasks, tokenizer, config.context_tokens, "calibration", config.seed)]
    if any(s.split != "calibration" for s in samples):  # a programming error, never user input
        raise RuntimeError("profiles must use calibration samples only")
    if state.is_main_process:
        existing = {r["id"] for r in read_jsonl(out / "samples.jsonl")}
        append_jsonl(out / "samples.jsonl", [s.to_dict() for s in samples if s.id not in existing])
    done = {c["sample_id"] for c in read_jsonl(out / "cells.jsonl")}
    engine = Engine(model, tokenizer, query_aware=config.query_aware, prefills=prefills)
    mine = samples[rank::world]
    desc = f"profile[{rank}]" if world > 1 else "profile"
    for s in tqdm(mine, desc=desc, unit="sample", disable=not progress or not state.is_main_process):
        if s.id in done:
            continue
        row = {"sample_id": s.id, **sample_damage(engine, s, config.budgets, config.methods, config.granularity)}
        append_jsonl(out / "cells.jsonl", [{**row, "rank": rank}])
    state.wait_for_everyone()  # every shard's rows are in cells.jsonl
    if state.is_main_process:
        rows = {c["sample_id"]: c for c in read_jsonl(out / "cells.jsonl")}
        profile = aggregate(config, name, n_layers, [rows[s.id] for s in samples])
        atomic_write(out / "profile.json", json.dumps(profile, indent=1) + "\n")
        heatmap(profile, out / "heatmap.png")
        for stem, route in build_routes(profile, model=name, n_layers=n_layers, methods=config.methods).items():
            route.to_file(out / f"{stem}.json")
    state.wait_for_everyone()  # the profile's files exist for every rank
    return out


def load_profile(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "profile.json"
    if not path.is_file():
        raise FileNotFoundError(f"profile {path} not found (run `learnroute profile` first)")
    return json.loads(path.read_text())
