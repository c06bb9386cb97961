"""A decode step's layer tail in one persistent Triton launch: the split-K combination, ``o_proj`` and the
residual, the post-attention RMSNorm, the gated MLP and its residual, and the next layer's input RMSNorm.

After the attention kernel, a SmolLM2-sized decode layer launched seven more kernels (the combination, four
cuBLAS GEMMs of 16 rows, three compiled norm / SiLU·mul kernels; ``benchmarks/profile_decode.py``): each is bound
by its launch and its first loads (2–4 µs on the H200), not by its few hundred KB of weights. :func:`layer_tail`
does that chain as the *phases* of one launch of at most one program per SM, separated by grid-wide barriers
(an atomic counter the programs wait on; every program of the launch is resident, so none waits on a program that
never runs):

0. the split-K combination with the output fusion (``splitk._combine_row``: FA gate, per-head RMSNorm, γ_h) into
   the FA heads' columns of ``o_proj``'s input (the GDN heads' columns are already there);
1. ``h1 = h + o_proj(y)`` in column tiles;
2. ``act = silu(gate(x)) · up(x)``, ``x = RMSNorm(h1)`` recomputed from the whole rows by every program;
3. ``h2 = h1 + down(act)``;
4. ``x_next = RMSNorm'(h2)`` (the next layer's input norm; none after the last layer).

At the start every program prefetches its weight tiles of phases 1–3 into L2 (and a share of an optional extra
region, e.g. the next layer's input projection), so their DRAM latency passes during phase 0 and the barriers.
Rounding follows the modules' (each GEMM's output, the residual sums, the norms' ``weight · x.to(dtype)`` in the
activations' dtype); products accumulate in fp32.

Without a GPU (Triton's interpreter, ``TRITON_INTERPRET=1``), whose programs run one after another and cannot
wait on each other, the phases run as five launches of the same kernel.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import splitk
from .shapes import Float

BN = 16  # output columns per work item of a GEMM phase (tl.dot's smallest N)
NUM_WARPS = 4
MAX_ROWS = 16  # rows (sequences) of one step: one 16-row tile
PREFETCH = True  # L2 prefetch of every program's weight tiles at the start (GPU only)
_kernels: dict = {}
_counters: dict = {}


def _make(triton, tl) -> dict:
    """The tail kernel (its combination body from splitk's kernels, built first)."""
    globals().update(_combine_row=splitk._build()["combine_row"], tl=tl)

    @triton.jit
    def _grid_sync(CNT, NP: tl.constexpr):
        # a grid-wide barrier: each program adds one to a counter that only grows (every launch adds NP per
        # barrier, so a barrier's generation is the count // NP) and waits until the generation is complete
        tl.debug_barrier()  # this program's stores are done before it arrives (release, cumulative)
        old = tl.atomic_add(CNT, 1, sem="release", scope="gpu")
        target = (old // NP + 1) * NP
        cur = old + 1
        while cur < target:
            cur = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _prefetch(P, first, n, NL: tl.constexpr, LINE: tl.constexpr):
        # L2 prefetch of the cache lines [first, first + n) of the region at P (LINE elements per 128-byte line)
        rl = tl.arange(0, NL)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [P + (first + rl).to(tl.int64) * LINE, (rl < n).to(tl.int32)], dtype=tl.int32, is_pure=False,
            pack=1)

    @triton.jit
    def _rms(X, rows, bmask, HID: tl.constexpr, KC: tl.constexpr, eps):
        # 1 / sqrt(mean(x²) + eps) of rows [16] of X [*, HID] (written by this launch: read past L1)
        ss = tl.zeros([16], tl.float32)
        for k0 in tl.static_range(0, HID, KC):
            rk = k0 + tl.arange(0, KC)
            x = tl.load(X + rows[:, None] * HID + rk[None, :], mask=bmask[:, None], other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            ss += tl.sum(x * x, 1)
        return 1.0 / tl.sqrt(ss / HID + eps)

    @triton.jit
    def _tail(ACC, ML, O, GATE, GAMMA, sob, soh, sgb, sgh, out_eps,
              Y, WO, BO, H, H1, WN1, eps1, WGU, BGU, ACT, WD, BD, H2, WN2, eps2, XN, CNT, XPF, xpf_lines, B,
              HID: tl.constexpr, KO: tl.constexpr, INTER: tl.constexpr, NCOMB: tl.constexpr,
              HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NS: tl.constexpr, SC: tl.constexpr,
              HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr,
              BN: tl.constexpr, KCO: tl.constexpr, KCH: tl.constexpr, KCI: tl.constexpr,
              HAS_BO: tl.constexpr, HAS_BGU: tl.constexpr, HAS_BD: tl.constexpr, HAS_NEXT: tl.constexpr,
              PREC: tl.constexpr, NP: tl.constexpr, PHASES: tl.constexpr, SYNC: tl.constexpr,
              PREFETCH: tl.constexpr, LINE: tl.constexpr, NLO: tl.constexpr, NLG: tl.constexpr, NLD: tl.constexpr,
              NLX: tl.constexpr):
        pid = tl.program_id(0)
        DT = H.dtype.element_ty
        rb = tl.arange(0, 16)
        bmask = rb < B
        rows = rb.to(tl.int64)
        if PREFETCH:  # this program's weight tiles of phases 1-3 (and its share of the extra region) into L2
            for it in range(pid, HID // BN, NP):
                _prefetch(WO, it * (BN * KO // LINE), BN * KO // LINE, NLO, LINE)
                _prefetch(WD, it * (BN * INTER // LINE), BN * INTER // LINE, NLD, LINE)
            for it in range(pid, INTER // BN, NP):
                _prefetch(WGU, it * (BN * HID // LINE), BN * HID // LINE, NLG, LINE)
                _prefetch(WGU, (INTER + it * BN) * HID // LINE, BN * HID // LINE, NLG, LINE)
            if NLX > 0:
                per = tl.cdiv(xpf_lines, NP)
                _prefetch(XPF, pid * per, tl.minimum(per, xpf_lines - pid * per), NLX, LINE)
        # ---- phase 0: the split-K combination (+ output fusion) into the FA heads' columns of Y
        if PHASES & 1:
            for it in range(pid, NCOMB, NP):
                _combine_row(it, ACC, ML, O, GATE, GAMMA, sob, soh, sgb, sgh, out_eps, HK, G, D, NS, SC, HAS_GATE,
                             HAS_NORM)
            if SYNC and NCOMB > 0:
                _grid_sync(CNT, NP)
        # ---- phase 1: h1 = h + o_proj(y)
        if PHASES & 2:
            for it in range(pid, HID // BN, NP):
                rn = it * BN + tl.arange(0, BN)
                acc = tl.zeros([16, BN], tl.float32)
                for k0 in tl.static_range(0, KO, KCO):
                    rk = k0 + tl.arange(0, KCO)
                    a = tl.load(Y + rows[:, None] * KO + rk[None, :], mask=bmask[:, None], other=0.0,
                                cache_modifier=".cg")
                    w = tl.load(WO + rn[:, None] * KO + rk[None, :])
                    acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
                if HAS_BO:
                    acc += tl.load(BO + rn).to(tl.float32)[None, :]
                hv = tl.load(H + rows[:, None] * HID + rn[None, :], mask=bmask[:, None], other=0.0)
                h1 = (hv.to(tl.float32) + acc.to(DT).to(tl.float32)).to(DT)
                tl.store(H1 + rows[:, None] * HID + rn[None, :], h1, mask=bmask[:, None])
            if SYNC:
                _grid_sync(CNT, NP)
        # ---- phase 2: act = silu(gate(x)) * up(x), x = RMSNorm(h1) (every program normalizes the whole rows)
        if PHASES & 4:
            for it in range(pid, INTER // BN, NP):
                r1 = _rms(H1, rows, bmask, HID, KCH, eps1)
                rn = it * BN + tl.arange(0, BN)
                acg = tl.zeros([16, BN], tl.float32)
                acu = tl.zeros([16, BN], tl.float32)
                for k0 in tl.static_range(0, HID, KCH):
                    rk = k0 + tl.arange(0, KCH)
                    hv = tl.load(H1 + rows[:, None] * HID + rk[None, :], mask=bmask[:, None], other=0.0,
                                 cache_modifier=".cg").to(tl.float32)
                    x = (tl.load(WN1 + rk).to(tl.float32)[None, :] * (hv * r1[:, None]).to(DT).to(tl.float32)).to(DT)
                    wg = tl.load(WGU + rn[:, None] * HID + rk[None, :])
                    wu = tl.load(WGU + (INTER + rn)[:, None] * HID + rk[None, :])
                    acg = tl.dot(x, tl.trans(wg), acg, input_precision=PREC)
                    acu = tl.dot(x, tl.trans(wu), acu, input_precision=PREC)
                if HAS_BGU:
                    acg += tl.load(BGU + rn).to(tl.float32)[None, :]
                    acu += tl.load(BGU + INTER + rn).to(tl.float32)[None, :]
                g = acg.to(DT).to(tl.float32)
                sg = (g * tl.sigmoid(g)).to(DT).to(tl.float32)
                act = (sg * acu.to(DT).to(tl.float32)).to(DT)
                tl.store(ACT + rows[:, None] * INTER + rn[None, :], act, mask=bmask[:, None])
            if SYNC:
                _grid_sync(CNT, NP)
        # ---- phase 3: h2 = h1 + down(act)
        if PHASES & 8:
            for it in range(pid, HID // BN, NP):
                rn = it * BN + tl.arange(0, BN)
                acc = tl.zeros([16, BN], tl.float32)
                for k0 in tl.static_range(0, INTER, KCI):
                    rk = k0 + tl.arange(0, KCI)
                    a = tl.load(ACT + rows[:, None] * INTER + rk[None, :], mask=bmask[:, None], other=0.0,
                                cache_modifier=".cg")
                    w = tl.load(WD + rn[:, None] * INTER + rk[None, :])
                    acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
                if HAS_BD:
                    acc += tl.load(BD + rn).to(tl.float32)[None, :]
                hv = tl.load(H1 + rows[:, None] * HID + rn[None, :], mask=bmask[:, None], other=0.0,
                             cache_modifier=".cg")
                h2 = (hv.to(tl.float32) + acc.to(DT).to(tl.float32)).to(DT)
                tl.store(H2 + rows[:, None] * HID + rn[None, :], h2, mask=bmask[:, None])
            if SYNC and HAS_NEXT:
                _grid_sync(CNT, NP)
        # ---- phase 4: the next layer's input norm
        if PHASES & 16:
            if HAS_NEXT:
                for it in range(pid, HID // BN, NP):
                    r2 = _rms(H2, rows, bmask, HID, KCH, eps2)
                    rn = it * BN + tl.arange(0, BN)
                    hv = tl.load(H2 + rows[:, None] * HID + rn[None, :], mask=bmask[:, None], other=0.0,
                                 cache_modifier=".cg").to(tl.float32)
                    xn = (tl.load(WN2 + rn).to(tl.float32)[None, :] * (hv * r2[:, None]).to(DT).to(tl.float32))
                    tl.store(XN + rows[:, None] * HID + rn[None, :], xn.to(DT), mask=bmask[:, None])

    globals().update(_grid_sync=_grid_sync, _prefetch=_prefetch, _rms=_rms)  # the interpreter's name lookup
    return {"tail": _tail}


def _build() -> dict:
    """The kernel, built on first use (see :func:`headscope.hybrid.splitk.build_kernels`)."""
    return splitk.build_kernels(_kernels, _make)


def _chunk(k: int) -> int:
    """The reduction chunk of a K-long row: the largest power of two ≤ 128 that divides k (0: none ≥ 16)."""
    c = 128
    while c >= 16 and k % c:
        c //= 2
    return c if c >= 16 else 0


def applies(rows: int, hidden: int, k_o: int, inter: int, device: torch.device) -> bool:
    """Whether :func:`layer_tail` runs for these sizes here: triton, CUDA (or Triton's interpreter), ≤ 16 rows, and
    ``hidden``, ``inter`` multiples of :data:`BN` with every reduction length (``k_o`` = o_proj's input, hidden,
    inter) a multiple of 16."""
    if not splitk.triton_available() or rows > MAX_ROWS:
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return hidden % BN == 0 and inter % BN == 0 and all(_chunk(k) for k in (k_o, hidden, inter))


def _counter(dev: torch.device, n_programs: int) -> Tensor:
    """The grid barrier's counter of launches of ``n_programs`` programs on ``dev`` (one int64 that only grows; one
    per grid size, so that every barrier's generation is count // n_programs)."""
    key = (str(dev), n_programs)
    c = _counters.get(key)
    if c is None:
        c = _counters[key] = torch.zeros(1, dtype=torch.int64, device=dev)
    return c


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
    attn: Optional[tuple] = None,
    prefetch: Optional[Tensor] = None,
) -> tuple[Float[Tensor, "batch hidden"], Optional[Float[Tensor, "batch hidden"]]]:
    """A decode step's layer tail of a Llama-family layer (SiLU-gated MLP, RMSNorms) in one launch (see the module
    docstring): ``h1 = h + o_proj(y)``, ``h2 = h1 + down(silu(gate(x)) · up(x))`` with ``x = RMSNorm(h1)``,
    and the next layer's input ``RMSNorm'(h2)``.

    Args:
        y: o_proj's input [batch ≤ 16, k_o], contiguous. With ``attn`` its FA heads' columns are written by the
            launch's first phase (``attn``'s output buffer must be a view of y).
        h: the residual stream before the layer [batch, hidden], contiguous, in y's dtype.
        w_o, b_o: o_proj's weight [hidden, k_o] and bias (or None).
        w_post, eps_post: the post-attention RMSNorm's weight [hidden] and ε.
        w_gu, b_gu: the gate and up projections' weights stacked [gate; up] = [2·inter, hidden], biases likewise
            (or None).
        w_down, b_down: the down projection's weight [hidden, inter] and bias (or None).
        w_next, eps_next: the next layer's input RMSNorm (None after the last layer).
        attn: ``(sp, gate, gamma, eps)``: the split-K partials of :func:`~headscope.hybrid.splitk.setup` (after the
            partial kernel ran) and the output fusion of :func:`~headscope.hybrid.splitk.combine`; None: y is
            complete.
        prefetch: a contiguous tensor to bring into L2 during the launch (e.g. the next layer's input projection,
            read by the next kernel), or None.

    Returns:
        (h2 [batch, hidden], x_next [batch, hidden] or None), new tensors in h's dtype.

    Raises:
        ValueError: sizes or dtypes that disagree, or sizes where :func:`applies` is False (use
            :func:`layer_tail_torch`); CPU tensors outside ``TRITON_INTERPRET=1``; bf16 in the interpreter (its bf16
            ``tl.dot`` is wrong in Triton 3.9).
        ImportError: triton is not installed.

    Source: the modules' forward (Llama's decoder layer after attention); flash-decoding's combination (Dao et al.,
    2023) with HydraHead eq. 13–14; a grid-wide barrier as in CUDA cooperative groups.
    """
    B, k_o = y.shape
    hid = h.shape[1]
    inter = w_down.shape[1]
    if (h.shape[0] != B or w_o.shape != (hid, k_o) or w_gu.shape != (2 * inter, hid) or w_down.shape != (hid, inter)
            or w_post.shape != (hid,) or (w_next is not None and w_next.shape != (hid,))):
        raise ValueError(f"layer_tail: sizes disagree: y {tuple(y.shape)}, h {tuple(h.shape)}, w_o {tuple(w_o.shape)}, "
                         f"w_gu {tuple(w_gu.shape)}, w_down {tuple(w_down.shape)}, w_post {tuple(w_post.shape)}")
    for name, t in (("y", y), ("h", h), ("w_o", w_o), ("w_gu", w_gu), ("w_down", w_down)):
        if t.dtype != h.dtype or not t.is_contiguous():
            raise ValueError(f"layer_tail: {name} must be contiguous in h's dtype {h.dtype}")
    splitk.require_kernel("layer_tail", "layer_tail_torch", h)
    if not applies(B, hid, k_o, inter, h.device):
        raise ValueError(f"layer_tail does not apply to {B} rows, hidden {hid}, o_proj input {k_o}, MLP {inter} "
                         f"(≤ {MAX_ROWS} rows, multiples of {BN} and 16); use layer_tail_torch")
    interp = not h.is_cuda
    if interp and h.dtype == torch.bfloat16:
        raise ValueError("Triton's CPU interpreter computes bf16 tl.dot wrongly (Triton 3.9): use fp32/fp16 tensors "
                         "there, or layer_tail_torch")
    h1, h2 = torch.empty_like(h), torch.empty_like(h)
    act = h.new_empty(B, inter)
    xn = torch.empty_like(h) if w_next is not None else None
    if attn is not None:
        sp, gate, gamma, out_eps = attn
        o = sp.o
        gm = gamma.float().contiguous() if gamma is not None else sp.acc
        gt = gate if gate is not None else o
        comb = (sp.acc, sp.ml, o, gt, gm, o.stride(0), o.stride(1), gt.stride(0), gt.stride(1), float(out_eps))
        cmeta = dict(NCOMB=sp.B * sp.Hk * sp.G, HK=sp.Hk, G=sp.G, D=sp.d, NS=sp.NS,
                     SC=max(2, min(1 << max(0, (sp.NS - 1).bit_length()), max(2, 8192 // sp.d))),
                     HAS_GATE=gate is not None, HAS_NORM=gamma is not None)
    else:
        comb = (y, y, y, y, y, 0, 0, 0, 0, 0.0)
        cmeta = dict(NCOMB=0, HK=1, G=1, D=16, NS=1, SC=2, HAS_GATE=False, HAS_NORM=False)
    line = 128 // h.element_size()
    pf = prefetch is not None and PREFETCH and not interp
    xlines = prefetch.numel() * prefetch.element_size() // 128 if pf else 0
    n_items = max(cmeta["NCOMB"], hid // BN, inter // BN)
    NP = n_items if interp else min(n_items, splitk._sm_count(h.device))
    dummy = h1
    args = (*comb, y, w_o, b_o if b_o is not None else dummy, h, h1, w_post, float(eps_post), w_gu,
            b_gu if b_gu is not None else dummy, act, w_down, b_down if b_down is not None else dummy, h2,
            w_next if w_next is not None else w_post, float(eps_next), xn if xn is not None else dummy,
            _counter(h.device, NP), prefetch if pf else dummy, xlines, B)

    def p2(n: int) -> int:
        return 1 << max(0, (max(1, n) - 1).bit_length())

    meta = dict(HID=hid, KO=k_o, INTER=inter, **cmeta, BN=BN, KCO=_chunk(k_o), KCH=_chunk(hid), KCI=_chunk(inter),
                HAS_BO=b_o is not None, HAS_BGU=b_gu is not None, HAS_BD=b_down is not None,
                HAS_NEXT=w_next is not None, PREC="ieee" if h.dtype == torch.float32 else "tf32", NP=NP,
                LINE=line, NLO=p2(BN * k_o // line), NLG=p2(BN * hid // line), NLD=p2(BN * inter // line),
                NLX=p2(-(-xlines // NP)) if pf else 0)
    kern = _build()["tail"]
    with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
        if interp:  # programs run one after another: one launch per phase
            for ph in range(5):
                kern[(NP,)](*args, **meta, PHASES=1 << ph, SYNC=False, PREFETCH=False, num_warps=NUM_WARPS)
        else:
            kern[(NP,)](*args, **meta, PHASES=31, SYNC=True, PREFETCH=PREFETCH, num_warps=NUM_WARPS)
    return h2, xn


def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm: ``w · (x / sqrt(mean(x²) + eps)).to(x.dtype)`` (statistics in fp32)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def layer_tail_torch(
    y: Tensor, h: Tensor, w_o: Tensor, b_o: Optional[Tensor], w_post: Tensor, eps_post: float, w_gu: Tensor,
    b_gu: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], w_next: Optional[Tensor] = None,
    eps_next: float = 0.0,
) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`layer_tail`'s computation in PyTorch for a complete ``y`` (no ``attn``): the reference, any device."""
    h1 = h + F.linear(y, w_o, b_o)
    g, u = F.linear(_rms_norm(h1, w_post, eps_post), w_gu, b_gu).chunk(2, dim=-1)
    h2 = h1 + F.linear(F.silu(g) * u, w_down, b_down)
    return h2, (_rms_norm(h2, w_next, eps_next) if w_next is not None else None)
