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


def _produced_elsewhere(spec: str) -> bool:
    """Route files under runs/ are written by `learnroute profile`, not shipped."""
    return spec.startswith("runs/")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_bench_config_is_valid(path):
    import yaml

    routes = yaml.safe_load(path.read_text()).get("routes", [])
    shipped = [r for r in routes if not _produced_elsewhere(r)]
    load_config(BenchConfig, path, [f"routes={shipped}"] if shipped != routes else [])


def test_profile_and_placement_configs_are_valid(tmp_path):
    from learnroute.placement import PlacementConfig
    from learnroute.profile import ProfileConfig
    from learnroute.route import Route

    for path in sorted((CONFIGS.parent / "profile").glob("*.yaml")):
        load_config(ProfileConfig, path)
    Route.homogeneous("snapkv", 30, 128).to_file(tmp_path / "r.json")
    for path in sorted((CONFIGS.parent / "placement").glob("*.yaml")):
        load_config(PlacementConfig, path, [f"route={tmp_path / 'r.json'}"])


def test_train_and_study_configs_are_valid(tmp_path):
    """Every shipped train and study config loads (no model is run); a study's imported
    routes under runs/ (another study's output) stand in as a route file here."""
    import json

    import yaml

    from learnroute.gates.train import TrainConfig
    from learnroute.route import Route
    from learnroute.study import StudyConfig

    Route.homogeneous("snapkv", 30, 0.1).to_file(tmp_path / "r.json")
    root = CONFIGS.parent
    for cls, folder in ((TrainConfig, "train"), (StudyConfig, "study")):
        paths = sorted((root / folder).glob("*.yaml"))
        assert paths, folder
        for path in paths:
            imported = (yaml.safe_load(path.read_text()) or {}).get("imported_routes") or {}
            elsewhere = {k: str(tmp_path / "r.json") if _produced_elsewhere(v) else v for k, v in imported.items()}
            load_config(cls, path, [f"imported_routes={json.dumps(elsewhere)}"] if elsewhere != imported else [])
