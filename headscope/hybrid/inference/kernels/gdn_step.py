"""One decode token of every GDN head of a layer in one Triton kernel (glue and the gated delta rule, eq. 7–8),
the state updated in place; :func:`gdn_decode_step_torch` is the PyTorch reference. Design: docs/hybrid.md,
"How the kernels work: GDN step".
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...rope import apply_rope
from ...shapes import Float
from .splitk import build_kernels, kernel_applies, require_kernel

_kernels: dict = {}


def full_rotary(cos: Optional[Tensor], d: int) -> bool:
    """Whether the decode kernels take this rotary row: none, or as wide as the head (partial rotary: PyTorch)."""
    return cos is None or cos.shape[-1] == d


def check_glue_args(cos: Optional[Tensor], sin: Optional[Tensor], q_norm: Optional[Tensor], k_norm: Optional[Tensor],
                    B: int, d: int) -> None:
    """The decode kernels' rotary rows [batch or 1, d] and QK-norm weights, given in pairs (ValueError otherwise)."""
    if (cos is None) != (sin is None) or (q_norm is None) != (k_norm is None):
        raise ValueError("give cos and sin together, and q_norm and k_norm together")
    if cos is not None and (cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] not in (1, B) or cos.shape[1] != d):
        raise ValueError(f"cos and sin must be [batch={B} or 1, d={d}] (the kernels rotate all d features; partial "
                         f"rotary: the PyTorch forms); got {tuple(cos.shape)}, {tuple(sin.shape)}")


def rms_norm(x: Tensor, w: Optional[Tensor], eps: float) -> Tensor:
    """x / RMS(x) over the last dimension (× w when given); the glue of the lean path uses it too."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


def l2_normalize(x: Tensor) -> Tensor:
    """x / max(‖x‖₂, 1e-6) over the last dimension (``F.normalize(eps=1e-6)``, written out so that
    ``torch.compile`` fuses it into the glue)."""
    return x / torch.clamp_min(x.pow(2).sum(-1, keepdim=True).sqrt(), 1e-6)


def gdn_decode_step_torch(
    q: Float[Tensor, "batch head d"], k: Float[Tensor, "batch head d"], v: Float[Tensor, "batch head d"],
    a: Float[Tensor, "batch head"], b: Float[Tensor, "batch head"], S: Float[Tensor, "batch head d d"],
    A_neg: Float[Tensor, " head"], dt_bias: Float[Tensor, " head"], scale: float,
    cos: Optional[Float[Tensor, "batch d"]] = None, sin: Optional[Float[Tensor, "batch d"]] = None,
    q_norm: Optional[Float[Tensor, " d"]] = None, k_norm: Optional[Float[Tensor, " d"]] = None, qk_eps: float = 0.0,
) -> Float[Tensor, "batch head d"]:
    """The reference of :func:`gdn_decode_step` in PyTorch (same arguments; S updated in place)."""
    dt = v.dtype
    qf, kf = q.float(), k.float()
    if q_norm is not None:
        qf, kf = rms_norm(qf, q_norm.float(), qk_eps), rms_norm(kf, k_norm.float(), qk_eps)
    if cos is not None:
        c, s_ = cos.float()[:, None], sin.float()[:, None]  # one time step: [B,1,n,d] for apply_rope
        qf, kf = apply_rope(qf[:, None], c, s_)[:, 0], apply_rope(kf[:, None], c, s_)[:, 0]
    qf, kf = l2_normalize(qf).to(dt).float(), l2_normalize(kf).to(dt).float()
    alpha = (A_neg * F.softplus(a.float() + dt_bias)).exp()[..., None, None]
    beta = torch.sigmoid(b.float()).to(dt).float()[..., None]
    aS = alpha * S
    delta = beta * (v.float() - (kf[..., :, None] * aS).sum(-2))
    S_new = aS + kf[..., :, None] * delta[..., None, :]
    S.copy_(S_new)
    return (scale * (qf[..., :, None] * S_new).sum(-2)).to(dt)


def _make(triton, tl) -> dict:
    """The Triton kernel of the GDN decode step."""

    @triton.jit
    def _gdn_head(pid, cb, Q, K, V, A, Bt, COS, SIN, QN, KN, ANEG, DTB, S, Y, GAMMA, scale, qk_eps, out_eps,
                  sqb, sqh, skb, skh, svb, svh, sab, sbb, scb, ssb, syb, syh,
                  N: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, ROPE: tl.constexpr, QKN: tl.constexpr,
                  NORM: tl.constexpr):
        """Value columns block ``cb`` of (sequence, head) ``pid`` (int64): the step's body, shared with ``one_launch.py``'s
        one-launch decode step."""
        b = pid // N
        h = pid % N
        H2: tl.constexpr = D // 2
        r = tl.arange(0, H2)
        # the state first: its loads do not wait for the q/k normalizations below (one memory round trip, not two)
        cv = cb * BV + tl.arange(0, BV)
        base = S + pid * D * D
        p1 = base + r[:, None] * D + cv[None, :]
        p2 = base + (H2 + r)[:, None] * D + cv[None, :]
        S1 = tl.load(p1)
        S2 = tl.load(p2)
        vv = tl.load(V + b * svb + h * svh + cv).to(tl.float32)
        q1 = tl.load(Q + b * sqb + h * sqh + r).to(tl.float32)
        q2 = tl.load(Q + b * sqb + h * sqh + H2 + r).to(tl.float32)
        k1 = tl.load(K + b * skb + h * skh + r).to(tl.float32)
        k2 = tl.load(K + b * skb + h * skh + H2 + r).to(tl.float32)
        if QKN:  # the teacher's per-head QK-RMSNorm (Qwen3)
            rq = 1.0 / tl.sqrt((tl.sum(q1 * q1, 0) + tl.sum(q2 * q2, 0)) / D + qk_eps)
            rk = 1.0 / tl.sqrt((tl.sum(k1 * k1, 0) + tl.sum(k2 * k2, 0)) / D + qk_eps)
            q1 = q1 * rq * tl.load(QN + r)
            q2 = q2 * rq * tl.load(QN + H2 + r)
            k1 = k1 * rk * tl.load(KN + r)
            k2 = k2 * rk * tl.load(KN + H2 + r)
        if ROPE:  # half-split rotary embedding: (x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2)
            c1 = tl.load(COS + b * scb + r).to(tl.float32)
            c2 = tl.load(COS + b * scb + H2 + r).to(tl.float32)
            s1 = tl.load(SIN + b * ssb + r).to(tl.float32)
            s2 = tl.load(SIN + b * ssb + H2 + r).to(tl.float32)
            q1, q2 = q1 * c1 - q2 * s1, q2 * c2 + q1 * s2
            k1, k2 = k1 * c1 - k2 * s1, k2 * c2 + k1 * s2
        nq = tl.maximum(tl.sqrt(tl.sum(q1 * q1, 0) + tl.sum(q2 * q2, 0)), 1e-6)
        nk = tl.maximum(tl.sqrt(tl.sum(k1 * k1, 0) + tl.sum(k2 * k2, 0)), 1e-6)
        DT = Y.dtype.element_ty
        q1 = (q1 / nq).to(DT).to(tl.float32)
        q2 = (q2 / nq).to(DT).to(tl.float32)
        k1 = (k1 / nk).to(DT).to(tl.float32)
        k2 = (k2 / nk).to(DT).to(tl.float32)
        x = tl.load(A + b * sab + h).to(tl.float32) + tl.load(DTB + h)
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # softplus (torch's threshold)
        alpha = tl.exp(tl.load(ANEG + h) * sp)
        beta = tl.sigmoid(tl.load(Bt + b * sbb + h).to(tl.float32)).to(DT).to(tl.float32)
        S1 = S1 * alpha
        S2 = S2 * alpha
        delta = beta * (vv - tl.sum(k1[:, None] * S1, 0) - tl.sum(k2[:, None] * S2, 0))
        S1 = S1 + k1[:, None] * delta[None, :]
        S2 = S2 + k2[:, None] * delta[None, :]
        y = scale * (tl.sum(q1[:, None] * S1, 0) + tl.sum(q2[:, None] * S2, 0))
        tl.store(p1, S1)
        tl.store(p2, S2)
        if NORM:  # eq. 13–14 (BV = D: the whole head here): y rounded as the unfused path sees it, RMSNorm, γ_h
            y = y.to(DT).to(tl.float32)
            y = y / tl.sqrt(tl.sum(y * y, 0) / D + out_eps) * tl.load(GAMMA + h * D + cv)
        tl.store(Y + b * syb + h * syh + cv, y.to(DT))

    globals().update(_gdn_head=_gdn_head, tl=tl)  # where the kernel below (and the interpreter) looks them up

    @triton.jit
    def _gdn_decode_step(Q, K, V, A, Bt, COS, SIN, QN, KN, ANEG, DTB, S, Y, GAMMA, scale, qk_eps, out_eps,
              sqb, sqh, skb, skh, svb, svh, sab, sbb, scb, ssb, syb, syh,
              N: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, ROPE: tl.constexpr, QKN: tl.constexpr,
              NORM: tl.constexpr):
        _gdn_head(tl.program_id(0).to(tl.int64), tl.program_id(1), Q, K, V, A, Bt, COS, SIN, QN, KN, ANEG, DTB, S, Y,
                  GAMMA, scale, qk_eps, out_eps, sqb, sqh, skb, skh, svb, svh, sab, sbb, scb, ssb, syb, syh,
                  N, D, BV, ROPE, QKN, NORM)

    return {"step": _gdn_decode_step, "head": _gdn_head}


def launch_shape(d: int, fused_norm: bool, block_v: int = 32) -> tuple[int, int]:
    """(value columns per program, warps per program) of :func:`gdn_decode_step`: a whole head per program with the
    output fusion (``gamma``), else ``block_v`` columns; warps so that a program's fp32 state slice stays about
    ≤ 64 values per thread (2 warps up to a 64 × 64 slice, the setting timed on the H200)."""
    bv = d if fused_norm else min(block_v, d)
    n = bv * d
    return bv, (2 if n <= 4096 else 4 if n <= 8192 else 8)


def _build() -> dict:
    """The kernels, built on first use (see :func:`headscope.hybrid.inference.kernels.splitk.build_kernels`)."""
    return build_kernels(_kernels, _make)


applies = kernel_applies  # whether :func:`gdn_decode_step` runs here (see splitk.kernel_applies)


def gdn_decode_step(
    q: Float[Tensor, "batch head d"], k: Float[Tensor, "batch head d"], v: Float[Tensor, "batch head d"],
    a: Float[Tensor, "batch head"], b: Float[Tensor, "batch head"], S: Float[Tensor, "batch head d d"],
    A_neg: Float[Tensor, " head"], dt_bias: Float[Tensor, " head"], scale: float,
    cos: Optional[Float[Tensor, "batch d"]] = None, sin: Optional[Float[Tensor, "batch d"]] = None,
    q_norm: Optional[Float[Tensor, " d"]] = None, k_norm: Optional[Float[Tensor, " d"]] = None, qk_eps: float = 0.0,
    block_v: int = 32, out: Optional[Tensor] = None, gamma: Optional[Float[Tensor, "head d"]] = None,
    out_eps: float = 1e-6,
) -> Float[Tensor, "batch head d"]:
    """One token of every GDN head (eq. 7–8 with the layer's q/k glue) in one Triton kernel.

    Args:
        q, k, v: the token's GDN rows (views of the fused projection: unit stride in d); a, b: decay and β
            pre-activations [batch, head]; S: the fp32 state, overwritten in place; A_neg: −exp(A_log), dt_bias
            (fp32, per head); scale: read-out scale; cos, sin [batch, d] with RoPE; q_norm, k_norm [d] fp32 and
            ``qk_eps``; block_v: value columns per program.
        out: where to write y ([batch, head, d], v's dtype, unit stride in d); None: a new tensor.
        gamma, out_eps: fold the output fusion in (eq. 13–14: y ← γ_h · y / RMS(y), y first rounded to v's dtype as
            the unfused path sees it; one program per head).

    Returns y [batch, head, d] in v's dtype. Raises ValueError: shapes or strides the kernel cannot take, CPU tensors
    outside ``TRITON_INTERPRET=1`` (naming the reference); ImportError without triton. Source: eq. 7–8 (Yang et al.
    2024's GDN), the glue of ``plan.py``.
    """
    grid, args, meta, y = setup(q, k, v, a, b, S, A_neg, dt_bias, scale, cos, sin, q_norm, k_norm, qk_eps, block_v,
                                out, gamma, out_eps)
    with torch.cuda.device(v.device) if v.is_cuda else contextlib.nullcontext():
        _build()["step"][grid](*args, **meta, num_warps=launch_shape(q.shape[-1], gamma is not None, block_v)[1])
    return y


def setup(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, S: Tensor, A_neg: Tensor, dt_bias: Tensor,
          scale: float, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None, q_norm: Optional[Tensor] = None,
          k_norm: Optional[Tensor] = None, qk_eps: float = 0.0, block_v: int = 32, out: Optional[Tensor] = None,
          gamma: Optional[Tensor] = None, out_eps: float = 1e-6) -> tuple[tuple[int, int], tuple, dict, Tensor]:
    """The checks of :func:`gdn_decode_step` (same arguments and errors) and its launch: (grid, the kernel's
    run-time arguments in ``_gdn_head``'s order, its compile-time settings, y). Shared with ``one_launch.py``."""
    B, N, d = q.shape
    if d < 16 or d & (d - 1) or d % block_v and block_v < d:
        raise ValueError(f"gdn_decode_step needs a head_dim that is a power of two ≥ 16 (got {d}); "
                         "use gdn_decode_step_torch")
    if not (k.shape == v.shape == q.shape and a.shape == b.shape == (B, N) and S.shape == (B, N, d, d)):
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}, S {tuple(S.shape)}")
    if S.dtype != torch.float32 or not S.is_contiguous():
        raise ValueError("S must be a contiguous fp32 tensor (the decode cache's state)")
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in its last dimension")
    check_glue_args(cos, sin, q_norm, k_norm, B, d)
    require_kernel("gdn_decode_step", "gdn_decode_step_torch", v)
    bv, _ = launch_shape(d, gamma is not None, block_v)
    if out is not None and (out.shape != (B, N, d) or out.dtype != v.dtype or out.stride(-1) != 1
                            or out.device != v.device):
        raise ValueError(f"out must be a {v.dtype} tensor on {v.device} of shape {(B, N, d)} with unit stride in d")
    if gamma is not None and gamma.shape != (N, d):
        raise ValueError(f"gamma must have shape {(N, d)} (one γ_h per GDN head); got {tuple(gamma.shape)}")
    y = torch.empty(B, N, d, dtype=v.dtype, device=v.device) if out is None else out
    rope, qkn = cos is not None, q_norm is not None
    cos_t, sin_t = (cos, sin) if rope else (y, y)
    qn, kn = (q_norm.float().contiguous(), k_norm.float().contiguous()) if qkn else (A_neg, A_neg)
    gm = gamma.float().contiguous() if gamma is not None else A_neg
    args = (q, k, v, a, b, cos_t, sin_t, qn, kn, A_neg.float().contiguous(), dt_bias.float().contiguous(), S, y, gm,
            float(scale), float(qk_eps), float(out_eps),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
            cos_t.stride(0) if rope else 0, sin_t.stride(0) if rope else 0, y.stride(0), y.stride(1))
    meta = dict(N=N, D=d, BV=bv, ROPE=rope, QKN=qkn, NORM=gamma is not None)
    return (B * N, d // bv), args, meta, y
