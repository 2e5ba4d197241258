"""What bounds the engine's speed-up on this machine: GEMM peak, question pass, greedy step.

Measures, on the default model and one ~2k-token needle sample:
- the fp32 GEMM throughput of the model's own MLP shape at the row count of a batched
  question pass (32 routes x 37 tokens), weights in cache;
- the engine's question pass per route (``max_new_tokens=1``: no greedy step) at batch 32,
  cache assembly included;
- one greedy step for batches of 1, 12, 32 and 100 routes (compressed caches of 256
  tokens per KV head).
From these and a kvpress per-route time (``--kvpress-per-route``, from
``benchmarks/engine.py``) it prints the time the engine would need per route to reach
the issue's targets, next to what the question pass alone costs.

    .venv/bin/python benchmarks/cpu_floor.py --kvpress-per-route 3.68
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import make_routes  # the benchmark's own route set


def best_of(fn, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed calls, seconds (the machine's noise only adds time)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvpress-per-route", type=float, default=3.68, help="seconds, from benchmarks/engine.py")
    parser.add_argument("--budget", type=int, default=256)
    args = parser.parse_args()

    import learnroute as lr
    from learnroute import _hf
    from learnroute.demo import needle_sample

    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    model, tok = lr.load_model()
    cfg = _hf.text_config(model)
    sample = needle_sample(tok, 2000, depth=0.5, seed=0)
    engine = lr.Engine(model, tok, max_new_tokens=1, max_batch=32)
    prompt = engine.encode(sample.context, sample.question, sample.answer_prefix)
    q = prompt.question_ids.shape[1]
    pre = engine.prefill(prompt)
    routes = make_routes(32, args.budget, cfg.num_hidden_layers, seed=0)
    engine.answer(pre, routes)  # scores every method once, so only decoding is timed below

    rows = 32 * q
    x = torch.randn(rows, cfg.hidden_size)
    w = torch.randn(cfg.intermediate_size, cfg.hidden_size)
    gemm_s = best_of(lambda: torch.nn.functional.linear(x, w), 20)
    gflops = 2 * rows * cfg.hidden_size * cfg.intermediate_size / gemm_s / 1e9

    # Non-embedding parameters: what every token multiplies through.
    body = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    qpass_gflop = 2 * body * q / 1e9  # per route
    qpass_s = best_of(lambda: engine.answer(pre, routes), 3) / len(routes)

    steps = {}
    n_ctx = pre.n_tokens
    for batch in (1, 12, 32, 100):
        kv = [(c.keys[:, :, : args.budget].expand(batch, -1, -1, -1).contiguous(),
               c.values[:, :, : args.budget].expand(batch, -1, -1, -1).contiguous()) for c in pre.layers]
        cache = _hf.build_cache(model, kv, extra=4)  # room for the step's token, written in place

        def step(cache=cache, batch=batch):
            ids = torch.full((batch, 1), 42)
            pos = torch.full((batch, 1), n_ctx + q)
            with _hf.routed_attention(model):
                model(input_ids=ids, past_key_values=cache, position_ids=pos)
            cache.crop(-1)  # forget the token again: every call times the same step

        steps[batch] = best_of(step, 5)

    report = {
        "question_tokens": q,
        "gemm_gflops_fp32": round(gflops),
        "question_pass_gflop_per_route": round(qpass_gflop, 2),
        "question_pass_floor_ms_per_route": round(qpass_gflop / gflops * 1e3, 1),
        "question_pass_measured_ms_per_route": round(qpass_s * 1e3, 1),
        "greedy_step_ms_by_batch": {b: round(t * 1e3) for b, t in steps.items()},
        "kvpress_per_route_s": args.kvpress_per_route,
        "engine_budget_s_for_40x_at_100_routes": round(100 * args.kvpress_per_route / 40, 2),
        "engine_budget_s_for_8x_at_12_routes": round(12 * args.kvpress_per_route / 8, 2),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
