"""How a stage's training step runs: :class:`StepPlan`, one frozen record of the trainer's modes (data
parallelism, fast or plain step, compile, CUDA graph, fused AdamW, bf16), resolved once from a
:class:`~headscope.train.trainer.TrainConfig`, the models and the process group when a
:class:`~headscope.train.trainer.Trainer` is made, and saved with its results (``done.json``, the
checkpoint's ``trainer.json``, the stage folder's ``training.json``); and the step it builds
(:func:`build_step`): the fast step (:class:`~headscope.train.fast.FastStep`) or the plain one
(:class:`PlainStep`), each a callable ``step(ids, mask) -> logged`` that leaves the reduced gradients
in ``.grad``.

Data parallelism is PyTorch's own (:mod:`headscope.train.parallel`): ``"ddp"``
(``DistributedDataParallel``: the whole student on every rank) or ``"fsdp"`` (FSDP2 ``fully_shard``).
Both average the gradients over ranks; the step's loss is this rank's share of the global batch's loss
(normalized by the global counts) times the world size, so the averaged gradient is the one-process
gradient of the whole batch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from ..errors import HeadscopeInputError

if TYPE_CHECKING:
    from .trainer import TrainConfig

DATA_PARALLEL = ("ddp", "fsdp")
TEACHER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # TrainConfig.teacher_dtype's choices


def dtype_name(dtype: torch.dtype) -> str:
    """``"fp32"`` / ``"bf16"`` for those two dtypes, else the torch name (``"float16"``)."""
    return next((k for k, v in TEACHER_DTYPES.items() if v == dtype), str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class StepPlan:
    """The trainer's modes for one stage (resolved by :func:`resolve_step_plan`).

    Attributes:
        world: ranks training together (1: one process).
        data_parallel: None (one process), ``"ddp"`` (DistributedDataParallel: every rank holds the
            student) or ``"fsdp"`` (FSDP2 shards; the plain step).
        fast: the fast step (:class:`~headscope.train.fast.FastStep`); False: :class:`PlainStep`.
        compile: ``torch.compile`` of the fast step's regions.
        cuda_graph: the fast step captured in a CUDA graph.
        fused_adamw: AdamW's fused kernel (the fast step on CUDA); else per parameter.
        bf16: bf16 autocast (master weights fp32).
        activation_checkpointing: keep only each student layer's input, recompute it in the backward
            (the fast step: every decoder layer, stage 1 every attention module; the plain step:
            transformers' ``activation_checkpointing_enable`` on the decoder layers, stages 2-3).
        grad_accum: micro-batches per step (gradient accumulation): each rank's rows are split into this many, run
            forward + backward one after the other with the whole batch's normalization (stage 1: its teacher
            statistics, applied to each layer's gradients at the end).
        fast_unavailable: why the fast step was wanted and could not run (then ``fast`` is False).
        deterministic: PyTorch's deterministic settings during the stage (:mod:`headscope.train.determinism`).
        nondeterministic: with ``deterministic``, the parts of the step outside PyTorch's switch, each with why
            (:func:`~headscope.train.determinism.nondeterministic_parts`; empty: none known).
        new_params_only: stage 1 trains only the parameters the hybrid initializes itself
            (:attr:`~headscope.train.trainer.TrainConfig.new_params_only`).
        teacher_dtype: the precision of the teacher's weights during the stage (``"fp32"``, ``"bf16"``; None without
            a teacher), after :attr:`~headscope.train.trainer.TrainConfig.teacher_dtype` was applied.
    """

    world: int = 1
    data_parallel: Optional[str] = None
    fast: bool = True
    compile: bool = False
    cuda_graph: bool = False
    fused_adamw: bool = False
    bf16: bool = False
    activation_checkpointing: bool = False
    grad_accum: int = 1
    fast_unavailable: Optional[str] = None
    deterministic: bool = False
    nondeterministic: tuple[str, ...] = ()
    new_params_only: bool = False
    teacher_dtype: Optional[str] = None

    @property
    def loss_scale(self) -> float:
        """What the step multiplies its loss share by before the backward: the world size where the
        wrapper averages gradients over ranks (DDP, FSDP2), else 1."""
        return float(self.world) if self.data_parallel in ("ddp", "fsdp") else 1.0

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON values (as it reads back from ``trainer.json`` / ``done.json``)."""
        return {**asdict(self), "nondeterministic": list(self.nondeterministic)}


def resolve_step_plan(
    config: "TrainConfig", student: nn.Module, teacher: Optional[nn.Module], device: torch.device, world: int,
    sharded: bool = False,
) -> StepPlan:
    """The :class:`StepPlan` of ``config`` for these models on ``device`` over ``world`` ranks.

    * fast step: ``config.fast``, or by default on CPU, and on CUDA where fla is installed (the measured
      configuration); not with FSDP2 (the fast step calls the layers by hand, past FSDP2's hooks), and not
      for a model without the Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 / GPT-NeoX structure (a warning names why; :attr:`StepPlan.fast_unavailable`);
    * data parallel (``world`` > 1): ``config.data_parallel``, or by default ``"ddp"`` where the fast step
      runs and ``"fsdp"`` otherwise or for an already sharded student;
    * compile / CUDA graph: ``config.compile`` / ``config.cuda_graph``, by default on CUDA, fast step only;
      fused AdamW with the fast step on CUDA; bf16: ``config.bf16``, by default on CUDA;
    * deterministic: ``config.deterministic``, with the parts it leaves nondeterministic;
    * new_params_only: ``config.new_params_only``; teacher_dtype: the teacher's parameters' precision as it is held.

    Raises:
        HeadscopeInputError: ``data_parallel="ddp"`` for a student already sharded with FSDP2.
    """
    from .fast import fast_step_problem

    on_cuda = device.type == "cuda"
    # the fast step on CUDA was measured and checked with fla's GDN kernels (docs/known-issues.md)
    want_fast = (not on_cuda or importlib.util.find_spec("fla") is not None) if config.fast is None else bool(config.fast)
    problem = fast_step_problem(config.stage, student, teacher) if want_fast else None
    if problem is not None:
        warnings.warn(f"fast training step unavailable ({problem}); using the plain step", RuntimeWarning, stacklevel=3)
    usable = want_fast and problem is None
    dp: Optional[str] = None
    if world > 1:
        if config.data_parallel == "ddp" and sharded:
            raise HeadscopeInputError(f"data_parallel={config.data_parallel!r} needs an unsharded student; pass a fresh "
                                      "one or use data_parallel='fsdp'")
        dp = config.data_parallel or ("fsdp" if sharded or not usable else "ddp")
    fast = usable and dp != "fsdp"
    compiled = fast and (on_cuda if config.compile is None else bool(config.compile))
    nondet: tuple[str, ...] = ()
    if config.deterministic:
        from .determinism import nondeterministic_parts

        nondet = nondeterministic_parts(student, device, world, compiled=compiled)
    return StepPlan(
        world=world,
        data_parallel=dp,
        fast=fast,
        compile=compiled,
        cuda_graph=fast and on_cuda and (config.cuda_graph is None or bool(config.cuda_graph)),
        fused_adamw=fast and on_cuda,
        bf16=on_cuda if config.bf16 is None else bool(config.bf16),
        activation_checkpointing=bool(config.activation_checkpointing),
        grad_accum=int(config.grad_accum),
        fast_unavailable=problem,
        deterministic=bool(config.deterministic),
        nondeterministic=nondet,
        new_params_only=bool(config.new_params_only),
        teacher_dtype=_teacher_dtype(teacher),
    )


def _teacher_dtype(teacher: Optional[nn.Module]) -> Optional[str]:
    """The teacher's floating-point parameter dtype as ``"fp32"`` / ``"bf16"`` (another dtype by its torch name; mixed
    dtypes joined by ``+``), None without a teacher."""
    if teacher is None:
        return None
    names = sorted({dtype_name(p.dtype) for p in teacher.parameters() if p.is_floating_point()})
    return "+".join(names) or None


class PlainStep:
    """The plain step: :func:`~headscope.train.stages.stage_loss_logged` on full logits (stage 1 through
    forward hooks on the teacher), bf16 autocast on CUDA when ``bf16``, then the backward of the loss
    times ``loss_scale``; through DDP when ``ddp`` (see :class:`StepPlan`). Works on FSDP2-sharded
    students and on any architecture the hybrid supports.

    Args:
        stage, student, teacher, params: the stage, the models and the trained parameters.
        bf16: autocast to bfloat16 on CUDA.
        reduce: data parallel: the sum over ranks (global normalization; see ``stage_loss``).
        loss_scale: multiplies the loss before the backward.
        ddp: wrap the forward in DistributedDataParallel (:func:`headscope.train.parallel.ddp_loss`).
        activation_checkpointing: transformers' activation checkpointing of the student's decoder layers
            (stages 2-3; stage 1 calls the attention modules directly and keeps their activations), turned
            off again by :meth:`close`.
        grad_accum: micro-batches per step, as :class:`~headscope.train.fast.FastStep`'s.
    """

    def __init__(self, stage: int, student: nn.Module, teacher: Optional[nn.Module], params: Sequence[Tensor],
                 bf16: bool = False, reduce: Optional[Callable[[Tensor], Tensor]] = None, loss_scale: float = 1.0,
                 ddp: bool = False, activation_checkpointing: bool = False, grad_accum: int = 1):
        from .stage_checks import check_grad_accum
        from .stages import alignment_sums, attention_parameters, stage_loss_logged

        self.grad_accum = check_grad_accum(stage, grad_accum)
        self._layer_params = attention_parameters(student) if stage == 1 and self.grad_accum > 1 else []
        self.stage, self.student, self.teacher, self.params = stage, student, teacher, list(params)
        self.device = next(student.parameters()).device
        self.bf16, self.reduce, self.loss_scale = bool(bf16), reduce, float(loss_scale)

        def loss_fn(ids: Tensor, mask: Tensor, denominator: Optional[Tensor] = None, sums: bool = False) -> tuple[Tensor, Tensor]:
            if sums:  # stage 1 under gradient accumulation: this micro-batch's sums (stages.accumulate_alignment)
                se, stats = alignment_sums(student, teacher, ids, mask)
                return se.sum(), torch.cat([se.detach(), stats])
            return stage_loss_logged(stage, student, teacher, ids, mask, reduce=reduce, denominator=denominator)

        self._forward: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] = loss_fn
        self.activation_checkpointing = bool(activation_checkpointing) and stage != 1
        if self.activation_checkpointing:
            student.activation_checkpointing_enable({"use_reentrant": False})
        if ddp:
            from .parallel import ddp_loss

            self._forward = ddp_loss(student, loss_fn)

    def __call__(self, ids: Int[Tensor, "batch time"], mask: Bool[Tensor, "batch time"]) -> Float[Tensor, "k"]:
        """Forward and backward on one batch (the gradients in ``.grad``); returns the logged values."""
        for p in self.params:
            p.grad = None
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 and self.device.type == "cuda" \
            else contextlib.nullcontext()
        if self.grad_accum == 1:
            with ctx:
                loss, logged = self._forward(ids, mask)
            (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
            return logged
        from .stages import accumulate_alignment, loss_token_count

        if self.stage == 1:
            def sums(i: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
                with ctx:
                    return self._forward(i, m, None, True)

            return accumulate_alignment(sums, ids, mask, self.grad_accum, self._layer_params, self.loss_scale, self.reduce)
        denom = loss_token_count(self.stage, mask).to(device=self.device, dtype=torch.float32)
        denom = denom if self.reduce is None else self.reduce(denom)
        total: Optional[Tensor] = None
        for ids_k, mask_k in zip(ids.tensor_split(self.grad_accum), mask.tensor_split(self.grad_accum)):
            with ctx:
                loss, logged = self._forward(ids_k, mask_k, denom)
            (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()  # adds to .grad
            total = logged if total is None else total + logged
        assert total is not None
        return total

    def close(self) -> None:
        """Turn the student's activation checkpointing off again (the fast step's counterpart drops its CUDA
        graph)."""
        if self.activation_checkpointing:
            self.student.activation_checkpointing_disable()


def build_step(plan: StepPlan, stage: int, student: nn.Module, teacher: Optional[nn.Module], params: Sequence[Tensor],
               loss_chunk: int) -> Any:
    """The step ``plan`` describes: a :class:`~headscope.train.fast.FastStep` or a :class:`PlainStep`,
    with the global normalization (``reduce``) and loss scale of its data parallelism and, for
    ``"ddp"``, the forward through DistributedDataParallel."""
    from . import parallel

    reduce = parallel.all_sum if plan.data_parallel in ("ddp", "fsdp") else None
    ddp = plan.data_parallel == "ddp"
    if plan.fast:
        from .fast import FastStep

        return FastStep(stage, student, teacher, params, bf16=plan.bf16, compile=plan.compile, cuda_graph=plan.cuda_graph,
                        chunk_rows=loss_chunk, reduce=reduce, loss_scale=plan.loss_scale, ddp=ddp,
                        activation_checkpointing=plan.activation_checkpointing, grad_accum=plan.grad_accum)
    return PlainStep(stage, student, teacher, params, bf16=plan.bf16, reduce=reduce, loss_scale=plan.loss_scale, ddp=ddp,
                     activation_checkpointing=plan.activation_checkpointing, grad_accum=plan.grad_accum)
