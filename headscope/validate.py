"""Primitive argument checks shared by every entry point: whole numbers, reals, choices, devices, dtypes,
files and output directories.

A leaf module: it imports nothing of headscope but :mod:`headscope.errors`, so a config, a selector or the
model adapter can validate its arguments before any model loads. Every helper raises
:class:`~headscope.errors.HeadscopeInputError` (or a variant) with a message that names the fix.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from .errors import HeadscopeInputError, InputFileNotFoundError, SettingError


# ---------------------------------------------------------------------------------------- scalars
def is_int(v: Any) -> bool:
    """Whether ``v`` is a whole number (a Python or NumPy int; bool is not)."""
    return isinstance(v, int) and not isinstance(v, bool) or type(v).__name__.startswith(("int", "uint"))


def check_int(name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None, fix: str = "") -> int:
    """``value`` as an int within [lo, hi]. Raises HeadscopeInputError naming ``name`` and ``fix``."""
    tail = f"; {fix}" if fix else ""
    if not is_int(value):
        raise SettingError(name, f"{{setting}}={value!r} must be a whole number{tail}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in {lo}..{hi}")
        raise SettingError(name, f"{{setting}}={v} must be {rng}{tail}")
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
        raise SettingError(name, f"{{setting}}={value!r} must be a number{tail}") from None
    bad_lo = lo is not None and (x <= lo if lo_open else x < lo)
    bad_hi = hi is not None and (x >= hi if hi_open else x > hi)
    if not math.isfinite(x) or bad_lo or bad_hi:
        left = "-inf" if lo is None else f"{'(' if lo_open else '['}{lo:g}"
        right = "inf)" if hi is None else f"{hi:g}{')' if hi_open else ']'}"
        if lo is None:
            left = "(-inf"
        raise SettingError(name, f"{{setting}}={value!r} must lie in {left}, {right}{tail}")
    return x


def check_choice(name: str, value: Any, choices: Sequence[Any], fix: str = "") -> Any:
    """``value`` if it is one of ``choices``. Raises HeadscopeInputError listing them."""
    if value not in tuple(choices):
        tail = f"; {fix}" if fix else ""
        raise SettingError(name, f"{{setting}}={value!r} is not one of {', '.join(map(str, choices))}{tail}")
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
        raise SettingError(name, f"{{setting}} {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if d.type == "cpu":
        return
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise SettingError(
                name, f"{{setting}} {device!r}: {why}; use {{setting}} cpu (or leave {{setting}} out: cuda is used when "
                "available)")
        n = torch.cuda.device_count()
        if d.index is not None and d.index >= n:
            raise SettingError(name, f"{{setting}} {device!r}: only {n} GPU(s) are visible (cuda:0..cuda:{n - 1})")
        return
    if d.type == "mps":
        if not torch.backends.mps.is_available():
            raise SettingError(name, "{setting} 'mps' is not available on this machine; use {setting} cpu")
        return
    raise SettingError(name, f"{{setting}} {device!r}: headscope runs on cpu or cuda (or mps)")


def check_dtype(dtype: Any) -> None:
    """Raises HeadscopeInputError unless ``dtype`` is a floating-point ``torch.dtype``."""
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise HeadscopeInputError(f"dtype={dtype!r}: pass torch.float32 (default), torch.bfloat16 or torch.float16")


# ---------------------------------------------------------------------------------------- paths
def check_out_dir(path: Any, name: str = "out") -> Path:
    """An output directory that exists or can be created (no file in its way, writable).

    Raises:
        HeadscopeInputError: ``path`` (or one of its parents) is a file, or the place is not writable.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise SettingError(name, f"{{setting}} {p} is a file, not a directory; pass a directory path (created when missing)")
    a = p
    while not a.exists() and a != a.parent:
        a = a.parent
    if a.exists() and not a.is_dir():
        raise SettingError(name, f"{{setting}} {p}: {a} is a file, so the directory cannot be created; pass another path")
    if a.exists() and not os.access(a, os.W_OK | os.X_OK):
        raise SettingError(name, f"{{setting}} {p}: {a} is not writable; pass a directory you can write to")
    return p


def check_file(path: Any, what: str, fix: str) -> Path:
    """An existing regular file. Raises InputFileNotFoundError / HeadscopeInputError naming ``fix``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InputFileNotFoundError(f"{what} {p} does not exist; {fix}")
    if not p.is_file():
        raise HeadscopeInputError(f"{what} {p} is a directory, not a file; {fix}")
    return p
