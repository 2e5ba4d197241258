"""Engine vs kvpress's pipeline: same model, same sample, each side in a fresh process.

Default model, one ~2k-token needle sample, R routes at one budget (tokens per KV head):
10 homogeneous (every candidate method) + mixed routes. The engine evaluates all R
routes from one prefill; the baseline runs kvpress's ``kv-press-text-generation``
pipeline once per route (kvpress's own press where it has one, RoutedPress otherwise).

    .venv/bin/python benchmarks/engine.py                    # 12 routes
    .venv/bin/python benchmarks/engine.py --routes 100       # 100 routes
    .venv/bin/python benchmarks/engine.py --repeats 3        # three alternating pairs, median ratio

Peak memory is the process's peak RSS during the timed work above the RSS after loading
the model (VmHWM reset through /proc/self/clear_refs), each side in a fresh subprocess.
Both sides get one warm-up forward first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import time

CANDIDATES = ["snapkv", "streaming_llm", "h2o", "tova", "knorm",
              "expected_attention", "keydiff", "critical_snapkv", "lava", "random"]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) so the peak covers the timed work only."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_routes(n_routes: int, budget: int, n_layers: int, seed: int):
    from learnroute import Route

    routes = [Route.homogeneous(m, n_layers, budget) for m in CANDIDATES]
    rng = random.Random(seed)
    while len(routes) < n_routes:
        methods = [rng.choice(CANDIDATES) for _ in range(n_layers)]
        routes.append(Route.from_layers(methods, budget, source="random", seed=seed))
    return routes[:n_routes]


def baseline_press(route, n_tokens: int):
    """kvpress's own press for homogeneous kvpress-backed routes, else RoutedPress."""
    from learnroute import RoutedPress
    from learnroute.methods import KVPRESS_METHODS, kvpress_press, resolve_budget

    methods, budgets = set(route.methods), set(route.budgets)
    if len(methods) == 1 and len(budgets) == 1 and (m := methods.pop()) in KVPRESS_METHODS:
        return kvpress_press(m, resolve_budget(budgets.pop(), n_tokens), n_tokens), True
    return RoutedPress(route), False


def side(which: str, n_routes: int, budget: int, tokens: int, max_new: int, sample_baseline: int, device: str, q):
    import torch

    import learnroute as lr
    from learnroute.demo import needle_sample

    torch.set_num_threads(2)
    model, tok = lr.load_model()
    model.to(device)
    cuda = device.startswith("cuda")

    def sync() -> None:  # CUDA runs asynchronously: wait before reading the clock
        if cuda:
            torch.cuda.synchronize()

    sample = needle_sample(tok, tokens, depth=0.5, seed=0)
    routes = make_routes(n_routes, budget, 30, seed=0)
    # Warm-up forward (thread pools, allocator, kernels) so neither side pays a cold start.
    with torch.no_grad():
        model(torch.tensor([tok.encode(sample.context)[:256]], device=device))
    sync()
    base_rss = rss_mib()
    reset_peak()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    out = {"which": which}
    if which == "engine":
        engine = lr.Engine(model, tok, max_new_tokens=max_new)
        t0 = time.perf_counter()
        prompt = engine.encode(sample.context, sample.question, sample.answer_prefix)
        engine.check_routes(routes, prompt.context_ids.shape[1])
        pre = engine.prefill(prompt)
        sync()
        t1 = time.perf_counter()
        # Score every (layer, method) the routes use up front (answer() would do it lazily)
        # so the report can split the time into prefill, scoring and decoding.
        counts = [engine.kept_counts(r, pre.n_tokens, pre.layer_tokens) for r in routes]
        for route, kept in zip(routes, counts):
            for layer, (entry, k) in enumerate(zip(route.layers, kept)):
                engine.kept_indices(pre, layer, entry.method, k)
        sync()
        t2 = time.perf_counter()
        results = engine.answer(pre, routes)
        t3 = time.perf_counter()
        out.update(seconds=t3 - t0, prefill=t1 - t0, scoring=t2 - t1, decode=t3 - t2, n_tokens=pre.n_tokens,
                   answers=[r.answer for r in results], kv_fraction=results[0].kv_fraction)
    else:
        from transformers import pipeline

        pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device=device)
        n_tokens = lr.Engine(model, tok).encode(sample.context, sample.question).context_ids.shape[1]
        idx = list(range(len(routes)))
        if sample_baseline and sample_baseline < len(routes):
            idx = sorted(random.Random(1).sample(idx, sample_baseline))
        answers, own, times = {}, {}, []
        for i in idx:
            press, is_own = baseline_press(routes[i], n_tokens)
            t0 = time.perf_counter()
            with lr.routed_attention(model):  # only matters for RoutedPress with per-layer budgets
                ans = pipe(sample.context, question=sample.question, answer_prefix=sample.answer_prefix,
                           press=press, max_new_tokens=max_new)["answer"]
            times.append(time.perf_counter() - t0)
            answers[i], own[i] = ans, is_own
        per_route = sum(times) / len(times)
        out.update(seconds=per_route * len(routes), measured=len(idx), per_route=per_route,
                   answers=answers, own=own)
    out["peak_mib"] = peak_mib() - base_rss
    if cuda:
        out["peak_gpu_mib"] = (torch.cuda.max_memory_allocated() - base_gpu) / 2**20
    q.put(out)


def run_side(*args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=side, args=(*args, q))
    p.start()
    res = q.get()
    p.join()
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routes", type=int, default=12)
    parser.add_argument("--budget", type=int, default=256, help="tokens per KV head, every layer")
    parser.add_argument("--tokens", type=int, default=2000, help="context length")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--sample-baseline", type=int, default=0,
                        help="time kvpress on this many routes only and extrapolate (0: all)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (untested here)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run both sides this many times, alternating, and report the median ratio")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    common = (args.routes, args.budget, args.tokens, args.max_new_tokens, args.sample_baseline, args.device)
    # Alternating engine/kvpress pairs: each ratio compares two runs made back to back, so
    # slow drifts of the machine hit both sides of a pair alike.
    pairs = [(run_side("engine", *common), run_side("kvpress", *common)) for _ in range(max(1, args.repeats))]
    ratios = [base["seconds"] / eng["seconds"] for eng, base in pairs]
    mid = sorted(range(len(pairs)), key=lambda i: ratios[i])[len(pairs) // 2]  # the median pair
    eng, base = pairs[mid]
    same = [eng["answers"][i] == a for i, a in base["answers"].items() if base["own"][i]]
    report = {
        "routes": args.routes, "budget": args.budget, "context_tokens": eng["n_tokens"],
        "engine_s": round(eng["seconds"], 2), "engine_prefill_s": round(eng["prefill"], 2),
        "engine_scoring_s": round(eng["scoring"], 2), "engine_decode_s": round(eng["decode"], 2),
        "kvpress_s": round(base["seconds"], 2), "kvpress_measured_routes": base["measured"],
        "kvpress_per_route_s": round(base["per_route"], 2),
        "speedup": round(ratios[mid], 1),
        "speedups_all_repeats": [round(r, 1) for r in ratios],
        "engine_s_all_repeats": [round(e["seconds"], 2) for e, _ in pairs],
        "kvpress_per_route_s_all_repeats": [round(b["per_route"], 2) for _, b in pairs],
        "device": args.device,
        "engine_peak_mib": round(eng["peak_mib"]), "kvpress_peak_mib": round(base["peak_mib"]),
        "kvpress_backed_routes_identical": f"{sum(same)}/{len(same)}",
    }
    if "peak_gpu_mib" in eng:
        report["engine_peak_gpu_mib"] = round(eng["peak_gpu_mib"])
        report["kvpress_peak_gpu_mib"] = round(base["peak_gpu_mib"])
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
