"""A decode step's layer tail in one persistent Triton launch: the split-K combination, ``o_proj`` and the residual,
the post-attention RMSNorm, the gated MLP and its residual, the next layer's input RMSNorm and, optionally, that
layer's input projection, as phases separated by grid-wide barriers (in Triton's interpreter: five launches). Design:
docs/hybrid.md, "How the kernels work: Layer tail".
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import splitk
from ...shapes import Float

BN = 16  # output columns per work item of a GEMM phase (tl.dot's smallest N)
NUM_WARPS = 4
MAX_ROWS = 16  # rows (sequences) of one step: one 16-row tile
_kernels: dict = {}


def llama_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """``w · RMSNorm(x)`` as Llama's and Qwen3's RMSNorm compute it (fp32 statistics, rounded before the weight)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _make(triton, tl) -> dict:
    """The tail kernel (its combination body from splitk's kernels, built first)."""
    globals().update(_combine_row=splitk._build()["combine_row"], tl=tl)

    @triton.jit
    def _arrive(CNT):
        # a grid-wide barrier's arrival: this program's stores are done (bar.sync) and released with the add
        tl.debug_barrier()
        tl.atomic_add(CNT, 1, sem="release", scope="gpu")

    @triton.jit
    def _wait(CNT, target):
        # ... and its wait: until every program of the launch has arrived (the count reaches target)
        cur = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
        while cur < target:
            cur = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _mm(A, lda, W, ldw, rows, bmask, rn, k0, K: tl.constexpr, KC: tl.constexpr, NST: tl.constexpr,
            PREC: tl.constexpr):
        # [16, BN] fp32 = A[rows, k0:k0+K] @ W[rn, k0:k0+K]^T in KC-column chunks, software-pipelined NST deep: the
        # chunks' copies into shared memory are all issued before the first product waits (A, written by this
        # launch, is read past L1: the copies are L2-only)
        acc = tl.zeros([16, rn.shape[0]], tl.float32)
        for kk in tl.range(0, K, KC, num_stages=NST):
            rk = k0 + kk + tl.arange(0, KC)
            a = tl.load(A + rows[:, None] * lda + rk[None, :], mask=bmask[:, None], other=0.0, cache_modifier=".cg")
            w = tl.load(W + rn[:, None] * ldw + rk[None, :])
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
        return acc

    @triton.jit
    def _rstd(SSQ, rb, eps, HID: tl.constexpr, BN: tl.constexpr, TP: tl.constexpr):
        # the rows' 1 / rms from the per-tile sums of squares SSQ[tile, row] of the phase before
        rt = tl.arange(0, TP)
        ss = tl.sum(tl.load(SSQ + rt[:, None] * 16 + rb[None, :], mask=(rt < HID // BN)[:, None], other=0.0,
                            cache_modifier=".cg"), 0)
        return 1.0 / tl.sqrt(ss / HID + eps)

    @triton.jit
    def _normed(H1, rows, bmask, k0, WN, r, HID: tl.constexpr, K: tl.constexpr):
        # x = RMSNorm(h)[rows, k0:k0+K] = (wn · (h · r).to(dtype)).to(dtype), given the rows' 1 / rms r
        rk = k0 + tl.arange(0, K)
        hv = tl.load(H1 + rows[:, None] * HID + rk[None, :], mask=bmask[:, None], other=0.0,
                     cache_modifier=".cg").to(tl.float32)
        DT = H1.dtype.element_ty
        return (tl.load(WN + rk).to(tl.float32)[None, :] * (hv * r[:, None]).to(DT).to(tl.float32)).to(DT)

    @triton.jit
    def _gated(acg, acu, BGU, ACT, rows, bmask, rn, INTER: tl.constexpr, HAS_BGU: tl.constexpr):
        # act = silu(gate) · up of a column tile, rounded as the modules round (each GEMM's output, SiLU, the product)
        if HAS_BGU:
            acg += tl.load(BGU + rn).to(tl.float32)[None, :]
            acu += tl.load(BGU + INTER + rn).to(tl.float32)[None, :]
        DT = ACT.dtype.element_ty
        g = acg.to(DT).to(tl.float32)
        sg = (g * tl.sigmoid(g)).to(DT).to(tl.float32)
        act = (sg * acu.to(DT).to(tl.float32)).to(DT)
        tl.store(ACT + rows[:, None] * INTER + rn[None, :], act, mask=bmask[:, None])

    @triton.jit
    def _residual(acc, BIAS, r, OUT, SSQ, t, rows, rb, bmask, rn, HID: tl.constexpr, HAS_BIAS: tl.constexpr):
        # a column tile of out = r + (acc + bias), rounded as the modules round (the GEMM's output, then the sum), and
        # the tile's sums of squares per row for the next norm
        if HAS_BIAS:
            acc += tl.load(BIAS + rn).to(tl.float32)[None, :]
        DT = OUT.dtype.element_ty
        o = (r.to(tl.float32) + acc.to(DT).to(tl.float32)).to(DT)
        tl.store(OUT + rows[:, None] * HID + rn[None, :], o, mask=bmask[:, None])
        of = o.to(tl.float32)
        tl.store(SSQ + t * 16 + rb, tl.sum(of * of, 1))

    @triton.jit
    def _mlp_in(pid, SSQ, eps1, H1, WN1, WGU, BGU, ACT, rows, rb, bmask, HID: tl.constexpr, INTER: tl.constexpr,
                BN: tl.constexpr, KCH: tl.constexpr, NSTH: tl.constexpr, TP: tl.constexpr, HAS_BGU: tl.constexpr,
                PREC: tl.constexpr, NP: tl.constexpr):
        """Phase 2 of :func:`_tail`: act = silu(gate(x)) · up(x), x = RMSNorm(h1), a column tile per item."""
        for it in range(pid, INTER // BN, NP):
            r1 = _rstd(SSQ, rb, eps1, HID, BN, TP)
            rn = it * BN + tl.arange(0, BN)
            acg = tl.zeros([16, BN], tl.float32)
            acu = tl.zeros([16, BN], tl.float32)
            for kk in tl.range(0, HID, KCH, num_stages=NSTH):
                rk = kk + tl.arange(0, KCH)
                x = _normed(H1, rows, bmask, kk, WN1, r1, HID, KCH)
                wg = tl.load(WGU + rn[:, None] * HID + rk[None, :])
                wu = tl.load(WGU + (INTER + rn)[:, None] * HID + rk[None, :])
                acg = tl.dot(x, tl.trans(wg), acg, input_precision=PREC)
                acu = tl.dot(x, tl.trans(wu), acu, input_precision=PREC)
            _gated(acg, acu, BGU, ACT, rows, bmask, rn, INTER, HAS_BGU)

    @triton.jit
    def _mlp_down(pid, ACT, WD, BD, DP, TCNT, H1, H2, SSQ2, rows, rb, bmask, HID: tl.constexpr, INTER: tl.constexpr,
                  BN: tl.constexpr, KCI: tl.constexpr, DS: tl.constexpr, NSTI: tl.constexpr, HAS_BD: tl.constexpr,
                  PREC: tl.constexpr, SYNC: tl.constexpr, NP: tl.constexpr):
        """Phase 3 of :func:`_tail`: h2 = h1 + down(act) and its tiles' sums of squares (DS pieces per tile)."""
        for it in range(pid, (HID // BN) * DS, NP):
            sp = it % DS
            t = it // DS
            rn = t * BN + tl.arange(0, BN)
            acc = _mm(ACT, INTER, WD, INTER, rows, bmask, rn, sp * (INTER // DS), INTER // DS, KCI, NSTI, PREC)
            last = True
            if DS > 1:
                tl.store(DP + (sp * 16 + rows[:, None]) * HID + rn[None, :], acc)
                if SYNC:  # the tile's counter grows by DS per launch: the DS-th arrival is the last
                    tl.debug_barrier()
                    last = tl.atomic_add(TCNT + t, 1, sem="acq_rel", scope="gpu") % DS == DS - 1
                else:  # the interpreter runs the programs in order, one item each
                    last = sp == DS - 1
            if last:
                if DS > 1:
                    acc = tl.zeros([16, BN], tl.float32)
                    for s in tl.static_range(DS):
                        acc += tl.load(DP + (s * 16 + rows[:, None]) * HID + rn[None, :], cache_modifier=".cg")
                hv = tl.load(H1 + rows[:, None] * HID + rn[None, :], mask=bmask[:, None], other=0.0,
                             cache_modifier=".cg")
                _residual(acc, BD, hv, H2, SSQ2, t, rows, rb, bmask, rn, HID, HAS_BD)

    @triton.jit
    def _next_input(pid, SSQ2, eps2, H2, WN2, XN, WIN, BIN, Z, rows, rb, bmask, HID: tl.constexpr, NIN: tl.constexpr,
                    BN: tl.constexpr, KCH: tl.constexpr, NSTH: tl.constexpr, TP: tl.constexpr, HAS_BIN: tl.constexpr,
                    NEXT: tl.constexpr, PREC: tl.constexpr, NP: tl.constexpr):
        """Phase 4 of :func:`_tail`: the next layer's input norm (NEXT = 1) or its input projection (NEXT = 2)."""
        DT = H2.dtype.element_ty
        if NEXT > 0:
            r2 = _rstd(SSQ2, rb, eps2, HID, BN, TP)
        if NEXT == 1:
            for it in range(pid, HID // BN, NP):
                rn = it * BN + tl.arange(0, BN)
                hv = tl.load(H2 + rows[:, None] * HID + rn[None, :], mask=bmask[:, None], other=0.0,
                             cache_modifier=".cg").to(tl.float32)
                xn = tl.load(WN2 + rn).to(tl.float32)[None, :] * (hv * r2[:, None]).to(DT).to(tl.float32)
                tl.store(XN + rows[:, None] * HID + rn[None, :], xn.to(DT), mask=bmask[:, None])
        if NEXT == 2:
            for it in range(pid, NIN // BN, NP):
                rn = it * BN + tl.arange(0, BN)
                acc = tl.zeros([16, BN], tl.float32)
                for kk in tl.range(0, HID, KCH, num_stages=NSTH):
                    rk = kk + tl.arange(0, KCH)
                    x = _normed(H2, rows, bmask, kk, WN2, r2, HID, KCH)
                    w = tl.load(WIN + rn[:, None] * HID + rk[None, :])
                    acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
                if HAS_BIN:
                    acc += tl.load(BIN + rn).to(tl.float32)[None, :]
                tl.store(Z + rows[:, None] * NIN + rn[None, :], acc.to(DT), mask=bmask[:, None])


    @triton.jit
    def _tail(ACC, ML, O, GATE, GAMMA, sob, soh, sgb, sgh, out_eps,
              Y, WO, BO, H, H1, SSQ, WN1, eps1, WGU, BGU, ACT, WD, BD, DP, TCNT, H2, SSQ2, WN2, eps2, XN, WIN, BIN, Z,
              CNT, B,
              HID: tl.constexpr, KO: tl.constexpr, INTER: tl.constexpr, NIN: tl.constexpr, NCOMB: tl.constexpr,
              HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NS: tl.constexpr, SC: tl.constexpr,
              HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr,
              BN: tl.constexpr, KCO: tl.constexpr, KCH: tl.constexpr, KCI: tl.constexpr, DS: tl.constexpr,
              NSTO: tl.constexpr, NSTH: tl.constexpr, NSTI: tl.constexpr, TP: tl.constexpr,
              HAS_BO: tl.constexpr, HAS_BGU: tl.constexpr, HAS_BD: tl.constexpr, HAS_BIN: tl.constexpr,
              NEXT: tl.constexpr, PREC: tl.constexpr, NP: tl.constexpr, PHASES: tl.constexpr, SYNC: tl.constexpr):
        pid = tl.program_id(0)
        DT = H.dtype.element_ty
        rb = tl.arange(0, 16)
        bmask = rb < B
        rows = rb.to(tl.int64)
        base = 0
        if SYNC:  # the counter only grows, by 4 · NP per launch (four arrivals per program, waited on or not):
            # this launch's count starts at the multiple of 4 · NP below the count now (its last barrier cannot
            # complete before this program arrives)
            base = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu") // (4 * NP) * (4 * NP)
        # ---- phase 0: the split-K combination (+ output fusion) into the FA heads' columns of Y
        if PHASES & 1:
            for it in range(pid, NCOMB, NP):
                _combine_row(it, ACC, ML, O, GATE, GAMMA, sob, soh, sgb, sgh, out_eps, HK, G, D, NS, SC, HAS_GATE,
                             HAS_NORM)
            if SYNC:
                _arrive(CNT)
                if NCOMB > 0:
                    _wait(CNT, base + NP)
        # ---- phase 1: h1 = h + o_proj(y), a column tile per item; the tile's sums of squares for the norm
        if PHASES & 2:
            for it in range(pid, HID // BN, NP):
                rn = it * BN + tl.arange(0, BN)
                hv = tl.load(H + rows[:, None] * HID + rn[None, :], mask=bmask[:, None], other=0.0)
                acc = _mm(Y, KO, WO, KO, rows, bmask, rn, 0, KO, KCO, NSTO, PREC)
                _residual(acc, BO, hv, H1, SSQ, it, rows, rb, bmask, rn, HID, HAS_BO)
            if SYNC:
                _arrive(CNT)
                _wait(CNT, base + 2 * NP)
        # ---- phase 2: act = silu(gate(x)) * up(x), x = RMSNorm(h1) (the rows' statistics from phase 1's tiles)
        if PHASES & 4:
            _mlp_in(pid, SSQ, eps1, H1, WN1, WGU, BGU, ACT, rows, rb, bmask, HID, INTER, BN, KCH, NSTH, TP, HAS_BGU,
                    PREC, NP)
            if SYNC:
                _arrive(CNT)
                _wait(CNT, base + 3 * NP)
        # ---- phase 3: h2 = h1 + down(act), and the tile's sums of squares: per 16-column tile, DS pieces of the
        # reduction on as many programs (fp32 partials); the tile's last piece to finish adds them in order
        if PHASES & 8:
            _mlp_down(pid, ACT, WD, BD, DP, TCNT, H1, H2, SSQ2, rows, rb, bmask, HID, INTER, BN, KCI, DS, NSTI, HAS_BD,
                      PREC, SYNC, NP)
            if SYNC:
                _arrive(CNT)
                if NEXT > 0:
                    _wait(CNT, base + 4 * NP)
        # ---- phase 4: the next layer's input norm (NEXT = 1: x_next), or its input projection of the normalized
        # rows (NEXT = 2: z = RMSNorm'(h2) @ W_in^T + b_in, what the next layer's attention would compute first)
        if PHASES & 16:
            _next_input(pid, SSQ2, eps2, H2, WN2, XN, WIN, BIN, Z, rows, rb, bmask, HID, NIN, BN, KCH, NSTH, TP,
                        HAS_BIN, NEXT, PREC, NP)

    globals().update(_arrive=_arrive, _wait=_wait, _mm=_mm, _residual=_residual, _gated=_gated, _rstd=_rstd,
                     _normed=_normed, _mlp_in=_mlp_in, _mlp_down=_mlp_down, _next_input=_next_input)
    return {"tail": _tail}


def _build() -> dict:
    """The kernel, built on first use (see :func:`headscope.hybrid.inference.kernels.splitk.build_kernels`)."""
    return splitk.build_kernels(_kernels, _make)


MAX_STAGES = 25  # the deepest pipeline of a reduction in 16-bit (≤ 25 × 4 KB of shared memory; fp32 Mistral-7B
# sizes at 25 stages asked 305,152 B, H100/H200 have 232,448: tests/test_triton_hopper_smem.py)
DOWN_PIECE = 512  # the longest piece of the down projection's reduction per work item (phase 3)


def _chunk(k: int) -> int:
    """The reduction chunk of a k-long row: 64, 32 or 16 columns, the largest that divides k (0: none)."""
    return next((c for c in (64, 32, 16) if k % c == 0), 0)


def _stages(k: int, itemsize: int = 2) -> int:
    """Pipeline depth of a k-long reduction: every chunk in flight, ≤ :data:`MAX_STAGES` · 2 / itemsize (fp32: 12)."""
    return max(2, min(MAX_STAGES * 2 // itemsize, k // _chunk(k) + 1))


def down_pieces(inter: int) -> int:
    """How many equal pieces phase 3 cuts the down projection's reduction into: the fewest of at most
    :data:`DOWN_PIECE` columns, a multiple of 16 each (1 where none up to 16 pieces is)."""
    return next((n for n in range(1, 17) if inter % n == 0 and inter // n <= DOWN_PIECE and inter // n % 16 == 0), 1)


def applies(rows: int, hidden: int, k_o: int, inter: int, device: torch.device) -> bool:
    """Whether :func:`layer_tail` runs for these sizes here: triton, CUDA (or Triton's interpreter), ≤ 16 rows, and
    ``hidden``, ``inter`` and o_proj's input ``k_o`` multiples of 16."""
    if not splitk.triton_available() or rows > MAX_ROWS:
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return hidden % BN == 0 and inter % BN == 0 and k_o % 16 == 0


def layer_tail(
    y: Float[Tensor, "batch k_o"],
    h: Float[Tensor, "batch hidden"],
    w_o: Float[Tensor, "hidden k_o"],
    b_o: Optional[Tensor],
    w_post: Float[Tensor, " hidden"],
    eps_post: float,
    w_gu: Float[Tensor, "two_inter hidden"],
    b_gu: Optional[Tensor],
    w_down: Float[Tensor, "hidden inter"],
    b_down: Optional[Tensor],
    w_next: Optional[Float[Tensor, " hidden"]] = None,
    eps_next: float = 0.0,
    w_in: Optional[Float[Tensor, "n_in hidden"]] = None,
    b_in: Optional[Tensor] = None,
    attn: Optional[tuple] = None,
) -> tuple[Float[Tensor, "batch hidden"], Optional[Float[Tensor, "batch n"]]]:
    """A Llama-family decode layer's tail in one launch (module docstring): ``h1 = h + o_proj(y)``, ``h2 = h1 +
    down(silu(gate(x)) · up(x))`` with ``x = RMSNorm(h1)``, and the next layer's input ``RMSNorm'(h2)`` — or with
    ``w_in`` its projection ``RMSNorm'(h2) @ w_inᵀ + b_in``.

    Args:
        y: o_proj's input [batch ≤ 16, k_o], contiguous (with ``attn``, its FA heads' columns are written by the
            launch's first phase: ``attn``'s output buffer is a view of y); h: the residual [batch, hidden].
        w_o, b_o: o_proj; w_post, eps_post: the post-attention RMSNorm; w_gu, b_gu: [gate; up] stacked
            [2·inter, hidden]; w_down, b_down: the down projection; w_next, eps_next: the next layer's input norm
            (None after the last); w_in, b_in: the next input projection [n_in (× 16), hidden] (needs w_next).
        attn: ``(sp, gate, gamma, eps)``: the split-K partials of :func:`~.splitk.setup` and the output fusion of
            :func:`~.splitk.combine`; None: y is complete.

    Returns (h2 [batch, hidden], x_next [batch, hidden] or z [batch, n_in] or None), in h's dtype. Raises
    ValueError: sizes / dtypes that disagree or where :func:`applies` is False (use :func:`layer_tail_torch`), CPU
    tensors outside ``TRITON_INTERPRET=1``, bf16 in the interpreter; ImportError without triton. Source: Llama's
    decoder layer; flash-decoding's combination with eq. 13–14; a grid-wide barrier (CUDA cooperative groups).
    """
    B, k_o = y.shape
    hid, inter = h.shape[1], w_down.shape[1]
    interp = _check_tail(y, h, w_o, w_gu, w_down, w_post, w_next, w_in, attn)
    h1, h2 = torch.empty_like(h), torch.empty_like(h)
    act = h.new_empty(B, inter)
    ssq = torch.empty(2, hid // BN, MAX_ROWS, dtype=torch.float32, device=h.device)  # phases 1 and 3
    DS = down_pieces(inter)
    dp = torch.empty(DS, MAX_ROWS, hid, dtype=torch.float32, device=h.device) if DS > 1 else ssq
    nxt = 0 if w_next is None else (2 if w_in is not None else 1)
    out = None if nxt == 0 else (torch.empty_like(h) if nxt == 1 else h.new_empty(B, w_in.shape[0]))
    comb, cmeta = _combination(attn, y)
    n_items = max(cmeta["NCOMB"], inter // BN, (hid // BN) * DS, w_in.shape[0] // BN if nxt == 2 else 0)
    NP = n_items if interp else min(n_items, splitk._sm_count(h.device))
    dummy = h1
    args = (*comb, y, w_o, b_o if b_o is not None else dummy, h, h1, ssq[0], w_post, float(eps_post), w_gu,
            b_gu if b_gu is not None else dummy, act, w_down, b_down if b_down is not None else dummy, dp,
            splitk.counters(("tiles", str(h.device), hid // BN, DS), hid // BN, h.device), h2, ssq[1],
            w_next if w_next is not None else w_post, float(eps_next), out if nxt == 1 else dummy,
            w_in if w_in is not None else w_o, b_in if b_in is not None else dummy, out if nxt == 2 else dummy,
            splitk.counters(("grid", str(h.device), NP), 1, h.device), B)

    p2 = lambda n: 1 << max(0, (max(1, n) - 1).bit_length())  # noqa: E731
    meta = dict(HID=hid, KO=k_o, INTER=inter, NIN=w_in.shape[0] if nxt == 2 else 0, **cmeta, BN=BN,
                KCO=_chunk(k_o), KCH=_chunk(hid), KCI=_chunk(inter // DS), DS=DS, NSTO=_stages(k_o, h.element_size()),
                NSTH=_stages(hid, h.element_size()), NSTI=_stages(inter // DS, h.element_size()), TP=p2(hid // BN),
                HAS_BO=b_o is not None, HAS_BGU=b_gu is not None, HAS_BD=b_down is not None, HAS_BIN=b_in is not None,
                NEXT=nxt, PREC="ieee" if h.dtype == torch.float32 else "tf32", NP=NP)
    kern = _build()["tail"]
    with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
        if interp:  # programs run one after another: one launch per phase
            for ph in range(5):
                kern[(NP,)](*args, **meta, PHASES=1 << ph, SYNC=False, num_warps=NUM_WARPS)
        else:
            kern[(NP,)](*args, **meta, PHASES=31, SYNC=True, num_warps=NUM_WARPS)
    return h2, out


def _check_tail(y: Tensor, h: Tensor, w_o: Tensor, w_gu: Tensor, w_down: Tensor, w_post: Tensor,
                w_next: Optional[Tensor], w_in: Optional[Tensor], attn: Optional[tuple]) -> bool:
    """:func:`layer_tail`'s argument checks (its Raises); returns whether it runs in Triton's interpreter."""
    B, k_o = y.shape
    hid = h.shape[1]
    inter = w_down.shape[1]
    if (h.shape[0] != B or w_o.shape != (hid, k_o) or w_gu.shape != (2 * inter, hid) or w_down.shape != (hid, inter)
            or w_post.shape != (hid,) or (w_next is not None and w_next.shape != (hid,))
            or (w_in is not None and (w_next is None or w_in.dim() != 2 or w_in.shape[1] != hid
                                      or w_in.shape[0] % BN))):
        raise ValueError(f"layer_tail: sizes disagree: y {tuple(y.shape)}, h {tuple(h.shape)}, w_o {tuple(w_o.shape)}, "
                         f"w_gu {tuple(w_gu.shape)}, w_down {tuple(w_down.shape)}, w_post {tuple(w_post.shape)}, "
                         f"w_in {None if w_in is None else tuple(w_in.shape)} (rows a multiple of {BN}; with w_next)")
    for name, t in (("y", y), ("h", h), ("w_o", w_o), ("w_gu", w_gu), ("w_down", w_down), ("w_in", w_in)):
        if t is None:
            continue
        if t.dtype != h.dtype or not t.is_contiguous():
            raise ValueError(f"layer_tail: {name} must be contiguous in h's dtype {h.dtype}")
    if attn is not None and (attn[0].B != B or attn[0].o.device != y.device):
        raise ValueError(f"layer_tail: attn's split-K launch has {attn[0].B} rows on {attn[0].o.device}; y has {B} on "
                         f"{y.device} (its output buffer must be a view of y)")
    splitk.require_kernel("layer_tail", "layer_tail_torch", h)
    if not applies(B, hid, k_o, inter, h.device):
        raise ValueError(f"layer_tail does not apply to {B} rows, hidden {hid}, o_proj input {k_o}, MLP {inter} "
                         f"(≤ {MAX_ROWS} rows, multiples of {BN} and 16); use layer_tail_torch")
    interp = not h.is_cuda
    if interp and h.dtype == torch.bfloat16:
        raise ValueError("Triton's CPU interpreter computes bf16 tl.dot wrongly (Triton 3.9): use fp32/fp16 tensors "
                         "there, or layer_tail_torch")
    return interp


def _combination(attn: Optional[tuple], y: Tensor) -> tuple[tuple, dict]:
    """The split-K combination's launch arguments and meta-parameters of :func:`layer_tail` (none without ``attn``)."""
    if attn is not None:
        sp, gate, gamma, out_eps = attn
        o = sp.o
        gm = gamma.float().contiguous() if gamma is not None else sp.acc
        gt = gate if gate is not None else o
        comb = (sp.acc, sp.ml, o, gt, gm, o.stride(0), o.stride(1), gt.stride(0), gt.stride(1), float(out_eps))
        cmeta = dict(NCOMB=sp.B * sp.Hk * sp.G, HK=sp.Hk, G=sp.G, D=sp.d, NS=sp.NS,
                     SC=splitk.combine_chunk(sp.NS, sp.d),
                     HAS_GATE=gate is not None, HAS_NORM=gamma is not None)
    else:
        comb = (y, y, y, y, y, 0, 0, 0, 0, 0.0)
        cmeta = dict(NCOMB=0, HK=1, G=1, D=16, NS=1, SC=2, HAS_GATE=False, HAS_NORM=False)
    return comb, cmeta


def layer_tail_torch(
    y: Tensor, h: Tensor, w_o: Tensor, b_o: Optional[Tensor], w_post: Tensor, eps_post: float, w_gu: Tensor,
    b_gu: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], w_next: Optional[Tensor] = None,
    eps_next: float = 0.0, w_in: Optional[Tensor] = None, b_in: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`layer_tail`'s computation in PyTorch for a complete ``y`` (no ``attn``): the reference, any device."""
    h1 = h + F.linear(y, w_o, b_o)
    g, u = F.linear(llama_rms_norm(h1, w_post, eps_post), w_gu, b_gu).chunk(2, dim=-1)
    h2 = h1 + F.linear(F.silu(g) * u, w_down, b_down)
    if w_next is None:
        return h2, None
    x = llama_rms_norm(h2, w_next, eps_next)
    return h2, (F.linear(x, w_in, b_in) if w_in is not None else x)
