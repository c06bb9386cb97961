"""Timing shared by the benchmarks: mean milliseconds per call of a function."""

from __future__ import annotations

import time

import torch


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
