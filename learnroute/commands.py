"""Argument parsing for the config-driven verbs (``bench``, ``report``); the work happens
in the library modules they call."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from learnroute.config import ConfigError, describe, load_config
from learnroute.route import RouteError


def _config_parser(prog: str, doc: str | None, cls: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=doc,
        epilog="config keys (YAML or key=value overrides, which win):\n" + describe(cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config file (defaults are used for missing keys)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    return parser


def bench(argv: list[str]) -> int:
    """Evaluate routes x budgets x tasks into a run folder (resumable; shards under torchrun)."""
    from learnroute.bench import BenchConfig, run_bench

    parser = _config_parser("learnroute bench", bench.__doc__, BenchConfig)
    parser.add_argument("--overwrite", action="store_true", help="move a run with another config aside")
    args = parser.parse_args(argv)
    try:
        config = load_config(BenchConfig, args.config, args.overrides)
        out = run_bench(config, overwrite=args.overwrite)
    except (ConfigError, RouteError, FileNotFoundError) as e:
        parser.exit(2, f"learnroute bench: error: {e}\n")
    print(f"results in {out}: summary.md, summary.csv, plot.png", file=sys.stderr)
    return 0


def report(argv: list[str]) -> int:
    """Rewrite a bench folder's summary (CSV, markdown, plot) from its JSONL files."""
    from learnroute.report import summarize

    parser = argparse.ArgumentParser(prog="learnroute report", description=report.__doc__)
    parser.add_argument("folder", help="bench run folder")
    parser.add_argument("--rescore", action="store_true", help="recompute scores from samples.jsonl")
    args = parser.parse_args(argv)
    try:
        summarize(args.folder, rescore=args.rescore)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"learnroute report: error: {e}\n")
    print(Path(args.folder, "summary.md").read_text())
    return 0


def profile(argv: list[str]) -> int:
    """Per-layer x method damage on calibration samples -> heatmap and profile-guided routes."""
    from learnroute.profile import ProfileConfig, run_profile

    parser = _config_parser("learnroute profile", profile.__doc__, ProfileConfig)
    parser.add_argument("--overwrite", action="store_true", help="move a run with another config aside")
    args = parser.parse_args(argv)
    try:
        config = load_config(ProfileConfig, args.config, args.overrides)
        out = run_profile(config, overwrite=args.overwrite)
    except (ConfigError, RouteError, FileNotFoundError) as e:
        parser.exit(2, f"learnroute profile: error: {e}\n")
    print(f"profile in {out}: profile.json, heatmap.png, profile_<budget>[_alloc].json", file=sys.stderr)
    return 0


def placement(argv: list[str]) -> int:
    """Rank a route among random placements of the same methods across layers."""
    from learnroute.placement import PlacementConfig, run_placement

    parser = _config_parser("learnroute placement", placement.__doc__, PlacementConfig)
    parser.add_argument("--overwrite", action="store_true", help="move a run with another config aside")
    args = parser.parse_args(argv)
    try:
        config = load_config(PlacementConfig, args.config, args.overrides)
        out = run_placement(config, overwrite=args.overwrite)
    except (ConfigError, RouteError, FileNotFoundError) as e:
        parser.exit(2, f"learnroute placement: error: {e}\n")
    print(Path(out, "placement.md").read_text())
    return 0
