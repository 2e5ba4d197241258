"""The shipped bench configs load and validate (no model is run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from learnroute.bench import BenchConfig
from learnroute.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "bench"


def test_smoke_config_is_valid_and_covers_routes_and_budgets():
    cfg = load_config(BenchConfig, CONFIGS / "smoke.yaml")  # raises ConfigError listing any problem
    assert cfg.model is None  # the bundled default model
    assert "full" in cfg.routes and len(cfg.routes) >= 4
    assert len(cfg.budgets) == 2
    assert cfg.tasks and all(n >= 1 for n in cfg.tasks.values())
    assert cfg.output == "runs/bench/smoke"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_bench_config_is_valid(path):
    load_config(BenchConfig, path)
