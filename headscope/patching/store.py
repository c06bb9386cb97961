"""Resumable results on disk: one file per finished work item, written atomically.

A run directory holds ``config.json`` (everything that determines the numbers) and ``items/``.
Re-opening a directory with the same config resumes (stored items are returned, not recomputed);
a different config is refused with a message, never silently mixed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ..runtime import atomic_torch_save, atomic_write_bytes, atomic_write_text  # noqa: F401  (old import place)
from ..runtime import config_diff


class ConfigMismatch(RuntimeError):
    pass


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Store:
    """Work-item store under ``root`` for one configuration.

    Args:
        root: run directory (created).
        config: JSON-able settings; a stored config that differs raises :class:`ConfigMismatch`.
        name: sub-store name (e.g. ``"receivers"``), so one run directory can hold several sweeps.
    """

    def __init__(self, root: str | Path, config: dict[str, Any], name: str = "items"):
        self.root = Path(root)
        self.dir = self.root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.dir / "config.json"
        text = json.dumps(config, sort_keys=True, indent=1, default=str)
        if cfg_path.exists():
            old = json.loads(cfg_path.read_text())
            new = json.loads(text)
            if old != new:
                changed = config_diff(old, new)
                raise ConfigMismatch(
                    f"{self.dir} holds results of another configuration (differs in: {', '.join(changed)}); "
                    "use a new output directory or delete this one"
                )
        else:
            atomic_write_text(cfg_path, text)

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.pt"

    def has(self, key: str) -> bool:
        return self._path(key).exists()

    def get(self, key: str) -> Any:
        return torch.load(self._path(key), weights_only=False)

    def put(self, key: str, value: Any) -> None:
        atomic_torch_save(self._path(key), value)

    def keys(self) -> list[str]:
        return sorted(p.stem for p in self.dir.glob("*.pt"))
