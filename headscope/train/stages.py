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
# the parameters of a hybrid attention layer that it initializes itself (HeadwiseHybridAttention.reset_new_parameters)
# instead of copying them from the teacher: the GDN heads' decay input a_proj, A_log and dt_bias, β's b_proj (weight
# and bias), the FA heads' output gate g_proj, the short convolution gdn_conv, the fusion's gamma. Every other
# parameter (q / o, the FA heads' k / v, the GDN heads' k / v rows, q / k norms) starts as the teacher's
# (headscope.hybrid.convert.migrate). TrainConfig(new_params_only=True) trains only these in stage 1.
NEW_PARAMETERS = ("a_proj", "b_proj", "A_log", "dt_bias", "g_proj", "gdn_conv", "gamma")


def trainable_parameters(student: nn.Module, stage: int, new_params_only: bool = False) -> list[tuple[str, nn.Parameter]]:
    """Set ``requires_grad`` for ``stage`` and return the (name, parameter) pairs it trains.

    Stage 1 trains every parameter of every decoder layer's attention module (``self_attn``; GPT-NeoX:
    ``attention``: migrated Q/K/V/O, GDN projections, decay, β, gates, γ) and freezes the rest; stages
    2 and 3 train everything. ``new_params_only`` (stage 1): only the parameters the hybrid layer initializes
    itself (:data:`NEW_PARAMETERS`: the GDN heads' ``a_proj`` (decay input), ``A_log``,
    ``dt_bias``, ``b_proj`` (β, weight and bias), the FA gate ``g_proj``, the short convolution ``gdn_conv`` where on,
    the fusion's ``gamma``); the copied ones (``q_proj``, ``o_proj``, the FA heads' ``k_proj`` / ``v_proj``, the GDN
    heads' ``gdn_k_proj`` / ``gdn_v_proj``, q / k norms) stay the teacher's.

    Raises:
        ValueError: a stage other than 1, 2, 3.
        HeadscopeInputError (a ValueError): ``new_params_only`` outside stage 1, or a student whose attention modules
            have no new parameter (every head FA, no gate, no γ).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    from ..errors import HeadscopeInputError
    from ..hybrid.modeling_hybrid import ATTENTION_NAMES

    if new_params_only and stage != 1:
        raise HeadscopeInputError(f"new_params_only applies to stage 1; stage {stage} trains the whole student")
    new = tuple(f".{a}.{n}" for a in ATTENTION_NAMES for n in NEW_PARAMETERS)
    out = []
    for name, p in student.named_parameters():
        on = stage != 1 or any(f".{a}." in name for a in ATTENTION_NAMES)
        if on and new_params_only:
            on = any(f"{x}." in name or name.endswith(x) for x in new)
        p.requires_grad_(on)
        if on:
            out.append((name, p))
    if new_params_only and not out:
        raise HeadscopeInputError("new_params_only: the student's attention modules have no new parameter (every head FA, "
                                  "no FA gate, no fusion γ); train without it")
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


def _as_student_inputs(rec: list[dict[str, Any]], student: nn.Module) -> list[dict[str, Any]]:
    """The teacher's attention inputs (hidden states, position embeddings) in the student's floating-point dtype (a
    bf16 teacher, ``TrainConfig.teacher_dtype``, feeds an fp32 student) where no autocast casts them; under autocast
    they stay as they are (half the bytes when bf16); outputs (targets) are kept as they are."""
    p0 = next(p for p in student.parameters() if p.is_floating_point())
    if torch.is_autocast_enabled(p0.device.type):
        return rec
    dt = p0.dtype
    cast = lambda t: t.to(dt) if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
    for r in rec:
        r["h"] = cast(r["h"])
        if isinstance(r.get("pe"), tuple):
            r["pe"] = tuple(cast(t) for t in r["pe"])
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
    rec = _as_student_inputs(_capture_attention_io(teacher, ids, mask), student)
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


def alignment_sums_of(
    y_s: list[Tensor], y_t: list[Tensor], m: Float[Tensor, "batch time 1"]
) -> tuple[Float[Tensor, "layer"], Float[Tensor, "k"]]:
    """The sums stage 1's loss is made of, for one micro-batch (gradient accumulation): per layer the squared error
    SE_l = Σ_real (A_l(h_l) − y_l)² (with its gradient), and, detached and packed into one vector, the teacher
    statistics [Σ_real y_l per channel (layer · D), Σ_real y_l² per layer (layer), real tokens (1)]. Summed over
    micro-batches (and ranks) they give the whole batch's loss through :func:`alignment_from_sums`."""
    se = torch.stack([(((a.float() - b.float()) * m) ** 2).sum() for a, b in zip(y_s, y_t)])
    with torch.no_grad():
        s1 = torch.stack([(b.float() * m).sum((0, 1)) for b in y_t])
        s2 = torch.stack([((b.float() * m) ** 2).sum() for b in y_t])
        stats = torch.cat([s1.reshape(-1), s2, m.sum().reshape(1).float()])
    return se, stats


def alignment_from_sums(
    se: Float[Tensor, "layer"], stats: Float[Tensor, "k"], d: int
) -> tuple[Float[Tensor, "layer"], Float[Tensor, "layer"]]:
    """(per-layer loss, per-layer gradient factor) from the summed :func:`alignment_sums_of` of a whole batch: the
    teacher variance var_l = (Σ y² − Σ_c (Σ y_c)² / n_tok) / (n_tok · D) (one pass, float32), the loss
    SE_l / (n_tok · D · var_l) as :func:`alignment_loss`'s, and the factor 1 / (L · n_tok · D · var_l) that turns the
    gradients of Σ_l SE_l into those of the mean over layers (each layer's parameters get only its own term)."""
    L = se.shape[0]
    s1 = stats[: L * d].reshape(L, d)
    s2 = stats[L * d: L * d + L]
    n_tok = stats[-1].clamp_min(1.0)
    n = n_tok * d
    var = ((s2 - (s1 ** 2).sum(-1) / n_tok) / n).clamp_min(1e-12)
    return se / (n * var), 1.0 / (L * n * var)


def scale_layer_gradients(layer_params: list[list[Tensor]], factor: Float[Tensor, "layer"]) -> None:
    """Multiply the gradient of every parameter of layer l by ``factor[l]`` (in place; no host sync)."""
    for ps, f in zip(layer_params, factor.unbind(0)):
        for p in ps:
            if p.grad is not None:
                p.grad.mul_(f.to(p.grad.dtype))


def alignment_sums(
    student: nn.Module, teacher: nn.Module, ids: Int[Tensor, "batch time"], mask: Bool[Tensor, "batch time"]
) -> tuple[Float[Tensor, "layer"], Float[Tensor, "k"]]:
    """:func:`alignment_sums_of` of one micro-batch through the plain path (teacher hooks, the student's attention
    modules as :func:`alignment_loss` calls them)."""
    from ..hybrid.modeling_hybrid import attention_name, decoder_layers

    rec = _as_student_inputs(_capture_attention_io(teacher, ids, mask), student)
    m = mask.to(ids.device)[..., None].float()
    y_s = [getattr(layer, attention_name(layer))(r["h"], position_embeddings=r["pe"])[0]
           for layer, r in zip(decoder_layers(student), rec)]
    return alignment_sums_of(y_s, [r["out"] for r in rec], m)


def accumulate_alignment(
    forward: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    ids: Int[Tensor, "batch time"],
    mask: Bool[Tensor, "batch time"],
    k: int,
    layer_params: list[list[Tensor]],
    loss_scale: float = 1.0,
    reduce: Optional[Callable[[Tensor], Tensor]] = None,
) -> Float[Tensor, "k"]:
    """Stage 1 with gradient accumulation: ``forward(ids_k, mask_k)`` -> (Σ_l SE_l, [SE_l..., packed teacher
    statistics]) (:func:`alignment_sums_of`) on each of ``k`` micro-batches, the backward of Σ SE after each (times
    ``loss_scale``), then, from the summed statistics (over ranks too with ``reduce``), every layer's gradients
    scaled to those of the whole batch's loss (:func:`alignment_from_sums`). Returns the logged values [loss,
    align_l0, ...] of the whole batch, as :func:`stage_loss_logged`'s."""
    L = len(layer_params)
    tot: Optional[Tensor] = None
    for ids_k, mask_k in zip(ids.tensor_split(k), mask.tensor_split(k)):
        se_sum, packed = forward(ids_k, mask_k)
        (se_sum * loss_scale if loss_scale != 1.0 else se_sum).backward()
        tot = packed if tot is None else tot + packed
    assert tot is not None
    if reduce is not None:
        tot = reduce(tot.clone())
    d = (tot.numel() - 2 * L - 1) // L
    per, factor = alignment_from_sums(tot[:L], tot[L:], d)
    scale_layer_gradients(layer_params, factor)
    return torch.cat([per.mean().reshape(1), per])


def attention_parameters(student: nn.Module) -> list[list[Tensor]]:
    """Per decoder layer, the trained parameters of its attention module (stage 1's, in layer order)."""
    from ..hybrid.modeling_hybrid import attention_name, decoder_layers

    return [[p for p in getattr(layer, attention_name(layer)).parameters() if p.requires_grad]
            for layer in decoder_layers(student)]


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
