"""Resumable results on disk: one file per finished work item, written atomically.

A run directory holds ``config.json`` (everything that determines the numbers) and ``items/``.
Re-opening a directory with the same config resumes (stored items are returned, not recomputed);
a different config is refused with a message, never silently mixed (:func:`check_rank_store` refuses
it before a model loads).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import HeadscopeInputError
from ..runtime import atomic_torch_save, atomic_write_text, config_diff


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


def check_rank_store(out_dir: Any, tasks: Sequence[str], fused: bool, spec: Any, settings: dict[str, Any],
                     lam: float, direction: str) -> None:
    """A rerun into ``out_dir`` resumes only a store of the same configuration: compare what is known
    before the model loads (tasks, task settings, λ, direction, model spec) with the stored config.

    Raises:
        HeadscopeInputError: the stored configuration differs (the message lists the keys).
    """
    if out_dir is None or not isinstance(spec, (str, os.PathLike)):
        return
    want = json.loads(json.dumps({"settings": settings, "lam": lam, "direction": direction}, default=str))
    for t in tasks:
        sub = Path(out_dir) / (t if fused else "") / "receivers" / "config.json"
        try:
            old = json.loads(sub.read_text())
        except (OSError, ValueError):
            continue
        diff = config_diff(old, want, keys=[k for k in want if k in old])
        if old.get("tasks") not in (None, [t] if fused else list(tasks)):
            diff.append("tasks")
        if isinstance(old.get("model"), dict) and old["model"].get("model_spec") not in (None, str(spec)):
            diff.append("model")
        if diff:
            raise HeadscopeInputError(
                f"{sub.parent} holds results of another configuration (differs in: {', '.join(sorted(diff))}); "
                "use a new output directory or delete this one"
            )
