"""Decode-sized linear layers: ``y = x Wᵀ + b`` for a few rows (one decode step's batch) in one Triton kernel.

At decode a projection multiplies [≤ 16, K] activations by an [N, K] weight: a few MB of weights and a
latency-bound kernel. On the H200, cuBLAS takes 2.9–4.3 µs for each SmolLM2 projection at 16 rows and this
kernel about the same alone (0.15 µs faster to 0.44 µs slower; ``benchmarks/bench_decode_gemm.py``); the difference is in a chain: it loads its
first weight tile, *then* waits on the kernel before it (programmatic dependent launch, ``splitk.PDL``), so its
launch and weight fetch overlap that kernel. A layer-shaped chain of 7 decode kernels took 18.2–18.3 µs per layer
with cuBLAS and 14.9 µs with this kernel and PDL, bit-identical outputs (same runs). In the whole decode step it did not pay
(:data:`ENABLE`), so it is opt-in.

- :func:`linear_rows` — the kernel (CUDA, or Triton's interpreter with ``TRITON_INTERPRET=1``).
- :func:`linear` — what the decode paths call: the kernel (as the custom op ``headscope::linear_rows``, opaque
  to ``torch.compile``) where :func:`applies`, else ``F.linear``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .shapes import Float
from .splitk import build_kernels, gdc_ops, launch_kw, pdl_applies, require_kernel, triton_available

# linear() uses the kernel where it applies (CUDA, ≤ MAX_ROWS rows); False: always F.linear. Off by default: it pays
# only in a PDL chain (splitk.PDL); without PDL it took ~5 µs per projection inside the SmolLM2 decode step, cuBLAS
# ~3.9 (H200, profile_decode.py), and with PDL the hybrid's step was within 0.5 % of cuBLAS + PDL.
ENABLE = False
MAX_ROWS = 16  # one 16-row tile (tl.dot's smallest M)
# output columns per program, reduction chunk, warps: the best of bench_decode_gemm.py's grid for 4 of the 5
# SmolLM2 decode projections on the H200 (gate/up: (16, 128, 2), 0.15 µs faster there)
BN, BK, WARPS = 16, 256, 2
_kernels: dict = {}


def _make(triton, tl) -> dict:
    gdc_wait, gdc_launch = gdc_ops()

    @triton.jit
    def _linear_rows(X, W, Bias, Y, M, N, K, sxm, swn, sym, HAS_B: tl.constexpr, BM: tl.constexpr,
                     BN_: tl.constexpr, BK_: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)  # a block of BN_ output columns, all rows
        rn = pid * BN_ + tl.arange(0, BN_)
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK_)
        nm = rn < N
        mm = rm < M
        w = tl.load(W + rn[None, :] * swn + rk[:, None], mask=nm[None, :] & (rk[:, None] < K), other=0.0)  # [BK, BN]
        if HAS_B:
            bias = tl.load(Bias + rn, mask=nm, other=0.0).to(tl.float32)
        if PDL:  # the weights are no running kernel's output: fetched before waiting for x
            gdc_wait()
            gdc_launch()
        acc = tl.zeros([BM, BN_], tl.float32)
        for k0 in range(0, K, BK_):
            x = tl.load(X + rm[:, None] * sxm + (k0 + rk)[None, :], mask=mm[:, None] & ((k0 + rk)[None, :] < K),
                        other=0.0)
            acc += tl.dot(x, w, input_precision=PREC)
            k1 = k0 + BK_  # the next weight tile (masked off past K)
            w = tl.load(W + rn[None, :] * swn + (k1 + rk)[:, None], mask=nm[None, :] & ((k1 + rk)[:, None] < K),
                        other=0.0)
        if HAS_B:
            acc += bias[None, :]
        tl.store(Y + rm[:, None] * sym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mm[:, None] & nm[None, :])

    return {"linear_rows": _linear_rows}


def linear_rows(
    x: Float[Tensor, "*rows k"],
    W: Float[Tensor, "n k"],
    b: Optional[Float[Tensor, " n"]] = None,
    out: Optional[Float[Tensor, "rows n"]] = None,
    tiles: Optional[tuple[int, int, int]] = None,
    pdl: Optional[bool] = None,
) -> Float[Tensor, "*rows n"]:
    """``x @ W.T + b`` for at most :data:`MAX_ROWS` rows in one Triton kernel: fp32 accumulation, the bias added in
    fp32, one rounding to x's dtype (as cuBLAS does); fp32 inputs multiply exactly (no TF32).

    Args:
        x: [..., K] activations whose leading dimensions hold ≤ :data:`MAX_ROWS` rows (any row stride after
            flattening them, unit stride in K).
        W: [N, K] weight (unit stride in K), x's dtype and device; b: [N] bias (x's dtype, unit stride) or None.
            With PDL the kernel loads W and b *before* waiting on the kernel launched just before it: they must
            be parameters, not that kernel's output.
        out: a [rows, N] tensor to write (x's dtype and device, unit stride in N; e.g. a benchmark's buffer);
            None: a new one.
        tiles: (output columns per program, reduction chunk, warps), powers of two, columns ≥ 16, chunk ≥ 16;
            default (:data:`BN`, :data:`BK`, :data:`WARPS`).
        pdl: launch with programmatic dependent launch where ``splitk.pdl_applies`` (None: there, i.e. when
            ``splitk.PDL`` is on); False: a plain launch.

    Returns:
        [..., N] in x's dtype (``out`` when given, as [rows, N]).

    Raises:
        ValueError: more than MAX_ROWS rows, shapes / dtypes / devices that disagree, a stride ≠ 1 in x's or W's
            last dimension or in b, bad ``tiles`` or ``out``, or CPU tensors outside Triton's interpreter; the
            messages about rows, strides and the device name ``torch.nn.functional.linear`` as the fallback.
        ImportError: triton missing.

    Source: a split-N GEMV-style product (one program per column block, the K loop software-pipelined by hand);
    programmatic dependent launch as in CUDA's programming guide (Hopper).
    """
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N = x2.shape[0], W.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"linear_rows takes at most {MAX_ROWS} rows, got {M}; use torch.nn.functional.linear")
    if W.dim() != 2 or W.shape[1] != K or (b is not None and b.shape != (N,)):
        raise ValueError(f"want W [N, {K}] and b [N]; got W {tuple(W.shape)}, b {None if b is None else tuple(b.shape)}")
    if W.dtype != x.dtype or W.device != x.device or (b is not None and (b.dtype != x.dtype or b.device != x.device)):
        raise ValueError(f"x, W (and b) need one dtype and device; got {x.dtype}/{W.dtype}"
                         f"{'' if b is None else '/' + str(b.dtype)} on {x.device}/{W.device}")
    if x2.stride(1) != 1 or W.stride(1) != 1 or (b is not None and b.stride(0) != 1):
        raise ValueError("x and W need unit stride in their last dimension, b unit stride; use "
                         "torch.nn.functional.linear")
    require_kernel("linear_rows", "torch.nn.functional.linear", x)
    bn, bk, warps = tiles if tiles is not None else (BN, BK, WARPS)
    if min(bn, bk) < 16 or bn & (bn - 1) or bk & (bk - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"tiles (columns, chunk, warps) must be powers of two with columns, chunk >= 16; got {tiles}")
    if out is not None and (out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1):
        raise ValueError(f"out must be a {x.dtype} tensor on {x.device} of shape {(M, N)} with unit stride in N")
    kern = build_kernels(_kernels, _make)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    pdl = pdl_applies(x, "rows", pdl)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kern["linear_rows"][(-(-N // bn),)](
            x2, W, b if b is not None else W, y, M, N, K, x2.stride(0), W.stride(0), y.stride(0), HAS_B=b is not None,
            BM=16, BN_=bn, BK_=bk, PREC="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl, num_warps=warps,
            **launch_kw(pdl))
    return y if out is not None else y.view(*x.shape[:-1], N)


@torch.library.custom_op("headscope::linear_rows", mutates_args=())
def _linear_rows_op(x: Tensor, W: Tensor, b: Optional[Tensor]) -> Tensor:
    return linear_rows(x, W, b)


@_linear_rows_op.register_fake
def _(x: Tensor, W: Tensor, b: Optional[Tensor]) -> Tensor:
    return x.new_empty(*x.shape[:-1], W.shape[0])


def applies(x: Tensor, W: Tensor, b: Optional[Tensor] = None) -> bool:
    """Whether :func:`linear` uses the kernel: :data:`ENABLE`, CUDA, ≤ :data:`MAX_ROWS` rows, W [N, K] of x's
    dtype with unit stride in K, K ≥ 16, 16/32-bit floats, b None or of x's dtype with unit stride, and no
    gradient to record (the kernel has no backward)."""
    if not ENABLE or not x.is_cuda:  # the common case first: one check per call on the decode path's host time
        return False
    grad = torch.is_grad_enabled() and (x.requires_grad or W.requires_grad or (b is not None and b.requires_grad))
    return (not grad and x.dim() >= 1 and W.dim() == 2 and x.shape[-1] == W.shape[1] >= 16
            and x.numel() // max(1, x.shape[-1]) <= MAX_ROWS and W.dtype == x.dtype and W.stride(1) == 1
            and (b is None or (b.dtype == x.dtype and b.dim() == 1 and b.stride(0) == 1))
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and triton_available())


def linear(x: Float[Tensor, "*rows k"], W: Float[Tensor, "n k"], b: Optional[Float[Tensor, " n"]] = None
           ) -> Float[Tensor, "*rows n"]:
    """``F.linear(x, W, b)``, through :func:`linear_rows` (the custom op ``headscope::linear_rows``) where
    :func:`applies` (a decode step's projections on a GPU, no gradient), else ``F.linear`` itself: same shapes
    and, up to rounding, the same values."""
    if applies(x, W, b) and x.stride(-1) == 1:
        return torch.ops.headscope.linear_rows(x, W, b)
    return F.linear(x, W, b)
