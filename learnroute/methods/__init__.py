"""Candidate eviction methods (per-layer scorers) and budget allocators.

A method scores one layer's cached context tokens: ``(B, H_kv, n)``, higher = keep.
Budget allocation across layers is a separate axis (:mod:`learnroute.methods.budgets`).
"""

from learnroute.methods.base import Method
from learnroute.methods.budgets import ALLOCATORS, allocate, resolve_budget
from learnroute.methods.kvpress_map import KVPRESS_METHODS, kvpress_press, kvpress_ratio
from learnroute.methods.registry import METHODS, get_method, method_names
from learnroute.methods.select import keep_indices

__all__ = [
    "ALLOCATORS",
    "KVPRESS_METHODS",
    "METHODS",
    "Method",
    "allocate",
    "get_method",
    "keep_indices",
    "kvpress_press",
    "kvpress_ratio",
    "method_names",
    "resolve_budget",
]
