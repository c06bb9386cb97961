"""Shared by the benchmarks: mean milliseconds per call of a function (eager or graph-replayed), and a variant's
module-option overrides (parsed, and applied for a block)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator

import torch


def cuda_device(script: str) -> torch.device:
    """The CUDA device a GPU-only benchmark runs on; exits naming the fix where there is none."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} times CUDA kernels: run it on a GPU host (see benchmarks/README.md)")
    return torch.device("cuda")


def time_ms(fn, dev: torch.device, reps: int, warmup: int = 1) -> float:
    """Mean ms per call of ``fn`` over ``reps`` calls after ``warmup`` calls: CUDA events around the calls on
    CUDA (one synchronization at the end), ``time.perf_counter`` on CPU."""
    for _ in range(warmup):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end) / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e3 / reps


def graphed_ms(fn, dev: torch.device, reps: int, warmup: int = 3) -> float:
    """Mean ms of one replay of ``fn`` recorded in a CUDA graph (``headscope.hybrid.graphs.capture`` after ``warmup``
    eager calls), by :func:`time_ms` over ``reps`` replays."""
    from headscope.hybrid.graphs import capture

    graph, _ = capture(fn, warmup=warmup, device=dev)
    return time_ms(graph.replay, dev, reps, warmup=5)


def parse_overrides(variant: str) -> tuple[str, list]:
    """'NAME' or 'NAME:module.ATTR=value,...' -> (NAME, [(module, ATTR, value)]) for headscope.hybrid's modules
    lean, static, splitk, skinny, tail_step, step and gdn_step; values True/False/integers are converted.

    Raises:
        ValueError: an item that is not module.ATTR=value with a known module and an existing ATTR.
    """
    from headscope.hybrid import gdn_step, lean, skinny, splitk, static, step, tail_step

    mods = {"lean": lean, "static": static, "splitk": splitk, "skinny": skinny, "tail_step": tail_step, "step": step,
            "gdn_step": gdn_step}
    vname, _, spec = variant.partition(":")
    overrides = []
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        mod, _, attr = key.partition(".")
        if mod not in mods or not hasattr(mods[mod], attr) or not val:
            raise ValueError(f"variant {variant!r}: {item!r} is not module.ATTR=value with module in {sorted(mods)} "
                             "and an existing ATTR (e.g. lean.DECODE_OVERLAP=False)")
        v = {"True": True, "False": False}.get(val, int(val) if val.lstrip("-").isdigit() else val)
        overrides.append((mods[mod], attr, v))
    return vname, overrides


@contextlib.contextmanager
def applied(overrides: list) -> Iterator[None]:
    """Module options [(module, ATTR, value)] (:func:`parse_overrides`) set for the ``with`` block, restored after."""
    saved = [(m, a, getattr(m, a)) for m, a, _ in overrides]
    try:
        for m, a, v in overrides:
            setattr(m, a, v)
        yield
    finally:
        for m, a, v in reversed(saved):
            setattr(m, a, v)
