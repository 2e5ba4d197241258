"""Prefills shared across a study's stages: the time of a later stage with and without.

A study's stages go over the same samples: the bench, then its controls (and the
placement) over the eval samples. With one :class:`learnroute.engine.PrefillStore` handed
to every stage's engine (the study makes one; ``prefill_cache_gib``) a later stage gets each
sample's prefill, and the method scores computed from it, from the earlier stage instead of
making them again.

This runs two stages on the same samples, as separate engines (a study's stages build
their own), in two modes alternating in rounds, in one process:

- ``separate``: every stage prefills and scores its samples itself (as before);
- ``shared``: both stages' engines handed one ``PrefillStore``.

Stage 1 is the default study's bench (the full cache and the ten candidate methods at 10
and 20 % kept); stage 2 its controls (pyramid and Ada-KV over keydiff and
expected_attention at the same budgets). It reports each stage's time per mode, so also
whether holding the first stage's prefills slows the first stage itself, the answers'
equality, and the bytes kept.

    .venv/bin/python benchmarks/shared_prefills.py
    .venv/bin/python benchmarks/shared_prefills.py --samples 6 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

METHODS = ["snapkv", "streaming_llm", "h2o", "tova", "knorm", "expected_attention", "keydiff",
           "critical_snapkv", "lava", "random"]
CONTROLS = ["keydiff", "expected_attention"]
BUDGETS = [0.1, 0.2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2"])
    parser.add_argument("--samples", type=int, default=4, help="samples, taken in turn from the tasks")
    parser.add_argument("--tokens", type=int, default=1024, help="context length")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="the default study's answer cap")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two modes")
    parser.add_argument("--threads", type=int, default=1, help="1: one of make run's two ranks")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    import torch

    import learnroute as lr
    from learnroute.engine import PrefillStore
    from learnroute.route import Route
    from learnroute.tasks.ruler import make_sample

    torch.set_num_threads(args.threads)
    model, tok = lr.load_model()
    n_layers = lr.Engine(model, tok).n_layers
    stage_routes = {
        "bench": [Route.full(n_layers)] + [Route.homogeneous(m, n_layers, b) for b in BUDGETS for m in METHODS],
        "controls": [Route.allocated(m, n_layers, b, "pyramid") for b in BUDGETS for m in CONTROLS]
        + [Route.adakv(m, n_layers, b) for b in BUDGETS for m in CONTROLS],
    }
    samples = [make_sample(args.tasks[i % len(args.tasks)], tok, args.tokens, "eval", 0, i // len(args.tasks))
               for i in range(args.samples)]

    def stage(routes, store) -> tuple[float, list[list[int]]]:
        # each stage its own engine, as in a study
        engine = lr.Engine(model, tok, max_new_tokens=args.max_new_tokens, prefills=store)
        start, answers = time.perf_counter(), []
        for s in samples:
            prefill = engine.prefill(engine.encode(s.context, s.question, s.answer_prefix))
            answers += [r.token_ids for r in engine.answer(prefill, routes)]
        return time.perf_counter() - start, answers

    times = {(mode, name): [] for mode in ("separate", "shared") for name in stage_routes}
    answers: dict[str, list] = {}
    kept = {}
    for _ in range(args.rounds):
        for mode in ("separate", "shared"):  # alternating: drifts of the machine hit both modes alike
            shared = PrefillStore(4 * 2**30 if mode == "shared" else 0)
            got = []
            for name, routes in stage_routes.items():
                seconds, out = stage(routes, shared)
                times[(mode, name)].append(seconds)
                got += out
            kept[mode] = {"hits": shared.hits, "made": shared.made, "gib": round(shared.bytes / 2**30, 3)}
            answers[mode] = got
    med = {f"{mode}_{name}_s": round(statistics.median(v), 1) for (mode, name), v in times.items()}
    report = {
        "tasks": args.tasks,
        "samples": args.samples,
        "context_tokens": args.tokens,
        "threads": args.threads,
        "routes": {k: len(v) for k, v in stage_routes.items()},
        **med,
        "controls_speedup": round(med["separate_controls_s"] / med["shared_controls_s"], 2),
        "bench_shared_over_separate": round(med["shared_bench_s"] / med["separate_bench_s"], 3),
        "all_s": {f"{mode}_{name}": [round(x, 1) for x in v] for (mode, name), v in times.items()},
        "answers_equal": answers["separate"] == answers["shared"],
        "shared_block": kept["shared"],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
