"""Profile cost on the default model: 30 layers x 10 methods, one budget, 2k tokens.

The issue's target: 32 calibration samples in under 20 minutes on 2 CPU cores. By default
this times ``--samples`` samples end to end (model load excluded) and extrapolates to
``--target-samples`` from the per-sample time, with the split into prefill, scoring
(all methods, all layers) and the L x M teacher-forced cells.

    python benchmarks/profile_cost.py                       # 4 samples, extrapolated to 32
    python benchmarks/profile_cost.py --samples 32          # the full measurement
    python benchmarks/profile_cost.py --granularity layer head --samples 2   # per-head cost beside per-layer

With several ``--granularity`` values, each sample is profiled once per granularity, one
after the other, so their ratio is measured in one run on the same cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from learnroute.engine import Engine
from learnroute.models import load_model
from learnroute.profile import CANDIDATES, sample_damage
from learnroute.tasks.suite import load_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--target-samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--granularity", nargs="+", default=["layer"], choices=["layer", "head"])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_model()
    engine = Engine(model, tok)
    tasks = ["niah_single_2", "niah_multikey", "niah_multivalue", "multihop_qa"]
    samples = [s for i in range(args.samples) for s in load_task(tasks[i % 4], tok, 1, args.tokens, "calibration", seed=i)]
    per: dict[str, list[dict]] = {g: [] for g in args.granularity}
    start = time.perf_counter()
    for s in samples:
        for g in args.granularity:
            t0 = time.perf_counter()
            d = sample_damage(engine, s, [args.budget], CANDIDATES, granularity=g)
            row = {"total": time.perf_counter() - t0, **d["seconds"], "n": d["n_tokens"], "answer": d["answer_tokens"]}
            per[g].append(row)
            print(json.dumps({"granularity": g, **{k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}}),
                  flush=True)
    wall = time.perf_counter() - start
    result = {
        "layers": engine.n_layers,
        "kv_heads": engine.n_kv_heads,
        "methods": len(CANDIDATES),
        "tokens": args.tokens,
        "budget": args.budget,
        "samples_timed": len(samples),
        "wall_s": wall,
        "target_min": 20,
    }
    for g, rows in per.items():
        mean = {k: statistics.mean(p[k] for p in rows) for k in ("total", "prefill", "scores", "cells")}
        result[g] = {"per_sample_s": mean, f"projected_min_for_{args.target_samples}": mean["total"] * args.target_samples / 60}
    if len(per) == 2:
        result["head_over_layer"] = result["head"]["per_sample_s"]["total"] / result["layer"]["per_sample_s"]["total"]
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
