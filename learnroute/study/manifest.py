"""What each route a study trained is, in data: ``routes/manifest.json``.

The export stage writes one entry per route file it puts in ``routes/`` (and per untrained
start it leaves out because an identical one is benched); the analysis reads which route is
whose start, which are seeds of which variant and which are pinned to one budget from
here, never from file-name suffixes. A folder made before the manifest existed gets the one
its config implies (:func:`build_manifest`), the same function the export writes with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from learnroute.gates.config import SEED_SUFFIX, TrainConfig
from learnroute.runs import atomic_write
from learnroute.study.config import (
    IMPORTED, START, VARIANT_TOKEN, Budget, StudyConfig, is_warm, route_name, shared_starts,
)

MANIFEST = "manifest.json"
SCHEMA = "learnroute.routes/1"
# What a route is. learned: a variant's trained route; seed: the main variant's recipe (or an
# earlier stage of it) again with another optimisation seed; per_budget: the main variant
# trained for one budget only; mixture: a variant's soft mixture route; start: a variant's
# untrained start (its control: a gain is learning's only over it); imported: made elsewhere.
KINDS = ("learned", "seed", "per_budget", "mixture", "start", "imported")


@dataclass(frozen=True)
class RouteEntry:
    """One route of a study's ``routes/`` folder."""

    name: str  # its name in the results and tables (routes/<name>.json)
    kind: str  # one of KINDS
    variant: str | None = None  # the study variant it comes from (seeds: the seeded variant; imported: None)
    seed: int | None = None  # the optimisation seed (train_seed) of a seed route
    start: str | None = None  # the route that is its untrained start, where it has one
    start_of: str | None = None  # a start's route
    benched_as: str | None = None  # a start not benched because this identical start is
    budget: Budget | None = None  # the one budget it is benched at (a variant trained for one budget)
    per_head: bool = False  # trained per KV head (granularity: head)

    def to_dict(self) -> dict[str, Any]:
        """The entry without its unset fields (None, and per_head when False)."""
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


def build_manifest(config: StudyConfig, shared: dict[str, str] | None = None) -> list[RouteEntry]:
    """The routes ``config``'s export makes, from the config alone (``shared``: start ->
    the identical start benched in its place)."""
    shared = shared or {}
    seeded = config.seeded_variants()
    entries: list[RouteEntry] = []
    for name, over in config.all_variants().items():
        data = {**config.train, **over}
        rname = route_name(name)
        budgets = data.get("budgets", config.all_budgets)  # as variant_configs defaults them
        pinned = budgets[0] if len(budgets) == 1 and budgets[0] in config.all_budgets else None
        per_head = data.get("granularity", TrainConfig.granularity) == "head"
        if name in seeded:
            base, _, k = name.rpartition(SEED_SUFFIX)
            source = over.get("init_route")
            # a later stage's seed starts from its own seed of the earlier stage; a first
            # stage's seeds share the variant's start (train_seed changes the optimisation only)
            if isinstance(source, str) and source.startswith(VARIANT_TOKEN):
                start = route_name(source[len(VARIANT_TOKEN):])
            else:
                start = f"{route_name(base)}{START}" if is_warm(data) else None
            entries.append(RouteEntry(rname, "seed", base, int(k), start, budget=pinned, per_head=per_head))
            continue
        kind = "per_budget" if name in config.per_budget_variants() else "learned"
        start = f"{rname}{START}" if is_warm(data) else None
        variant = config.main_variant if kind == "per_budget" else name
        entries.append(RouteEntry(rname, kind, variant, start=start, budget=pinned, per_head=per_head))
        if name in config.mixture_of:
            entries.append(RouteEntry(f"{rname}_mixture", "mixture", name, budget=pinned))
        if start is not None:
            entries.append(RouteEntry(start, "start", variant, start_of=rname, benched_as=shared.get(start),
                                      budget=pinned, per_head=per_head))
    entries += [RouteEntry(f"{IMPORTED}{name}", "imported") for name in config.imported_routes]
    return entries


def write_manifest(routes: Path, entries: list[RouteEntry]) -> None:
    atomic_write(Path(routes) / MANIFEST,
                 json.dumps({"schema": SCHEMA, "routes": [e.to_dict() for e in entries]}, indent=1) + "\n")


def read_manifest(routes: Path, config: StudyConfig) -> list[RouteEntry]:
    """``routes/manifest.json``, or for a folder made before it, the manifest its config
    implies (with its ``shared_starts.json``)."""
    path = Path(routes) / MANIFEST
    if not path.is_file():
        return build_manifest(config, shared_starts(routes))
    data = json.loads(path.read_text())
    known = {f.name for f in fields(RouteEntry)}
    return [RouteEntry(**{k: v for k, v in e.items() if k in known}) for e in data["routes"]]
