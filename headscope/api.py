"""The one-call entry point: :func:`rank`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch

from . import __version__
from .models import DEFAULT_MODEL, LoadedModel, load_model
from .patching.receivers import DEFAULT_MIN_GAP, Direction, receiver_patching
from .readout import DEFAULT_LAMBDA
from .scores import Ranking, head_table
from .tasks import TASKS, make_pairs
from .tasks.base import Pair


def rank(
    model: str | LoadedModel = DEFAULT_MODEL,
    tasks: Sequence[str] = ("niah_single",),
    n_pairs: int = 6,
    seq_len: int = 512,
    seed: int = 0,
    depth: float | Sequence[float] = 0.5,
    lam: float = DEFAULT_LAMBDA,
    direction: Direction = "noising",
    min_gap: float = DEFAULT_MIN_GAP,
    pairs: Sequence[Pair] | None = None,
    out_dir: str | Path | None = None,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    batch_size: int | None = None,
    progress: bool = True,
    task_settings: dict[str, Any] | None = None,
    shard: tuple[int, int] | None = None,
) -> Ranking:
    """Rank every attention head by its causal importance for the given capabilities.

    Receiver activation patching of ``hook_z`` (SPEC.md §4, eq. 10) with the λ-decayed logit
    difference over the answer span (eq. 9), averaged over ``n_pairs`` calibration pairs.

    Args:
        model: ``"smollm2-135m"`` (default), a local HF directory, a ``.gguf`` path, a cached hub
            id, or a :class:`~headscope.models.LoadedModel`.
        tasks: capability names from :data:`headscope.tasks.TASKS`.
        n_pairs: calibration pairs per capability (>= 1).
        seq_len: prompt length in tokens; depth: needle depth (fraction, or a list cycled).
        seed: seeds the task generators.
        lam: λ of the readout; direction: "noising" (default) or "denoising".
        min_gap: pairs with |m(x) − m(x')| below this (logits) are skipped and reported.
        pairs: ready-made pairs (overrides task generation; ``tasks`` then only labels them).
        out_dir: if given, per-pair results are written there as they finish (a rerun resumes)
            and the Ranking is saved there at the end.
        shard: ``(rank, world_size)`` of a sharded sweep (see :mod:`headscope.distributed`;
            needs ``out_dir``); every rank returns the merged Ranking, rank 0 saves it.

    Returns:
        Ranking (``.scores`` DataFrame, ``.mask(budget)``, ``.heatmap()``, ``.save(dir)``).

    Raises:
        ValueError: n_pairs < 1, unknown task, bad pairs; ModelSpecError: unknown model spec;
        GapError: no pair separates a⁺ from a⁻.
    """
    if n_pairs < 1:
        raise ValueError(f"n_pairs={n_pairs}: need at least one calibration pair per task")
    tasks = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available: {', '.join(sorted(TASKS))}")
    if len(tasks) != 1:
        raise NotImplementedError("fusion over several capabilities is not implemented yet; pass one task")
    t0 = time.time()
    lm = load_model(model, device=device, dtype=dtype)
    settings = {"n_pairs": n_pairs, "seq_len": seq_len, "seed": seed, "depth": depth, **(task_settings or {})}
    if pairs is None:
        pairs = make_pairs(tasks[0], lm.tokenizer, **settings)
    prov: dict[str, Any] = {
        "headscope_version": __version__,
        **lm.provenance(),
        "tasks": list(tasks),
        "task_settings": settings,
        "n_pairs": len(pairs),
        "seed": seed,
        "direction": direction,
        "lambda": lam,
        "min_gap": min_gap,
        "patching": "hook_z, all positions, exact",
        "score": "ie_recv (mean over pairs)",
        "pair_lengths": [p.length for p in pairs],
    }
    res = receiver_patching(
        lm,
        pairs,
        lam=lam,
        direction=direction,
        min_gap=min_gap,
        batch_size=batch_size,
        store_dir=str(out_dir) if out_dir is not None else None,
        # the device is left out: items computed on cuda:0 and cuda:1 (or resumed elsewhere) may mix
        store_config={"model": {k: v for k, v in lm.provenance().items() if k != "device"},
                      "tasks": list(tasks), "settings": settings},
        progress=progress,
        shard=shard,
    )
    df = head_table(res.ie, lm.geometry.n_kv_heads)
    prov["skipped_pairs"] = res.skipped
    prov["m_clean"] = res.m_clean.tolist()
    prov["m_corrupt"] = res.m_corrupt.tolist()
    prov["seconds"] = round(time.time() - t0, 1)
    ranking = Ranking(df, lm.geometry.to_dict(), prov, res.ie)
    if out_dir is not None and (shard is None or shard[0] == 0):
        ranking.save(out_dir)
    return ranking
