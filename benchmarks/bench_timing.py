"""Shared by the benchmarks: mean milliseconds per call of a function (eager or graph-replayed), and a variant's
InferenceConfig changes (parsed, and set on models for a block)."""

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
    """Mean ms of one replay of ``fn`` recorded in a CUDA graph (``headscope.hybrid.inference.graphs.capture`` after ``warmup``
    eager calls), by :func:`time_ms` over ``reps`` replays."""
    from headscope.hybrid.inference.graphs import capture

    graph, _ = capture(fn, warmup=warmup, device=dev)
    return time_ms(graph.replay, dev, reps, warmup=5)


def parse_variant(variant: str) -> tuple[str, dict]:
    """'NAME' or 'NAME:field=value,...' -> (NAME, {field: value}) of
    :class:`headscope.hybrid.inference.InferenceConfig` fields; values True/False/None/integers are converted.

    Raises:
        ValueError: an item that is not field=value with a field of InferenceConfig, or a value it refuses.
    """
    from dataclasses import fields

    from headscope.hybrid.inference import DEFAULT

    names = {f.name for f in fields(DEFAULT)}
    vname, _, spec = variant.partition(":")
    changes = {}
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        if key not in names or not val:
            raise ValueError(f"variant {variant!r}: {item!r} is not field=value with a field of InferenceConfig "
                             f"({sorted(names)}; e.g. tail_kernel=False)")
        changes[key] = {"True": True, "False": False, "None": None}.get(
            val, int(val) if val.lstrip("-").isdigit() else val)
    variant_config(changes)  # validated now, before any model loads
    return vname, changes


def variant_config(changes: dict, base=None):
    """``dataclasses.replace(base or InferenceConfig(), **changes)`` (validated: ValueError names the field)."""
    from dataclasses import replace

    from headscope.hybrid.inference import DEFAULT

    return replace(base if base is not None else DEFAULT, **changes)


@contextlib.contextmanager
def configured(models, config) -> Iterator[None]:
    """Each model in ``models`` runs with ``config`` (:func:`headscope.hybrid.inference.use_inference`) for the
    ``with`` block; its own config is restored after."""
    from headscope.hybrid.inference import inference_config, use_inference

    saved = [(m, inference_config(m)) for m in models]
    try:
        for m, _ in saved:
            use_inference(m, config)
        yield
    finally:
        for m, old in saved:
            use_inference(m, old)
