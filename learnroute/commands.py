"""Argument parsing for the config-driven verbs (``bench``, ``profile``, ``placement``,
``train``, ``export``, ``report``); the work happens in the library modules they call."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from learnroute.config import ConfigError, describe, load_config
from learnroute.route import RouteError

# Bad input, raised on purpose with a message that says what to change: one line, exit 2.
# Anything else (a torch shape error, CUDA out of memory, a bug) keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, RouteError, FileNotFoundError)


def _run_config_command(
    verb: str,
    doc: str | None,
    cls: type,
    runner: Callable,
    argv: list[str],
    done: Callable[[Path], str],
    user_errors: tuple[type[BaseException], ...] = (),
    options: dict[str, dict] | None = None,
) -> int:
    """``learnroute VERB --config FILE [--overwrite] [key=value ...]``: load, run, report.

    ``user_errors``: the verb's own deliberate errors, reported like :data:`USER_ERRORS`.
    ``options``: the verb's own flags (flag -> ``add_argument`` keywords); each one given
    reaches ``runner`` as a keyword named by its ``dest``.
    """
    parser = argparse.ArgumentParser(
        prog=f"learnroute {verb}",
        description=doc,
        epilog="config keys (YAML or key=value overrides, which win):\n" + describe(cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config file (defaults are used for missing keys)")
    parser.add_argument("--overwrite", action="store_true", help="move a run with another config aside")
    for flag, kwargs in (options or {}).items():
        parser.add_argument(flag, **kwargs)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    args = parser.parse_args(argv)
    extra = {k: v for k, v in vars(args).items() if k not in ("config", "overwrite", "overrides") and v is not None}
    try:
        config = load_config(cls, args.config, args.overrides)
        out = runner(config, overwrite=args.overwrite, **extra)
    except USER_ERRORS + user_errors as e:
        parser.exit(2, f"learnroute {verb}: error: {e}\n")
    if os.environ.get("RANK", "0") == "0":  # under torchrun / accelerate launch: said once, by rank 0
        print(done(out), file=sys.stderr)
    return 0


def bench(argv: list[str]) -> int:
    """Evaluate routes x budgets x tasks into a run folder (resumable; shards under torchrun)."""
    from learnroute.bench import BenchConfig, run_bench

    return _run_config_command(
        "bench", bench.__doc__, BenchConfig, run_bench, argv, lambda out: f"results in {out}: summary.md, plot.png"
    )


def profile(argv: list[str]) -> int:
    """Per-layer x method damage on calibration samples -> heatmap and profile-guided routes."""
    from learnroute.profile import ProfileConfig, run_profile

    return _run_config_command(
        "profile",
        profile.__doc__,
        ProfileConfig,
        run_profile,
        argv,
        lambda out: f"profile in {out}: profile.json, heatmap.png, profile_<budget>[_alloc].json",
    )


def placement(argv: list[str]) -> int:
    """Rank a route among random placements of the same methods across layers."""
    from learnroute.placement import PlacementConfig, run_placement

    return _run_config_command(
        "placement",
        placement.__doc__,
        PlacementConfig,
        run_placement,
        argv,
        lambda out: Path(out, "placement.md").read_text(),
    )


def report(argv: list[str]) -> int:
    """Rewrite a bench folder's summary (CSV, markdown, plot), or a study folder's answers
    (study.json, study.md and its benches' summaries), from the JSONL files alone."""
    from learnroute.report import summarize

    parser = argparse.ArgumentParser(prog="learnroute report", description=report.__doc__)
    parser.add_argument(
        "folder", nargs="+",
        help="bench run folder or study folder; with --paired, several bench folders are joined into one "
        "report (say one bench per family split), if they share the settings that change a score and no cell")
    parser.add_argument("--rescore", action="store_true", help="recompute scores from samples.jsonl")
    parser.add_argument(
        "--paired", metavar="ROUTE",
        help="print ROUTE minus other routes per budget, paired over samples, with bootstrap 95 %% intervals "
        "(a route name or a route file's stem; 'full', the full cache, pairs at every budget)",
    )
    parser.add_argument("--against", nargs="+", metavar="ROUTE", help="with --paired: only these routes")
    parser.add_argument("--bootstrap", type=int, default=2000, help="with --paired: bootstrap resamples")
    parser.add_argument("--tasks", nargs="+", metavar="TASK",
                        help="with --paired: only these tasks' samples (a family split, say)")
    parser.add_argument(
        "--pool", action="append", metavar="NAME=ROUTE,ROUTE",
        help="with --paired: a route NAME whose score on a sample is the mean of these routes' (say one "
        "recipe's training seeds), so that its intervals over samples read the recipe; usable as --paired "
        "or in --against; repeatable",
    )
    parser.add_argument(
        "--main", metavar="VARIANT",
        help="a study folder: answer every question of this variant instead of the config's main_variant, "
        "written to study_<VARIANT>.md and .json (study.md is kept)",
    )
    args = parser.parse_args(argv)
    if (args.against or args.tasks or args.pool) and not args.paired:
        parser.error("--against, --tasks and --pool need --paired ROUTE")
    if len(args.folder) > 1 and not args.paired:
        parser.error(f"{len(args.folder)} folders need --paired ROUTE (a summary or a study is rewritten one "
                     "folder at a time)")
    folder = Path(args.folder[0])
    if args.paired:
        from learnroute.bench import BenchConfig
        from learnroute.config import to_dict
        from learnroute.report import load_folders, paired_table, parse_pools

        if args.bootstrap < 100:
            parser.error(f"--bootstrap must be >= 100, got {args.bootstrap}")
        try:
            pools = parse_pools(args.pool)
            # a key an older folder's config.yaml lacks ran at the bench's default
            rows = load_folders(args.folder, args.rescore, defaults=to_dict(BenchConfig()))
            print(paired_table(rows, args.paired, args.against, args.bootstrap, args.tasks, pools), end="")
        except (FileNotFoundError, ValueError) as e:
            parser.exit(2, f"learnroute report: error: {e}\n")
        return 0
    try:
        if (folder / "config.yaml").is_file() and any(folder.glob("bench_*/results.jsonl")):
            from learnroute.study import analyze

            for bench in sorted(folder.glob("bench_*")):
                summarize(bench, rescore=args.rescore)
            result = analyze(folder, rescore=args.rescore, main_variant=args.main)
            print((folder / result["answers"]).read_text())
            return 0
        if args.main is not None:
            parser.error(f"--main needs a study folder (with config.yaml and bench_*/results.jsonl); {folder} is not one")
        summarize(folder, rescore=args.rescore)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"learnroute report: error: {e}\n")
    print(Path(folder, "summary.md").read_text())
    return 0


def study(argv: list[str]) -> int:
    """Profile, train every variant, export, bench on eval samples, placement: one study folder."""
    from learnroute.gates.train import TrainingError
    from learnroute.study import StudyConfig, run_study, summary_table

    def done(out: Path) -> str:
        import json

        from learnroute.runs import process_state

        if not process_state().is_main_process:  # under torchrun: rank 0 prints the answers
            return ""
        result = json.loads((out / "study.json").read_text())
        return f"{summary_table(result)}\n\nfull answers in {out / 'study.md'}"

    return _run_config_command("study", study.__doc__, StudyConfig, run_study, argv, done, (TrainingError,))


def train(argv: list[str]) -> int:
    """Learn per-layer gates (methods and/or budgets) on calibration samples -> a hardened route."""
    from learnroute.gates.train import TrainConfig, TrainingError, run_train, run_train_seeds

    def runner(config: TrainConfig, overwrite: bool, seeds: list[int] | None = None) -> Path | list[Path]:
        return run_train(config, overwrite) if seeds is None else run_train_seeds(config, seeds, overwrite)

    def done(out: Path | list[Path]) -> str:
        def files(o: Path) -> str:  # a run with a budget slope also wrote each budget's allocation
            slope = (o / "route_by_budget.json").is_file()
            per_budget = "route_by_budget.json (an allocation per budget), " if slope else ""
            return (f"gates in {o}: {per_budget}route.json (hardened at the first budget), pi.png, budgets.png, "
                    "checkpoints/")

        return "\n".join(files(o) for o in (out if isinstance(out, list) else [out]))

    seeds = dict(type=_seed_list, metavar="K,K,...",
                 help="train once per optimisation seed (train_seed=K) into <output>_seed<K>, prefilling the "
                      "calibration samples once for all of them (e.g. --seeds 0,1,2)")
    return _run_config_command(
        "train",
        train.__doc__,
        TrainConfig,
        runner,
        argv,
        done,
        (TrainingError,),  # the loss became NaN: the message says which checkpoint and what to change
        options={"--seeds": seeds},
    )


def _seed_list(text: str) -> list[int]:
    """``--seeds 0,1,2`` -> [0, 1, 2] (one argument, so that key=value overrides may follow)."""
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes integers separated by commas, e.g. --seeds 0,1,2; got {text!r}")


def export(argv: list[str]) -> int:
    """Write the route of a trained gates run (or one of its checkpoints) as a route file."""
    from learnroute.budget_routes import BudgetRoutes, load_route_file
    from learnroute.gates.export import export_cli, export_start

    parser = argparse.ArgumentParser(prog="learnroute export", description=export.__doc__)
    parser.add_argument("source", help="train run folder, or a gates checkpoint (.safetensors) inside one")
    parser.add_argument("--out", required=True, help="route file to write (JSON)")
    parser.add_argument("--budget", help="mean budget of the route (int tokens per KV head or a fraction); "
                        "default: the first training budget")
    parser.add_argument("--mixture", action="store_true", help="keep π as per-layer mixture weights")
    parser.add_argument("--temperature", type=float, help="π temperature of a mixture (default: the final one)")
    parser.add_argument("--model", help="refuse the checkpoint unless it was trained on this model name")
    parser.add_argument("--per-budget", action="store_true",
                        help="write a budget-conditional route file: the hardened route at each training budget "
                             "(the default for a run that learned a budget slope, as the recipe does)")
    parser.add_argument("--start", action="store_true",
                        help="write the run's untrained start instead (its initial gates, hardened): the "
                             "control to bench beside the trained route")
    args = parser.parse_args(argv)
    if args.start and (args.mixture or args.temperature is not None):
        parser.error("--start writes the hardened untrained start: --mixture and --temperature do not apply")
    try:
        if args.start:
            route = export_start(args.source, args.out, budget=args.budget, model=args.model)
        else:
            # A run with a budget slope learned one allocation per training budget: all of them
            # ("auto"), unless one budget (or the mixture) is asked for.
            route = export_cli(args.source, args.out, budget=args.budget, mixture=args.mixture,
                               temperature=args.temperature, model=args.model,
                               per_budget=True if args.per_budget else "auto")
        written = load_route_file(args.out)
    except (ConfigError, RouteError, FileNotFoundError, ValueError) as e:
        parser.exit(2, f"learnroute export: error: {e}\n")
    if isinstance(written, BudgetRoutes):
        print(f"wrote {args.out}: one allocation per training budget {written.budgets} (a budget-conditional route; "
              f"--budget B writes one route), at {written.budgets[0]}: {route.describe()}", file=sys.stderr)
    else:
        print(f"wrote {args.out}: {route.describe()}", file=sys.stderr)
    return 0
