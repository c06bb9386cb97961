"""Checks of scalars, devices, paths, model specs (geometry without weights) and budgets (issue #19).

Every helper raises :class:`~headscope.errors.HeadscopeInputError` (or a variant) naming the fix.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence

from ..errors import HeadscopeInputError, InputFileNotFoundError, InputTypeError


# ---------------------------------------------------------------------------------------- scalars
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or type(v).__name__.startswith(("int", "uint"))


def check_int(name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None, fix: str = "") -> int:
    """``value`` as an int within [lo, hi]. Raises HeadscopeInputError naming ``name`` and ``fix``."""
    tail = f"; {fix}" if fix else ""
    if not _is_int(value):
        raise HeadscopeInputError(f"{name}={value!r} must be a whole number{tail}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in {lo}..{hi}")
        raise HeadscopeInputError(f"{name}={v} must be {rng}{tail}")
    return v


def check_real(
    name: str, value: Any, lo: Optional[float] = None, hi: Optional[float] = None,
    lo_open: bool = False, hi_open: bool = False, fix: str = "",
) -> float:
    """``value`` as a finite float in the interval (``lo_open``/``hi_open`` exclude the ends).

    Raises:
        HeadscopeInputError: not a number, NaN/inf, or outside the interval (names ``fix``).
    """
    tail = f"; {fix}" if fix else ""
    try:
        if isinstance(value, (bool, str)):
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise HeadscopeInputError(f"{name}={value!r} must be a number{tail}") from None
    bad_lo = lo is not None and (x <= lo if lo_open else x < lo)
    bad_hi = hi is not None and (x >= hi if hi_open else x > hi)
    if not math.isfinite(x) or bad_lo or bad_hi:
        left = "-inf" if lo is None else f"{'(' if lo_open else '['}{lo:g}"
        right = "inf)" if hi is None else f"{hi:g}{')' if hi_open else ']'}"
        if lo is None:
            left = "(-inf"
        raise HeadscopeInputError(f"{name}={value!r} must lie in {left}, {right}{tail}")
    return x


def check_choice(name: str, value: Any, choices: Sequence[Any], fix: str = "") -> Any:
    """``value`` if it is one of ``choices``. Raises HeadscopeInputError listing them."""
    if value not in tuple(choices):
        tail = f"; {fix}" if fix else ""
        raise HeadscopeInputError(f"{name}={value!r} is not one of {', '.join(map(str, choices))}{tail}")
    return value


# ---------------------------------------------------------------------------------------- devices
def check_device(device: Any, name: str = "device") -> None:
    """A device headscope can run on: cpu, cuda[:N] on a machine with that GPU, or mps when available.

    Raises:
        HeadscopeInputError: an unknown device string, CUDA on a machine without it, a GPU index
            past the visible GPUs.
    """
    if device is None:
        return
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise HeadscopeInputError(f"{name} {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if d.type == "cpu":
        return
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise HeadscopeInputError(
                f"{name} {device!r}: {why}; use {name} cpu (or leave {name} out: cuda is used when available)"
            )
        n = torch.cuda.device_count()
        if d.index is not None and d.index >= n:
            raise HeadscopeInputError(f"{name} {device!r}: only {n} GPU(s) are visible (cuda:0..cuda:{n - 1})")
        return
    if d.type == "mps":
        if not torch.backends.mps.is_available():
            raise HeadscopeInputError(f"{name} 'mps' is not available on this machine; use {name} cpu")
        return
    raise HeadscopeInputError(f"{name} {device!r}: headscope runs on cpu or cuda (or mps)")


def check_dtype(dtype: Any) -> None:
    """Raises HeadscopeInputError unless ``dtype`` is a floating-point ``torch.dtype``."""
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise HeadscopeInputError(f"dtype={dtype!r}: pass torch.float32 (default), torch.bfloat16 or torch.float16")


def check_device_map(device_map: Any, devices: int = 1, name: str = "device_map") -> None:
    """A known device-map name or a {module: device} dict, accelerate installed, one process.

    Raises:
        HeadscopeInputError: an unknown name, with ``devices`` > 1, or accelerate missing.
    """
    if device_map is None:
        return
    from ..models import DEVICE_MAPS

    if devices > 1:
        raise HeadscopeInputError(
            "--device-map spreads one model over the GPUs; --devices shards the sweep: use one of them"
        )
    if isinstance(device_map, str):
        check_choice(name, device_map, DEVICE_MAPS, "or pass a {module name: device} dict")
    elif not isinstance(device_map, dict):
        raise HeadscopeInputError(f"{name}={device_map!r}: use one of {DEVICE_MAPS} or a {{module: device}} dict")
    if importlib.util.find_spec("accelerate") is None:
        raise HeadscopeInputError(f"{name} needs accelerate: pip install 'headscope[scale]' (or accelerate)")


# ---------------------------------------------------------------------------------------- paths
def check_out_dir(path: Any, name: str = "out") -> Path:
    """An output directory that exists or can be created (no file in its way, writable).

    Raises:
        HeadscopeInputError: ``path`` (or one of its parents) is a file, or the place is not writable.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise HeadscopeInputError(f"{name} {p} is a file, not a directory; pass a directory path (created when missing)")
    a = p
    while not a.exists() and a != a.parent:
        a = a.parent
    if a.exists() and not a.is_dir():
        raise HeadscopeInputError(f"{name} {p}: {a} is a file, so the directory cannot be created; pass another path")
    if a.exists() and not os.access(a, os.W_OK | os.X_OK):
        raise HeadscopeInputError(f"{name} {p}: {a} is not writable; pass a directory you can write to")
    return p


def check_file(path: Any, what: str, fix: str) -> Path:
    """An existing regular file. Raises InputFileNotFoundError / HeadscopeInputError naming ``fix``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InputFileNotFoundError(f"{what} {p} does not exist; {fix}")
    if not p.is_file():
        raise HeadscopeInputError(f"{what} {p} is a directory, not a file; {fix}")
    return p


# ---------------------------------------------------------------------------------------- models
def _geometry(cfg: dict[str, Any]) -> Any:
    from ..models import geometry_of

    cfg = cfg if "num_attention_heads" in cfg else cfg.get("text_config") or {}
    try:
        return geometry_of(SimpleNamespace(**cfg))
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


def config_geometry(path: Any) -> Any:
    """Geometry from a transformers ``config.json`` (None when it cannot be read)."""
    try:
        return _geometry(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None


_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_value(f: Any, t: int) -> Any:
    """One GGUF metadata value; arrays are skipped (None)."""
    if t in _GGUF_SCALAR:
        fmt = _GGUF_SCALAR[t]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if t == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8", "replace")
    if t == 9:
        et, n = struct.unpack("<IQ", f.read(12))
        if et in _GGUF_SCALAR:
            f.seek(n * struct.calcsize(_GGUF_SCALAR[et]), 1)
        else:
            for _ in range(n):
                _gguf_value(f, et)
        return None
    raise ValueError(f"unknown GGUF value type {t}")


def gguf_geometry(path: Any) -> Any:
    """Geometry from a GGUF file's metadata, read without its tensors (None when unreadable)."""
    from ..models import Geometry

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            (version,) = struct.unpack("<I", f.read(4))
            if version < 2:
                return None
            _, n_kv = struct.unpack("<QQ", f.read(16))
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(n).decode("utf-8", "replace")
                (t,) = struct.unpack("<I", f.read(4))
                meta[key] = _gguf_value(f, t)
        arch = meta["general.architecture"]
        g = {k: meta.get(f"{arch}.{k}") for k in ("block_count", "attention.head_count", "attention.head_count_kv",
                                                  "embedding_length", "context_length", "attention.key_length")}
        n_heads = int(g["attention.head_count"])
        return Geometry(
            n_layers=int(g["block_count"]), n_heads=n_heads, n_kv_heads=int(g["attention.head_count_kv"] or n_heads),
            d_head=int(g["attention.key_length"] or int(g["embedding_length"]) // n_heads),
            d_model=int(g["embedding_length"]), n_ctx=int(g["context_length"] or 0),
        )
    except (OSError, ValueError, KeyError, TypeError, struct.error, ZeroDivisionError):
        return None


def _cached_hub_config(repo_id: str) -> Optional[str]:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id: not in the cache either
        return None
    return hit if isinstance(hit, str) else None


def check_model(spec: Any, name: str = "model") -> Any:
    """Resolve a model spec without loading it -> its Geometry (None where the config is unreadable).

    Raises:
        ModelSpecError (a HeadscopeInputError): unknown spec, missing GGUF / directory / config.json,
            a hub id that is not in the local Hugging Face cache.
        InputTypeError: ``spec`` is neither a spec string, a path nor a LoadedModel.
    """
    from ..models import LoadedModel, ModelSpecError, _resolve

    if isinstance(spec, LoadedModel):
        return spec.geometry
    if not isinstance(spec, (str, os.PathLike)):
        raise InputTypeError(f"{name} must be a model spec (name, directory, .gguf path, hub id) or a LoadedModel, "
                             f"not {type(spec).__name__}")
    path, kw, _ = _resolve(spec)
    if "gguf_file" in kw:
        return gguf_geometry(Path(path) / kw["gguf_file"])
    if kw.get("local_files_only"):
        cfg = _cached_hub_config(path)
        if cfg is None:
            raise ModelSpecError(
                f"{str(spec)!r} is not in the local Hugging Face cache and headscope never downloads: download it "
                "yourself (huggingface-cli download ...) or pass a local model directory / .gguf path"
            )
        return config_geometry(cfg)
    return config_geometry(Path(path) / "config.json")


# ---------------------------------------------------------------------------------------- budgets
def check_budget(budget: Any, geometry: Any = None, min_per_layer: int = 1, name: str = "budget",
                 allow_raise: bool = False) -> Optional[int]:
    """The syntax of a budget, and with ``geometry`` its head count and ``min_per_layer`` -> K or None.
    ``allow_raise``: a budget below ``min_per_layer`` per layer is accepted (the mask step raises it).

    Raises:
        HeadscopeInputError: a malformed budget, a count outside the model, a ratio leaving no FA
            head, a fraction outside (0, 1], or a budget too small for ``min_per_layer`` per layer.
    """
    from ..masks import parse_budget

    mpl_name = "--min-per-layer" if name.startswith("--") else "min_per_layer"
    check_int(mpl_name, min_per_layer, lo=0)
    if geometry is None:
        parse_budget(budget, 10**9)  # syntax only: 'lots', '7:0', a fraction above 1
        return None
    k = parse_budget(budget, geometry.n_total)
    if min_per_layer > geometry.n_heads:
        raise HeadscopeInputError(
            f"{mpl_name}={min_per_layer} is more than the {geometry.n_heads} heads of a layer; lower {mpl_name}"
        )
    if min_per_layer * geometry.n_layers > k and not allow_raise:
        raise HeadscopeInputError(
            f"budget of {k} FA heads cannot give {min_per_layer} head(s) to each of {geometry.n_layers} layers; "
            f"raise {name} or lower {mpl_name}"
        )
    return k
