"""Registry: method name -> class. Every lookup builds a fresh object."""

from __future__ import annotations

from learnroute.methods import scorers
from learnroute.methods.base import Method

METHODS: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (
        scorers.SnapKV,
        scorers.StreamingLLM,
        scorers.H2O,
        scorers.TOVA,
        scorers.Knorm,
        scorers.ExpectedAttention,
        scorers.KeyDiff,
        scorers.CriticalSnapKV,
        scorers.LAVa,
        scorers.Random,
        scorers.FullCache,
    )
}


def method_names() -> list[str]:
    """Registered method names (the candidates, then ``full``)."""
    return list(METHODS)


def register_method(cls: type[Method]) -> type[Method]:
    """Register a Method subclass under ``cls.name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    METHODS[cls.name] = cls
    return cls


def unregister_method(name: str) -> None:
    METHODS.pop(name, None)


def get_method(name: str, **kwargs) -> Method:
    """A fresh method object; an unknown name lists the registered ones."""
    try:
        cls = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(METHODS)}") from None
    return cls(**kwargs)
