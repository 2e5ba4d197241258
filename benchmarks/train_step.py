"""Gates training step cost on the default model: one 2k-token calibration sample.

Times (a) a training step as ``learnroute train`` runs it (soft masks from the once-computed
ranks, question + answer against the cached full-cache keys/values with log-mask biases,
backward into the gates, AdamW) and (b) the same step preceded by what it avoids: the
full-cache prefill and the scoring of every candidate method, which is also what a step of
``learnroute train stream=1`` costs (one fresh calibration sample per step: its prefill,
its scores, the step). Both in this process, same
cores, alternating, so the ratio is measured in one run. Peak RSS of the process is
reported at the end (it includes the model and one sample's cache).

    python benchmarks/train_step.py                  # 10 alternating pairs at 2k tokens
    python benchmarks/train_step.py --tokens 1024 --mixing mask
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from learnroute.engine import Engine
from learnroute.gates.calibration import prepare_item
from learnroute.gates.train import CANDIDATES, answer_loss, frozen
from learnroute.gates.gates import Gates
from learnroute.models import load_model
from learnroute.tasks.suite import load_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=0.1, help="mean budget (fraction kept)")
    parser.add_argument("--mixing", default="score", choices=["score", "mask"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_model()
    engine = Engine(model, tok)
    sample = load_task("niah_multikey", tok, 1, args.tokens, "calibration", seed=0)[0]
    with frozen(model):
        item = prepare_item(engine, "niah_multikey", sample, CANDIDATES, with_ref=False)
        gates = Gates(CANDIDATES, [True] * engine.n_layers)
        opt = torch.optim.AdamW([gates.theta, gates.beta], lr=0.02)

        def step(it) -> None:
            opt.zero_grad()
            masks = gates.soft_masks(it.ranks, args.fraction * it.n_tokens, temperature=0.5, tau=0.01, mixing=args.mixing)
            loss, _ = answer_loss(model, it, masks, eps=1e-6)
            loss.backward()
            opt.step()

        step(item)  # warm-up
        cached, reprefill = [], []
        for _ in range(args.pairs):
            t0 = time.perf_counter()
            step(item)
            cached.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fresh = prepare_item(engine, "niah_multikey", sample, CANDIDATES, with_ref=False)
            step(fresh)
            reprefill.append(time.perf_counter() - t0)
            del fresh
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
    result = {
        "context_tokens": item.n_tokens,
        "question_answer_tokens": int(item.ids.shape[1]),
        "layers": engine.n_layers,
        "methods": len(CANDIDATES),
        "mixing": args.mixing,
        "step_s_median": statistics.median(cached),
        "reprefill_step_s_median": statistics.median(reprefill),
        "stream_step_s_median": statistics.median(reprefill),  # stream=1: one fresh sample prefilled per step
        "speedup": statistics.median(r / c for r, c in zip(reprefill, cached)),
        "peak_rss_gib": peak_gib,
        "targets": {"step_s": 1.0, "speedup": 5.0, "peak_rss_gib": 8.0},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
