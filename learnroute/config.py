"""Dataclass configs: defaults -> YAML file -> ``key=value`` overrides.

Every config is a dataclass whose fields carry their documentation in
``field(metadata={"help": ...})``. :func:`load_config` merges the three layers and checks
everything at once: unknown keys, wrong types and missing files come back as one
:class:`ConfigError` that lists every problem, before any model is loaded.

Override values are parsed as YAML, so ``budgets=[64,0.25]``, ``query_aware=true`` and
``tasks={niah_single_2: 4}`` work; dotted keys (``tasks.niah_single_2=4``) set one entry
of a mapping field.

A config with many fields names groups of them (``GROUPS``: group -> its keys, e.g.
TrainConfig's ``data``, ``gates``, ``loss``, ``optimiser``, ``lora``, ``run``). A YAML file may
write the keys inside their groups (``optimiser: {lr: 0.03, steps: 150}``) or flat
(``lr: 0.03``), and an override may name the group (``optimiser.lr=0.1``) or not
(``lr=0.1``); the config object itself is flat (``config.lr``), so a run folder's
resolved ``config.yaml`` reads the same either way.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """Invalid configuration; the message lists every problem found."""


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _check(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """Check ``value`` against the annotation ``tp``; returns it (ints widened to float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        # Try the members in order on a scratch problem list; the first that fits wins.
        for option in options:
            scratch: list[str] = []
            out = _check(value, option, where, scratch)
            if not scratch:
                return out
        problems.append(f"{where}: expected {' or '.join(map(_type_name, options))}, got {value!r}")
        return value
    if origin is typing.Literal:  # a choice among fixed values
        options = typing.get_args(tp)
        if not any(value == o and type(value) is type(o) for o in options):
            problems.append(f"{where}: expected one of {', '.join(map(repr, options))}, got {value!r}")
        return value
    if tp is type(None):
        if value is not None:
            problems.append(f"{where}: expected null, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {value!r}")
            return value
        return [_check(v, item, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        key_t, val_t = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a mapping, got {value!r}")
            return value
        return {
            _check(k, key_t, f"{where} key", problems): _check(v, val_t, f"{where}.{k}", problems)
            for k, v in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: expected a number, got {value!r}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"config field type {tp!r} is not supported")  # a programming error, not user input


def groups_of(cls: type) -> dict[str, tuple[str, ...]]:
    """``cls``'s groups of keys (group -> field names), or none."""
    return dict(getattr(cls, "GROUPS", {}) or {})


def flatten_groups(cls: type, data: dict[str, Any], where: str = "") -> tuple[dict[str, Any], list[str]]:
    """``data`` with every group's keys lifted to the top (``{"optimiser": {"lr": 0.1}}`` ->
    ``{"lr": 0.1}``), and the problems: a group that is not a mapping, a key inside the
    wrong group, a key given twice. Keys outside any group pass through (unknown ones are
    reported by :func:`from_dict`). ``where`` prefixes the problems (a study's ``train.``)."""
    groups = groups_of(cls)
    if not groups:
        return dict(data), []
    owner = {name: g for g, names in groups.items() for name in names}
    flat: dict[str, Any] = {}
    given: dict[str, str] = {}  # key -> how it was given, for the "twice" message
    problems = []
    for key, value in data.items():
        if key not in groups:
            entries = [(key, value, key)]
        elif not isinstance(value, dict):
            problems.append(f"{where}{key}: the group of {', '.join(groups[key])}; expected a mapping, got {value!r}")
            continue
        else:
            entries = [(k, v, f"{key}.{k}") for k, v in value.items()]
            for k, _, _ in entries:
                if k not in groups[key]:
                    elsewhere = f" ({k} belongs to {owner[k]})" if k in owner else ""
                    problems.append(f"{where}{key}.{k}: not a key of {key}{elsewhere}; its keys: "
                                    f"{', '.join(groups[key])}")
            entries = [e for e in entries if e[0] in groups[key]]
        for k, v, how in entries:
            if k in given:
                problems.append(f"{where}{k} is given twice ({given[k]} and {how}); keep one")
            flat[k], given[k] = v, how
    return flat, problems


def _ungroup_override(cls: type, item: str) -> str:
    """``optimiser.lr=0.1`` -> ``lr=0.1`` for a key of that group (``tasks.x=4`` stays)."""
    key, sep, raw = item.partition("=")
    group, dot, rest = key.partition(".")
    if sep and dot and rest.split(".")[0] in groups_of(cls).get(group, ()):
        return f"{rest}={raw}"
    return item


def apply_overrides(data: dict[str, Any], items: list[str]) -> list[str]:
    """Apply ``key=value`` items to ``data`` in order; returns the malformed ones as problems.

    A plain key replaces the value; a dotted key (``tasks.niah_single_2=4``) sets one
    entry inside a mapping, creating it if needed.
    """
    problems = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} is not key=value")
            continue
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            problems.append(f"override {item!r}: value is not valid YAML ({e})")
            continue
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[leaf] = value
    return problems


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build ``cls`` from its defaults, an optional YAML file and ``key=value`` overrides.

    Raises :class:`ConfigError` listing every problem (missing file, bad YAML, unknown
    keys, wrong types, and whatever ``cls.validate()`` returns).
    """
    problems: list[str] = []
    # Start from the defaults so a dotted override edits the default mapping.
    data: dict[str, Any] = dataclasses.asdict(cls())  # type: ignore[call-arg]
    if path is not None:
        p = Path(path)
        if not p.is_file():
            problems.append(f"config file {p} does not exist")
        else:
            try:
                loaded = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as e:
                problems.append(f"config file {p} is not valid YAML: {e}")
                loaded = {}
            if not isinstance(loaded, dict):
                problems.append(f"config file {p} must hold a mapping of keys to values, got {type(loaded).__name__}")
                loaded = {}
            loaded, grouping = flatten_groups(cls, loaded)  # checked within the file, before the defaults
            problems += grouping
            data.update(loaded)
    problems += apply_overrides(data, [_ungroup_override(cls, o) for o in overrides or []])
    # A whole group given as an override (optimiser={lr: 0.1}) wins over the file and defaults.
    grouped = {k: data.pop(k) for k in list(data) if k in groups_of(cls)}
    lifted, grouping = flatten_groups(cls, grouped)
    problems += grouping
    data.update(lifted)
    return from_dict(cls, data, problems)


def from_dict(cls: type[T], data: dict[str, Any], problems: list[str] | None = None) -> T:
    """Check ``data`` against ``cls``'s fields and build it (one error listing all problems)."""
    problems = list(problems or [])
    data, grouping = flatten_groups(cls, data)
    problems += [p for p in grouping if p not in problems]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        problems.append(f"unknown keys {unknown}; valid keys: {', '.join(fields)}")
    values = {}
    for name, value in data.items():
        if name in fields:
            mine: list[str] = []
            checked = _check(value, hints[name], name, mine)
            problems += mine
            if not mine:  # an ill-typed value is reported above; its default stands in below
                values[name] = checked
    # Value checks run even when keys are unknown or ill-typed, so that one error lists
    # every problem (`steps=-3 foo=1` reports both). Where a value was ill-typed its
    # default stands in, which validate() may accept or (for a cross-field rule) not.
    try:
        config = cls(**values)
    except (TypeError, ValueError) as e:  # a __post_init__ refusing the combination
        problems.append(str(e))
    else:
        validate = getattr(config, "validate", None)
        problems += [p for p in (validate() if validate else []) if p not in problems]
        if not problems:
            return config
    raise ConfigError(f"invalid {cls.__name__}:\n  " + "\n  ".join(problems))


def to_dict(config: Any) -> dict[str, Any]:
    """Plain dict of a config (for the resolved ``config.yaml`` of a run folder)."""
    return dataclasses.asdict(config)


def describe(cls: type) -> str:
    """One line per field: name, type, default and help; ``learnroute VERB --help`` shows it
    after the options (config keys for YAML or ``key=value`` overrides), under its group's
    name where the config has groups."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}

    def line(name: str, indent: str) -> str:
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        return f"{indent}{name} ({_type_name(hints[name])}, default {default!r}): {f.metadata.get('help', '')}"

    groups = groups_of(cls)
    if not groups:
        return "\n".join(line(name, "  ") for name in fields)
    lines = []
    for group, names in groups.items():
        lines.append(f"  {group}:")
        lines += [line(name, "    ") for name in names]
    return "\n".join(lines)
