"""``learnroute`` console script: parses and dispatches only; the logic lives in the package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from learnroute import __version__

# verb -> (help, "module:function"); each function takes argv and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("answer a long-context question with the full cache and three routes", "learnroute.demo:main"),
    "show": ("print a route file as a per-layer table", "learnroute.route_cli:show"),
    "reshape": ("floor, cap or flatten a route file's budgets after the fact", "learnroute.route_cli:reshape"),
    "combine": ("one budget-conditional route file from routes made for one budget each", "learnroute.route_cli:combine"),
    "bench": ("evaluate routes x budgets x tasks into a run folder", "learnroute.commands:bench"),
    "profile": ("per-layer damage profile on calibration data -> profile-guided routes", "learnroute.commands:profile"),
    "placement": ("rank a route among random placements of its methods", "learnroute.commands:placement"),
    "train": ("learn per-layer gates on calibration data -> a hardened route", "learnroute.commands:train"),
    "export": ("write the route of a trained gates run (hardened or mixture)", "learnroute.commands:export"),
    "study": ("profile, train, export and bench learned vs offline routes: the project's study", "learnroute.commands:study"),
    "report": ("rewrite (and re-score) a bench folder's summary and plot", "learnroute.commands:report"),
}


def _load(target: str) -> Callable[[list[str]], int]:
    module, func = target.split(":")
    return getattr(__import__(module, fromlist=[func]), func)


def main(argv: list[str] | None = None) -> int:
    """Entry point; ``argv`` defaults to ``sys.argv[1:]`` so tests call it in-process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="learnroute",
        description="Layer-wise routing of KV-cache eviction methods in HuggingFace LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"learnroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(argv[:1])
    if args.command is None:
        if not argv:
            parser.print_help()
            return 0
        parser.error(_misplaced(argv))  # exits 2, saying what is wrong
    return int(_load(COMMANDS[args.command][1])(argv[1:]) or 0)


def _misplaced(argv: list[str]) -> str:
    """The error for a command line that does not start with a verb: options before it
    (``learnroute --config x bench``) or no verb at all."""
    verb = next((a for a in argv if a in COMMANDS), None)
    if verb is None:
        return f"unrecognized argument {argv[0]!r}: give a command first ({', '.join(COMMANDS)}); options come after it"
    i = argv.index(verb)
    fixed = " ".join(["learnroute", verb, *argv[:i], *argv[i + 1 :]])
    return f"{argv[0]} must come after the verb: {fixed}"


if __name__ == "__main__":
    raise SystemExit(main())
