"""Registries of pluggable parts (tasks, selectors): a name -> ``"module:attribute"`` table, imported on
first use. Adding a part is one new file plus one line in its registry."""

from __future__ import annotations

import importlib
from typing import Any, Iterator, Mapping


class Registry(Mapping[str, Any]):
    """A read-only mapping name -> object whose entries are ``"module:attribute"`` strings (relative to
    ``package``), imported when first looked up (so listing the names imports nothing).

    Example: ``TASKS = Registry("headscope.tasks", {"induction": "induction:induction"})``.
    """

    def __init__(self, package: str, entries: Mapping[str, str]):
        self.package = package
        self.entries = dict(entries)
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            mod, _, attr = self.entries[name].partition(":")  # KeyError for an unknown name
            self._loaded[name] = getattr(importlib.import_module(f".{mod}", self.package), attr)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __repr__(self) -> str:
        return f"Registry({self.package}: {', '.join(self.entries)})"
