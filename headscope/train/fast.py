"""The fast training step (forward + backward) of the three stages, for one process.

:class:`FastStep` computes the same losses as :func:`headscope.train.stages.stage_loss` with:

- **the model body by hand** (:mod:`headscope.train.fast_body`): embeddings, rotary tables, one call per decoder
  layer, final norm (the Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 structure, or GPT-NeoX's), so that each decoder
  layer can be compiled on its own ("regional" compilation: layers of the same shape share one compiled graph; a
  hybrid layer is compiled per distinct count of FA / GDN heads; every region is compiled whole (``fullgraph``: the
  GDN kernel call is one operator, :func:`~headscope.hybrid.gdn_kernels.gdn_op`), so a graph break raises instead of
  slowing the step);
- **the hybrid layers' fast path** (:mod:`headscope.hybrid.inference.train_forward`: one input GEMM, no head
  permutation of activations, all GDN heads in one kernel call);
- **LM head + loss in row chunks** (:mod:`headscope.train.fused_loss`): the [rows, vocab] logits of
  the student and the teacher are never materialized whole; the chunk's softmax math is compiled;
- **stage 1 without hooks**: the teacher's attention inputs and outputs are taken in a hand-written
  loop over its layers (compiled per layer), each student attention layer is compiled the same way;
- **a CUDA graph of the whole forward + backward** (``cuda_graph``): after ``warmup`` eager steps
  (which compile), the step is captured once and replayed, so the CPU launches nothing per layer.
  Gradients then live in the graph's memory: the caller must not set them to None (it clips them and
  runs the optimizer as usual). A capture that fails falls back to the eager compiled step, with a
  warning and the reason in :attr:`FastStep.graph_error`.

Every step, warm-up or replayed, computes the same function; the loss and the logged scalars come
back as one device tensor (``[loss]``, or ``[loss, align_l0, ...]`` in stage 1), so the caller syncs
once. Not for FSDP2-sharded training (the trainer uses the plain step there); under DistributedDataParallel
(``ddp``) every rank runs this step on its rows with losses normalized by the global batch (``reduce``) and
DDP averages the gradients during the backward (inside the graph when it is captured: NCCL collectives are
capturable; DDP is then made on a side stream and the step warms up 11 times first, as PyTorch's CUDA-graph
notes ask).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from jaxtyping import Bool, Int
from torch import Tensor, nn

from .fast_body import (NAMES, _attn_call, _layer_call, _teacher_io, attention_of, decoder_parts_ok, embed,
                        has_fast_body, inner_model, layer_masks, layer_positions, mask_for, model_body, output_head)
from .fused_loss import CHUNK_ROWS, ce_chunk, kl_chunk, linear_ce_loss, linear_kl_loss

__all__ = ["FastStep", "fast_step_problem", "flops_per_token", "layer_masks", "layer_positions", "model_body"]


# ---------------------------------------------------------------------------------------- pieces
def _align_term(y_s: Tensor, y_t: Tensor, m: Tensor) -> Tensor:
    """One layer's alignment loss (as :func:`headscope.train.stages.alignment_loss`); m: [batch, time, 1]."""
    y_t = y_t.float()
    n_tok = m.sum()
    n = n_tok * y_t.shape[-1]
    mean = (y_t * m).sum((0, 1)) / n_tok
    var = (((y_t - mean) * m) ** 2).sum() / n
    mse = (((y_s.float() - y_t) * m) ** 2).sum() / n
    return mse / var.clamp_min(1e-12)


def _align_term_global(y_s: Tensor, y_t: Tensor, m: Tensor, n: Tensor, var: Tensor) -> Tensor:
    """This rank's share of one layer's alignment loss when the batch is spread over ranks: the squared
    error over this rank's real tokens divided by the global batch's element count ``n`` and teacher
    variance ``var`` (summed over ranks the shares give the global loss)."""
    return ((((y_s.float() - y_t.float()) * m) ** 2).sum() / n) / var.clamp_min(1e-12)


def _global_teacher_stats(outs: Sequence[Tensor], m: Tensor, reduce: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """(element count n [layer], variance [layer]) of every layer's teacher attention output over the
    real tokens of the global batch, from two sums over ranks (the plain step's
    :func:`~headscope.train.stages.alignment_loss` computes the same per layer)."""
    d = outs[0].shape[-1]
    cnt = m.sum().reshape(1)
    s1 = reduce(torch.stack([torch.cat([(a.float() * m).sum((0, 1)), cnt]) for a in outs]))  # [layer, D + 1]
    n_tok = s1[:, -1]
    mean = s1[:, :d] / n_tok[:, None].clamp_min(1.0)
    ss = reduce(torch.stack([(((a.float() - mu) * m) ** 2).sum() for a, mu in zip(outs, mean)]))
    n = (n_tok * d).clamp_min(1.0)
    return n, ss / n


def _prepare_hybrid(model: nn.Module) -> Any:
    """Choose the hybrid layers' ``fused`` training backend (InferenceConfig.train) and build its index tensors
    before any compile; returns the model's previous InferenceConfig (for :func:`_unprepare_hybrid`)."""
    from dataclasses import replace

    from ..hybrid.inference import inference_config, use_inference
    from ..hybrid.inference.train_forward import train_index

    old = inference_config(model)
    use_inference(model, replace(old, train="fused"))
    for mod in model.modules():
        if hasattr(mod, "new_decode_cache"):
            train_index(mod)
            mod.backends.fn(mod, "train")  # resolved before capture: no guard on the memo inside the graph
    return old


def _unprepare_hybrid(model: nn.Module, old: Any) -> None:
    """Give the model back its InferenceConfig from before :func:`_prepare_hybrid`."""
    from ..hybrid.inference import use_inference

    use_inference(model, old)


def _raise_recompile_limit(n: int = 64) -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)
    if hasattr(cfg, "accumulated_recompile_limit") and cfg.accumulated_recompile_limit < 4 * n:
        cfg.accumulated_recompile_limit = 4 * n


def _compiled_whole(f: Callable, backend: str, breaks_ok: bool, breaks: list[str]) -> Callable:
    """``torch.compile(f, fullgraph=True)``; at a graph break (``torch._dynamo.exc.Unsupported`` at a call's compile)
    with ``breaks_ok``, ``f`` is compiled again allowing breaks, the reason appended to ``breaks`` and warned; without
    ``breaks_ok`` the break raises, naming the fix."""
    whole = torch.compile(f, backend=backend, dynamic=False, fullgraph=True)
    current = [whole]

    def call(*args: Any) -> Any:
        try:
            return current[0](*args)
        except torch._dynamo.exc.Unsupported as e:
            if current[0] is not whole:
                raise
            reason = f"{getattr(f, '__name__', f)}: {str(e).strip().splitlines()[0][:300]}"
            if not breaks_ok:
                raise RuntimeError(f"a graph break in the compiled training step ({reason}): with activation checkpointing "
                                   "the recomputation could differ from the forward; train without "
                                   "--activation-checkpointing (--grad-accum K for memory) or with the plain step") from e
            breaks.append(reason)
            warnings.warn(f"headscope: a graph break in the compiled training step ({reason}); compiled again with "
                          "breaks allowed (slower, same values)")
            current[0] = torch.compile(f, backend=backend, dynamic=False)
            return current[0](*args)

    return call


def fast_step_problem(stage: int, student: nn.Module, teacher: Optional[nn.Module]) -> Optional[str]:
    """Why :class:`FastStep` cannot run ``stage`` on these models (a sentence), or None when it can: a
    stage other than 1-3, stages 1-2 without a teacher, a model without the structure of a family of
    :data:`~headscope.train.fast_body.BODIES`."""
    if stage not in (1, 2, 3):
        return f"stage must be 1, 2 or 3, got {stage!r}"
    if stage in (1, 2) and teacher is None:
        return f"stage {stage} needs the teacher model"
    for name, m in (("student", student), ("teacher", teacher)):
        if m is not None and not has_fast_body(m):
            return f"the fast step needs a {NAMES} causal LM as {name}, got {type(m).__name__}"
    if stage == 1 and not decoder_parts_ok(teacher):
        return ("stage 1's fast step needs decoder layers with input_layernorm, self_attn (or attention), "
                "post_attention_layernorm and mlp")
    return None


# ---------------------------------------------------------------------------------------- the step
class FastStep:
    """Forward + backward of one stage's loss on a batch, fast (see the module docstring).

    Args:
        stage: 1, 2 or 3.
        student: the hybrid (or any Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 / GPT-NeoX) causal LM being trained.
        teacher: the frozen teacher (stages 1, 2).
        params: the trained parameters (``requires_grad`` set, as by
            :func:`~headscope.train.stages.trainable_parameters`).
        bf16: run under bf16 autocast (CUDA).
        compile: ``torch.compile`` the decoder layers (student and teacher), the stage-1 attention
            calls and the chunk loss math.
        cuda_graph: capture the step in a CUDA graph after ``warmup`` eager steps (CUDA only).
        chunk_rows: rows per LM-head chunk.
        backend: the ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` for tests).
        warmup: eager steps before the capture (the first compiles).
        reduce: data parallel: the sum of a tensor over ranks (:func:`headscope.train.parallel.all_sum`).
            The batch is then this rank's slice of the global batch, the loss is normalized by the global
            batch's counts (stage 1: its teacher statistics too), so the ranks' losses are shares that sum
            to the global loss, and the logged values are the global ones (as the plain step with
            ``reduce``, :func:`~headscope.train.stages.stage_loss`).
        loss_scale: the loss is multiplied by it before the backward (the world size under DDP, which
            averages the gradients over ranks: the average of ``world`` × the shares is their sum).
        activation_checkpointing: keep only each student layer's input (stage 1: each attention module's)
            and recompute the layer in the backward (``torch.utils.checkpoint``, non-reentrant, around the compiled
            layer: the recomputation replays the forward's graph): the same loss and gradients for less memory
            (:mod:`headscope.train.memory_plan`) and one more forward.
        ddp: run the forward through :class:`torch.nn.parallel.DistributedDataParallel` wrapped around
            the student (:func:`headscope.train.parallel.ddp_loss`), so that the gradients are averaged
            over ranks during the backward; needs an initialized process group.
        grad_accum: gradient accumulation: the batch is split into this many micro-batches (``torch.tensor_split``
            of the rows), each forward + backward in turn. Stages 2-3: each loss normalized by the whole batch's
            count, so the gradients add up to the whole batch's and the logged loss is the sum of the shares. Stage
            1: the backward of each micro-batch's squared errors, then every layer's gradients scaled by the whole
            batch's teacher statistics (:func:`~headscope.train.stages.accumulate_alignment`). Under a CUDA graph
            all micro-batches are in the one captured step.

    Raises:
        ValueError: a stage other than 1, 2, 3; stages 1, 2 without a teacher; a model without the
            Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 / GPT-NeoX structure.
        torch._dynamo.exc.Unsupported / FailOnRecompileLimitHit (on a step, with ``compile``): a graph break in a
            compiled region / Dynamo's recompile limit reached (both fell back to eager code silently before; under
            activation checkpointing the recomputation then differed from the forward, issue 63).
    """

    def __init__(
        self,
        stage: int,
        student: nn.Module,
        teacher: Optional[nn.Module],
        params: Sequence[Tensor],
        bf16: bool = False,
        compile: bool = False,
        cuda_graph: bool = False,
        chunk_rows: int = CHUNK_ROWS,
        backend: str = "inductor",
        warmup: int = 2,
        reduce: Optional[Callable[[Tensor], Tensor]] = None,
        loss_scale: float = 1.0,
        ddp: bool = False,
        activation_checkpointing: bool = False,
        grad_accum: int = 1,
    ):
        problem = fast_step_problem(stage, student, teacher)
        if problem is not None:
            raise ValueError(problem)
        from .stage_checks import check_grad_accum
        from .stages import attention_parameters

        self.grad_accum = check_grad_accum(stage, grad_accum)
        # stage 1 under accumulation scales each layer's gradients by its own factor
        self._layer_params = attention_parameters(student) if stage == 1 and self.grad_accum > 1 else []
        self.stage, self.student, self.teacher = stage, student, teacher
        self.params = list(params)
        self.device = next(student.parameters()).device
        self._student_dtype = next(p.dtype for p in student.parameters() if p.is_floating_point())
        self.bf16 = bool(bf16)
        self.chunk_rows = int(chunk_rows)
        self.cuda_graph = bool(cuda_graph) and self.device.type == "cuda"
        self.warmup = max(1, int(warmup))
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.graph_error: Optional[str] = None
        self._static: dict[str, Tensor] = {}
        self._prepared = False
        self.reduce = reduce
        self.loss_scale = float(loss_scale)
        self._forward: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] = self.loss
        # a graphed DDP step: DDP is made, warmed up and captured on one side stream (the stream its gradient
        # hooks were made on must be the capture's); the one-process step keeps a fresh stream per warm-up
        self._stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(self.device) if ddp and self.cuda_graph else None
        if ddp:
            from .parallel import ddp_loss

            # CUDA graphs of a DDP step: DDP built on a side stream, and 11 DDP-enabled eager steps before
            # the capture (PyTorch's CUDA-graph notes, "Usage with DistributedDataParallel")
            self.warmup = max(self.warmup, 11) if self.cuda_graph else self.warmup
            side = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
            with side:
                self._forward = ddp_loss(student, self.loss)
        # fullgraph: a graph break shows at the first step instead of splitting a layer into graphs whose resume
        # functions recompiled on every call up to Dynamo's limit, then ran eagerly (issue 63); without activation
        # checkpointing a region with a break still computes the same (slower): it is compiled again allowing breaks,
        # warned and listed in graph_breaks; with checkpointing it raises (the recomputation could differ)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.graph_breaks: list[str] = []
        wrap = ((lambda f: _compiled_whole(f, backend, not self.activation_checkpointing, self.graph_breaks))
                if compile else (lambda f: f))
        if compile:
            _raise_recompile_limit()
        self._layer = wrap(_layer_call)
        self._attn = wrap(_attn_call)
        self._s_layer, self._s_attn = self._layer, self._attn  # the student's calls
        if self.activation_checkpointing:
            from torch.utils.checkpoint import checkpoint

            layer_fn, attn_fn = self._layer, self._attn
            self._s_layer = lambda *a: checkpoint(layer_fn, *a, use_reentrant=False)
            self._s_attn = lambda *a: checkpoint(attn_fn, *a, use_reentrant=False)
        self._tio = wrap(_teacher_io)
        self._align = wrap(_align_term)
        self._align_global = wrap(_align_term_global)
        self._kl = wrap(kl_chunk)
        self._ce = wrap(ce_chunk)

    # -------------------------------------------------------------------- losses (no host sync)
    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)

    def loss(self, ids: Int[Tensor, "batch time"], mask: Bool[Tensor, "batch time"],
             denominator: Optional[Tensor] = None, sums: bool = False) -> tuple[Tensor, Tensor]:
        """(loss, logged) of the stage on a batch, without a backward and without a host sync;
        ``logged`` is [loss] or, in stage 1, [loss, per-layer alignment losses...], detached.
        ``denominator`` (stages 2-3): the count the loss is divided by instead of this batch's (global with
        ``reduce``): a micro-batch's share of the whole batch's loss. ``sums`` (stage 1 under gradient accumulation):
        (Σ_l SE_l, [SE_l..., teacher statistics]) of :func:`~headscope.train.stages.alignment_sums_of` instead, local
        to this micro-batch and rank."""
        with self._autocast():
            if self.stage == 1:
                return self._stage1(ids, mask, sums)
            if self.stage == 2:
                with torch.no_grad():
                    h_t = model_body(self.teacher, ids, self._layer)
                h_s = model_body(self.student, ids, self._s_layer)
                D, Dt = h_s.shape[-1], h_t.shape[-1]
                hs, ht = output_head(self.student), output_head(self.teacher)
                loss = linear_kl_loss(
                    h_s.reshape(-1, D), hs.weight, h_t.reshape(-1, Dt), ht.weight,
                    mask.reshape(-1), denominator=self._global_count(mask.sum()) if denominator is None else denominator,
                    b_s=hs.bias, b_t=ht.bias,
                    chunk_rows=self.chunk_rows, chunk_fn=self._kl,
                )
            else:
                h = model_body(self.student, ids, self._s_layer)
                tgt = ids.roll(-1, dims=1)  # row t predicts token t+1; the last row's target is masked out
                keep = torch.zeros_like(mask)
                keep[:, :-1] = mask[:, 1:] & mask[:, :-1]
                head = output_head(self.student)
                loss = linear_ce_loss(
                    h.reshape(-1, h.shape[-1]), head.weight, tgt.reshape(-1), keep.reshape(-1),
                    denominator=self._global_count(keep.sum()) if denominator is None else denominator, b=head.bias,
                    chunk_rows=self.chunk_rows, chunk_fn=self._ce,
                )
        return loss, self._global_logged(loss.detach().reshape(1))

    def _global_count(self, n: Tensor) -> Optional[Tensor]:
        """The global batch's count (a sum over ranks) with ``reduce``, else None (the local count)."""
        return None if self.reduce is None else self.reduce(n.to(torch.float32).reshape(()).clone())

    def _global_logged(self, logged: Tensor) -> Tensor:
        return logged if self.reduce is None else self.reduce(logged.float().clone())

    def _stage1(self, ids: Tensor, mask: Tensor, sums: bool = False) -> tuple[Tensor, Tensor]:
        t_inner = inner_model(self.teacher)
        with torch.no_grad():
            h = embed(self.teacher, ids)
            pos = torch.arange(ids.shape[1], device=ids.device)[None]
            pe = layer_positions(self.teacher, h, pos)
            wm, s_wm = layer_masks(self.teacher, ids.shape[1], ids.device), layer_masks(self.student, ids.shape[1], ids.device)
            io = []
            for layer, (cos, sin), w in zip(t_inner.layers, pe, wm):
                hn, a, h = self._tio(layer, h, cos, sin, *mask_for(attention_of(layer), w))
                io.append((self._as_student(hn), a))
            pe = [(self._as_student(cos), self._as_student(sin)) for cos, sin in pe]
        m = mask.to(torch.float32)[..., None]
        attns = [attention_of(layer) for layer in inner_model(self.student).layers]
        if sums:
            from .stages import alignment_sums_of

            y_s = [self._s_attn(s_attn, hn, *pe[i], *mask_for(s_attn, s_wm[i]))
                   for i, (s_attn, (hn, _)) in enumerate(zip(attns, io))]
            se, stats = alignment_sums_of(y_s, [a for _, a in io], m)
            return se.sum(), torch.cat([se.detach(), stats])
        if self.reduce is None:
            per = [self._align(self._s_attn(s_attn, hn, *pe[i], *mask_for(s_attn, s_wm[i])), a, m)
                   for i, (s_attn, (hn, a)) in enumerate(zip(attns, io))]
        else:  # this rank's shares of the global batch's per-layer losses
            with torch.no_grad():
                n, var = _global_teacher_stats([a for _, a in io], m, self.reduce)
            per = [self._align_global(self._s_attn(s_attn, hn, *pe[i], *mask_for(s_attn, s_wm[i])),
                                      a, m, n[i], var[i])
                   for i, (s_attn, (hn, a)) in enumerate(zip(attns, io))]
        per_t = torch.stack(per)
        loss = per_t.mean()
        return loss, self._global_logged(torch.cat([loss.detach().reshape(1), per_t.detach()]))

    def _as_student(self, t: Tensor) -> Tensor:
        """A bf16 teacher's tensor (TrainConfig.teacher_dtype) as the fp32 student's input where no autocast casts it
        (a CPU, or bf16 off); under bf16 autocast it stays bf16 (half the bytes of every layer's kept input)."""
        return t if self.bf16 else t.to(self._student_dtype)

    # -------------------------------------------------------------------- the step
    def _eager(self, ids: Tensor, mask: Tensor) -> Tensor:
        for p in self.params:
            p.grad = None
        if self.grad_accum == 1:
            loss, logged = self._forward(ids, mask)
            (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
            return logged
        from .stages import accumulate_alignment, attention_parameters, loss_token_count

        if self.stage == 1:
            return accumulate_alignment(lambda i, m: self._forward(i, m, None, True), ids, mask, self.grad_accum,
                                        self._layer_params, self.loss_scale, self.reduce)

        denom = self._global_count(loss_token_count(self.stage, mask))
        if denom is None:
            denom = loss_token_count(self.stage, mask).to(torch.float32)
        total: Optional[Tensor] = None
        for ids_k, mask_k in zip(ids.tensor_split(self.grad_accum), mask.tensor_split(self.grad_accum)):
            loss, logged = self._forward(ids_k, mask_k, denom)
            (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()  # adds to .grad
            total = logged if total is None else total + logged
        assert total is not None
        return total

    def __call__(self, ids: Int[Tensor, "batch time"], mask: Bool[Tensor, "batch time"]) -> Tensor:
        """Forward and backward on one batch; the gradients are in the parameters' ``.grad``.

        Returns:
            the logged values as one device tensor ([loss] or [loss, align_l0, ...]).
        """
        ids, mask = ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        if not self._prepared:
            self._old_inference = _prepare_hybrid(self.student)
            self._prepared = True
        self.calls += 1
        if self.graph is not None:
            st = self._static
            if ids.shape != st["ids"].shape:
                raise ValueError(f"the captured step is for batches of shape {tuple(st['ids'].shape)}, got {tuple(ids.shape)}")
            st["ids"].copy_(ids)
            st["mask"].copy_(mask)
            self.graph.replay()
            return st["logged"]
        if not self.cuda_graph or self.graph_error is not None or self.calls <= self.warmup:
            if self.cuda_graph and self.graph_error is None:  # warm-up on a side stream, as capture wants
                s = self._stream or torch.cuda.Stream(self.device)
                s.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(s):
                    logged = self._eager(ids, mask)
                torch.cuda.current_stream(self.device).wait_stream(s)
                return logged
            return self._eager(ids, mask)
        return self._capture(ids, mask)

    def _capture(self, ids: Tensor, mask: Tensor) -> Tensor:
        st = {"ids": ids.clone(), "mask": mask.clone()}
        for p in self.params:
            p.grad = None  # the captured backward allocates them in the graph's pool
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize(self.device)
            # capture on a stream of the step's own device: torch.cuda.graph's default capture stream is
            # made on the *current* device, so a step on cuda:1 in a process whose current device is cuda:0
            # launched its kernels outside the capture and invalidated it (seen on 2 × H200: every job of
            # the second queue trained ungraphed)
            with torch.cuda.device(self.device), torch.cuda.graph(graph, stream=self._stream or torch.cuda.Stream(self.device)):
                st["logged"] = self._eager(st["ids"], st["mask"])
        except Exception as e:  # noqa: BLE001 - any capture failure: keep training without the graph
            self.graph_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graph capture of the training step failed ({self.graph_error}); "
                          "continuing without it", RuntimeWarning, stacklevel=3)
            del graph
            torch.cuda.synchronize(self.device)
            return self._eager(ids, mask)
        self.graph, self._static = graph, st
        graph.replay()
        return st["logged"]

    def close(self) -> None:
        """Drop the captured graph and its memory (the gradients are set to None) and turn the hybrid
        layers' fast path off; a later call warms up, and captures, again."""
        for p in self.params:
            p.grad = None
        self.graph, self._static, self.calls = None, {}, 0
        if self._prepared:
            _unprepare_hybrid(self.student, self._old_inference)
            self._prepared = False


def flops_per_token(model: nn.Module, seq_len: int, backward: bool = True, attention_only: bool = False) -> dict[str, float]:
    """Model FLOPs per token of a forward (and, with ``backward``, backward: 2× forward) pass of a
    decoder-only model or a head-wise hybrid, the usual MFU accounting: 2 per weight of every linear
    map (the LM head included, the embedding lookup not), causal softmax attention 2 · 2 · (T/2) · d
    per FA head, and a chunked GDN head 2 · (5 · C · d + 3 · d²) with C = 64 (K Kᵀ, Q Kᵀ, the two
    triangular solves and the intra-chunk output; the state read, update and output maps). Any family
    :func:`headscope.hybrid.hybridize` converts (GPT-NeoX's layers under ``gpt_neox``, its attention ``attention``).
    ``attention_only``: only the attention modules' linear maps (stage 1 trains nothing else).

    Returns:
        {"linear", "attention", "gdn", "total"} in FLOPs per token.
    """
    from ..hybrid.layer import HeadwiseHybridAttention
    from ..hybrid.modeling_hybrid import attention_name, decoder_layers

    attns = [getattr(layer, attention_name(layer)) for layer in decoder_layers(model)]
    root = nn.ModuleList(attns) if attention_only else model
    lin = sum(m.weight.numel() for m in root.modules() if isinstance(m, nn.Linear))
    cfg = model.config
    H = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    n_fa = n_gdn = 0
    for a in attns:
        if isinstance(a, HeadwiseHybridAttention):
            n_fa += len(a.fa_heads)
            n_gdn += len(a.gdn_heads)
        else:
            n_fa += H
    mult = 3.0 if backward else 1.0
    out = {
        "linear": 2.0 * lin * mult,
        "attention": 2.0 * 2.0 * (seq_len / 2) * d * n_fa * mult,
        "gdn": 2.0 * (5 * 64 * d + 3 * d * d) * n_gdn * mult,
    }
    out["total"] = sum(out.values())
    return out
