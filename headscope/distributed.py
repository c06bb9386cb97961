"""Sharded sweeps on PyTorch's distributed stack (gloo on CPU, NCCL on GPU).

The work items of a receiver sweep (pair × layer, each holding that layer's head patches) are dealt
round-robin over the ranks; every rank writes its items into the run's resumable store and, after a
``torch.distributed`` barrier, reads the others' items back, so every rank ends with the table a
single process would produce, and a rank that dies leaves its finished items on disk for a rerun.

Two ways to start ranks, one code path inside them (:func:`headscope.runtime.init_from_env`):

* ``headscope rank ... --devices N`` (or :func:`spawn_rank`): N local processes via
  :func:`headscope.runtime.launch` (``torch.multiprocessing``, the environment torchrun would set);
* ``torchrun --nproc-per-node N -m headscope.cli rank ...``.

The process-group helpers live in :mod:`headscope.runtime`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .runtime import init_from_env, launch, rank_device


def _rank_worker(device: str | None, kwargs: dict[str, Any]) -> None:
    """One rank of a sharded :func:`headscope.rank` (inside a process group set up by ``launch``); with a
    ``config`` (:class:`~headscope.rank_config.RankConfig`) in ``kwargs``, that config on this rank's device."""
    from dataclasses import replace

    from .api import rank, run

    r, world = init_from_env(device)  # type: ignore[misc]
    kw, dev = dict(kwargs), rank_device(device, r)
    cfg = kw.pop("config", None)
    if cfg is not None:
        run(kw.pop("model"), replace(cfg, device=dev), shard=(r, world), progress=r == 0, **kw)
    else:
        rank(device=dev, shard=(r, world), progress=r == 0, **kw)


def spawn_rank(n: int, out_dir: str | Path, device: str | None = None, **kwargs: Any) -> Any:
    """Run :func:`headscope.rank` sharded over ``n`` local processes; returns the merged Ranking
    (rank 0 saves it into ``out_dir``).

    Raises:
        ValueError: n < 1 (the shared store in ``out_dir`` is where ranks meet).
    """
    from .scores import Ranking

    if n < 1:
        raise ValueError(f"--devices {n}: need at least one process")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    launch(_rank_worker, n, (device, {**kwargs, "out_dir": str(out)}), device=device)
    return Ranking.load(out)
