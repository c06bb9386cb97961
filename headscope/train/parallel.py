"""Data-parallel training on PyTorch's distributed stack: FSDP2 sharding, global-batch slicing and
device-count-independent checkpoints (torch.distributed.checkpoint, DCP).

* Every rank draws the same global batch from the same :class:`~headscope.train.data.Loader` and
  trains on a contiguous slice of its rows (:func:`local_rows`); the loss is normalized by the
  global token count (an all-reduced sum), so the loss and the gradient of a step are those of the
  whole batch in one process.
* The student is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``, public since torch 2.6):
  stages 2 and 3 shard every decoder layer plus the root (embeddings, final norm, LM head); stage 1,
  which calls each layer's attention directly, shards every ``self_attn`` (the only trained modules)
  and keeps the frozen rest replicated. FSDP2 runs on CUDA (NCCL) and on CPU (gloo).
* Checkpoints are DCP directories written collectively from ``get_state_dict`` (model + optimizer,
  keyed by parameter names, not by shard), so a checkpoint written by N ranks loads into M ranks
  (``set_state_dict``), including M = 1 without a process group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from jaxtyping import Bool, Int
from torch import Tensor, nn


def world_info() -> tuple[int, int]:
    """(rank, world size) of the current process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if world_info()[1] > 1:
        dist.barrier()


def all_sum(t: Tensor) -> Tensor:
    """Sum of ``t`` over all ranks (in place, returned); identity in one process. ``t`` must live on
    the device of the process group's backend (CPU for gloo, the rank's GPU for NCCL)."""
    if world_info()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is set on any rank (a collective: every rank must call it)."""
    if world_info()[1] == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def local_rows(
    ids: Int[Tensor, "batch time"], mask: Bool[Tensor, "batch time"], rank: int, world: int
) -> tuple[Int[Tensor, "local time"], Bool[Tensor, "local time"]]:
    """This rank's deterministic slice of a global batch: contiguous chunks of
    ``torch.tensor_split`` (sizes differ by at most one row).

    Raises:
        ValueError: fewer rows than ranks (a rank would get no data).
    """
    if len(ids) < world:
        raise ValueError(f"global batch of {len(ids)} rows cannot feed {world} ranks; use --batch-size >= {world}")
    return ids.tensor_split(world)[rank], mask.tensor_split(world)[rank]


def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (so that randomly initialized parts
    of a student start equal everywhere before sharding)."""
    if world_info()[1] == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src)


def shard_student(student: nn.Module, stage: int) -> None:
    """Shard ``student`` in place with FSDP2 over all ranks (see the module docstring for the units).

    Call after ``trainable_parameters`` (FSDP2 keeps each parameter's ``requires_grad``) and before
    building the optimizer (the sharded parameters are new ``nn.Parameter`` objects).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, world = world_info()
    dev = next(student.parameters()).device
    mesh = init_device_mesh(dev.type, (world,))
    from ..hybrid.modeling_hybrid import attention_name, decoder_layers

    layers = decoder_layers(student)
    if stage == 1:
        for layer in layers:
            fully_shard(getattr(layer, attention_name(layer)), mesh=mesh)
    else:
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(student, mesh=mesh)


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """The full (unsharded) state dict on CPU; a collective when ``module`` is sharded (every rank must
    call it; all ranks get the full tensors)."""
    if not is_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def grad_norm(params: list[Tensor], clip: float) -> float:
    """Global gradient norm of ``params`` (sharded or not), clipping to ``clip`` when ``clip > 0``."""
    gn = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    if hasattr(gn, "full_tensor"):
        gn = gn.full_tensor()
    return float(gn)


# ---------------------------------------------------------------------------------------- checkpoints
TRAINER_STATE = "trainer.pt"


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Path:
    """Write a DCP checkpoint directory ``path`` (collective): model and optimizer state from
    ``get_state_dict`` plus ``extra`` (step, scheduler, data position, RNG; written by rank 0 as
    ``trainer.pt``). The new directory replaces the old one only when complete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, _ = world_info()
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    msd, osd = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    if rank == 0:
        torch.save(extra, tmp / TRAINER_STATE)
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)
    barrier()
    return path


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Hide DCP's "torch.distributed is disabled ... single process" UserWarning: without a process group, a
    single process is what we mean (``no_dist``), so the warning only alarms the user."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
        yield


def find_checkpoint(path: Path) -> Optional[Path]:
    """``path`` if it holds a complete checkpoint, else the previous one left by a crash during the
    swap (``path.old``), else None."""
    for p in (path, path.with_name(path.name + ".old")):
        if (p / TRAINER_STATE).exists():
            return p
    return None


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` directory into ``model``/``optimizer`` (any world size, sharded or
    not; a collective when sharded) and return its ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)


Reducer = Callable[[Tensor], Tensor]
