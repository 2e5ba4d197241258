"""The project's main job for now (``make run``): answer a long-context question with the
full cache and with three routes, printing answers and KV bytes kept."""

from __future__ import annotations

import random
from dataclasses import dataclass

from learnroute import _hf
from learnroute.engine import Engine
from learnroute.methods.budgets import Budget
from learnroute.route import Route
from learnroute.route import parse_budget as route_parse_budget

# RULER's noise haystack sentence block and needle template (background.md §5).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "One of the special magic numbers for {key} is: {value}. "
KEYS = ("lucky-river", "silent-moon", "brave-falcon", "amber-forest", "quiet-harbor", "golden-canyon")


@dataclass
class NeedleSample:
    context: str
    question: str
    answer_prefix: str
    answer: str


def needle_sample(tokenizer, n_tokens: int, depth: float, seed: int) -> NeedleSample:
    """A single-needle haystack of about ``n_tokens`` tokens, needle at ``depth`` in [0, 1]."""
    rng = random.Random(seed)
    key = rng.choice(KEYS)
    value = str(rng.randint(1_000_000, 9_999_999))
    per_block = len(tokenizer.encode(NOISE, add_special_tokens=False))
    blocks = max(1, n_tokens // per_block)
    at = min(blocks, int(round(depth * blocks)))
    context = NOISE * at + NEEDLE.format(key=key, value=value) + NOISE * (blocks - at)
    question = f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    prefix = f"The special magic number for {key} mentioned in the provided text is"
    return NeedleSample(context, question, prefix, value)


def parse_budget(text: str) -> Budget:
    """A command-line budget (see :func:`learnroute.route.parse_budget`), as argparse wants it."""
    import argparse

    try:
        return route_parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def describe_budget(budget: Budget) -> str:
    return f"{budget} of the context" if isinstance(budget, float) else f"{budget} tokens per KV head"


def main(argv: list[str] | None = None) -> int:
    """Demo: full cache vs three routes on one needle sample with the default model."""
    import argparse

    from learnroute.models import load_model, model_name

    parser = argparse.ArgumentParser(prog="learnroute demo", description=main.__doc__)
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: bundled SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=2000, help="context length in tokens")
    parser.add_argument(
        "--budget",
        type=parse_budget,
        default=0.25,
        help="kept per layer: an integer is tokens per KV head (128), a decimal a fraction of the context (0.25)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model)
    name = model_name(model)
    n_layers = len(_hf.attention_modules(model))
    sample = needle_sample(tokenizer, args.tokens, depth=0.4, seed=args.seed)
    half = n_layers // 2
    routes = [
        Route.full(n_layers, model=name),
        Route.homogeneous("snapkv", n_layers, args.budget, model=name),
        Route.homogeneous("tova", n_layers, args.budget, model=name),
        Route.from_layers(
            ["tova"] * half + ["knorm"] * (n_layers - half), args.budget, model=name, source="hand-mixed"
        ),
    ]
    engine = Engine(model, tokenizer, max_new_tokens=16)
    results = engine.run(sample.context, sample.question, routes, answer_prefix=sample.answer_prefix)
    print(f"model {name}, {n_layers} layers; needle {sample.answer}; budget {describe_budget(args.budget)}")
    for r in results:
        ok = "ok " if sample.answer in r.answer else "MISS"
        print(
            f"  {ok} {r.route.describe():32s} kept {r.kv_bytes / 2**20:7.2f} MiB "
            f"({100 * r.kv_fraction:5.1f}% of full)  answer: {r.answer.strip()!r}"
        )
    return 0
