"""Training step cost with a decode-time LoRA adapter vs a gates-only step (default model).

One calibration sample, prefilled once. Times, alternating in this process (same cores):

- (a) a gates-only step as ``learnroute train`` runs it: soft masks from the ranks,
  question + answer against the cached keys/values with log-mask biases, backward into
  the gates, AdamW;
- (b) the same step with the adapter on (``adapter: true``, joint training): LoRA on the
  chosen target modules, backward into the gates and the adapter, AdamW on both;
- (c) a fixed-route adapter step (``learn: none``): hard masks, backward into the adapter.

Target: (b) / (a) <= 1.5.

    python benchmarks/adapter_step.py --threads 1        # 1k tokens, attention targets, rank 8
    python benchmarks/adapter_step.py --threads 1 --tokens 2048 \
        --targets q_proj k_proj v_proj o_proj gate_proj up_proj down_proj

On cores shared with other jobs, --threads 1 keeps the figures stable (2 threads
competing for 2 busy cores measured 10x slower steps and ratios that were noise).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from types import SimpleNamespace

import torch

from learnroute.engine import Engine
from learnroute.gates.cotrain import AdapterTraining, FixedGates
from learnroute.gates.gates import Gates
from learnroute.gates.calibration import prepare_item
from learnroute.gates.train import CANDIDATES, answer_loss, frozen
from learnroute.models import load_model, model_name
from learnroute.route import Route
from learnroute.tasks.suite import load_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.1, help="mean budget (fraction kept)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_model()
    engine = Engine(model, tok)
    sample = load_task("niah_multikey", tok, 1, args.tokens, "calibration", seed=0)[0]
    cfg = SimpleNamespace(lora_rank=args.rank, lora_alpha=2.0 * args.rank, lora_targets=args.targets, seed=0,
                          train_seed=None, adapter_lr=1e-3)
    with frozen(model):
        item = prepare_item(engine, "niah_multikey", sample, CANDIDATES, with_ref=False)
        L = engine.n_layers
        gates = Gates(CANDIDATES, [True] * L)
        fixed = FixedGates(CANDIDATES, [True] * L, Route.homogeneous("snapkv", L, args.fraction))
        gate_opt = torch.optim.AdamW([gates.theta, gates.beta], lr=0.02)
        lora = AdapterTraining(model, cfg, model_name(model))
        n_lora = sum(p.numel() for p in lora.params)
        joint_opt = torch.optim.AdamW([{"params": [gates.theta, gates.beta]}, lora.param_group(cfg)], lr=0.02)
        fixed_opt = torch.optim.AdamW([lora.param_group(cfg)])
        mean = args.fraction * item.n_tokens

        def gates_step(opt) -> None:
            opt.zero_grad()
            masks = gates.soft_masks(item.ranks, mean, temperature=0.5, tau=0.01)
            loss, _ = answer_loss(model, item, masks, eps=1e-6)
            loss.backward()
            opt.step()

        def fixed_step() -> None:
            fixed_opt.zero_grad()
            loss, _ = answer_loss(model, item, fixed.hard_masks(item.ranks, fixed.harden(args.fraction, item.n_tokens)), eps=1e-6, hard=True)
            loss.backward()
            fixed_opt.step()

        from learnroute import adapter as A

        gates_step(gate_opt)  # warm-up, adapter attached but off (the LoRA layers return the base output)
        A.detach(model, lora.adapter)
        plain, joint, fixed_only = [], [], []  # (wall s, process CPU s) per step
        clock = lambda: (time.perf_counter(), time.process_time())
        since = lambda t: (time.perf_counter() - t[0], time.process_time() - t[1])
        for _ in range(args.pairs):
            t0 = clock()
            gates_step(gate_opt)  # no adapter in the model at all
            plain.append(since(t0))
            lora = AdapterTraining(model, cfg, model_name(model))  # re-attach (same seed: same init)
            joint_opt.param_groups[1]["params"] = lora.params
            fixed_opt.param_groups[0]["params"] = lora.params
            joint_opt.state.clear()
            fixed_opt.state.clear()
            with lora.scope():
                t0 = clock()
                gates_step(joint_opt)
                joint.append(since(t0))
                t0 = clock()
                fixed_step()
                fixed_only.append(since(t0))
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
    result = {
        "context_tokens": item.n_tokens,
        "question_answer_tokens": int(item.ids.shape[1]),
        "layers": L,
        "lora_rank": args.rank,
        "lora_targets": args.targets,
        "lora_params": n_lora,
        "lora_bytes_fp32": 4 * n_lora,
        # wall clock, and the process's CPU time (less sensitive to other jobs on shared cores)
        "gates_step_s_median": statistics.median(w for w, _ in plain),
        "joint_step_s_median": statistics.median(w for w, _ in joint),
        "fixed_route_adapter_step_s_median": statistics.median(w for w, _ in fixed_only),
        "joint_over_gates": statistics.median(j[0] / p[0] for j, p in zip(joint, plain)),
        "fixed_over_gates": statistics.median(f[0] / p[0] for f, p in zip(fixed_only, plain)),
        "gates_step_cpu_s_median": statistics.median(c for _, c in plain),
        "joint_step_cpu_s_median": statistics.median(c for _, c in joint),
        "fixed_route_adapter_step_cpu_s_median": statistics.median(c for _, c in fixed_only),
        "joint_over_gates_cpu": statistics.median(j[1] / p[1] for j, p in zip(joint, plain)),
        "fixed_over_gates_cpu": statistics.median(f[1] / p[1] for f, p in zip(fixed_only, plain)),
        "peak_rss_gib": peak_gib,
        "target": {"joint_over_gates": 1.5},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
