"""Calibration tasks (SPEC.md §2): seeded generators of clean/counterfactual pairs."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..errors import HeadscopeInputError
from ..plugin_registry import Registry
from .base import Pair, PairError, validate_pair
from .filler import Filler
from .induction import induction
from .niah import build_pair, niah_single
from .ruler import niah_multikey, niah_multivalue, variable_tracking

#: capability name -> "module:generator" (imported on first use). Adding a task: a new file
#: ``headscope/tasks/<name>.py`` with ``def <name>(tokenizer, n_pairs, seq_len, depth, seed, ...) -> list[Pair]``
#: (build each pair with :func:`~headscope.tasks.niah.build_pair` or :class:`~headscope.tasks.base.Pair`)
#: and one line here.
TASKS: Mapping[str, Callable[..., list[Pair]]] = Registry(__name__, {
    "niah_single": "niah:niah_single",
    "niah_multikey": "ruler:niah_multikey",
    "niah_multivalue": "ruler:niah_multivalue",
    "variable_tracking": "ruler:variable_tracking",
    "induction": "induction:induction",
})


def make_pairs(task: str, tokenizer: Any, **settings: Any) -> list[Pair]:
    """Pairs of the named capability. Raises HeadscopeInputError (a ValueError) for an unknown task name."""
    if task not in TASKS:
        raise HeadscopeInputError(f"unknown task {task!r}; available: {', '.join(sorted(TASKS))}")
    return TASKS[task](tokenizer, **settings)


__all__ = ["Pair", "PairError", "validate_pair", "Filler", "build_pair", "niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "induction", "make_pairs", "TASKS"]
