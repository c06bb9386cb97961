"""The FA heads' per-token work of a decode step in one Triton kernel: q/k glue (QK-RMSNorm, RoPE or the NoPE
scale) and the K/V cache write at the token's slot (an int or read from device memory). :func:`fa_decode_prep_torch`
is the PyTorch reference. Design: docs/hybrid.md, "How the kernels work: FA prep".
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Union

import torch
from torch import Tensor

from .gdn_step import check_glue_args, rms_norm
from ...rope import apply_rope
from ...shapes import Float
from .splitk import build_kernels, kernel_applies, require_kernel

_kernels: dict = {}


def _slot_tensor(slot: Union[int, Tensor], B: int, dev: torch.device) -> Tensor:
    if isinstance(slot, Tensor):
        if slot.dim() != 1 or slot.shape[0] not in (1, B) or slot.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slot must be an int or an integer tensor of shape [1] or [batch]; got {slot.dtype} "
                             f"{tuple(slot.shape)}")
        return slot
    return torch.full((1,), int(slot), dtype=torch.long, device=dev)


def check_args(q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor, cos: Optional[Tensor], sin: Optional[Tensor],
               q_norm: Optional[Tensor], k_norm: Optional[Tensor], nope_a: Optional[float]) -> None:
    """The shape checks of :func:`fa_decode_prep` (shared with ``one_launch.py``). Raises ValueError naming the mismatch."""
    B, nf, d = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != d:
        raise ValueError(f"want q [batch, fa_head, d] and k, v [batch, kv_group, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if kc.shape != vc.shape or kc.dim() != 4 or kc.shape[:2] != k.shape[:2] or kc.shape[3] != d:
        raise ValueError(f"the caches must be [batch, kv_group, slots, d] matching k {tuple(k.shape)}; got "
                         f"{tuple(kc.shape)}, {tuple(vc.shape)}")
    check_glue_args(cos, sin, q_norm, k_norm, B, d)
    if cos is not None and nope_a is not None:
        raise ValueError("RoPE (cos, sin) and the NoPE scale (nope_a) exclude each other")


def glue_args(q: Tensor, cos: Optional[Tensor], sin: Optional[Tensor], positions: Optional[Tensor],
              nope_a: Optional[float], q_norm: Optional[Tensor], k_norm: Optional[Tensor], dummy: Tensor) -> tuple:
    """The FA glue's kernel arguments (shared with ``one_launch.py``): (COS, SIN, QN, KN, POS, inv_log_a, a, cos stride,
    sin stride, positions stride, ROPE, QKN, NOPE); ``dummy`` stands for the pointers a setting leaves unused.

    Raises:
        ValueError: NoPE without positions, positions that are not integers of shape [1] / [batch], cos / sin
            without unit stride in d.
    """
    B = q.shape[0]
    rope, qkn, nope = cos is not None, q_norm is not None, nope_a is not None
    if nope and positions is None:
        raise ValueError("the NoPE scale needs the token's positions ([1] or [batch] integers)")
    if rope and cos.shape[0] == 1:
        cos, sin = cos.expand(B, -1), sin.expand(B, -1)  # stride 0 over the batch
    for name, t in (("cos", cos), ("sin", sin)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in its last dimension")
    pos = positions.reshape(-1) if nope else dummy
    if nope and (pos.shape[0] not in (1, B) or pos.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"positions must be an integer tensor of shape [1] or [batch]; got {pos.dtype} "
                         f"{tuple(positions.shape)}")
    a = float(nope_a) if nope else 2.0
    return (cos if rope else dummy, sin if rope else dummy, q_norm.float().contiguous() if qkn else dummy,
            k_norm.float().contiguous() if qkn else dummy, pos, 1.0 / math.log(a), a, cos.stride(0) if rope else 0,
            sin.stride(0) if rope else 0, pos.stride(0) if nope and pos.shape[0] > 1 else 0, rope, qkn, nope)


def fa_decode_prep_torch(q: Float[Tensor, "batch fa_head d"], k: Float[Tensor, "batch kv_group d"],
                         v: Float[Tensor, "batch kv_group d"], k_cache: Float[Tensor, "batch kv_group slots d"],
                         v_cache: Float[Tensor, "batch kv_group slots d"], slot: Union[int, Tensor],
                         cos: Optional[Float[Tensor, "batch d"]] = None, sin: Optional[Float[Tensor, "batch d"]] = None,
                         positions: Optional[Tensor] = None, nope_a: Optional[float] = None,
                         q_norm: Optional[Float[Tensor, " d"]] = None, k_norm: Optional[Float[Tensor, " d"]] = None,
                         qk_eps: float = 0.0) -> Float[Tensor, "batch fa_head d"]:
    """The reference of :func:`fa_decode_prep` in PyTorch (same arguments; the caches written in place)."""
    check_args(q, k, v, k_cache, v_cache, cos, sin, q_norm, k_norm, nope_a)
    B = q.shape[0]
    qf, kf = q.float(), k.float()
    if q_norm is not None:
        qf, kf = rms_norm(qf, q_norm.float(), qk_eps), rms_norm(kf, k_norm.float(), qk_eps)
    if cos is not None:
        c, s_ = cos.float()[:, None], sin.float()[:, None]
        qf, kf = apply_rope(qf[:, None], c, s_)[:, 0], apply_rope(kf[:, None], c, s_)[:, 0]
    if nope_a is not None:
        if positions is None:
            raise ValueError("the NoPE scale needs the token's positions ([1] or [batch] integers)")
        s_t = torch.log(positions.float().reshape(-1) + nope_a) / math.log(nope_a)
        qf = qf * s_t.expand(B)[:, None, None]
    s = _slot_tensor(slot, B, q.device).long().expand(B)
    bi = torch.arange(B, device=q.device)
    k_cache[bi, :, s] = kf.to(k_cache.dtype)
    v_cache[bi, :, s] = v.to(v_cache.dtype)
    return qf.to(q.dtype)


def _make(triton, tl) -> dict:
    """The Triton kernel of the FA heads' decode prep."""

    # slot_int is never specialized: Triton makes an int argument equal to 1 a compile-time constant (no .to)
    @triton.jit(do_not_specialize=["slot_int"])
    def _fa_decode_prep(Q, K, V, KC, VC, SLOT, slot_int, POS, COS, SIN, QN, KN, QO, qk_eps, inv_log_a, nope_a,
              sqb, sqh, skb, skh, svb, svh, skcb, skch, skcl, svcb, svch, svcl, scb, ssb, sqob, sqoh,
              slot_stride, pos_stride,
              NF: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, QKN: tl.constexpr, NOPE: tl.constexpr,
              SLOT_PTR: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)  # < NF: an FA query head; else the kept KV group j - NF
        H2: tl.constexpr = D // 2
        r = tl.arange(0, H2)
        is_q = j < NF
        if is_q:
            src = Q + b * sqb + j * sqh
        else:
            src = K + b * skb + (j - NF) * skh
        x1 = tl.load(src + r).to(tl.float32)
        x2 = tl.load(src + H2 + r).to(tl.float32)
        if QKN:  # the teacher's per-head QK-RMSNorm (Qwen3)
            rr = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + qk_eps)
            if is_q:
                w1 = tl.load(QN + r)
                w2 = tl.load(QN + H2 + r)
            else:
                w1 = tl.load(KN + r)
                w2 = tl.load(KN + H2 + r)
            x1 = x1 * rr * w1
            x2 = x2 * rr * w2
        if ROPE:  # half-split rotary embedding
            c1 = tl.load(COS + b * scb + r).to(tl.float32)
            c2 = tl.load(COS + b * scb + H2 + r).to(tl.float32)
            s1 = tl.load(SIN + b * ssb + r).to(tl.float32)
            s2 = tl.load(SIN + b * ssb + H2 + r).to(tl.float32)
            x1, x2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
        if is_q:
            if NOPE:  # HypeNet's query scale s_t = log(t + a) / log(a)
                t = tl.load(POS + b * pos_stride).to(tl.float32)
                st = tl.log(t + nope_a) * inv_log_a
                x1 = x1 * st
                x2 = x2 * st
            dst = QO + b * sqob + j * sqoh
            tl.store(dst + r, x1.to(QO.dtype.element_ty))
            tl.store(dst + H2 + r, x2.to(QO.dtype.element_ty))
        else:
            g = j - NF
            if SLOT_PTR:  # the slot from device memory (one CUDA graph for every position)
                s = tl.load(SLOT + b * slot_stride).to(tl.int64)
            else:  # a host int (a graph replays that slot)
                s = slot_int.to(tl.int64)
            dk = KC + b * skcb + g * skch + s * skcl
            tl.store(dk + r, x1.to(KC.dtype.element_ty))
            tl.store(dk + H2 + r, x2.to(KC.dtype.element_ty))
            rd = tl.arange(0, D)
            vv = tl.load(V + b * svb + g * svh + rd)
            tl.store(VC + b * svcb + g * svch + s * svcl + rd, vv.to(VC.dtype.element_ty))

    return {"prep": _fa_decode_prep}


def _build() -> dict:
    """The kernels, built on first use (see :func:`headscope.hybrid.inference.kernels.splitk.build_kernels`)."""
    return build_kernels(_kernels, _make)


applies = kernel_applies  # whether :func:`fa_decode_prep` runs here (see splitk.kernel_applies)


def fa_decode_prep(q: Float[Tensor, "batch fa_head d"], k: Float[Tensor, "batch kv_group d"],
                   v: Float[Tensor, "batch kv_group d"], k_cache: Float[Tensor, "batch kv_group slots d"],
                   v_cache: Float[Tensor, "batch kv_group slots d"], slot: Union[int, Tensor],
                   cos: Optional[Float[Tensor, "batch d"]] = None, sin: Optional[Float[Tensor, "batch d"]] = None,
                   positions: Optional[Tensor] = None, nope_a: Optional[float] = None,
                   q_norm: Optional[Float[Tensor, " d"]] = None, k_norm: Optional[Float[Tensor, " d"]] = None,
                   qk_eps: float = 0.0) -> Float[Tensor, "batch fa_head d"]:
    """One decode token of the FA heads: the prepared queries, the key/value written into the cache.

    Per FA query head: QK-RMSNorm (``q_norm``), then RoPE (``cos``/``sin``) or the NoPE scale s_t = log(t + a) / log(a)
    (``nope_a``, t = ``positions``). Per kept KV group: QK-RMSNorm (``k_norm``) and RoPE of the key, written with the
    value into ``k_cache`` / ``v_cache`` at ``slot``.

    Args:
        q [batch, fa_head, d], k, v [batch, kv_group, d]: the token's (views of the fused projection: unit stride in
            d); k_cache, v_cache [batch, kv_group, slots, d]; slot: an int, or an integer tensor [1] / [batch] on the
            device (one graph serves every position; not bounds-checked); cos, sin [batch or 1, d]; positions [1] /
            [batch] (NoPE only); nope_a (> 1); q_norm, k_norm [d] fp32 with ``qk_eps``.

    Returns the prepared queries [batch, fa_head, d] in q's dtype. Raises ValueError: shapes that disagree, d not a
    power of two ≥ 16, RoPE with NoPE, NoPE without positions, an int slot outside the cache, CPU tensors outside
    ``TRITON_INTERPRET=1`` (naming :func:`fa_decode_prep_torch`); ImportError without triton. Source: the lean glue
    (RoPE: Su et al. 2021; NoPE scale: HypeNet, SPEC §4.2).
    """
    check_args(q, k, v, k_cache, v_cache, cos, sin, q_norm, k_norm, nope_a)
    B, nf, d = q.shape
    nk = k.shape[1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"fa_decode_prep needs a head_dim that is a power of two ≥ 16 (got {d}); "
                         "use fa_decode_prep_torch")
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in its last dimension")
    qo = torch.empty(B, nf, d, dtype=q.dtype, device=q.device)
    cos_t, sin_t, qn, kn, pos, inv_log_a, a, scb, ssb, pos_stride, rope, qkn, nope = glue_args(
        q, cos, sin, positions, nope_a, q_norm, k_norm, qo)
    require_kernel("fa_decode_prep", "fa_decode_prep_torch", q)
    kern = _build()
    slot_ptr = isinstance(slot, Tensor)
    if slot_ptr:
        _slot_tensor(slot, B, q.device)  # checks it
    elif not 0 <= int(slot) < k_cache.shape[2]:
        raise ValueError(f"slot {slot} is outside the cache's {k_cache.shape[2]} slots")
    s = slot if slot_ptr else qo  # any pointer without SLOT_PTR
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        kern["prep"][(B, nf + nk)](
            q, k, v, k_cache, v_cache, s, 0 if slot_ptr else int(slot), pos, cos_t, sin_t, qn, kn, qo, float(qk_eps), inv_log_a, a,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), scb, ssb, qo.stride(0),
            qo.stride(1), s.stride(0) if slot_ptr and s.shape[0] > 1 else 0, pos_stride,
            NF=nf, D=d, ROPE=rope, QKN=qkn, NOPE=nope, SLOT_PTR=slot_ptr, num_warps=1)
    return qo
