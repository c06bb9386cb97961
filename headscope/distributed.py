"""Sharded sweeps on PyTorch's distributed stack (gloo on CPU, NCCL on GPU).

The work items of a receiver sweep (pair × layer, each holding that layer's head patches) are dealt
round-robin over the ranks; every rank writes its items into the run's resumable store and, after a
``torch.distributed`` barrier, reads the others' items back, so every rank ends with the table a
single process would produce, and a rank that dies leaves its finished items on disk for a rerun.

Two ways to start ranks:

* ``headscope rank ... --devices N`` (or :func:`spawn_rank`): N local processes via
  ``torch.multiprocessing.spawn``, a file-based rendezvous in the run directory;
* ``torchrun --nproc-per-node N -m headscope.cli rank ...``: the ranks read ``RANK``/``WORLD_SIZE``
  from the environment (``init_from_env``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def backend_for(device: str | None) -> str:
    return "nccl" if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else "gloo"


def rank_device(device: str | None, rank: int) -> str:
    """cuda:{local rank} on GPU machines, else cpu."""
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        n = torch.cuda.device_count()
        if n == 0:
            raise RuntimeError("device 'cuda' asked for but no GPU is visible")
        return f"cuda:{rank % n}"
    return "cpu"


def init_from_env(device: str | None = None) -> tuple[int, int] | None:
    """Join the process group torchrun set up (RANK/WORLD_SIZE in the environment) -> (rank, world)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device))
    return dist.get_rank(), dist.get_world_size()


def _worker(rank: int, world: int, rendezvous: str, device: str | None, kwargs: dict[str, Any], result_path: str) -> None:
    from .api import rank as rank_heads

    if not (device or "").startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    dist.init_process_group(backend_for(device), init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        r = rank_heads(device=rank_device(device, rank), shard=(rank, world), progress=rank == 0, **kwargs)
        if rank == 0:
            r.save(result_path)
    finally:
        dist.destroy_process_group()


def spawn_rank(n: int, out_dir: str | Path, device: str | None = None, **kwargs: Any) -> Any:
    """Run :func:`headscope.rank` sharded over ``n`` local processes; returns the merged Ranking.

    Raises:
        ValueError: n < 1 or no ``out_dir`` (the shared store is where ranks meet).
    """
    from .scores import Ranking

    if n < 1:
        raise ValueError(f"--devices {n}: need at least one process")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rendezvous = out / f".rendezvous-{os.getpid()}"
    if rendezvous.exists():
        rendezvous.unlink()
    torch.multiprocessing.spawn(
        _worker, args=(n, str(rendezvous), device, {**kwargs, "out_dir": str(out)}, str(out)), nprocs=n, join=True
    )
    if rendezvous.exists():
        rendezvous.unlink()
    return Ranking.load(out)
