"""Calibration tasks (SPEC.md §2): seeded generators of clean/counterfactual pairs."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import HeadscopeInputError
from .base import Pair, PairError, validate_pair
from .filler import Filler
from .induction import induction
from .niah import build_pair, niah_single
from .ruler import niah_multikey, niah_multivalue, variable_tracking

TASKS: dict[str, Callable[..., list[Pair]]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "variable_tracking": variable_tracking,
    "induction": induction,
}


def make_pairs(task: str, tokenizer: Any, **settings: Any) -> list[Pair]:
    """Pairs of the named capability. Raises HeadscopeInputError (a ValueError) for an unknown task name."""
    if task not in TASKS:
        raise HeadscopeInputError(f"unknown task {task!r}; available: {', '.join(sorted(TASKS))}")
    return TASKS[task](tokenizer, **settings)


__all__ = ["Pair", "PairError", "validate_pair", "Filler", "build_pair", "niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "induction", "make_pairs", "TASKS"]
