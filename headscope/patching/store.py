"""Resumable results on disk: one JSON file per finished work item, written atomically.

A run directory holds ``config.json`` (everything that determines the numbers) and one ``<key>.json`` per
item. Re-opening a directory with the same config resumes (stored items are returned, not recomputed);
a different config is refused with a message, never silently mixed (:func:`check_rank_store` refuses
it before a model loads).

Items are JSON (:func:`encode` / :func:`decode`): numbers, strings, lists, dicts with int or str keys and
tensors (dtype, shape and values; a float32 or float64 value round-trips exactly). Reading a store never runs
code. Stores written by headscope 0.1.0 hold pickled ``<key>.pt`` items; they are refused
(:class:`PickledStore`), not read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import HeadscopeInputError
from ..runtime import atomic_write_text, config_diff


class ConfigMismatch(RuntimeError):
    pass


class PickledStore(ConfigMismatch):
    """A store directory holds items in the old pickle format (``*.pt``), which headscope no longer reads:
    unpickling a file runs whatever code it names."""


def pickled_items_error(folder: Path) -> PickledStore:
    return PickledStore(
        f"{folder} holds per-item results in the old pickle format (*.pt), which headscope no longer reads "
        "(unpickling a file can run code); rerun into a new output directory, or delete that folder to recompute it")


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def encode(value: Any) -> Any:
    """A JSON-able form of ``value`` (what :meth:`Store.put` writes): scalars as they are, a dict as
    ``{"dict": [[key, value], ...]}`` (int or str keys), a list or tuple as ``{"list": [...]}``, a tensor as
    ``{"tensor": dtype, "shape": [...], "data": [...]}`` (on the CPU, values in row-major order).

    Raises:
        TypeError: another type (a store keeps numbers, text and tensors only).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"a store keeps tensors of {sorted(_DTYPES)}, not {t.dtype}")
        data = t.reshape(-1).tolist() if t.dtype not in (torch.float16, torch.bfloat16) else t.float().reshape(-1).tolist()
        return {"tensor": name, "shape": list(t.shape), "data": data}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, (int, str)) or isinstance(k, bool)]
        if bad:
            raise TypeError(f"a stored dict needs int or str keys, not {bad[0]!r}")
        return {"dict": [[k, encode(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"list": [encode(v) for v in value]}
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # a NumPy scalar
        return encode(value.item())
    raise TypeError(f"a store keeps numbers, text, lists, dicts and tensors, not {type(value).__name__}")


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode`.

    Raises:
        ValueError: an object that :func:`encode` does not write.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        if set(obj) == {"dict"}:
            return {k: decode(v) for k, v in obj["dict"]}
        if set(obj) == {"list"}:
            return [decode(v) for v in obj["list"]]
        if set(obj) == {"tensor", "shape", "data"} and obj["tensor"] in _DTYPES:
            return torch.tensor(obj["data"], dtype=_DTYPES[obj["tensor"]]).reshape(obj["shape"])
    raise ValueError(f"not a stored value: {str(obj)[:80]}")


class Store:
    """Work-item store under ``root`` for one configuration.

    Args:
        root: run directory (created).
        config: JSON-able settings; a stored config that differs raises :class:`ConfigMismatch`.
        name: sub-store name (e.g. ``"receivers"``), so one run directory can hold several sweeps.

    Raises:
        ConfigMismatch: the directory holds another configuration; :class:`PickledStore`: it holds items
            in the old pickle format.
    """

    def __init__(self, root: str | Path, config: dict[str, Any], name: str = "items"):
        self.root = Path(root)
        self.dir = self.root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        if any(self.dir.glob("*.pt")):
            raise pickled_items_error(self.dir)
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
        if key == "config":
            raise ValueError("'config' names the store's configuration, not an item")
        return self.dir / f"{key}.json"

    def has(self, key: str) -> bool:
        return self._path(key).exists()

    def get(self, key: str) -> Any:
        """The item ``key`` (:func:`decode` of its JSON). Raises ValueError: a file that is not a stored item."""
        p = self._path(key)
        try:
            return decode(json.loads(p.read_text()))
        except ValueError as e:
            raise ValueError(f"{p} is not a headscope store item ({e}); delete it to recompute it") from None

    def put(self, key: str, value: Any) -> None:
        """Write item ``key`` atomically (:func:`encode`)."""
        atomic_write_text(self._path(key), json.dumps(encode(value)))

    def keys(self) -> list[str]:
        return sorted(p.stem for p in self.dir.glob("*.json") if p.name != "config.json")


def check_rank_store(out_dir: Any, tasks: Sequence[str], fused: bool, spec: Any, settings: dict[str, Any],
                     lam: float, direction: str) -> None:
    """A rerun into ``out_dir`` resumes only a store of the same configuration: compare what is known
    before the model loads (tasks, task settings, λ, direction, model spec) with the stored config.

    Raises:
        HeadscopeInputError: the stored configuration differs (the message lists the keys).
        PickledStore: the store holds items in the old pickle format.
    """
    if out_dir is None or not isinstance(spec, (str, os.PathLike)):
        return
    for t in tasks:
        sub = Path(out_dir) / (t if fused else "") / "receivers"
        if sub.is_dir() and any(sub.glob("*.pt")):
            raise pickled_items_error(sub)
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
