"""Losses of the three-stage transfer (SPEC.md §9, paper section 4.3).

1. :func:`alignment_loss` — layer-wise alignment: every hybrid attention layer, fed the teacher's own
   layer input, reproduces the teacher layer's attention output; MSE normalized by the teacher
   output's variance, per layer.
2. :func:`distillation_loss` — global distillation: per-token forward KL(teacher ‖ student) of the
   next-token distributions, masked mean over real tokens (teacher and student logits at the same
   positions; no shift).
3. :func:`lm_loss` — long-context fine-tuning: next-token cross-entropy over real tokens.

:data:`TRAINABLE` says which student parameters each stage trains (stage 1: the attention layers
only; stages 2 and 3: the whole model).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

STAGES = (1, 2, 3)


def trainable_parameters(student: nn.Module, stage: int) -> list[tuple[str, nn.Parameter]]:
    """Set ``requires_grad`` for ``stage`` and return the (name, parameter) pairs it trains.

    Stage 1 trains every parameter of every decoder layer's attention module (``self_attn``; GPT-NeoX:
    ``attention``: migrated Q/K/V/O, GDN projections, decay, β, gates, γ) and freezes the rest; stages
    2 and 3 train everything.

    Raises:
        ValueError: a stage other than 1, 2, 3.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    from ..hybrid.modeling_hybrid import ATTENTION_NAMES

    out = []
    for name, p in student.named_parameters():
        on = stage != 1 or any(f".{a}." in name for a in ATTENTION_NAMES)
        p.requires_grad_(on)
        if on:
            out.append((name, p))
    return out


def _capture_attention_io(teacher: nn.Module, ids: Tensor, mask: Tensor) -> list[dict[str, Any]]:
    """Run the teacher once and record, per layer, the attention module's input hidden states,
    position embeddings and output."""
    from ..hybrid.modeling_hybrid import attention_name, decoder_layers

    layers = decoder_layers(teacher)
    rec: list[dict[str, Any]] = [dict() for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        def hook(mod, args, kwargs, output, i=i):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            rec[i].update(h=h.detach(), pe=kwargs.get("position_embeddings"), out=output[0].detach())
        hooks.append(getattr(layer, attention_name(layer)).register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            teacher.base_model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return rec


def alignment_loss(
    student: nn.Module,
    teacher: nn.Module,
    ids: Int[Tensor, "batch time"],
    mask: Bool[Tensor, "batch time"],
    reduce: Optional[Callable[[Tensor], Tensor]] = None,
) -> tuple[Float[Tensor, ""], Float[Tensor, "layer"]]:
    """Stage 1: layer-wise alignment loss.

    For layer l with teacher attention input h_l, teacher attention output y_l and hybrid attention
    A_l: L_l = Σ_real (A_l(h_l) − y_l)² / Σ_real (y_l − mean(y_l))², i.e. the MSE over real tokens and
    channels divided by the variance of the teacher output (so 1.0 = predicting the mean; 0 = exact).
    The total is the mean over layers. Layers are independent: gradients reach only the hybrid
    attention parameters.

    Data parallel: with ``reduce`` (the sum of a tensor over all ranks, each holding a slice of the
    global batch) the token count and the teacher statistics (mean, variance) are those of the global
    batch, and the returned terms are this rank's shares: summed over ranks they give the global
    batch's loss (the teacher statistics carry no gradient, so the loss is linear in the shares).

    Returns:
        (total loss, per-layer losses [n_layers], detached).
    """
    rec = _capture_attention_io(teacher, ids, mask)
    m = mask.to(ids.device)[..., None]
    if reduce is None:
        n_tok = m.sum()
        n = n_tok * rec[0]["out"].shape[-1]
    per = []
    from ..hybrid.modeling_hybrid import attention_name, decoder_layers

    for layer, r in zip(decoder_layers(student), rec):
        y_s, _ = getattr(layer, attention_name(layer))(r["h"], position_embeddings=r["pe"])
        y_t = r["out"].float()
        if reduce is None:
            mean = (y_t * m).sum((0, 1)) / n_tok
            var = (((y_t - mean) * m) ** 2).sum() / n
        else:
            d = y_t.shape[-1]
            s1 = reduce(torch.cat([(y_t * m).sum((0, 1)), m.sum().reshape(1).to(y_t.dtype)]))
            n_tok = s1[-1]
            n = n_tok * d
            mean = s1[:d] / n_tok
            var = reduce((((y_t - mean) * m) ** 2).sum()) / n
        mse = (((y_s.float() - y_t) * m) ** 2).sum() / n
        per.append(mse / var.clamp_min(1e-12))
    per_t = torch.stack(per)
    return per_t.mean(), per_t.detach()


def distillation_loss(
    student_logits: Float[Tensor, "batch time vocab"],
    teacher_logits: Float[Tensor, "batch time vocab"],
    mask: Bool[Tensor, "batch time"],
    denominator: Optional[Tensor] = None,
) -> Float[Tensor, ""]:
    """Stage 2: per-token forward KL(p_teacher ‖ p_student) in nats, masked mean over real tokens
    (divided by ``denominator`` instead of this batch's real-token count when given: the global
    batch's count in data-parallel training).

    KL_t = Σ_v p_t(v) (log p_t(v) − log q_t(v)) with p = softmax(teacher_logits[t]) and q =
    softmax(student_logits[t]) at the same position t (both predict token t+1; no shift).

    Raises:
        ValueError: logits of different shapes or a mask that does not match them.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ; "
            "both models must share the tokenizer and see the same ids"
        )
    if mask.shape != student_logits.shape[:2]:
        raise ValueError(f"mask {tuple(mask.shape)} does not match logits {tuple(student_logits.shape[:2])}")
    lq = F.log_softmax(student_logits.float(), dim=-1)
    lp = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # batch, time
    m = mask.to(kl.dtype)
    return (kl * m).sum() / (m.sum() if denominator is None else denominator).clamp_min(1.0)


def lm_loss(
    logits: Float[Tensor, "batch time vocab"],
    ids: Int[Tensor, "batch time"],
    mask: Bool[Tensor, "batch time"],
    denominator: Optional[Tensor] = None,
) -> Float[Tensor, ""]:
    """Stage 3: next-token cross-entropy (nats/token), mean over positions t whose target t+1 and
    input t are both real tokens (divided by ``denominator`` instead of their count when given)."""
    tgt = ids[:, 1:]
    keep = (mask[:, 1:] & mask[:, :-1]).to(logits.device)
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    ce = ce.view_as(tgt)
    k = keep.to(ce.dtype)
    return (ce * k).sum() / (k.sum() if denominator is None else denominator).clamp_min(1.0)


def loss_token_count(stage: int, mask: Bool[Tensor, "batch time"]) -> Int[Tensor, ""]:
    """The count a stage's loss is averaged over: real tokens (stages 1, 2: distillation over every real
    position) or positions whose input and next token are both real (stage 3: next-token loss).

    Raises:
        ValueError: a stage other than 1, 2, 3.
    """
    if stage in (1, 2):
        return mask.sum()
    if stage == 3:
        return (mask[:, 1:] & mask[:, :-1]).sum()
    raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")


def stage_loss_logged(
    stage: int,
    student: nn.Module,
    teacher: Optional[nn.Module],
    ids: Tensor,
    mask: Tensor,
    reduce: Optional[Callable[[Tensor], Tensor]] = None,
    denominator: Optional[Tensor] = None,
) -> tuple[Float[Tensor, ""], Float[Tensor, "k"]]:
    """:func:`stage_loss` with the logged values as one detached tensor (``[loss]``, or in stage 1
    ``[loss, align_l0, ...]``; global values with ``reduce``), without a host sync.

    ``denominator`` (stages 2-3): the count the loss is divided by instead of this batch's (or, with
    ``reduce``, the global batch's): a micro-batch's share of a whole batch's loss under gradient
    accumulation (the count of :func:`loss_token_count` on the whole batch, summed over ranks).

    Raises:
        ValueError: a stage other than 1, 2, 3.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if stage == 1:
        loss, per = alignment_loss(student, teacher, ids, mask, reduce=reduce)
        logged = torch.cat([loss.detach().reshape(1), per])
    else:
        if stage == 2:
            with torch.no_grad():
                t_logits = teacher(input_ids=ids, use_cache=False).logits
        logits = student(input_ids=ids, use_cache=False).logits
        denom = denominator if denominator is not None else \
            None if reduce is None else reduce(loss_token_count(stage, mask).to(device=logits.device, dtype=torch.float32))
        loss = distillation_loss(logits, t_logits, mask, denominator=denom) if stage == 2 else \
            lm_loss(logits, ids, mask, denominator=denom)
        logged = loss.detach().reshape(1)
    if reduce is not None:
        logged = reduce(logged.float().clone())
    return loss, logged


def logged_scalars(stage: int, logged: Float[Tensor, "k"] | list[float]) -> dict[str, float]:
    """The logged values as the log's columns: ``loss`` and, in stage 1, ``align_l{i}`` per layer."""
    vals = logged.tolist() if isinstance(logged, Tensor) else list(logged)
    out = {"loss": vals[0]}
    if stage == 1:
        out.update({f"align_l{i}": v for i, v in enumerate(vals[1:])})
    return out


def stage_loss(
    stage: int,
    student: nn.Module,
    teacher: nn.Module,
    ids: Tensor,
    mask: Tensor,
    reduce: Optional[Callable[[Tensor], Tensor]] = None,
) -> tuple[Tensor, dict[str, float]]:
    """Loss of one batch for ``stage`` and the scalars to log (``loss`` and, in stage 1,
    ``align_l{i}`` per layer).

    ``reduce`` (data parallel, see :mod:`headscope.train.parallel`): the sum of a tensor over all
    ranks. The batch is then this rank's slice of the global batch, the returned loss is this rank's
    share (the shares sum to the global batch's loss) and the logged scalars are the global values.

    Raises:
        ValueError: a stage other than 1, 2, 3.
    """
    loss, logged = stage_loss_logged(stage, student, teacher, ids, mask, reduce=reduce)
    return loss, logged_scalars(stage, logged)
