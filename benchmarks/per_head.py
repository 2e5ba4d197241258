"""Per-head routes against per-layer routes keeping the same total tokens: decode and training step.

Issue 21's speed targets, measured as ratios in one process, alternating, on the same
cores:

- **decode**: ``engine.answer`` of per-head routes (each layer's KV heads keep different
  counts) against per-layer routes of the same methods keeping the same total tokens per
  layer, under both head layouts: ``split`` (the default: each head in its own buffer,
  attention once per KV head, nothing allocated beyond what is kept) and ``padded`` (a
  layer's heads padded to its longest, the padding masked, one attention call). Target:
  per-head / per-layer <= 1.3. Every answer decodes exactly ``--max-new-tokens`` tokens
  (EOS held off), so both sides take the same decode steps: routes that keep other tokens
  give other answers, and a longer answer is not a cost of the layout (the free-length
  ratio is printed beside it). Kept and allocated bytes (with the heads' padding) are
  reported beside it.
- **train step**: a gates step (soft masks, question + answer against the cached
  keys/values with log-mask biases, backward, AdamW) with ``n_heads = H_kv`` gates per
  layer against per-layer gates. Target: per-head / per-layer <= 1.2.

Both at 1k and 2k tokens on the default model (one needle sample per length).

    .venv/bin/python benchmarks/per_head.py                  # 1024 and 2048 tokens
    .venv/bin/python benchmarks/per_head.py --tokens 1024 --pairs 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

METHODS = ["snapkv", "tova", "keydiff", "knorm"]


def route_pairs(n_layers: int, n_heads: int, budget: float, count: int, seed: int):
    """``count`` (per-head, per-layer) pairs: per-head budgets spread 0.3x-2x the mean within
    each layer, and the per-layer route giving each layer the same total (its heads' mean)."""
    from learnroute.route import LayerRoute, Route

    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        method = rng.choice(METHODS)
        heads, layers = [], []
        for _ in range(n_layers):
            raw = [rng.uniform(0.3, 2.0) for _ in range(n_heads)]
            share = [budget * r * n_heads / sum(raw) for r in raw]  # mean = budget per layer
            share = [min(1.0, s) for s in share]
            heads.append(LayerRoute.per_head([LayerRoute(method, s) for s in share]))
            layers.append(LayerRoute(method, sum(share) / n_heads))
        pairs.append((Route(heads, provenance={"source": "bench"}), Route(layers, provenance={"source": "bench"})))
    return pairs


def time_decode(engine, prefill, routes, min_new_tokens: int = 0) -> float:
    start = time.perf_counter()
    engine.answer(prefill, routes, min_new_tokens=min_new_tokens)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--routes", type=int, default=8, help="route pairs per length (one decode batch each side)")
    parser.add_argument("--budget", type=float, default=0.15, help="mean fraction kept per layer")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=3, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    import torch

    import learnroute as lr
    from learnroute.demo import needle_sample
    from learnroute.gates.gates import Gates
    from learnroute.gates.calibration import prepare_item
    from learnroute.gates.train import CANDIDATES, answer_loss, frozen
    from learnroute.tasks.suite import load_task

    torch.set_num_threads(args.threads)
    model, tok = lr.load_model()
    # One decode batch per side: identical decode work apart from the heads' layout.
    engine = lr.Engine(model, tok, max_new_tokens=args.max_new_tokens, max_padding=100.0, park_after=None)
    padded = lr.Engine(model, tok, max_new_tokens=args.max_new_tokens, max_padding=100.0, park_after=None,
                       head_layout="padded")
    out = {"threads": args.threads, "budget": args.budget, "routes": args.routes, "lengths": {}}
    for n_tokens in args.tokens:
        sample = needle_sample(tok, n_tokens, depth=0.5, seed=0)
        prefill = engine.prefill(engine.encode(sample.context, sample.question))
        pairs = route_pairs(engine.n_layers, engine.n_kv_heads, args.budget, args.routes, seed=n_tokens)
        headed, layered = [p[0] for p in pairs], [p[1] for p in pairs]
        res_h, res_l = engine.answer(prefill, headed), engine.answer(prefill, layered)  # warm-up, bytes
        res_p = padded.answer(prefill, headed)
        if [r.token_ids for r in res_p] != [r.token_ids for r in res_h]:
            raise SystemExit("split and padded heads gave different answers")
        kept_h = sum(r.kv_bytes for r in res_h)
        alloc_h = sum(r.allocated_kv_bytes for r in res_h)
        alloc_p = sum(r.allocated_kv_bytes for r in res_p)
        kept_l = sum(r.kv_bytes for r in res_l)
        steps_h = max(len(r.token_ids) for r in res_h)  # free-length decode steps of each batch
        steps_l = max(len(r.token_ids) for r in res_l)
        dec_h, dec_p, dec_l, free_h, free_l = [], [], [], [], []
        for _ in range(args.pairs):
            dec_h.append(time_decode(engine, prefill, headed, args.max_new_tokens))
            dec_p.append(time_decode(padded, prefill, headed, args.max_new_tokens))
            dec_l.append(time_decode(engine, prefill, layered, args.max_new_tokens))
            free_h.append(time_decode(engine, prefill, headed))
            free_l.append(time_decode(engine, prefill, layered))

        item_sample = load_task("niah_multikey", tok, 1, n_tokens, "calibration", seed=0)[0]
        with frozen(model):
            item = prepare_item(engine, "niah_multikey", item_sample, CANDIDATES, with_ref=False)
            gates = {h: Gates(CANDIDATES, [True] * engine.n_layers, n_heads=h) for h in (1, engine.n_kv_heads)}
            opts = {h: torch.optim.AdamW([g.theta, g.beta], lr=0.02) for h, g in gates.items()}

            def step(h: int) -> float:
                start = time.perf_counter()
                opts[h].zero_grad()
                masks = gates[h].soft_masks(item.ranks, args.budget * item.n_tokens, temperature=0.5, tau=0.01)
                loss, _ = answer_loss(model, item, masks, eps=1e-6)
                loss.backward()
                opts[h].step()
                return time.perf_counter() - start

            step(1), step(engine.n_kv_heads)  # warm-up
            st_l, st_h = [], []
            for _ in range(args.pairs * 3):
                st_l.append(step(1))
                st_h.append(step(engine.n_kv_heads))
        fig = {
            "decode_per_head_s": statistics.median(dec_h), "decode_per_layer_s": statistics.median(dec_l),
            "decode_ratio": statistics.median(dec_h) / statistics.median(dec_l),
            "decode_padded_s": statistics.median(dec_p),
            "decode_padded_ratio": statistics.median(dec_p) / statistics.median(dec_l),
            "decode_tokens": args.max_new_tokens,
            "free_decode_ratio": statistics.median(free_h) / statistics.median(free_l),
            "free_decode_steps_per_head": steps_h, "free_decode_steps_per_layer": steps_l,
            "kept_bytes_per_head": kept_h, "allocated_bytes_per_head": alloc_h, "kept_bytes_per_layer": kept_l,
            "allocated_over_kept": alloc_h / kept_h,
            "allocated_padded_bytes_per_head": alloc_p, "allocated_over_kept_padded": alloc_p / kept_h,
            "step_per_head_s": statistics.median(st_h), "step_per_layer_s": statistics.median(st_l),
            "step_ratio": statistics.median(st_h) / statistics.median(st_l),
        }
        out["lengths"][n_tokens] = fig
        print(f"{n_tokens} tokens: decode {args.routes} routes per-head {fig['decode_per_head_s']:.2f} s "
              f"(split heads) / {fig['decode_padded_s']:.2f} s (padded heads) vs per-layer "
              f"{fig['decode_per_layer_s']:.2f} s (x{fig['decode_ratio']:.2f} split, x{fig['decode_padded_ratio']:.2f} "
              f"padded; target <= 1.3; {args.max_new_tokens} tokens each; free length (split) "
              f"x{fig['free_decode_ratio']:.2f} with {steps_h} vs {steps_l} steps); kept bytes "
              f"{kept_h / 2**20:.2f} vs {kept_l / 2**20:.2f} MiB, allocated {alloc_h / 2**20:.2f} MiB split "
              f"(x{fig['allocated_over_kept']:.2f}), {alloc_p / 2**20:.2f} MiB padded "
              f"(x{fig['allocated_over_kept_padded']:.2f}); train step per-head {fig['step_per_head_s']:.3f} s vs "
              f"per-layer {fig['step_per_layer_s']:.3f} s (x{fig['step_ratio']:.2f}; target <= 1.2)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
