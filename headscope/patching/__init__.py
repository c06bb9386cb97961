"""Patching: the engine, receivers (eq. 10) and the resumable store."""

from .engine import Engine, RunCache, UnsupportedArchitecture
from .receivers import GapError, PatchResult, receiver_ie, receiver_patching, reference_patched_metric
from .store import ConfigMismatch, Store

__all__ = [
    "Engine",
    "RunCache",
    "UnsupportedArchitecture",
    "GapError",
    "PatchResult",
    "receiver_ie",
    "receiver_patching",
    "reference_patched_metric",
    "ConfigMismatch",
    "Store",
]
