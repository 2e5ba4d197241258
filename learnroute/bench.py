"""``learnroute bench``: routes x budgets x tasks through the one engine, into a run folder.

Per sample the engine prefills once and decodes every (route, budget) cell from that
prefill. Results are appended to ``results.jsonl`` after each sample (one locked write
per sample), so a killed run loses at most the sample in progress and a rerun of the same
config skips the finished cells. Under ``torchrun`` / ``accelerate launch`` the samples are
sharded across processes, which all append to the same folder.

Run folder::

    config.yaml      the resolved config          versions.json  library versions, git commit (every start)
    samples.jsonl    every sample evaluated        results.jsonl  one row per task x sample x route x budget
    summary.csv/.md  tables (learnroute.report)   plot.png       average score vs budget
"""

from __future__ import annotations

import glob
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from learnroute.budget_routes import BudgetRoutes, load_route_file
from learnroute.methods.registry import METHODS
from learnroute.route import Route, RouteError, budget_problem, parse_budget
from learnroute.runs import (
    append_jsonl,
    device_problem,
    DTYPE_HELP,
    Dtype,
    dtype_problem,
    prepare_folder,
    process_state,
    read_jsonl,
    resolve_device,
    result_key,
    wandb_run,
)
from learnroute.tasks.suite import check_tasks, load_tasks

Budget = int | float
ROUTE_KINDS = ("full", "homogeneous:<method>", "pyramid:<method>", "adakv:<method>", "<route file or glob>",
               "<route file>@<budget>")


@dataclass
class BenchConfig:
    """What ``learnroute bench`` evaluates. Budgets are tokens per KV head (int) or
    fractions of the context (float in (0, 1])."""

    model: str | None = field(default=None, metadata={"help": "HF model folder or hub id; null = bundled SmolLM2"})
    tasks: dict[str, int] = field(
        default_factory=lambda: {"niah_single_2": 4},
        metadata={"help": "task name -> number of eval samples: a generated family, longbench/<dataset>, or jsonl:PATH (your records' eval split)"},
    )
    context_tokens: int = field(
        default=2048, metadata={"help": "context length of generated samples; LongBench truncation limit (tokens)"}
    )
    budgets: list[Budget] = field(default_factory=lambda: [0.25], metadata={"help": "budgets to evaluate"})
    routes: list[str] = field(
        default_factory=lambda: ["full", "homogeneous:snapkv"],
        metadata={
            "help": "full | homogeneous:<method> | pyramid:<method> | adakv:<method> | route file | glob of route files | "
            "FILE@BUDGET (that file at that budget only, e.g. a profile route made for it)"
        },
    )
    route_file_budgets: Literal["scale", "file"] = field(
        default="scale",
        metadata={
            "help": "scale: route files keep their methods, their per-layer budget shape is rescaled to each "
            "budget; file: evaluate each file once at its own budgets"
        },
    )
    query_aware: bool = field(default=False, metadata={"help": "put the question in the prefill (scored)"})
    seed: int = field(default=0, metadata={"help": "seed of the eval sample stream"})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "cap on answer tokens; null = each task's own (RULER / LongBench)"}
    )
    stop_at_final_score: bool = field(
        default=False,
        metadata={"help": "end an answer once its score can no longer change (RULER's string_match_all/part "
                          "with every reference found); the same scores, shorter predictions, fewer steps"},
    )
    max_batch: int = field(default=32, metadata={"help": "most routes decoded as one batch"})
    max_padding: float = field(
        default=4.0,
        metadata={"help": "routes of different per-layer budgets share a decode batch while padding them "
                          "costs at most this factor in cache size; 1 = identical shapes only"},
    )
    longbench_dir: str | None = field(
        default=None, metadata={"help": "folder of LongBench JSONL files (default $LEARNROUTE_LONGBENCH)"}
    )
    dtype: Dtype = field(default="float32", metadata={"help": DTYPE_HELP})
    device: str = field(
        default="auto", metadata={"help": "auto (CUDA when available) | cpu | cuda (refused without CUDA)"}
    )
    output: str = field(default="runs/bench", metadata={"help": "run folder"})
    wandb: bool = field(default=False, metadata={"help": "log to Weights & Biases (offline without network)"})
    wandb_project: str = field(default="learnroute", metadata={"help": "wandb project"})

    def validate(self) -> list[str]:
        """Problems that need no model: bad budgets, routes, tasks, sizes."""
        problems = []
        if not self.budgets:
            problems.append("budgets is empty; give at least one (tokens per KV head or a fraction)")
        for b in self.budgets:
            if (p := budget_problem(b)) is not None:
                problems.append(f"budgets: {p}")
        if not self.routes:
            problems.append(f"routes is empty; valid forms: {', '.join(ROUTE_KINDS)}")
        asked = None if self.route_file_budgets == "file" else self.budgets
        for spec in self.routes:
            problems += route_spec_problems(spec, asked)
        problems += check_tasks(dict(self.tasks), "eval", self.longbench_dir)
        for name, n in self.tasks.items():
            if n < 1:
                problems.append(f"tasks.{name}: sample count must be >= 1, got {n}")
        if self.context_tokens < 16:
            problems.append(f"context_tokens must be >= 16, got {self.context_tokens}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1 or null, got {self.max_new_tokens}")
        if self.max_batch < 1:
            problems.append(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_padding < 1:
            problems.append(f"max_padding must be >= 1 (1 = identical shapes only), got {self.max_padding}")
        if self.route_file_budgets not in ("scale", "file"):
            problems.append(f"route_file_budgets must be 'scale' or 'file', got {self.route_file_budgets!r}")
        if (p := device_problem(self.device)) is not None:
            problems.append(p)
        if (p := dtype_problem(self.dtype)) is not None:
            problems.append(p)
        return problems


# ---------------------------------------------------------------------------- routes


def pinned(spec: str) -> tuple[str, Budget | None]:
    """``FILE@BUDGET`` -> (FILE, budget); any other spec -> (spec, None). A route file made
    for one budget (a profile's allocation for it) is run at that budget only."""
    head, sep, tail = spec.rpartition("@")
    if not sep or not head or glob.has_magic(head) or not Path(head).is_file():
        return spec, None
    return head, parse_budget(tail)  # ValueError says what a budget may be


def route_spec_problems(spec: str, budgets: list[Budget] | None = None) -> list[str]:
    """What is wrong with one route spec (empty list if fine); reads route files. With
    ``budgets`` (those the bench asks for; None: a file run at its own budgets), a
    budget-conditional file is also checked to answer each (or its ``@BUDGET``)."""
    kind, sep, method = spec.partition(":")
    if spec == "full":
        return []
    if sep and kind in ("homogeneous", "pyramid", "adakv"):
        if method not in METHODS:
            return [f"route {spec!r}: unknown method {method!r}; registered: {', '.join(METHODS)}"]
        return []
    try:
        spec, pin = pinned(spec)
    except ValueError as e:
        return [f"route {spec!r}: {e}"]
    paths = sorted(glob.glob(spec))
    if not paths:
        return [f"route {spec!r} is neither one of {', '.join(ROUTE_KINDS)} nor an existing file"]
    problems = []
    for p in paths:
        try:
            found = load_route_file(p)
        except RouteError as e:
            problems.append(str(e))
            continue
        for route in found.routes if isinstance(found, BudgetRoutes) else [found]:
            if route.adapter_path is not None and not route.adapter_path.is_dir():
                problems.append(f"route file {p} names adapter folder {route.adapter_path}, which does not exist")
                break
        if isinstance(found, BudgetRoutes) and budgets is not None:
            # a budget outside those it holds (outside: error), before any model loads
            for b in [pin] if pin is not None else budgets:
                try:
                    found.at(b)
                except RouteError as e:
                    problems.append(str(e))
    return problems


def nominal_budget(route: Route) -> Budget:
    """One budget figure for a route evaluated at its own budgets (uniform value or mean)."""
    if len(set(route.budgets)) == 1:
        return route.budgets[0]
    mean = sum(route.budgets) / route.n_layers
    return round(mean) if all(isinstance(b, int) for b in route.budgets) else mean


@dataclass
class Cell:
    """One (route, budget) column of the benchmark; ``budget`` is None for the full cache."""

    name: str
    budget: Budget | None
    route: Route

    @property
    def key(self) -> tuple[str, str]:
        """(route, budget) as in :func:`learnroute.runs.result_key` without the sample."""
        return self.name, json.dumps(self.budget)


def resolve_routes(config: BenchConfig, n_layers: int, model: str) -> list[Cell]:
    """Expand route specs x budgets into cells; route files are checked against the model."""
    cells: list[Cell] = []
    problems = []
    for spec in config.routes:
        kind, _, method = spec.partition(":")
        if spec == "full":
            cells.append(Cell("full", None, Route.full(n_layers, model=model)))
        elif kind == "homogeneous":
            cells += [Cell(spec, b, Route.homogeneous(method, n_layers, b, model=model)) for b in config.budgets]
        elif kind == "pyramid":
            cells += [
                Cell(spec, b, Route.allocated(method, n_layers, b, "pyramid", model=model)) for b in config.budgets
            ]
        elif kind == "adakv":  # the layer's budget shared across its KV heads by scores, per sample
            cells += [Cell(spec, b, Route.adakv(method, n_layers, b, model=model)) for b in config.budgets]
        else:
            spec, pin = pinned(spec)
            for path in sorted(glob.glob(spec)):
                route = load_route_file(path)
                try:
                    route.check_layers(n_layers, f"model {model}")
                except RouteError as e:
                    problems.append(f"{path}: {e}")
                    continue
                if isinstance(route, BudgetRoutes):  # the allocation for each budget (file: those it holds)
                    asked = [pin] if pin is not None else (
                        route.budgets if config.route_file_budgets == "file" else config.budgets)
                    cells += [Cell(path, b, route.at(b)) for b in asked]
                elif pin is not None:
                    cells.append(Cell(path, pin, route.rescaled(pin)))
                elif config.route_file_budgets == "file":
                    cells.append(Cell(path, nominal_budget(route), route))
                else:
                    cells += [Cell(path, b, route.rescaled(b)) for b in config.budgets]
    if problems:
        raise RouteError("route files do not fit the model:\n  " + "\n  ".join(problems))
    seen = set()
    unique = []
    for c in cells:  # the same file matched by two globs is evaluated once
        if c.key not in seen:
            seen.add(c.key)
            unique.append(c)
    return unique


def mode_mismatches(cells: list[Cell], query_aware: bool) -> list[str]:
    """One line per learned route file trained in the other prompt mode than this bench runs.

    A route trained query-agnostic and run query-aware dropped with more cache on the
    four out-of-family families (docs/results.md, "Every budget"); trained query-aware it held.
    Routes without a training config (homogeneous, profile, hand-written) are not named."""
    mode = {True: "query-aware", False: "query-agnostic"}
    lines, seen = [], set()
    for c in cells:
        trained = (c.route.provenance.get("train_config") or {}).get("query_aware")
        if isinstance(trained, bool) and trained != query_aware and c.name not in seen:
            seen.add(c.name)
            lines.append(f"{c.name} was trained {mode[trained]} and is benched {mode[query_aware]}; to deploy it "
                         f"{mode[query_aware]}, train with query_aware={str(query_aware).lower()}")
    return lines


# ---------------------------------------------------------------------------- the run


def run_bench(config: BenchConfig, overwrite: bool = False, *, prefills=None) -> Path:
    """Evaluate every cell on every sample (this process's shard); returns the run folder.
    ``prefills``: a :class:`~learnroute.engine.PrefillStore` shared with other stages."""
    from tqdm import tqdm

    from learnroute import _hf
    from learnroute.engine import Engine
    from learnroute.models import load_model, model_name
    from learnroute.report import summarize

    device = resolve_device(config.device)  # cuda without CUDA is refused before anything is written
    state = process_state()  # samples are sharded across ranks (torchrun / accelerate launch)
    rank, world = state.process_index, state.num_processes
    # Routes may be added on a resume (a study that grows): their cells run, finished cells are kept.
    out = prepare_folder(config, overwrite, state.is_main_process, growable=("routes",))
    state.wait_for_everyone()

    model, tokenizer = load_model(config.model, dtype=config.dtype)
    if device == "cuda":
        model.to(state.device)  # this rank's GPU
    name = model_name(model)
    cells = resolve_routes(config, len(_hf.attention_modules(model)), name)
    if state.is_main_process:
        for line in mode_mismatches(cells, config.query_aware):
            print(f"note: {line}", file=sys.stderr)
    samples = load_tasks(config.tasks, tokenizer, config.context_tokens, "eval", config.seed, config.longbench_dir)
    if state.is_main_process:
        existing = {r["id"] for r in read_jsonl(out / "samples.jsonl")}
        append_jsonl(out / "samples.jsonl", [{"task": t, **s.to_dict()} for t, s in samples if s.id not in existing])
    done = {result_key(r) for r in read_jsonl(out / "results.jsonl")}
    mine = samples[rank::world]
    engine = Engine(
        model, tokenizer, query_aware=config.query_aware, max_batch=config.max_batch, max_padding=config.max_padding,
        prefills=prefills,
    )
    engine.check_routes([c.route for c in cells])  # adapters named by route files fit the model, before any forward
    newline_id = tokenizer.encode("\n", add_special_tokens=False)[-1]  # as LongBench's pred.py takes it
    wb = wandb_run(config, out) if config.wandb and state.is_main_process else None
    warned: set[tuple] = set()
    bar = tqdm(mine, desc=f"bench[{rank}]" if world > 1 else "bench", disable=not state.is_main_process, unit="sample")
    for task, sample in bar:
        todo = [c for c in cells if (sample.id, *c.key) not in done]
        if not todo:
            continue
        rows = _bench_sample(engine, config, task, sample, todo, newline_id, warned, rank)
        append_jsonl(out / "results.jsonl", rows)
        if wb is not None:
            for row in rows:
                wb.log({f"score/{row['task']}/{row['route']}@{row['budget']}": row["score"]})
        bar.set_postfix(task=task)
    state.wait_for_everyone()
    if state.is_main_process:
        summary = summarize(out)
        if wb is not None:
            _log_summary(wb, summary)
    return out


def _bench_sample(engine, config: BenchConfig, task: str, sample, todo: list, newline_id: int, warned: set,
                  rank: int) -> list[dict]:
    """One sample's prefill and every unfinished cell's answer on it: the results rows."""
    from tqdm import tqdm

    from learnroute.tasks.metrics import score_is_final, score_sample

    max_new = config.max_new_tokens or sample.meta.get("max_new_tokens", 50)
    prompt = engine.encode(
        sample.context,
        sample.question,
        sample.answer_prefix,
        chat=sample.meta.get("chat_template", True),
        max_new_tokens=max_new,
    )
    n = prompt.context_ids.shape[1]
    for c in todo:
        if isinstance(c.budget, int) and c.budget >= n and (c.budget, task) not in warned:
            warned.add((c.budget, task))
            tqdm.write(f"note: budget {c.budget} >= context ({n} tokens) in {task}: the cache is kept whole",
                       file=sys.stderr)
    engine.check_routes([c.route for c in todo], n)
    prefill = engine.prefill(prompt)
    # LongBench's samsum generates with "\n" as a second EOS and at least one new token.
    stop = (newline_id,) if sample.meta.get("stop_at_newline") else ()
    until = (lambda text: score_is_final(sample, text)) if config.stop_at_final_score else None
    results = engine.answer(
        prefill, [c.route for c in todo], max_new_tokens=max_new, stop_token_ids=stop, min_new_tokens=len(stop),
        until=until,
    )
    return [
        {
            "task": task,
            "sample_id": sample.id,
            "route": c.name,
            "budget": c.budget,
            "prediction": r.answer,
            "score": score_sample(sample, r.answer),
            "kv_bytes": r.kv_bytes,  # what the route keeps
            "allocated_kv_bytes": r.allocated_kv_bytes,  # its cache with per-head padding
            "kv_fraction": r.kv_fraction,
            "n_tokens": n,
            "seconds": r.seconds,
            "prefill_seconds": prefill.seconds,
            "rank": rank,
        }
        for c, r in zip(todo, results)
    ]


def _log_summary(wb, summary: list[dict]) -> None:
    import wandb

    wb.log({"summary": wandb.Table(dataframe=None, columns=list(summary[0]), data=[list(r.values()) for r in summary])})
    wb.finish()
