"""Full-cache accuracy of the non-NIAH task families (learnroute/tasks/families.py).

For each family: N eval samples (seed 0) at a target context length, prefilled and
answered with the full cache through ``learnroute.Engine`` the way ``learnroute bench``
does it (chat template, greedy, each task's max_new_tokens, decoding stops at EOS),
scored with ``score_sample``. Prints a markdown table: family, n, full-cache score x100,
mean context tokens (with the chat template), seconds.

    python benchmarks/families_fullcache.py                       # 12 samples each at 1k
    python benchmarks/families_fullcache.py --tokens 4096 -n 6
    python benchmarks/families_fullcache.py --tasks kv_json --show  # print each prediction

The families must score >= 30 at 1k tokens on the default model (issue 20), or eviction
cannot be judged on them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from learnroute import _hf
from learnroute.engine import Engine
from learnroute.models import load_model, model_name
from learnroute.route import Route
from learnroute.tasks.families import FAMILIES
from learnroute.tasks.metrics import score_sample
from learnroute.tasks.ruler import make_samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="target context tokens (context_tokens)")
    ap.add_argument("-n", type=int, default=12, help="eval samples per family")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", nargs="+", default=list(FAMILIES), help="families (default: all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on shared cores)")
    ap.add_argument("--model", default=None, help="model (default: learnroute's default model)")
    ap.add_argument("--show", action="store_true", help="print every prediction with its references")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model) if args.model else load_model()
    n_layers = len(_hf.attention_modules(model))
    engine = Engine(model, tokenizer)
    full = Route.full(n_layers, model=model_name(model))
    rows = []
    for task in args.tasks:
        start = time.perf_counter()
        scores, lengths = [], []
        for sample in make_samples(task, tokenizer, args.n, args.tokens, "eval", args.seed):
            max_new = sample.meta["max_new_tokens"]
            prompt = engine.encode(sample.context, sample.question, sample.answer_prefix, max_new_tokens=max_new)
            prefill = engine.prefill(prompt)
            (result,) = engine.answer(prefill, [full], max_new_tokens=max_new)
            scores.append(score_sample(sample, result.answer))
            lengths.append(prompt.context_ids.shape[1])
            if args.show:
                print(f"{sample.id}: {scores[-1]:.2f} {result.answer!r} <- {sample.answers}", flush=True)
        rows.append((task, len(scores), 100 * statistics.mean(scores), statistics.mean(lengths),
                     time.perf_counter() - start))
        print(f"# {task}: {rows[-1][2]:.1f}", flush=True)
    print(f"\n{model_name(model)}, full cache, target {args.tokens} tokens, eval split, seed {args.seed}\n")
    print("| family | n | full-cache score x100 | mean context tokens | seconds |")
    print("|---|---|---|---|---|")
    for task, n, s, length, seconds in rows:
        print(f"| {task} | {n} | {s:.1f} | {length:.0f} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
