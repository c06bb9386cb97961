"""Data-parallel training on PyTorch's distributed stack: FSDP2 sharding, global-batch slicing and
device-count-independent checkpoints (safetensors + JSON).

* Every rank draws the same global batch from the same :class:`~headscope.train.data.Loader` and
  trains on a contiguous slice of its rows (:func:`local_rows`); the loss is normalized by the
  global token count (an all-reduced sum), so the loss and the gradient of a step are those of the
  whole batch in one process.
* The student is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``, public since torch 2.6):
  stages 2 and 3 shard every decoder layer plus the root (embeddings, final norm, LM head); stage 1,
  which calls each layer's attention directly, shards every ``self_attn`` (the only trained modules)
  and keeps the frozen rest replicated. FSDP2 runs on CUDA (NCCL) and on CPU (gloo).
* Checkpoints hold the full model and optimizer state from ``get_state_dict`` (keyed by parameter
  names, not by shard) as safetensors plus JSON, nothing pickled, so a checkpoint written by N ranks
  loads into M ranks (``set_state_dict``), including M = 1 without a process group, and reading one
  runs no code.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

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


class StepLoss(nn.Module):
    """A stage's loss as a module whose parameters are the student's (the teacher stays outside it), so
    that :class:`~torch.nn.parallel.DistributedDataParallel` wraps the whole forward of a step.

    ``forward(ids, mask, *extra)`` returns ``loss_fn(ids, mask, *extra)`` (the loss and the logged values;
    ``extra``: e.g. a micro-batch's denominator under gradient accumulation)."""

    def __init__(self, student: nn.Module, loss_fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]):
        super().__init__()
        self.student = student
        self._loss_fn = loss_fn

    def forward(self, ids: Tensor, mask: Tensor, *extra: Any) -> tuple[Tensor, Tensor]:
        return self._loss_fn(ids, mask, *extra)


def ddp_loss(student: nn.Module, loss_fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> nn.Module:
    """``loss_fn`` (ids, mask -> loss, logged) run through PyTorch's DistributedDataParallel around
    ``student``: rank 0's parameters and buffers are copied to every rank when it is made, and the
    gradients of the parameters that require one are averaged over ranks in buckets while the
    backward runs. Call after ``trainable_parameters`` (DDP reduces the parameters that require a
    gradient when it is made) and with an initialized process group (gloo on CPU, NCCL on GPU).

    Every parameter that requires a gradient must get one in every step (``find_unused_parameters`` is
    off); the gradients are views into DDP's buckets (``gradient_as_bucket_view``: no second copy)."""
    from torch.nn.parallel import DistributedDataParallel

    dev = next(student.parameters()).device
    return DistributedDataParallel(
        StepLoss(student, loss_fn), device_ids=[dev] if dev.type == "cuda" else None,
        forward_sync_buffers=False, gradient_as_bucket_view=True,
    )


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
TRAINER_STATE = "trainer.json"
MODEL_FILE, OPTIM_FILE, OPTIM_META = "model.safetensors", "optim.safetensors", "optim.json"


def _tensor_file(flat: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors to write, aliases) of a flat tensor dict: tensors that share storage (tied weights) are
    written once and the others recorded as aliases of it."""
    tensors: dict[str, Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for k, v in flat.items():
        v = v.detach()
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else None
        if key is not None and key in seen:
            aliases[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        tensors[k] = v.cpu().contiguous()
    return tensors, aliases


def _optim_parts(osd: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A name-keyed optimizer state dict ({"state": {fqn: {key: value}}, "param_groups": [...]}) as
    (tensors "fqn::key", JSON of the rest)."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, st in osd["state"].items():
        for key, v in st.items():
            if isinstance(v, Tensor):
                tensors[f"{fqn}::{key}"] = v
            else:
                scalars.setdefault(fqn, {})[key] = v
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _optim_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for k, v in tensors.items():
        fqn, key = k.split("::")
        state.setdefault(fqn, {})[key] = v
    for fqn, st in meta.get("scalars", {}).items():
        state.setdefault(fqn, {}).update(st)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Path:
    """Write a checkpoint directory ``path`` (a collective when ``model`` is sharded): the full model
    state (``model.safetensors``), the optimizer state keyed by parameter name (``optim.safetensors``
    and ``optim.json``, from ``get_state_dict`` with flattened optimizer state) and ``extra`` (step,
    scheduler, data position, RNG: ``trainer.json``, written last). Nothing in it is pickled, so
    reading it runs no code. The new directory replaces the old one only when complete."""
    import json

    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    rank, _ = world_info()
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=opts)  # full tensors, by parameter name (rank 0 when sharded)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        m_t, aliases = _tensor_file(msd)
        o_t, o_meta = _optim_parts(osd)
        o_t, o_aliases = _tensor_file(o_t)
        save_file(m_t, str(tmp / MODEL_FILE), metadata={"aliases": json.dumps(aliases)})
        save_file(o_t, str(tmp / OPTIM_FILE), metadata={"aliases": json.dumps(o_aliases)})
        (tmp / OPTIM_META).write_text(json.dumps(o_meta))
        (tmp / TRAINER_STATE).write_text(json.dumps(extra))
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)
    barrier()
    return path


def find_checkpoint(path: Path) -> Optional[Path]:
    """``path`` if it holds a complete checkpoint, else the previous one left by a crash during the
    swap (``path.old``), else None."""
    for p in (path, path.with_name(path.name + ".old")):
        if (p / TRAINER_STATE).exists():
            return p
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    """``trainer.json`` of a checkpoint directory (JSON: reading it runs no code).

    Raises:
        HeadscopeInputError: the file is not JSON (e.g. a pickle of an older or foreign format).
    """
    import json

    from ..errors import HeadscopeInputError

    f = Path(path) / TRAINER_STATE
    try:
        return json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadscopeInputError(f"{f} is not a headscope checkpoint (not JSON: {e}); start the stage anew "
                                  "without --resume in another output directory") from None


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` directory into ``model``/``optimizer`` (any world size, sharded or
    not; a collective when sharded: every rank reads the files) and return its ``extra``. Only
    safetensors and JSON are read.

    Raises:
        HeadscopeInputError: a file of the checkpoint is missing or not of this format.
    """
    import json

    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from ..errors import HeadscopeInputError

    extra = read_trainer_state(path)

    def read(name: str) -> dict[str, Tensor]:
        tensors = load_file(str(path / name))
        with safe_open(str(path / name), "pt") as f:
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        return {**tensors, **{k: tensors[src] for k, src in aliases.items()}}

    try:
        msd = read(MODEL_FILE)
        osd = _optim_state(read(OPTIM_FILE), json.loads((path / OPTIM_META).read_text()))
    except (OSError, SafetensorError, UnicodeDecodeError, json.JSONDecodeError, KeyError, ValueError) as e:
        raise HeadscopeInputError(f"{path} is not a complete headscope checkpoint ({type(e).__name__}: {e}); start the "
                                  "stage anew without --resume in another output directory") from None
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))
    return extra


Reducer = Callable[[Tensor], Tensor]
