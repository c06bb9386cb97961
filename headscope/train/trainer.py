"""The three-stage transfer trainer (SPEC.md §9): AdamW, warmup + cosine schedule, gradient clipping,
bf16 autocast on GPU, checkpoints every N steps and on exit, exact resume, tqdm + CSV/JSONL logs.

One :class:`Trainer` runs one stage. Layout of its output directory::

    out/checkpoint/     latest checkpoint (:func:`headscope.train.parallel.save_checkpoint`): student
                        weights and optimizer state by parameter name (safetensors + JSON), plus
                        trainer.json (step, scheduler, data position, RNG, seconds and peak memory so
                        far); nothing pickled; it loads on any number of devices
    out/log.csv         one row per step (stage, step, tokens, loss, lr, grad_norm, seconds, align_l*)
    out/log.jsonl       the same rows as JSON lines
    out/student.pt      final student weights (state_dict) when the stage finishes, only with
                        ``save_student`` (``headscope convert`` writes a model folder instead)
    out/done.json       written last: the stage's summary

Data parallel: when a ``torch.distributed`` process group with more than one rank is initialized
(``headscope convert --devices N`` or torchrun), every rank trains on its slice of each global batch
and the loss, gradient, logs and checkpoints are those of the one-process run; only rank 0 writes logs
and files. The losses are normalized by the global batch's counts (stage 1: its teacher statistics),
and PyTorch's wrappers average the gradients over ranks (:mod:`headscope.train.step_plan`). Two modes
(:attr:`TrainConfig.data_parallel`):

* ``"ddp"`` (the default where the fast step is usable, all three stages): every rank holds the whole
  student (rank 0's copied to every rank by DistributedDataParallel) and runs the fast step
  (:class:`~headscope.train.fast.FastStep`, CUDA-graphed on GPU) on its rows through
  ``DistributedDataParallel``, which all-reduces the gradients in buckets during the backward;
  clipping and AdamW then run identically on every rank.
* ``"fsdp"`` (the default otherwise): the student is sharded with FSDP2 ``fully_shard``
  (:mod:`headscope.train.parallel`) and the plain step runs on the shards.

How the step runs (data parallelism, fast or plain step, compile, CUDA graph, fused AdamW, bf16) is
decided once, when the trainer is made, in a frozen :class:`~headscope.train.step_plan.StepPlan`
(:attr:`Trainer.plan`), saved in the checkpoint's ``trainer.json`` and the run's summary.
"""

from __future__ import annotations

import csv
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from ..errors import HeadscopeInputError, InputFileExistsError, InputFileNotFoundError
from . import parallel
from .data import Loader, TokenRows
from .interrupt import StopAtStepBoundary
from .stages import logged_scalars, trainable_parameters
from .step_plan import DATA_PARALLEL, TEACHER_DTYPES, build_step, resolve_step_plan


@dataclass
class TrainConfig:
    """Settings of one stage.

    Attributes:
        stage: 1 (layer-wise alignment), 2 (global distillation) or 3 (long-context fine-tuning).
        tokens: token budget of the stage; steps = ceil(tokens / (batch_size · seq_len)).
        batch_size: rows per step.
        lr: peak AdamW learning rate; ``min_lr_ratio`` · lr at the end of the cosine.
        warmup: fraction of the steps with linear warmup from 0.
        weight_decay, betas: AdamW.
        grad_clip: max global gradient norm (0 = off).
        ckpt_every: write a checkpoint every N steps (0 = only on exit).
        ckpt_on_exit: write a checkpoint when the run stops (finished, interrupted or failed).
        save_student: write ``student.pt`` (a bare state dict) when the stage finishes (default off:
            :func:`headscope.train.convert_stage` writes the stage's model folder).
        bf16: autocast to bfloat16 (None = on CUDA only). Master weights stay fp32.
        seed: data order seed.
        progress: tqdm bar.
        fast: the fast step (:class:`~headscope.train.fast.FastStep`: fused LM head + loss in row
            chunks, the hybrid layers' fast path, and on CUDA regional ``torch.compile``, a CUDA graph
            of forward + backward and fused AdamW). False: the plain step (:func:`stage_loss` on full
            logits, per-parameter AdamW). None (default): on CPU, and on CUDA where fla is installed
            (the measured configuration; without fla the plain step). Data parallel: the fast step
            in the ``"ddp"`` mode, the plain step in the ``"fsdp"`` mode.
        compile: ``torch.compile`` in the fast step (None = on CUDA).
        cuda_graph: capture the fast step in a CUDA graph (None = on CUDA).
        loss_chunk: rows per LM-head chunk of the fast step.
        activation_checkpointing: keep only each student layer's input and recompute the layer in the
            backward (the same losses and gradients, less activation memory, one more student forward;
            the plain step: stages 2-3 only). Plan the memory with ``headscope plan-memory``.
        data_parallel: with a process group of more than one rank: ``"ddp"`` (PyTorch's
            DistributedDataParallel: the whole student on every rank, the fast step, gradients
            averaged over ranks during the backward) or ``"fsdp"`` (the student sharded with FSDP2,
            the plain step). None (default): ``"ddp"`` when the fast step is usable (``fast`` and a
            Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 / GPT-NeoX structure), else ``"fsdp"``. Ignored in one process. Both give the
            one-process run's losses and weights (to float rounding; ``tests/test_train_ddp.py``).
        grad_accum: gradient accumulation: each step's ``batch_size`` rows (each rank's share of them) run as
            this many micro-batches, forward + backward one after the other, normalized by the whole batch's token
            count (stage 1: its teacher statistics, applied to each layer's gradients once all micro-batches ran):
            the same loss and gradients as one pass over the batch (to float rounding;
            ``tests/test_train_grad_accum.py``) with the activations of a micro-batch. ``batch_size`` must be a
            multiple of it (times the ranks, in data-parallel training).
        deterministic: PyTorch's deterministic algorithms (``warn_only=False``: an op without a deterministic
            version raises), deterministic cuBLAS and cuDNN during :meth:`Trainer.run`
            (:mod:`headscope.train.determinism`); the parts outside PyTorch's switch (fla's Triton kernels, the
            all-reduce of several ranks) are listed in the :class:`~headscope.train.step_plan.StepPlan`'s
            ``nondeterministic``. A checkpoint resumes only with the same setting.
        new_params_only: stage 1 trains only the parameters the hybrid initializes itself (the GDN heads' a_proj,
            A_log, dt_bias, b_proj; the FA gate; the short convolution; γ: :data:`headscope.train.stages.NEW_PARAMETERS`,
            :func:`~headscope.train.stages.trainable_parameters`); the copied q / k / v / o (and the GDN heads' k / v
            rows) stay the teacher's, get no gradient and no AdamW state. Stage 1 only. A checkpoint resumes only
            with the same setting.
        teacher_dtype: the precision the teacher's weights are held in during the stage: ``"fp32"``, ``"bf16"`` (half
            the bytes; on a CPU its forward then runs in bf16, on CUDA under autocast its residual stream and norms
            too) or None (default: as passed). The trainer casts the teacher's parameters in place (buffers such as
            the rotary frequencies keep their precision); the student's master weights stay as they are (fp32). A
            checkpoint resumes only against a teacher held as it was (the StepPlan's ``teacher_dtype``).
    """

    stage: int
    tokens: int
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.05
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    ckpt_every: int = 0
    ckpt_on_exit: bool = True
    save_student: bool = False
    bf16: Optional[bool] = None
    seed: int = 0
    progress: bool = True
    fast: Optional[bool] = None
    compile: Optional[bool] = None
    cuda_graph: Optional[bool] = None
    loss_chunk: int = 4096
    data_parallel: Optional[str] = None
    activation_checkpointing: bool = False
    grad_accum: int = 1
    deterministic: bool = False
    new_params_only: bool = False
    teacher_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        """Raises HeadscopeInputError (a ValueError) for a stage other than 1-3, a count / rate <= 0, a
        ``data_parallel`` other than None, "ddp", "fsdp", a ``grad_accum`` < 1 or not dividing ``batch_size``,
        ``new_params_only`` outside stage 1, a ``teacher_dtype`` other than None, "fp32", "bf16"."""
        from .stage_checks import check_grad_accum, check_stage

        check_stage(self.stage)
        if self.new_params_only and self.stage != 1:
            raise HeadscopeInputError(f"new_params_only applies to stage 1; stage {self.stage} trains the whole student")
        if self.teacher_dtype not in (None, *TEACHER_DTYPES):
            raise HeadscopeInputError(f"teacher_dtype={self.teacher_dtype!r}: use 'fp32', 'bf16' or None (as passed)")
        check_grad_accum(self.stage, self.grad_accum)
        if self.batch_size % self.grad_accum:
            raise HeadscopeInputError(f"batch_size={self.batch_size} does not split into grad_accum={self.grad_accum} "
                                      "equal micro-batches; use a batch size that is a multiple of it")
        if self.tokens < 1 or self.batch_size < 1 or self.lr <= 0:
            raise HeadscopeInputError(
                f"tokens ({self.tokens}), batch_size ({self.batch_size}) and lr ({self.lr}) must be > 0"
            )
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        if self.data_parallel not in (None, *DATA_PARALLEL):
            raise HeadscopeInputError(
                f"data_parallel={self.data_parallel!r}: use 'ddp', 'fsdp' or None (ddp where the fast step works)"
            )


def hold_teacher(teacher: Optional[nn.Module], dtype: Optional[str]) -> Optional[nn.Module]:
    """Cast the teacher's floating-point parameters to ``dtype`` (``"fp32"`` / ``"bf16"``; None: leave it) in place and
    return it. Buffers keep their precision: the rotary ``inv_freq`` rounded to bf16 would turn the angle at position
    t by up to t · 2⁻⁸ radians (transformers' own bf16 loading keeps it in fp32 too)."""
    if dtype is None or teacher is None:
        return teacher
    dt = TEACHER_DTYPES[dtype]
    for p in teacher.parameters():
        if p.is_floating_point() and p.dtype != dt:
            p.data = p.data.to(dt)
    return teacher


class StopTraining(Exception):
    """Raised by a ``on_step`` callback to stop a run (the exit checkpoint is still written)."""


def cosine_lambda(total: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier at step s: linear warmup from 0 over ``warmup`` steps, then a cosine from 1 to
    ``min_ratio`` (transformers' ``get_cosine_with_min_lr_schedule_with_warmup`` rule; the Trainer uses
    that scheduler itself)."""
    from functools import partial

    from transformers.optimization import _get_cosine_schedule_with_warmup_lr_lambda

    return partial(_get_cosine_schedule_with_warmup_lr_lambda, num_warmup_steps=warmup, num_training_steps=total,
                   num_cycles=0.5, min_lr_rate=min_ratio)


def _rng_state() -> dict[str, Any]:
    """torch / CUDA / Python / NumPy RNG states as JSON values (lists of ints)."""
    ver, py, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    st: dict[str, Any] = {"torch": torch.get_rng_state().tolist(), "python": [ver, list(py), gauss],
                          "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    ver, py, gauss = st["python"]
    random.setstate((ver, tuple(py), gauss))
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]])


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Peak memory so far: ``torch.cuda.max_memory_allocated`` on CUDA (since the last reset), else the
    process's maximum resident set size (``ru_maxrss``, kilobytes on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return {"bytes": int(torch.cuda.max_memory_allocated(device)), "kind": "torch.cuda.max_memory_allocated"}
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"bytes": int(rss if sys.platform == "darwin" else rss * 1024), "kind": "ru_maxrss (process)"}


class Trainer:
    """Runs one stage of the transfer on ``student`` (in place).

    Args:
        student: the hybrid model (from :func:`headscope.hybridize`, or the previous stage's result).
        teacher: the original model (frozen; used by stages 1 and 2, may be None for stage 3).
        rows: the training rows (:mod:`headscope.train.data`).
        config: :class:`TrainConfig`.
        out_dir: directory for checkpoint and logs.
        resume: continue from ``out_dir/checkpoint/`` (weights, optimizer, scheduler, data position,
            RNG, step; written by any number of ranks); without it an existing checkpoint is an error.
        data_parallel: train data-parallel over the initialized process group (default: when one with
            more than one rank is initialized), in the mode :attr:`TrainConfig.data_parallel` (see the
            module docstring; :attr:`plan` tells which one runs). Every rank must build the same
            ``rows``.

    Raises (all HeadscopeInputError, so ValueError; the first two also the built-in type named):
        InputFileExistsError: ``out_dir`` holds a checkpoint and ``resume`` is False.
        InputFileNotFoundError: ``resume`` is True but there is no checkpoint.
        HeadscopeInputError: the checkpoint is of another stage or data set; a global batch smaller
            than the number of ranks; stage 1 or 2 without a teacher; ``data_parallel="ddp"`` for a
            student already sharded with FSDP2.
    """

    def __init__(
        self,
        student: nn.Module,
        teacher: Optional[nn.Module],
        rows: TokenRows,
        config: TrainConfig,
        out_dir: str | Path,
        resume: bool = False,
        data_parallel: Optional[bool] = None,
    ):
        self.student, self.teacher, self.cfg = student, teacher, config
        self.rank, self.world = parallel.world_info()
        self.parallel = self.world > 1 if data_parallel is None else bool(data_parallel)
        if self.parallel and config.batch_size < self.world:
            raise HeadscopeInputError(
                f"batch_size={config.batch_size} cannot feed {self.world} ranks; use a batch size >= {self.world}"
            )
        if self.parallel and config.batch_size % (self.world * config.grad_accum):
            raise HeadscopeInputError(
                f"batch_size={config.batch_size} does not split into {self.world} ranks x grad_accum={config.grad_accum} "
                f"equal micro-batches; use a multiple of {self.world * config.grad_accum}")
        if config.stage in (1, 2) and teacher is None:
            raise HeadscopeInputError(f"stage {config.stage} needs the teacher model")
        self.out = Path(out_dir)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        parallel.barrier()
        self.device = next(student.parameters()).device
        if teacher is not None:
            teacher.eval()
            hold_teacher(teacher, config.teacher_dtype)
            for p in teacher.parameters():
                p.requires_grad_(False)
        self.params = trainable_parameters(student, config.stage, config.new_params_only)
        self.loader = Loader(rows, config.batch_size, seed=config.seed)
        self.tokens_per_step = config.batch_size * rows.seq_len
        self.total_steps = max(1, math.ceil(config.tokens / self.tokens_per_step))
        sharded = parallel.is_sharded(student)
        self.plan = resolve_step_plan(config, student, teacher, self.device, self.world if self.parallel else 1, sharded)
        if self.plan.data_parallel == "fsdp" and not sharded:
            parallel.broadcast_module(student)  # identical start on every rank (random GDN init); DDP copies rank 0's itself
        if self.plan.data_parallel == "fsdp":
            if not sharded:
                parallel.shard_student(student, config.stage)
            # FSDP2 replaced the parameters by sharded ones
            self.params = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
        self.step_fn = build_step(self.plan, config.stage, student, teacher, [p for _, p in self.params], config.loss_chunk)
        decay = [p for n, p in self.params if p.dim() >= 2]
        other = [p for n, p in self.params if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=config.lr,
            betas=config.betas,
            **({"fused": True} if self.plan.fused_adamw else {"foreach": False}),
        )
        warm = int(config.warmup * self.total_steps)
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        self.sched = get_cosine_with_min_lr_schedule_with_warmup(
            self.opt, num_warmup_steps=warm, num_training_steps=self.total_steps, min_lr_rate=config.min_lr_ratio)
        self.step = 0
        self.seconds_before = 0.0  # training seconds of the earlier runs of this stage (from the checkpoint)
        self.peak_before = 0  # their peak memory (bytes)
        self.ckpt_path = self.out / "checkpoint"
        found = parallel.find_checkpoint(self.ckpt_path)
        if resume:
            if found is not None:
                self._load(found)
            else:
                raise InputFileNotFoundError(f"--resume: no checkpoint at {self.ckpt_path}; start without --resume")
        elif found is not None:
            raise InputFileExistsError(
                f"{self.ckpt_path} exists: pass resume=True (--resume) to continue it, or use another output directory"
            )
        self._fields: Optional[list[str]] = None
        self._t_run: Optional[float] = None  # time.time() at the start of the current run()
        self._in_step = False  # between taking a batch and logging its step: the state is not a step's

    def seconds(self) -> float:
        """Training seconds of this stage so far, over every run that resumed it."""
        return self.seconds_before + (time.time() - self._t_run if self._t_run is not None else 0.0)

    def peak_memory(self) -> dict[str, Any]:
        """Peak memory of this stage so far (bytes, the larger of this run's and the earlier runs')."""
        p = peak_memory(self.device)
        return {**p, "bytes": max(p["bytes"], self.peak_before)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write the ``checkpoint/`` directory (collective when sharded; :func:`headscope.train.parallel.save_checkpoint`):
        student weights and optimizer state by parameter name, plus step, scheduler, data position, RNG,
        seconds and peak memory so far; the previous checkpoint is replaced only once the new one is complete."""
        extra = {
            "format": "headscope.train/3",
            "stage": self.cfg.stage,
            "step": self.step,
            "total_steps": self.total_steps,
            "config": asdict(self.cfg),
            "scheduler": self.sched.state_dict(),
            "data": self.loader.state_dict(),
            "rng": _rng_state(),
            "world_size": self.world if self.parallel else 1,
            "step_plan": self.plan.as_dict(),
            "seconds": round(self.seconds(), 3),
            "peak_memory_bytes": self.peak_memory()["bytes"],
        }
        return parallel.save_checkpoint(self.ckpt_path, self.student, self.opt, extra)

    def _check(self, st: dict[str, Any], where: Path) -> None:
        if st.get("stage") != self.cfg.stage:
            raise HeadscopeInputError(f"{where} is a stage-{st.get('stage')} checkpoint, this is stage {self.cfg.stage}")
        if st.get("total_steps") != self.total_steps:
            raise HeadscopeInputError(
                f"checkpoint planned {st.get('total_steps')} steps, this run {self.total_steps}: resume with the same "
                "--tokens, batch size and sequence length"
            )
        was_new = bool((st.get("config") or {}).get("new_params_only", False))
        if was_new != self.cfg.new_params_only:
            flag = "with" if was_new else "without"
            raise HeadscopeInputError(f"{where} was written {flag} --new-params-only; resume {flag} it (the optimizer holds "
                                      "states for the parameters it trained)")
        held = (st.get("step_plan") or {}).get("teacher_dtype")
        if held is not None and self.plan.teacher_dtype is not None and held != self.plan.teacher_dtype:
            raise HeadscopeInputError(f"{where} trained against a {held} teacher, this run holds it in "
                                      f"{self.plan.teacher_dtype}: resume with --teacher-dtype {held}")
        was = bool((st.get("config") or {}).get("deterministic", False))
        if was != self.cfg.deterministic:
            flag = "with" if was else "without"
            raise HeadscopeInputError(
                f"{where} was written {flag} --deterministic (deterministic={was}); resume {flag} it, so that the "
                "stage runs under one setting"
            )

    def _restore(self, st: dict[str, Any]) -> None:
        self.sched.load_state_dict(st["scheduler"])
        self.loader.load_state_dict(st["data"])
        _set_rng_state(st["rng"])
        self.step = int(st["step"])

    def _load(self, path: Path) -> None:
        st = parallel.read_trainer_state(path)
        self._check(st, path)
        parallel.load_checkpoint(path, self.student, self.opt)
        self._restore(st)
        self.seconds_before = float(st.get("seconds", 0.0))
        self.peak_before = int(st.get("peak_memory_bytes", 0))

    # ------------------------------------------------------------------ logging
    def _log(self, row: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        path = self.out / "log.csv"
        if self._fields is None:
            if path.exists() and path.stat().st_size:
                with open(path) as f:
                    self._fields = next(csv.reader(f))
            else:
                self._fields = list(row)
                with open(path, "w", newline="") as f:
                    csv.writer(f).writerow(self._fields)
        with open(path, "a", newline="") as f:
            csv.DictWriter(f, self._fields, extrasaction="ignore").writerow(row)

    # ------------------------------------------------------------------ training
    def train_step(self) -> dict[str, Any]:
        """One optimizer step on the next batch; returns the logged row."""
        t0 = time.perf_counter()
        self._in_step = True  # until the row is logged, an exception leaves a half-done step (run() then saves nothing)
        ids, mask = self.loader.next()
        if self.parallel:  # this rank's slice of the global batch; losses normalized globally
            ids, mask = parallel.local_rows(ids, mask, self.rank, self.world)
        self.student.train()
        # forward + backward; the gradients in .grad are the global batch's (reduced by DDP / FSDP2)
        logged = self.step_fn(ids.to(self.device), mask.to(self.device))
        params = [p for _, p in self.params if p.grad is not None]
        gn = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf"))
        if hasattr(gn, "full_tensor"):  # FSDP2: a DTensor
            gn = gn.full_tensor()
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.step += 1
        vals = torch.cat([logged.float().reshape(-1), gn.reshape(1).float().to(logged.device)]).tolist()  # one host sync
        row = {
            "stage": self.cfg.stage,
            "step": self.step,
            "tokens": self.step * self.tokens_per_step,
            **logged_scalars(self.cfg.stage, vals[:-1]),
            "lr": lr,
            "grad_norm": vals[-1],
            "seconds": round(time.perf_counter() - t0, 4),
        }
        self._log(row)
        self._in_step = False
        return row

    def run(
        self,
        max_steps: Optional[int] = None,
        on_step: Optional[Callable[["Trainer", dict[str, Any]], None]] = None,
        deadline: Optional[float] = None,
    ) -> dict[str, Any]:
        """Train to the end of the stage (or ``max_steps`` in total, or wall-clock ``deadline`` =
        ``time.time()`` value); checkpoint every ``ckpt_every`` steps and on exit.

        ``on_step(trainer, row)`` is called after each step; raising :class:`StopTraining` in it stops
        the run cleanly. Ctrl-C (SIGINT, in the main thread) stops after the current step
        (:class:`~headscope.train.interrupt.StopAtStepBoundary`), so the exit checkpoint is that step's; a second
        Ctrl-C, or any error, inside a step writes no exit checkpoint (the last complete one stays, and resuming
        replays from it). Returns a summary {stage, steps, tokens, final_loss, finished, stopped ("finished",
        "deadline", "interrupted"), exit_checkpoint (bool), seconds, data_parallel (None in one process, else
        "ddp" or "fsdp"), fast_step (bool), step_plan (the :class:`~headscope.train.step_plan.StepPlan` as a
        dict)}.
        """
        from tqdm.auto import tqdm

        from .determinism import deterministic_mode

        end = self.total_steps if max_steps is None else min(self.total_steps, max_steps)
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"stage {self.cfg.stage}",
                   disable=not self.cfg.progress or self.rank != 0)
        t0 = time.time()
        self._t_run = t0
        last: dict[str, Any] = {}
        stopped = "finished"
        # compiles and CUDA-graph captures happen inside the steps, under the setting
        with deterministic_mode(self.plan.deterministic), StopAtStepBoundary() as ctrl_c:
            try:
                while self.step < end:
                    # every rank must take the same decision (collectives follow)
                    late = deadline is not None and time.time() > deadline
                    stop = late or ctrl_c.requested
                    if parallel.any_rank(stop, self.device) if self.parallel else stop:
                        stopped = "deadline" if late else "interrupted"
                        break
                    last = self.train_step()
                    bar.update(1)
                    bar.set_postfix(loss=f"{last['loss']:.4g}")
                    if self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0:
                        self.save_checkpoint()
                    if on_step is not None:
                        on_step(self, last)
            except (StopTraining, KeyboardInterrupt):
                stopped = "interrupted"
            finally:
                bar.close()
                # a step cut in the middle (a second Ctrl-C, an error) leaves the loader, the weights and AdamW's
                # states between two steps: the last complete checkpoint stays, and --resume replays from it
                exit_checkpoint = self.cfg.ckpt_on_exit and self.step > 0 and not self._in_step
                if exit_checkpoint:
                    self.save_checkpoint()
                self._in_step = False
                self.step_fn.close()  # frees the captured graph's memory; a later run() captures again
                self.seconds_before, self._t_run = self.seconds(), None
        finished = self.step >= self.total_steps
        summary = {
            "stage": self.cfg.stage,
            "steps": self.step,
            "total_steps": self.total_steps,
            "tokens": self.step * self.tokens_per_step,
            "final_loss": last.get("loss"),
            "finished": finished,
            "stopped": stopped if not finished else "finished",
            "exit_checkpoint": exit_checkpoint,
            "seconds": round(time.time() - t0, 2),
            "seconds_total": round(self.seconds(), 2),
            "peak_memory": self.peak_memory(),
            "data_parallel": self.plan.data_parallel,
            "fast_step": self.plan.fast,
            "step_plan": self.plan.as_dict(),
            # what the compiled fast step could not keep whole (FastStep.graph_breaks) and a failed CUDA-graph capture
            "graph_breaks": list(getattr(self.step_fn, "graph_breaks", [])),
            "graph_error": getattr(self.step_fn, "graph_error", None),
        }
        if finished:
            sd = parallel.full_state_dict(self.student) if self.cfg.save_student else None  # collective if sharded
            if self.rank == 0:
                if sd is not None:
                    torch.save(sd, self.out / "student.pt")
                (self.out / "done.json").write_text(json.dumps(summary, indent=2))
            parallel.barrier()
        return summary
