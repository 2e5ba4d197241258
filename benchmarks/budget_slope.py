"""Gates training step with ``budget_slope`` against without, on the default model.

``budget_slope`` (issue 58; on in the recipe) makes the budget logits affine in log-budget,
one extra (L x H_kv) parameter vector held small by ``slope_weight``, so that each training
budget gets its own allocation. The issue's target: training time per route within 1.5x of
the one-shape recipe's for the same steps. This times the recipe's step (per-head budgets
over keydiff, learn: budgets, one 1k calibration sample, a budget drawn per step from the
recipe's five) with the slope and its penalty and without them, alternating in one process
on the same cores, so the ratio is measured in one run.

    python benchmarks/budget_slope.py                 # 15 alternating pairs at 1k tokens
    python benchmarks/budget_slope.py --tokens 2048 --pairs 10
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from learnroute.engine import Engine
from learnroute.gates.calibration import prepare_item
from learnroute.gates.gates import Gates
from learnroute.gates.train import CANDIDATES, answer_loss, frozen
from learnroute.models import load_model
from learnroute.tasks.suite import load_task

BUDGETS = (0.075, 0.1, 0.15, 0.2, 0.4)  # the recipe's (configs/train/default.yaml)
SLOPE_WEIGHT = 1.0  # the recipe's slope_weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_model()
    engine = Engine(model, tok)
    sample = load_task("niah_multikey", tok, 1, args.tokens, "calibration", seed=0)[0]
    ref = statistics.geometric_mean(BUDGETS)  # the trainer's b_ref
    with frozen(model):
        item = prepare_item(engine, "niah_multikey", sample, CANDIDATES, with_ref=False)
        runs = {}
        for slope in (False, True):
            gates = Gates(CANDIDATES, [True] * engine.n_layers, learn="budgets", n_heads=engine.n_kv_heads,
                          init_methods=["keydiff"] * engine.n_layers, budget_slope=slope, ref_budget=ref)
            runs[slope] = (gates, torch.optim.AdamW(gates.trainable(), lr=0.03))

        def step(slope: bool, fraction: float) -> float:
            gates, opt = runs[slope]
            t0 = time.perf_counter()
            opt.zero_grad()
            masks = gates.soft_masks(item.ranks, fraction * item.n_tokens, temperature=0.2, tau=0.01)
            loss, _ = answer_loss(model, item, masks, eps=1e-6)
            if gates.beta_slope is not None:  # the recipe's slope_weight (1.0) penalty, as train.py adds it
                loss = loss + SLOPE_WEIGHT * gates.slope_penalty()
            loss.backward()
            opt.step()
            return time.perf_counter() - t0

        step(False, 0.1), step(True, 0.1)  # warm-up
        draws = random.Random(0)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.pairs):
            fraction = draws.choice(BUDGETS)  # the same budget for both sides of a pair
            for slope in (False, True):
                times[slope].append(step(slope, fraction))
    result = {
        "context_tokens": item.n_tokens,
        "layers": engine.n_layers,
        "kv_heads": engine.n_kv_heads,
        "pairs": args.pairs,
        "step_s_median": statistics.median(times[False]),
        "step_budget_slope_s_median": statistics.median(times[True]),
        "ratio": statistics.median(s / p for s, p in zip(times[True], times[False])),
        "targets": {"ratio": 1.5},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
