"""Every YAML config in the repository loads and validates (no model is run), and the
configs a user starts from say what they are and match the library's defaults."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from learnroute.bench import BenchConfig
from learnroute.config import load_config
from learnroute.gates.config import TrainConfig
from learnroute.placement import PlacementConfig
from learnroute.profile import ProfileConfig
from learnroute.route import Route
from learnroute.study import StudyConfig

ROOT = Path(__file__).resolve().parents[1]
# A config's kind from the folder it lives in (experiments/dev holds bench configs) or,
# for a walk-through's files under examples/, from its file name.
KINDS = {"bench": BenchConfig, "dev": BenchConfig, "train": TrainConfig, "study": StudyConfig,
         "profile": ProfileConfig, "placement": PlacementConfig}


def shipped_configs() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.yaml", "*.yml"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    return sorted(ROOT / p for p in listed if p.split("/")[0] in ("configs", "experiments", "examples"))


def kind(path: Path) -> type:
    for name in (path.parent.name, path.stem):
        if name in KINDS:
            return KINDS[name]
    raise AssertionError(f"{path}: no config kind for its folder or name; known: {sorted(KINDS)}")


def _stand_in(value, route: str):
    """Route files under runs/ are written by another command (a profile, a study), not
    shipped: a route file stands in for them (an ``@budget`` suffix kept)."""
    if isinstance(value, str) and value.startswith("runs/") and ".json" in value:
        return route + value[value.index(".json") + len(".json"):]
    if isinstance(value, list):
        return [_stand_in(v, route) for v in value]
    if isinstance(value, dict):
        return {k: _stand_in(v, route) for k, v in value.items()}
    return value


def _generated_records(path: Path, tasks: dict, tmp_path: Path) -> dict:
    """A walk-through's records are written by its step 1 (make_records.py, not shipped
    data): write them here, under the config's task counts."""
    subprocess.run([sys.executable, str(path.parent / "make_records.py"), str(tmp_path / "records.jsonl")],
                   check=True, capture_output=True)
    return {(f"jsonl:{tmp_path / 'records.jsonl'}" if t.startswith("jsonl:") else t): n for t, n in tasks.items()}


def test_the_configs_are_all_found():
    paths = shipped_configs()
    assert {p.relative_to(ROOT).parts[0] for p in paths} == {"configs", "experiments", "examples"}
    assert len([p for p in paths if p.parts[-3] == "configs"]) >= 8


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_in_the_repository_is_valid(path, tmp_path):
    route = str(Route.homogeneous("snapkv", 30, 0.1).to_file(tmp_path / "r.json"))
    data = yaml.safe_load(path.read_text()) or {}
    over = {k: _stand_in(v, route) for k, v in data.items() if k in ("routes", "route", "imported_routes", "init_route")}
    if any(t.startswith("jsonl:") and not (ROOT / t[len("jsonl:"):]).exists() for t in data.get("tasks", {})):
        over["tasks"] = _generated_records(path, data["tasks"], tmp_path)
    overrides = [f"{k}={json.dumps(v)}" for k, v in over.items() if v != data[k]]
    load_config(kind(path), path, overrides)  # raises ConfigError listing every problem


@pytest.mark.parametrize("path", [p for p in shipped_configs() if p.relative_to(ROOT).parts[0] != "experiments"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_user_config_says_what_it_is_for(path):
    header = path.read_text().splitlines()[0]
    assert header.startswith("# ") and len(header) > 20, f"{path}: starts without a header comment"


def test_the_train_config_users_start_from_is_the_recommended_recipe():
    """configs/train/default.yaml writes TrainConfig's defaults out; the default study's
    main variant trains them too (over the study's own profile's best method)."""
    assert load_config(TrainConfig, ROOT / "configs" / "train" / "default.yaml") == TrainConfig()
    study = load_config(StudyConfig, ROOT / "configs" / "study" / "default.yaml")
    assert study.variants == StudyConfig().variants == {"learned": {"init_method": "@profile_best"}}
    data = study.variant_configs(Path("runs/x"), check=True)["learned"]
    recipe = dataclasses.asdict(TrainConfig())
    owned = {"model", "tasks", "context_tokens", "seed", "methods", "output", "budgets", "device", "dtype", "init_method"}
    cut_for_time = {"steps", "lr", "eval_every", "save_every"}  # the header of default.yaml says why
    assert set(data) - owned == cut_for_time
    trained = dataclasses.asdict(load_config(TrainConfig, overrides=[f"{k}={json.dumps(v)}" for k, v in data.items()]))
    assert {k for k in recipe if trained[k] != recipe[k]} <= owned | cut_for_time


def test_smoke_config_covers_routes_and_budgets():
    cfg = load_config(BenchConfig, ROOT / "configs" / "bench" / "smoke.yaml")
    assert cfg.model is None  # the bundled default model
    assert "full" in cfg.routes and len(cfg.routes) >= 4
    assert len(cfg.budgets) == 2
    assert cfg.tasks and all(n >= 1 for n in cfg.tasks.values())


def test_every_experiment_record_is_in_the_index():
    """experiments/README.md says which table each record regenerates: none is left out."""
    index = (ROOT / "experiments" / "README.md").read_text()
    sections = dict(re.findall(r"^## (\w+)/.*?\n(.*?)(?=^## |\Z)", index, re.S | re.M))
    missing = [str(p.relative_to(ROOT)) for p in shipped_configs() if p.relative_to(ROOT).parts[0] == "experiments"
               and f"| `{p.name}` |" not in sections.get(p.parent.name, "")]
    assert not missing, f"experiments/README.md does not index {missing}"
