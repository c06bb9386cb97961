"""A decode step's layer tail in two kernel launches: residual, RMSNorm, gated MLP, residual, next layer's norm.

After a decoder layer's attention, a decode step computes (Llama / Qwen3 layers)::

    h ← h + a;   x = w_post · RMSNorm(h);   h ← h + W_down (silu(W_gate x) · W_up x);   x' = w_next · RMSNorm(h)

Compiled by Inductor with cuBLAS GEMMs this is five launches per layer (two fused norms, the gate/up GEMM, the
SwiGLU product, the down GEMM), each a few µs of latency for 5 MB of SmolLM2 weights at batch 16
(``benchmarks/profile_decode.py``). :func:`decode_mlp` does it in two:

1. **partials**: program p takes a block of ``block_i`` intermediate columns; it recomputes the residual and the
   norm for all (≤ 16) rows itself (576 values a row), multiplies them by its gate/up rows, applies SiLU and the
   product, and multiplies the result by its columns of W_down: an fp32 partial of the down projection
   [p, rows, hidden]. Program 0 also stores the new residual h + a.
2. **finish**: one program per row sums the partials (a fixed order: deterministic), adds them to the residual
   and applies the next layer's input norm.

Rounding follows the modules' forward in the layer's dtype: h + a rounded, the norm in fp32 rounded before the
weight, the GEMM outputs rounded, SiLU rounded before the product, the product rounded, the down projection
rounded before the residual add. The sums run in another order than cuBLAS's, so results differ from the modules by
GEMM rounding (bf16: a few ulp); :class:`~headscope.hybrid.static.StaticDecoder` checks the path against the
layers' own modules before it uses it.

- :func:`decode_mlp` — the two kernels (CUDA, or Triton's interpreter with ``TRITON_INTERPRET=1``).
- :func:`decode_mlp_torch` — the same function in PyTorch (the reference).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .shapes import Float
from .splitk import build_kernels, kernel_applies, require_kernel

MAX_ROWS = 16  # one 16-row tile (tl.dot's smallest M)
MAX_PARTIAL_BYTES = 4 << 20  # the fp32 partials that the finish kernel reads (SmolLM2 at batch 16: 1.8 MB)
BLOCK_I, BLOCK_K, BLOCK_N, WARPS = 32, 64, 64, 4
_kernels: dict = {}


def llama_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """``w · RMSNorm(x)`` as Llama's and Qwen3's RMSNorm compute it (fp32 statistics, rounded before the weight)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def decode_mlp_torch(
    h: Float[Tensor, "rows hidden"],
    a: Float[Tensor, "rows hidden"],
    w_post: Float[Tensor, " hidden"],
    eps_post: float,
    W_gu: Float[Tensor, "two_inter hidden"],
    W_down: Float[Tensor, "hidden inter"],
    w_next: Optional[Float[Tensor, " hidden"]] = None,
    eps_next: float = 0.0,
) -> tuple[Tensor, Optional[Tensor]]:
    """The reference of :func:`decode_mlp` (same arguments and results), as the modules compute it."""
    h = h + a
    g, u = F.linear(llama_rms_norm(h, w_post, eps_post), W_gu).chunk(2, dim=-1)
    h = h + F.linear(F.silu(g) * u, W_down)
    return h, (llama_rms_norm(h, w_next, eps_next) if w_next is not None else None)


def _make(triton, tl) -> dict:
    """The two Triton kernels."""

    @triton.jit
    def _mlp_partials(H, A, WN, WGU, WD, HH, P, M, eps, sh, sa, shh,
                      HID: tl.constexpr, INTER: tl.constexpr, MP: tl.constexpr, BK: tl.constexpr, BI: tl.constexpr,
                      BN: tl.constexpr, PREC: tl.constexpr):
        pid = tl.program_id(0)
        rm = tl.arange(0, MP)
        mmask = rm < M
        ri = pid * BI + tl.arange(0, BI)
        imask = ri < INTER
        rk = tl.arange(0, BK)
        DT = HH.dtype.element_ty
        ss = tl.zeros([MP], tl.float32)
        for k0 in range(0, HID, BK):  # the residual h + a (rounded) and its sum of squares
            kk = k0 + rk
            m2 = mmask[:, None] & (kk < HID)[None, :]
            hv = (tl.load(H + rm[:, None] * sh + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                  + tl.load(A + rm[:, None] * sa + kk[None, :], mask=m2, other=0.0).to(tl.float32)).to(DT)
            hf = hv.to(tl.float32)
            ss += tl.sum(hf * hf, 1)
            if pid == 0:
                tl.store(HH + rm[:, None] * shh + kk[None, :], hv, mask=m2)
        rstd = 1.0 / tl.sqrt(ss / HID + eps)
        accg = tl.zeros([MP, BI], tl.float32)
        accu = tl.zeros([MP, BI], tl.float32)
        for k0 in range(0, HID, BK):  # x = w · norm(h), times this program's gate and up rows
            kk = k0 + rk
            km = kk < HID
            m2 = mmask[:, None] & km[None, :]
            hv = (tl.load(H + rm[:, None] * sh + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                  + tl.load(A + rm[:, None] * sa + kk[None, :], mask=m2, other=0.0).to(tl.float32)).to(DT)
            w = tl.load(WN + kk, mask=km, other=0.0).to(tl.float32)
            x = ((hv.to(tl.float32) * rstd[:, None]).to(DT).to(tl.float32) * w[None, :]).to(DT)
            wm = imask[:, None] & km[None, :]
            wg = tl.load(WGU + ri[:, None] * HID + kk[None, :], mask=wm, other=0.0)
            wu = tl.load(WGU + (INTER + ri)[:, None] * HID + kk[None, :], mask=wm, other=0.0)
            accg = tl.dot(x, tl.trans(wg), accg, input_precision=PREC)
            accu = tl.dot(x, tl.trans(wu), accu, input_precision=PREC)
        g = accg.to(DT).to(tl.float32)
        act = ((g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * accu.to(DT).to(tl.float32)).to(DT)
        for n0 in range(0, HID, BN):  # this program's share of the down projection, fp32
            rn = n0 + tl.arange(0, BN)
            nm = rn < HID
            wd = tl.load(WD + rn[:, None] * INTER + ri[None, :], mask=nm[:, None] & imask[None, :], other=0.0)
            out = tl.dot(act, tl.trans(wd), input_precision=PREC)
            tl.store(P + (pid * MP + rm[:, None]) * HID + rn[None, :], out, mask=mmask[:, None] & nm[None, :])

    @triton.jit
    def _mlp_finish(HH, P, WN2, HOUT, XOUT, eps2, shh, sho, sxo, NP: tl.constexpr, HID: tl.constexpr,
                    MP: tl.constexpr, HP: tl.constexpr, PB: tl.constexpr, HAS_NEXT: tl.constexpr):
        m = tl.program_id(0)
        rh = tl.arange(0, HP)
        hm = rh < HID
        rp = tl.arange(0, PB)
        acc = tl.zeros([HP], tl.float32)
        for p0 in range(0, NP, PB):  # the partials in a fixed order
            pp = p0 + rp
            acc += tl.sum(tl.load(P + ((pp * MP + m) * HID)[:, None] + rh[None, :],
                                  mask=(pp < NP)[:, None] & hm[None, :], other=0.0), 0)
        DT = HOUT.dtype.element_ty
        hn = (tl.load(HH + m * shh + rh, mask=hm, other=0.0).to(tl.float32) + acc.to(DT).to(tl.float32)).to(DT)
        tl.store(HOUT + m * sho + rh, hn, mask=hm)
        if HAS_NEXT:  # the next layer's input norm
            hf = hn.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / HID + eps2)
            w = tl.load(WN2 + rh, mask=hm, other=0.0).to(tl.float32)
            tl.store(XOUT + m * sxo + rh, ((hf * rstd).to(DT).to(tl.float32) * w).to(DT), mask=hm)

    return {"partials": _mlp_partials, "finish": _mlp_finish}


def _build() -> dict:
    """The kernels, built on first use (see :func:`headscope.hybrid.splitk.build_kernels`)."""
    return build_kernels(_kernels, _make)


def n_programs(inter: int, block_i: int = BLOCK_I) -> int:
    """Programs (blocks of ``block_i`` intermediate columns) of the partials kernel."""
    return -(-inter // block_i)


def applies(rows: int, hidden: int, inter: int, device: torch.device) -> bool:
    """Whether :func:`decode_mlp` runs here: triton and CUDA (or the interpreter), ≤ :data:`MAX_ROWS` rows, the fp32
    partials at most :data:`MAX_PARTIAL_BYTES` (small models: larger ones keep the GEMMs)."""
    return (1 <= rows <= MAX_ROWS and n_programs(inter) * MAX_ROWS * hidden * 4 <= MAX_PARTIAL_BYTES
            and kernel_applies(16, device))


def decode_mlp(
    h: Float[Tensor, "rows hidden"],
    a: Float[Tensor, "rows hidden"],
    w_post: Float[Tensor, " hidden"],
    eps_post: float,
    W_gu: Float[Tensor, "two_inter hidden"],
    W_down: Float[Tensor, "hidden inter"],
    w_next: Optional[Float[Tensor, " hidden"]] = None,
    eps_next: float = 0.0,
) -> tuple[Float[Tensor, "rows hidden"], Optional[Float[Tensor, "rows hidden"]]]:
    """A decode step's layer tail after attention in two launches: h ← h + a; h ← h + W_down(silu(W_gate x) ·
    W_up x) with x = w_post · RMSNorm(h); and the next layer's input w_next · RMSNorm(h).

    Args:
        h: the residual stream before the attention output is added [rows, hidden] (unit stride in hidden).
        a: the attention layer's output [rows, hidden] (likewise), in h's dtype.
        w_post, eps_post: the post-attention RMSNorm's weight [hidden] and ε.
        W_gu: the gate rows, then the up rows [2 · inter, hidden], contiguous; W_down [hidden, inter], contiguous
            (bias-free projections, SiLU gate: Llama / Qwen3 MLPs).
        w_next, eps_next: the next layer's input RMSNorm; None after the last layer.

    Returns:
        (the new residual [rows, hidden], the next layer's normalized input or None), new tensors in h's dtype.

    Raises:
        ValueError: shapes or dtypes that disagree, more than :data:`MAX_ROWS` rows, non-contiguous weights, CPU
            tensors outside ``TRITON_INTERPRET=1`` (the message names :func:`decode_mlp_torch`).
        ImportError: triton missing.

    Source: the Llama decoder layer's tail (RMSNorm: Zhang & Sennrich 2019; SwiGLU: Shazeer 2020) in two launches
    (``benchmarks/profile_decode.py``).
    """
    M, Hd = h.shape
    I2 = W_gu.shape[0]
    if a.shape != h.shape or W_gu.dim() != 2 or W_gu.shape[1] != Hd or I2 % 2 or W_down.shape != (Hd, I2 // 2):
        raise ValueError(f"shapes disagree: h {tuple(h.shape)}, a {tuple(a.shape)}, W_gu {tuple(W_gu.shape)} (want "
                         f"[2·inter, {Hd}]), W_down {tuple(W_down.shape)} (want [{Hd}, inter])")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"decode_mlp takes 1..{MAX_ROWS} rows (one decode step's batch), got {M}; use decode_mlp_torch")
    if len({t.dtype for t in (h, a, W_gu, W_down)}) != 1:
        raise ValueError("h, a and the weights must share one dtype")
    if not (W_gu.is_contiguous() and W_down.is_contiguous()) or h.stride(-1) != 1 or a.stride(-1) != 1:
        raise ValueError("W_gu and W_down must be contiguous, h and a of unit stride in hidden")
    require_kernel("decode_mlp", "decode_mlp_torch", h)
    inter = I2 // 2
    NP = n_programs(inter)
    kern = _build()
    hh = torch.empty_like(h, memory_format=torch.contiguous_format)
    hout = torch.empty_like(hh)
    xout = torch.empty_like(hh) if w_next is not None else hout
    part = torch.empty(NP * MAX_ROWS * Hd, dtype=torch.float32, device=h.device)
    wn = w_post.contiguous()
    wn2 = w_next.contiguous() if w_next is not None else wn
    with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
        kern["partials"][(NP,)](h, a, wn, W_gu, W_down, hh, part, M, float(eps_post), h.stride(0), a.stride(0),
                                hh.stride(0), HID=Hd, INTER=inter, MP=MAX_ROWS, BK=BLOCK_K, BI=BLOCK_I, BN=BLOCK_N,
                                PREC="ieee" if h.dtype == torch.float32 else "tf32", num_warps=WARPS)
        kern["finish"][(M,)](hh, part, wn2, hout, xout, float(eps_next), hh.stride(0), hout.stride(0), xout.stride(0),
                             NP=NP, HID=Hd, MP=MAX_ROWS, HP=1 << (Hd - 1).bit_length(), PB=8,
                             HAS_NEXT=w_next is not None, num_warps=4)
    return hout, (xout if w_next is not None else None)
