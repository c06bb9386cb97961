"""LM-head + loss in row chunks: the [rows, vocab] logits are never materialized whole.

:func:`linear_kl_loss` (stage 2) and :func:`linear_ce_loss` (stage 3) take the final hidden states
and the LM-head weight instead of logits. Rows are processed ``chunk_rows`` at a time: the chunk's
logits are formed (in the autocast dtype, as ``lm_head`` would under autocast), the loss terms and
the gradient with respect to the chunk's logits are computed in fp32 by one small function
(``chunk_fn``, which the fast step compiles so that the softmaxes fuse into a few passes), and the
gradients with respect to the hidden states and the weight are accumulated right away. The forward
therefore already holds the backward's result; ``backward`` only scales it by the incoming gradient.
Peak memory is a few [chunk_rows, vocab] fp32 buffers instead of several [rows, vocab] ones; the
teacher's logits (stage 2) are formed chunk by chunk too.

The values equal :func:`headscope.train.stages.distillation_loss` / :func:`~headscope.train.stages.lm_loss`
on the logits ``h @ Wᵀ (+ b)`` (same masking and normalization), up to float summation order.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

CHUNK_ROWS = 4096  # rows per chunk: [4096, 49152] fp32 is 0.8 GB


def kl_chunk(
    s: Float[Tensor, "rows vocab"], t: Float[Tensor, "rows vocab"], m: Float[Tensor, "rows"], inv: Float[Tensor, ""]
) -> tuple[Float[Tensor, ""], Float[Tensor, "rows vocab"]]:
    """Σ_rows m · KL(softmax t ‖ softmax s) and its gradient w.r.t. s scaled by m · inv (in s's dtype)."""
    lq = F.log_softmax(s.float(), dim=-1)
    lp = F.log_softmax(t.float(), dim=-1)
    p = lp.exp()
    kl = (p * (lp - lq)).sum(-1)
    g = (lq.exp() - p) * (m * inv)[:, None]
    return (kl * m).sum(), g.to(s.dtype)


def ce_chunk(
    s: Float[Tensor, "rows vocab"], tgt: Int[Tensor, "rows"], m: Float[Tensor, "rows"], inv: Float[Tensor, ""]
) -> tuple[Float[Tensor, ""], Float[Tensor, "rows vocab"]]:
    """Σ_rows m · CE(s, tgt) and its gradient w.r.t. s scaled by m · inv (in s's dtype)."""
    sf = s.float()
    lse = torch.logsumexp(sf, dim=-1)
    ce = lse - sf.gather(1, tgt[:, None])[:, 0]
    g = torch.exp(sf - lse[:, None])
    g.scatter_add_(1, tgt[:, None], torch.full_like(lse[:, None], -1.0))
    g = g * (m * inv)[:, None]
    return (ce * m).sum(), g.to(s.dtype)


def _mm_dtype(h: Tensor) -> torch.dtype:
    """The dtype lm_head's matmul would run in: autocast's when autocast is on, else h's."""
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


def _logits(h: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    out = h @ w.t()
    return out if b is None else out + b.to(out.dtype)


class _LinearLoss(torch.autograd.Function):
    """Shared body of both losses: ``other`` is the teacher's (h_t, w_t, b_t) for KL, the targets for CE."""

    @staticmethod
    def forward(ctx, h, w, b, m, denom, other_h, other_w, other_b, tgt, mm_dtype, chunk_rows, chunk_fn):
        with torch.autocast(device_type=h.device.type, enabled=False):
            N = h.shape[0]
            hs, ws = h.to(mm_dtype), w.to(mm_dtype)
            bs = None if b is None else b.to(mm_dtype)
            if other_h is not None:
                ht, wt = other_h.to(mm_dtype), other_w.to(mm_dtype)
                bt = None if other_b is None else other_b.to(mm_dtype)
            mf = m.to(torch.float32)
            inv = 1.0 / denom.to(device=h.device, dtype=torch.float32).clamp_min(1.0)
            need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
            gh = torch.empty(N, h.shape[1], dtype=mm_dtype, device=h.device) if need_h else None
            gw = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if need_w else None
            gb = torch.zeros(w.shape[0], dtype=torch.float32, device=h.device) if (need_w and b is not None) else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for r0 in range(0, N, chunk_rows):
                r1 = min(N, r0 + chunk_rows)
                s = _logits(hs[r0:r1], ws, bs)
                ref = _logits(ht[r0:r1], wt, bt) if other_h is not None else tgt[r0:r1]
                part, g = chunk_fn(s, ref, mf[r0:r1], inv)
                total = total + part
                if gh is not None:
                    gh[r0:r1] = g @ ws
                if gw is not None:
                    gw += (g.t() @ hs[r0:r1]).float()
                if gb is not None:
                    gb += g.float().sum(0)
            ctx.save_for_backward(gh, gw, gb)
            ctx.dtypes = (h.dtype, w.dtype, None if b is None else b.dtype)
            return total * inv

    @staticmethod
    def backward(ctx, go):
        gh, gw, gb = ctx.saved_tensors
        dh, dw, db = ctx.dtypes
        out_h = None if gh is None else (gh * go.to(gh.dtype)).to(dh)
        out_w = None if gw is None else (gw * go).to(dw)
        out_b = None if gb is None else (gb * go).to(db)
        return out_h, out_w, out_b, None, None, None, None, None, None, None, None, None


def linear_kl_loss(
    h_s: Float[Tensor, "rows hidden"],
    w_s: Float[Tensor, "vocab hidden"],
    h_t: Float[Tensor, "rows hidden_t"],
    w_t: Float[Tensor, "vocab hidden_t"],
    mask: Bool[Tensor, "rows"],
    denominator: Optional[Tensor] = None,
    b_s: Optional[Float[Tensor, "vocab"]] = None,
    b_t: Optional[Float[Tensor, "vocab"]] = None,
    chunk_rows: int = CHUNK_ROWS,
    chunk_fn: Optional[Callable] = None,
) -> Float[Tensor, ""]:
    """Stage 2: masked mean over rows of KL(softmax(h_t W_tᵀ + b_t) ‖ softmax(h_s W_sᵀ + b_s)), nats.

    Args:
        h_s, w_s, b_s: the student's final hidden states (flattened rows) and LM head; gradients flow
            to all three.
        h_t, w_t, b_t: the teacher's (no gradient).
        mask: real rows; the sum is divided by ``denominator`` (default: the number of real rows),
            clamped to at least 1.
        chunk_rows: rows per chunk.
        chunk_fn: :func:`kl_chunk` or a compiled version of it.

    Raises:
        ValueError: rows or vocabularies that do not match, chunk_rows < 1.
    """
    if h_s.shape[0] != h_t.shape[0] or h_s.shape[0] != mask.shape[0] or w_s.shape[0] != w_t.shape[0]:
        raise ValueError(
            f"student rows {tuple(h_s.shape)}, teacher rows {tuple(h_t.shape)}, mask {tuple(mask.shape)}, "
            f"vocabularies {w_s.shape[0]} / {w_t.shape[0]} must match"
        )
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    denom = mask.sum() if denominator is None else denominator
    return _LinearLoss.apply(h_s, w_s, b_s, mask, denom, h_t.detach(), w_t.detach(),
                             None if b_t is None else b_t.detach(), None, _mm_dtype(h_s), chunk_rows,
                             chunk_fn or kl_chunk)


def linear_ce_loss(
    h: Float[Tensor, "rows hidden"],
    w: Float[Tensor, "vocab hidden"],
    targets: Int[Tensor, "rows"],
    keep: Bool[Tensor, "rows"],
    denominator: Optional[Tensor] = None,
    b: Optional[Float[Tensor, "vocab"]] = None,
    chunk_rows: int = CHUNK_ROWS,
    chunk_fn: Optional[Callable] = None,
) -> Float[Tensor, ""]:
    """Stage 3: Σ_rows keep · CE(h Wᵀ + b, target) / denominator (default: the number of kept rows,
    clamped to at least 1), nats/token. Rows with ``keep`` False may hold any valid target id.

    Raises:
        ValueError: rows that do not match, chunk_rows < 1.
    """
    if h.shape[0] != targets.shape[0] or h.shape[0] != keep.shape[0]:
        raise ValueError(f"hidden rows {tuple(h.shape)}, targets {tuple(targets.shape)} and keep {tuple(keep.shape)} must match")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    denom = keep.sum() if denominator is None else denominator
    return _LinearLoss.apply(h, w, b, keep, denom, None, None, None, targets, _mm_dtype(h), chunk_rows,
                             chunk_fn or ce_chunk)
