"""Ending answers once their score is final: decode time with and without, same scores.

RULER's NIAH metrics (string_match_all / _part) only ask whether the references occur in
the answer, so once an answer holds them all no later token changes its score. SmolLM2
never stops on its own on these tasks (it repeats the needle until the token cap), so
a route that found the needle still pays for every remaining step. ``stop_at_final_score``
(bench, placement, study) hands ``score_is_final`` to ``Engine.answer(until=...)``, and
such answers leave their batch. This times ``engine.answer`` on the same prefills with
and without it, alternating, in one process, and checks every score is unchanged.

Workload (like ``experiments/study/full.yaml``'s bench): default model, ~1k-token samples of
the given tasks (eval split, seed 1), 48 new tokens at most, the full cache and the eight
candidate methods homogeneous at five budgets (41 routes).

    .venv/bin/python benchmarks/stop_at_final_score.py
    .venv/bin/python benchmarks/stop_at_final_score.py --tasks niah_single_3 niah_multivalue --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

METHODS = ["snapkv", "streaming_llm", "h2o", "tova", "knorm", "expected_attention", "keydiff", "lava"]
BUDGETS = [0.075, 0.1, 0.15, 0.2, 0.4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_multivalue"])
    parser.add_argument("--tokens", type=int, default=1024, help="context length")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds of the two modes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    import torch

    import learnroute as lr
    from learnroute.route import Route
    from learnroute.tasks.metrics import score_is_final, score_sample
    from learnroute.tasks.ruler import make_sample

    torch.set_num_threads(args.threads)
    model, tok = lr.load_model()
    engine = lr.Engine(model, tok, max_new_tokens=args.max_new_tokens)
    routes = [Route.full(engine.n_layers)] + [
        Route.homogeneous(m, engine.n_layers, b) for b in BUDGETS for m in METHODS
    ]
    times = {"whole": [], "stop_at_final_score": []}
    scores = {"whole": [], "stop_at_final_score": []}
    tokens = {"whole": 0, "stop_at_final_score": 0}
    for task in args.tasks:
        sample = make_sample(task, tok, args.tokens, "eval", 1, 0)
        pre = engine.prefill(engine.encode(sample.context, sample.question, sample.answer_prefix))
        engine.answer(pre, routes[:2], max_new_tokens=2)  # score and select outside the timings
        for rep in range(args.repeats):
            for mode in times:  # alternating: drifts of the machine hit both modes alike
                until = (lambda text, s=sample: score_is_final(s, text)) if mode != "whole" else None
                t0 = time.perf_counter()
                out = engine.answer(pre, routes, until=until)
                times[mode].append(time.perf_counter() - t0)
                if rep == 0:
                    scores[mode] += [score_sample(sample, r.answer) for r in out]
                    tokens[mode] += sum(len(r.token_ids) for r in out)
    ratios = [a / b for a, b in zip(times["whole"], times["stop_at_final_score"])]
    report = {
        "tasks": args.tasks,
        "context_tokens": args.tokens,
        "routes": len(routes),
        "threads": args.threads,
        "whole_s_median": round(statistics.median(times["whole"]), 2),
        "stop_s_median": round(statistics.median(times["stop_at_final_score"]), 2),
        "speedup_median": round(statistics.median(ratios), 2),
        "speedups_all": [round(r, 2) for r in ratios],
        "answer_tokens_whole": tokens["whole"],
        "answer_tokens_stop": tokens["stop_at_final_score"],
        "scores_equal": f"{sum(a == b for a, b in zip(scores['whole'], scores['stop_at_final_score']))}"
                        f"/{len(scores['whole'])}",
        "mean_score": round(100 * statistics.mean(scores["whole"]), 1),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
