"""Patching: the engines and their contract, receivers (eq. 10), senders (path patching, SPEC.md §5) and the
resumable store."""

from .contract import PatchingEngine, PlanEngine, make_engine
from .engine import Engine, Precision, RunCache, UnsupportedArchitecture
from .receivers import GapError, PatchResult, receiver_ie, receiver_patching, reference_patched_metric
from .senders import SenderRounds, iterate_senders, sender_ie, sender_patching
from .store import ConfigMismatch, Store

__all__ = [
    "Engine",
    "PatchingEngine",
    "PlanEngine",
    "make_engine",
    "Precision",
    "RunCache",
    "UnsupportedArchitecture",
    "GapError",
    "PatchResult",
    "receiver_ie",
    "receiver_patching",
    "reference_patched_metric",
    "sender_ie",
    "sender_patching",
    "iterate_senders",
    "SenderRounds",
    "ConfigMismatch",
    "Store",
]
