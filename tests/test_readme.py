"""The README's commands are real: the quick start's verbs, config files and keys exist
and parse, each command reads what an earlier one writes, and the formats it documents
are the ones the library reads. No model is run (the quick start itself takes ~15 min)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from learnroute.bench import BenchConfig
from learnroute.cli import COMMANDS
from learnroute.config import load_config
from learnroute.gates.config import TrainConfig
from learnroute.placement import PlacementConfig
from learnroute.profile import ProfileConfig
from learnroute.route import SCHEMA, Route
from learnroute.study import StudyConfig
from learnroute.tasks.custom import read_records

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONFIGS = {"train": TrainConfig, "bench": BenchConfig, "profile": ProfileConfig, "placement": PlacementConfig,
           "study": StudyConfig}


def section(title: str) -> str:
    """The README's text under the ``## title`` heading, up to the next ``##``."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(title: str) -> list[list[str]]:
    """Each shell line of a section's bash blocks, split as a shell would (comments dropped)."""
    lines = [line for block in blocks(section(title), "bash") for line in block.splitlines() if line.strip()]
    return [shlex.split(line, comments=True) for line in lines]


def test_setup_comes_first_and_its_commands_exist():
    assert README.index("## Set-up") < len("\n".join(README.splitlines()[:60]))  # within the first 60 lines
    makefile = (ROOT / "Makefile").read_text()
    pins = set(re.findall(r"pip install -q (?:--no-deps )?(\S+==\S+)", makefile))
    for argv in commands("Set-up"):
        if argv[0] == "make":
            assert re.search(rf"^{argv[1]}:", makefile, re.M), f"Makefile has no target {argv[1]!r}"
        elif argv[:2] == ["pip", "install"]:
            pinned = [a for a in argv[2:] if "==" in a]
            assert set(pinned) <= pins, f"README pins {pinned}, the Makefile installs {sorted(pins)}"
    assert {"make test", "make run"} <= {" ".join(a) for a in commands("Set-up")}
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # the README's test command is CI's


def test_quick_start_commands_parse_and_chain(tmp_path):
    """Every command is a verb of the CLI; its config loads with its overrides; and every
    file or folder a command reads was written by an earlier one (or ships in the repo)."""
    written: dict[str, str] = {}  # path -> the verb that writes it
    benched: dict[str, set[str]] = {}  # bench folder -> the names its routes are reported by
    quick = commands("Quick start")
    assert quick, "the quick start has no commands"
    stand_in = str(Route.homogeneous("keydiff", 30, 0.1).to_file(tmp_path / "stand_in.json"))
    for argv in quick:
        assert argv[0] == ".venv/bin/learnroute", f"{argv}: run from the repo's .venv, as set-up makes it"
        verb, rest = argv[1], argv[2:]
        assert verb in COMMANDS, f"{verb!r} is not a verb: {sorted(COMMANDS)}"
        if verb in CONFIGS:
            path = ROOT / rest[rest.index("--config") + 1]
            overrides = [a for a in rest if "=" in a and not a.startswith("-")]
            if verb == "bench":  # its route files are written by the commands before it
                routes = yaml.safe_load(path.read_text())["routes"]
                files = [r for r in routes if r.endswith(".json")]
                missing = [r for r in files if r not in written]
                assert not missing, f"{path.name} reads {missing}, which no earlier command writes"
                overrides.append(f"routes={json.dumps([stand_in if r in files else r for r in routes])}")
            config = load_config(CONFIGS[verb], path, overrides)  # raises listing every problem
            written[str(config.output)] = verb
            if verb == "bench":
                benched[str(config.output)] = {Path(r).stem if r.endswith(".json") else r for r in routes}
        elif verb == "export":
            assert written.get(rest[0]) == "train", f"export reads {rest[0]}, which is not an earlier train run"
            written[rest[rest.index("--out") + 1]] = "export"
        elif verb == "show":
            assert rest[0] in written, f"show reads {rest[0]}, which no earlier command writes"
        elif verb == "report":
            assert rest[0] in benched, f"report reads {rest[0]}, which is not an earlier bench folder"
            asked = {a for a in rest[1:] if not a.startswith("--")}
            assert asked <= benched[rest[0]], f"report asks for {asked - benched[rest[0]]}: not benched"
    assert {argv[1] for argv in quick} >= {"train", "export", "bench"}


def test_every_verb_is_in_the_cli_table_and_every_listed_config_exists():
    cli = section("The command line")
    listed = set(re.findall(r"^\| `learnroute (\w+)", cli, re.M))
    assert listed == set(COMMANDS), f"CLI table lists {sorted(listed)}, the CLI has {sorted(COMMANDS)}"
    for name in re.findall(r"`((?:configs|examples)/[\w/.]+\.yaml)`", README):
        assert (ROOT / name).is_file(), f"README names {name}, which does not exist"


def test_the_documented_record_format_is_what_jsonl_tasks_read(tmp_path):
    example = blocks(section("Your own model and data"), "json")[0]
    path = tmp_path / "records.jsonl"
    path.write_text(example.replace("…", "some text"))
    records, problems = read_records(path)
    assert not problems and len(records) == 2
    assert records[1].split == "eval" and records[1].metric == "string_match_part"
    fields = set(re.findall(r"^\| `(\w+)`", section("Your own model and data"), re.M))
    fields |= {"max_new_tokens"}  # listed with `id` in one row
    assert fields == {"context", "question", "answers", "answer_prefix", "metric", "split", "id", "max_new_tokens"}


def test_the_route_example_is_the_format_routes_are_written_in(tmp_path):
    example = blocks(section("Route files"), "json")[0]
    # the example elides layers 3-29 and the provenance: fill them in as a user would
    data = json.loads(example.replace(', "..."]', "]").replace('"...": "..."', '"note": "x"'))
    assert data["schema"] == SCHEMA
    data["layers"] += [{"layer": i, "method": "keydiff", "budget": 256} for i in range(3, data["n_layers"])]
    route = Route.from_dict(data)
    written = json.loads(route.to_file(tmp_path / "r.json").read_text())
    assert written["schema"] == SCHEMA and written["layers"][1]["heads"][2]["method"] == "snapkv"
    assert written["layers"][2]["share"] == "adakv"


@pytest.mark.parametrize("script", sorted(re.findall(r"`(benchmarks/\w+\.py)", README)))
def test_every_benchmark_the_readme_cites_exists(script):
    assert (ROOT / script).is_file()
