"""bfloat16 against float32 on the bundled model: the same eval samples and routes, each
dtype in one run of the engine (one prefill per sample, every route decoded from it).

Prints, per route: the average score in each dtype, how many answers are the same text
and how many the same score, and the time per dtype. bf16's scores tie often (SnapKV's
pooled window attention especially); the engine breaks ties by position in both dtypes,
so a differing answer is bf16's rounding, not a second rule.

    python benchmarks/bf16.py                        # 4 samples x 3 tasks at 1k, 10 and 20 % kept
    python benchmarks/bf16.py -n 8 --tokens 2048
"""

from __future__ import annotations

import argparse
import time

import torch

from learnroute.engine import Engine
from learnroute.models import load_model
from learnroute.route import Route
from learnroute.tasks.metrics import score_sample
from learnroute.tasks.ruler import make_samples

METHODS = ["snapkv", "keydiff", "tova", "streaming_llm", "expected_attention", "knorm"]


def routes(n_layers: int, budgets: list[float]) -> dict[str, Route]:
    out = {"full": Route.full(n_layers)}
    for b in budgets:
        out.update({f"{m}@{b}": Route.homogeneous(m, n_layers, b) for m in METHODS})
        out[f"pyramid:snapkv@{b}"] = Route.allocated("snapkv", n_layers, b, allocator="pyramid")
        out[f"adakv:keydiff@{b}"] = Route.adakv("keydiff", n_layers, b)
    return out


def run(dtype: torch.dtype, args) -> tuple[dict[str, list[tuple[str, float]]], float]:
    model, tok = load_model(dtype=dtype)
    engine = Engine(model, tok, max_new_tokens=args.max_new_tokens)
    named = routes(model.config.num_hidden_layers, args.budgets)
    answers: dict[str, list[tuple[str, float]]] = {name: [] for name in named}
    start = time.perf_counter()
    for task in args.tasks:
        for sample in make_samples(task, tok, args.n, args.tokens, "eval", seed=args.seed):
            results = engine.run(sample.context, sample.question, list(named.values()), answer_prefix=sample.answer_prefix)
            for name, r in zip(named, results):
                answers[name].append((r.answer, score_sample(sample, r.answer)))
    return answers, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=["niah_single_2", "niah_multikey", "code_passkey"])
    ap.add_argument("-n", type=int, default=4, help="eval samples per task")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.2])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    fp32, t32 = run(torch.float32, args)
    bf16, t16 = run(torch.bfloat16, args)
    n = len(next(iter(fp32.values())))
    print(f"{n} samples ({', '.join(args.tasks)}; {args.tokens} tokens); float32 {t32:.1f} s, bfloat16 {t16:.1f} s\n")
    print("| route | float32 | bfloat16 | same answer | same score |\n|---|---|---|---|---|")
    same_text = same_score = total = 0
    for name in fp32:
        a, b = fp32[name], bf16[name]
        text = sum(x[0] == y[0] for x, y in zip(a, b))
        score = sum(x[1] == y[1] for x, y in zip(a, b))
        same_text, same_score, total = same_text + text, same_score + score, total + len(a)
        print(f"| {name} | {100 * sum(x[1] for x in a) / n:.1f} | {100 * sum(y[1] for y in b) / n:.1f} "
              f"| {text}/{n} | {score}/{n} |")
    print(f"| **all** | | | **{same_text}/{total}** | **{same_score}/{total}** |")


if __name__ == "__main__":
    main()
