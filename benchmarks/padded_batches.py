"""Decoding many routes of different per-layer budgets: padded batches vs one batch per shape.

A study benches dozens of routes per sample whose kept counts differ per layer (allocated
budgets, learned budgets, pyramid), so with one batch per distinct shape most routes
decode alone, and a decode step of one row costs nearly what a step of 16 rows costs on
a CPU. The engine pads routes of similar shapes to one batch and masks the padding
(``Engine(max_padding=...)``), and, when routes need several batches, sets answers still
unfinished after ``park_after`` tokens aside and finishes them together. This times
``engine.answer`` on the same prefill in three modes, alternating, in one process:
identical shapes only (``max_padding=1``, no parking), padded (4, no parking), and padded
with parking (the defaults: 4, 12).

Workload (like ``experiments/study/full.yaml``'s bench): default model, one ~1k-token needle
sample, 48 new tokens at most; at each of five budgets, the eight candidate methods
homogeneous (one shape), PyramidKV-shaped SnapKV, and ``--allocated`` routes of one
method whose per-layer budgets are random around the mean (each its own shape), plus the
full cache.

    .venv/bin/python benchmarks/padded_batches.py                 # 3 alternating pairs
    .venv/bin/python benchmarks/padded_batches.py --allocated 12 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

METHODS = ["snapkv", "streaming_llm", "h2o", "tova", "knorm", "expected_attention", "keydiff", "lava"]
BUDGETS = [0.075, 0.1, 0.15, 0.2, 0.4]


def make_routes(n_layers: int, n_tokens: int, allocated: int, seed: int):
    from learnroute.methods.budgets import pyramid
    from learnroute.route import Route

    rng = random.Random(seed)
    routes = [Route.full(n_layers)]
    for budget in BUDGETS:
        routes += [Route.homogeneous(m, n_layers, budget) for m in METHODS]
        routes.append(Route.from_layers(["snapkv"] * n_layers, pyramid(n_layers, budget), source="pyramid"))
        mean = budget * n_tokens
        for _ in range(allocated):
            # Per-layer token counts spread like a sensitivity allocation (0.3x-2x the mean),
            # rescaled so the route keeps the budget on average.
            raw = [rng.uniform(0.3, 2.0) for _ in range(n_layers)]
            scale = mean * n_layers / sum(raw)
            counts = [max(1, min(n_tokens, round(r * scale))) for r in raw]
            routes.append(Route.from_layers([rng.choice(METHODS)] * n_layers, counts, source="allocated"))
    return routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="context length")
    parser.add_argument("--allocated", type=int, default=8, help="allocated routes per budget")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of the three modes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    import torch

    import learnroute as lr
    from learnroute.demo import needle_sample
    from learnroute.engine import pack_batches

    torch.set_num_threads(args.threads)
    model, tok = lr.load_model()
    sample = needle_sample(tok, args.tokens, depth=0.5, seed=0)
    modes = {  # name: (max_padding, park_after)
        "shape_only": (1.0, None),
        "padded": (4.0, None),
        "padded_parked": (4.0, 12),
    }
    engines = {
        name: lr.Engine(model, tok, max_new_tokens=args.max_new_tokens, max_padding=pad, park_after=park)
        for name, (pad, park) in modes.items()
    }
    first = engines["shape_only"]
    pre = first.prefill(first.encode(sample.context, sample.question, sample.answer_prefix))
    routes = make_routes(first.n_layers, pre.n_tokens, args.allocated, seed=0)
    counts = [first.kept_counts(r, pre.n_tokens) for r in routes]
    # Score and select every (layer, method, count) once, outside the timings: every mode
    # shares the prefill and its caches, so only decoding is compared.
    for route, kept in zip(routes, counts):
        for layer, (entry, k) in enumerate(zip(route.layers, kept)):
            first.kept_indices(pre, layer, entry.method, k)
    for engine in engines.values():
        engine._methods = first._methods
    times: dict[str, list[float]] = {name: [] for name in modes}
    answers: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():  # alternating: drifts of the machine hit every mode alike
            t0 = time.perf_counter()
            out = engine.answer(pre, routes)
            times[name].append(time.perf_counter() - t0)
            answers[name] = [r.answer for r in out]
    base = times["shape_only"]
    report = {
        "context_tokens": pre.n_tokens,
        "routes": len(routes),
        "distinct_shapes": len({tuple(c) for c in counts}),
        "batches_shape_only": len(pack_batches(counts, 32, 1.0)),
        "batches_padded": len(pack_batches(counts, 32, 4.0)),
        "answer_tokens": sum(len(tok.encode(a, add_special_tokens=False)) for a in answers["shape_only"]),
        "threads": args.threads,
    }
    for name in modes:
        report[f"{name}_s"] = round(statistics.median(times[name]), 2)
        if name != "shape_only":
            ratios = [a / b for a, b in zip(base, times[name])]
            report[f"{name}_speedup_median"] = round(statistics.median(ratios), 2)
            report[f"{name}_speedups_all_repeats"] = [round(r, 2) for r in ratios]
            same = sum(a == b for a, b in zip(answers["shape_only"], answers[name]))
            report[f"{name}_same_answers"] = f"{same}/{len(routes)}"
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
