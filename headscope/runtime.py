"""Runtime plumbing in one place: the version, a command process's garbage collection, devices, process groups
and atomic writes.

Nothing here knows about heads, rankings or training; both the sharded ranking
(:mod:`headscope.distributed`) and data-parallel training (:mod:`headscope.train.pipeline`) start their
processes with :func:`launch`, and every saved file goes through :func:`atomic_write_bytes`.

Process groups: a rank process finds ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` /
``MASTER_PORT`` in its environment, set either by ``torchrun --nproc-per-node N`` or by :func:`launch`
(``torch.multiprocessing.spawn`` of N local processes, TCP rendezvous on a free local port), and joins
with :func:`init_from_env`. So the code a rank runs is the same under both starters.

``torch`` is imported inside the functions: ``import headscope`` stays cheap.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

__version__ = "0.1.0"


# ---------------------------------------------------------------------------------------- command processes
def lean_gc() -> None:
    """Garbage collection tuned for a command-line process (the ``headscope`` command, ``python -m headscope.cli``,
    the experiment scripts), called before its heavy imports: young collections every 10,000 allocations instead of
    700 (the older generations' ratios unchanged). Importing torch and transformers and loading a model make millions
    of long-lived objects that the default thresholds traverse again and again: ``python -m headscope.cli rank`` up
    to its first check, three runs each on a 2-core CPU, 3.6-4.1 s with the defaults, 3.2-3.6 s so. Objects are
    still freed by reference count and cycles by a collection (gen0 every 10,000 allocations, a full one every
    1,000,000). Not done: freezing every object at exit (a further ~1 s), which leaves Triton's nanobind objects
    uncollected, and nanobind then prints ~30 lines of "leaked instance" after the command's own output."""
    import gc

    gc.set_threshold(10_000, 10, 10)


# ---------------------------------------------------------------------------------------- devices
def default_device(device: Optional[str] = None) -> str:
    """``device`` if given, else ``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    if device:
        return str(device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: Optional[str]) -> str:
    """The ``torch.distributed`` backend for a device: NCCL on CUDA, gloo otherwise."""
    return "nccl" if default_device(device).startswith("cuda") else "gloo"


def rank_device(device: Optional[str], rank: int) -> str:
    """``cuda:{rank mod #GPUs}`` on GPU machines (``device`` None or cuda), else ``"cpu"``.

    Raises:
        RuntimeError: ``device`` is cuda but no GPU is visible.
    """
    if default_device(device).startswith("cuda"):
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise RuntimeError("device 'cuda' asked for but no GPU is visible")
        return f"cuda:{rank % n}"
    return "cpu"


def same_device(a: Any, b: Any) -> bool:
    """Whether two device names / ``torch.device``s name the same device (``cuda`` = ``cuda:0``)."""
    import torch

    da, db = torch.device(a), torch.device(b)
    if da.type != db.type:
        return False
    return (da.index or 0) == (db.index or 0) if da.type == "cuda" else True


# ---------------------------------------------------------------------------------------- process groups
def init_from_env(device: Optional[str] = None) -> tuple[int, int] | None:
    """Join the process group described by the environment (torchrun or :func:`launch`) -> (rank, world),
    or None when this process is not a rank (no ``RANK`` / ``WORLD_SIZE`` in the environment)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend_for(device))
    return dist.get_rank(), dist.get_world_size()


def local_rank() -> int:
    """``LOCAL_RANK`` (or ``RANK``) from the environment; 0 outside a process group."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0)))


def barrier() -> None:
    """``torch.distributed.barrier()`` when a process group is initialized; else nothing."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, device: Optional[str], fn: Callable[..., Any], args: tuple,
           result: str) -> None:
    """One spawned rank: the environment torchrun would set, the device / threads, the group, ``fn``."""
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dev = rank_device(device, rank)
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    init_from_env(device)
    try:
        out = fn(*args)
        if rank == 0:
            atomic_write_bytes(Path(result), pickle.dumps(out))
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], n: int, args: tuple = (), device: Optional[str] = None) -> Any:
    """Run ``fn(*args)`` in ``n`` local rank processes (``torch.multiprocessing.spawn``) -> rank 0's return value.

    Each process gets the environment torchrun would give it, pins ``cuda:{rank}`` (GPU machines) or
    1/n of the CPU threads, and joins the process group (NCCL on CUDA, gloo on CPU) before ``fn``
    runs; inside, :func:`init_from_env` returns ``(rank, n)`` and :func:`local_rank` the rank.
    ``fn`` must be a module-level function and its return value picklable.

    Raises:
        ValueError: ``n`` < 1. A failing rank's exception is re-raised by ``torch.multiprocessing``.
    """
    if n < 1:
        raise ValueError(f"{n} processes: need at least one")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="headscope-launch-") as tmp:
        result = os.path.join(tmp, "rank0.pkl")
        mp.spawn(_entry, args=(n, _free_port(), device, fn, tuple(args), result), nprocs=n, join=True)
        with open(result, "rb") as f:
            return pickle.load(f)


# ---------------------------------------------------------------------------------------- atomic writes
def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never a part:
    a temporary file in the same directory, fsync, then ``os.replace``. Creates the parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path | str, text: str) -> None:
    """:func:`atomic_write_bytes` of UTF-8 text."""
    atomic_write_bytes(path, text.encode())


def atomic_torch_save(path: Path | str, obj: Any) -> None:
    """``torch.save(obj)`` written atomically (see :func:`atomic_write_bytes`)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


__all__ = [
    "__version__", "atomic_torch_save", "atomic_write_bytes", "atomic_write_text", "backend_for", "barrier",
    "default_device", "init_from_env", "launch", "local_rank", "rank_device", "same_device",
]


def config_diff(old: dict[str, Any], new: dict[str, Any], keys: Any = None) -> list[str]:
    """The settings in which two stored configurations differ: a top-level key, or for a dict value
    ``key.sub: <stored> stored, <new> now`` per differing entry (what a clash message names)."""
    out = []
    for k in sorted(keys if keys is not None else set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}.{j}: {a.get(j)!r} stored, {b.get(j)!r} now" for j in sorted(set(a) | set(b)) if a.get(j) != b.get(j)]
        else:
            out.append(k)
    return out
