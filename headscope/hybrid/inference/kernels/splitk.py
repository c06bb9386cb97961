"""Split-K decode attention of the FA heads (flash-decoding): one query token per sequence over a long K/V cache,
the valid length read from device memory (one CUDA graph serves every position). :func:`decode_attention` — the
Triton kernels; :func:`decode_attention_torch` — the PyTorch reference and fallback. Design:
docs/hybrid.md, "How the kernels work: Split-K decode attention".
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ...gdn_kernels import module_found
from ...shapes import Float

def triton_available() -> bool:
    """True when ``triton`` can be imported (searched once per process)."""
    return module_found("triton")


def kernel_applies(d: int, device: torch.device) -> bool:
    """Whether headscope's decode-step Triton kernels run here: triton importable, CUDA (or Triton's
    interpreter, ``TRITON_INTERPRET=1``), head_dim a power of two ≥ 16."""
    return (d >= 16 and not d & (d - 1) and triton_available()
            and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


def require_kernel(name: str, reference: str, t: Tensor, plural: bool = False) -> None:
    """Refuse a launch of the Triton kernel(s) of ``name`` where they cannot run, naming the PyTorch ``reference``.

    Raises:
        ImportError: triton is not installed.
        ValueError: ``t`` is a CPU tensor outside Triton's interpreter (``TRITON_INTERPRET=1``).
    """
    if not triton_available():
        raise ImportError(f"{name} needs triton (pip install triton); or use {reference}")
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name} runs {'Triton kernels' if plural else 'a Triton kernel'} on CUDA tensors, or on CPU "
                         "tensors in Triton's interpreter (set TRITON_INTERPRET=1 before Python starts); else use "
                         f"{reference}")


def _check(q: Tensor, k: Tensor, v: Tensor, length: Optional[Tensor], kv_index: Optional[Tensor] = None) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"want q [batch, q_head, d] and k, v [batch, kv_head, slots, d]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, d = q.shape
    Bk, Hk, L, dk = k.shape
    if kv_index is not None:
        if kv_index.shape != (Hq,) or kv_index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"kv_index must be an integer tensor of shape [q_head={Hq}]; got {kv_index.dtype} "
                             f"{tuple(kv_index.shape)}")
    elif Hq % Hk:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hk} KV heads; pass kv_index (the KV head of each "
                         "query head)")
    if Bk != B or dk != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree in batch or head_dim")
    if length is not None and (length.dim() != 1 or length.shape[0] not in (1, B) or length.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"length must be an integer tensor of shape [1] or [batch]; got {length.dtype} {tuple(length.shape)}")
    return B, Hq, Hk, L, d


def decode_attention_torch(
    q: Float[Tensor, "batch q_head d"],
    k: Float[Tensor, "batch kv_head slots d"],
    v: Float[Tensor, "batch kv_head slots d"],
    length: Optional[Tensor],
    scale: float,
    kv_index: Optional[Tensor] = None,
) -> Float[Tensor, "batch q_head d"]:
    """softmax(scale · q kᵀ) v over the first ``length`` slots, in fp32 (output in q's dtype).

    Args:
        q: one query per sequence and head.
        k, v: cache buffers (head-major; any strides).
        length: Long[1] or Long[batch] valid slots (≥ 1), on k's device; None: every slot.
        scale: logit scale.
        kv_index: Long[q_head], the KV head each query head reads; None: GQA order (i // (q_head / kv_head)).

    Raises:
        ValueError: shapes that disagree.
    """
    B, Hq, Hk, L, d = _check(q, k, v, length, kv_index)
    if kv_index is not None:
        k, v, Hk = k.index_select(1, kv_index), v.index_select(1, kv_index), Hq
    G = Hq // Hk
    qf = q.float().view(B, Hk, G, d)
    s = torch.einsum("bhgd,bhld->bhgl", qf, k.float()) * scale
    if length is not None:
        keep = torch.arange(L, device=k.device)[None, :] < length.view(-1, 1)  # [1 or B, L]
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgl,bhld->bhgd", s.softmax(-1), v.float())
    return o.reshape(B, Hq, d).to(q.dtype)


def n_splits_for(batch_groups: int, slots: int, block: int = 64, sms: int = 132, min_split: Optional[int] = None,
                 blocks_per_sm: Optional[int] = None, reserved: int = 0) -> int:
    """Splits of the time axis: about ``blocks_per_sm`` thread blocks per SM (default :data:`BLOCKS_PER_SM`) over
    all (sequence, KV group) pairs, less ``reserved`` blocks of the same launch doing other work (the GDN heads of
    ``one_launch.py``'s one-launch step), each split at least ``min_split`` slots (default :data:`MIN_SPLIT`; a whole
    number of ``block``-slot tiles), at most :data:`MAX_SPLITS`."""
    per_sm = BLOCKS_PER_SM if blocks_per_sm is None else blocks_per_sm
    want = max(1, (per_sm * sms - reserved + batch_groups - 1) // batch_groups)
    most = max(1, slots // max(MIN_SPLIT if min_split is None else min_split, block))
    return max(1, min(want, most, MAX_SPLITS))


MAX_SPLITS = 256  # the combine kernel holds every split's partials of a column block in registers
# Launch settings of the partial kernel (defaults of decode_attention; Triton's own num_warps / num_stages on
# CUDA): slots per tile, warps per program, software-pipelining stages, thread blocks per SM that the split
# count aims for, and the fewest slots per split. ``benchmarks/bench_splitk.py`` sweeps them against SDPA and
# the bandwidth roof.
BLOCK = 64  # at most; fewer where a K or V tile would pass TILE_BYTES (tile_slots)
TILE_BYTES = 32 << 10  # fp32 at d 256: 32 slots (64 asked 282,688 B of shared memory, H100/H200 have 232,448)
NUM_WARPS = 4
NUM_STAGES = 3
BLOCKS_PER_SM = 4  # was 2; with 4 the all-FA teacher's decode step was 6-8 % faster on the H200, the hybrid's equal (profile_decode.py)
MIN_SPLIT = 256
_sms: dict = {}
_counters: dict = {}
_LAUNCH = ("block", "num_warps", "num_stages", "blocks_per_sm", "min_split")


def tile_slots(d: int, itemsize: int) -> int:
    """Slots per tile by default: :data:`BLOCK`, fewer (≥ 16) where a K or V tile's bytes would pass :data:`TILE_BYTES`
    (the pipelined tiles set the kernels' shared memory: tests/test_triton_hopper_smem.py)."""
    return max(16, min(BLOCK, TILE_BYTES // (d * itemsize)))


def launch_defaults() -> dict:
    """The split-K launch settings in force: ``{block, num_warps, num_stages, blocks_per_sm, min_split}``."""
    return {k: globals()[k.upper()] for k in _LAUNCH}


def _sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on the H100/H200; 132 off CUDA), read once."""
    if dev.type != "cuda":
        return 132
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _sms:
        _sms[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _sms[i]


_kernels: dict = {}


def counters(key: tuple, n: int, dev: torch.device) -> Tensor:
    """Arrival counters kept across launches (``n`` int64 zeros on ``dev``, made once per key): they only grow, so a
    launch finds its start from them and none needs a reset (a CUDA graph replays the same buffers); int64 never wraps
    (int32 would after ~12 hours of B = 16 decoding). Keys (the device first after the kind): ("grid", device,
    programs) — ``layer_tail``'s grid barrier, +4 · programs per launch; ("tiles", device, tiles, pieces) — its phase
    3's per-tile counters, +pieces per launch; ("splits", device, rows, splits) — ``one_launch.py``'s in-launch combination,
    +splits per (sequence, KV head) row per launch. Launches that share a counter must not run concurrently (one
    stream)."""
    c = _counters.get(key)
    if c is None:
        c = _counters[key] = torch.zeros(n, dtype=torch.int64, device=dev)
    return c


def build_kernels(cache: dict, make: Callable[[Any, Any], dict]) -> dict:
    """A module's Triton kernels, ``make(triton, triton.language)`` → {name: kernel}, kept in ``cache``: built on
    first use (importing triton is slow and optional) and again when ``TRITON_INTERPRET`` changed (the tests run
    them through Triton's CPU interpreter). Shared by every kernel module here."""
    mode = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if cache.get("interpret") is mode:
        return cache
    cache.clear()
    import triton
    import triton.language as tl

    cache.update(make(triton, tl), interpret=mode)
    return cache


def _make(triton, tl) -> dict:
    """The Triton kernels: the per-split partials and their exact combination (plain or with the output fusion).
    ``attend`` and ``tile`` are the partial's body and its per-tile update, shared with ``one_launch.py``'s one-launch
    decode step (a Triton function called from another kernel is inlined there)."""
    @triton.jit
    def _glue(x, xr, sign, c, s, w, wr, qk_eps, D: tl.constexpr, QKN: tl.constexpr, ROPE: tl.constexpr):
        """The FA heads' q/k glue on rows [R, D] (fp32): x, and xr = x at the rotate-half columns (j + D/2 mod D),
        sign = −1 on the first half; QK-RMSNorm (weights w, and w at the rotate-half columns wr), then half-split
        RoPE (c, s: [1, D])."""
        if QKN:
            rr = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + qk_eps)
            x = x * rr[:, None] * w
            xr = xr * rr[:, None] * wr
        if ROPE:
            x = x * c + sign * xr * s
        return x

    @triton.jit
    def _tile(q, kt, vt, tmask, m, l_, acc, scale, PREC: tl.constexpr):
        """One tile of the online softmax: scores q·kᵀ of the tile's slots (``tmask``: valid), (m, l, acc) updated."""
        sc = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale  # [GP, BN] fp32
        sc = tl.where(tmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l_ = l_ * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        return m_new, l_, acc

    @triton.jit
    def _own_slot(q, K, V, KN, VN, KNW, b, hk, n, t_own, end, rd, rr, sign, c, sn, w, wr, qk_eps, scale, m, l_, acc,
                  skb, skh, skl, svb, svh, svl, sknb, sknh, svnb, svnh, D: tl.constexpr, BN: tl.constexpr,
                  QKN: tl.constexpr, ROPE: tl.constexpr, PREC: tl.constexpr):
        """The tile of :func:`_attend`'s split that holds the token's slot n − 1 (PREP): the token's key prepared with
        the glue, key and value written into the cache and used in place of the slot's old contents -> (m, l, acc)."""
        ro = t_own + tl.arange(0, BN)
        omask = ro < end
        new = (ro == n - 1)[:, None]
        kp = K + b * skb + hk * skh + ro[:, None] * skl + rd[None, :]
        vp = V + b * svb + hk * svh + ro[:, None] * svl + rd[None, :]
        keep = (omask & (ro != n - 1))[:, None]  # the token's row is not read (another program may write it)
        ko = tl.load(kp, mask=keep, other=0.0)
        vo = tl.load(vp, mask=keep, other=0.0)
        # the token's key with the glue (every row of the tile the same vector: the glue's [rows, D] form)
        zr = tl.zeros([BN, D], tl.int32)
        kr = KN + b * sknb + hk * sknh
        xk = tl.load(kr + rd[None, :] + zr).to(tl.float32)
        xkr = tl.load(kr + rr[None, :] + zr).to(tl.float32)
        wk = w
        wkr = wr
        if QKN:
            wk = tl.load(KNW + rd)[None, :]
            wkr = tl.load(KNW + rr)[None, :]
        kn = _glue(xk, xkr, sign, c, sn, wk, wkr, qk_eps, D, QKN, ROPE).to(K.dtype.element_ty)
        vn = tl.load(VN + b * svnb + hk * svnh + rd[None, :] + zr).to(V.dtype.element_ty)
        tl.store(kp, kn, mask=new & omask[:, None])
        tl.store(vp, vn, mask=new & omask[:, None])
        ko = tl.where(new, kn, ko)
        vo = tl.where(new, vn, vo)
        return _tile(q, ko, vo, omask, m, l_, acc, scale, PREC)

    @triton.jit
    def _attend(bh, s, Q, K, V, LEN, KVI, ACC, ML, scale, L, split_len,
                sqb, sqh, skb, skh, skl, svb, svh, svl, len_stride,
                KN, VN, COS, SIN, QN, KNW, POS, qk_eps, inv_log_a, nope_a, sknb, sknh, svnb, svnh, scb, ssb, pos_stride,
                HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                NS: tl.constexpr, HAS_LEN: tl.constexpr, HAS_KVI: tl.constexpr, PREC: tl.constexpr,
                PREP: tl.constexpr, ROPE: tl.constexpr, QKN: tl.constexpr, NOPE: tl.constexpr):
        """Split ``s`` of (sequence, KV head) ``bh``: the partial (acc, m, l) of its slots into ACC / ML. With PREP,
        Q holds the raw queries and KN / VN the token's raw key and value: the program applies the glue to its
        queries itself, and the program whose split holds the token's slot (length − 1) prepares the key, writes
        key and value into the cache and uses them in place of the slot's old contents."""
        b = (bh // HK).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2^31 elements
        h = bh % HK  # a KV head (G query heads each), or with KVI a query head reading KV head KVI[h]
        hk = h.to(tl.int64)
        if HAS_KVI:
            hk = tl.load(KVI + h).to(tl.int64)
        n = L
        if HAS_LEN:
            n = tl.minimum(tl.load(LEN + b * len_stride).to(tl.int32), L)
        start = s * split_len
        end = tl.minimum(start + split_len, n)
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        gmask = rg < G
        qp = Q + b * sqb + (h * G + rg[:, None]) * sqh
        if PREP:  # the query glue (as fa_prep's kernel), rounded to the cache's dtype as that kernel stores it
            H2: tl.constexpr = D // 2
            rr = (rd + H2) % D
            sign = tl.where(rd < H2, -1.0, 1.0)[None, :]
            c = tl.zeros([1, D], tl.float32)
            sn = tl.zeros([1, D], tl.float32)
            w = tl.zeros([1, D], tl.float32)
            wr = tl.zeros([1, D], tl.float32)
            if ROPE:
                c = tl.load(COS + b * scb + rd).to(tl.float32)[None, :]
                sn = tl.load(SIN + b * ssb + rd).to(tl.float32)[None, :]
            if QKN:
                w = tl.load(QN + rd)[None, :]
                wr = tl.load(QN + rr)[None, :]
            x = tl.load(qp + rd[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
            xr = tl.load(qp + rr[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
            x = _glue(x, xr, sign, c, sn, w, wr, qk_eps, D, QKN, ROPE)
            x = tl.where(gmask[:, None], x, 0.0)  # padded rows: 0, not the QK-norm's 0 · inf
            if NOPE:  # HypeNet's query scale s_t = log(t + a) / log(a)
                x = x * (tl.log(tl.load(POS + b * pos_stride).to(tl.float32) + nope_a) * inv_log_a)
            q = x.to(Q.dtype.element_ty)
        else:
            q = tl.load(qp + rd[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l_ = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        stop = end
        if PREP:  # the split that holds the token's slot n − 1 does that slot's tile after the loop
            own = (start <= n - 1) & (n - 1 < end)
            t_own = start + ((n - 1 - start) // BN) * BN
            stop = tl.where(own, t_own, end)
        for t0 in range(start, stop, BN):
            rt = t0 + tl.arange(0, BN)
            tmask = rt < end
            kt = tl.load(K + b * skb + hk * skh + rt[:, None] * skl + rd[None, :], mask=tmask[:, None], other=0.0)
            vt = tl.load(V + b * svb + hk * svh + rt[:, None] * svl + rd[None, :], mask=tmask[:, None], other=0.0)
            m, l_, acc = _tile(q, kt, vt, tmask, m, l_, acc, scale, PREC)
        if PREP:
            if own:  # (names of its own: a runtime branch may not change the type of a name from outside it)
                m, l_, acc = _own_slot(q, K, V, KN, VN, KNW, b, hk, n, t_own, end, rd, rr, sign, c, sn, w, wr, qk_eps,
                                       scale, m, l_, acc, skb, skh, skl, svb, svh, svl, sknb, sknh, svnb, svnh, D, BN,
                                       QKN, ROPE, PREC)
        base = (bh * NS + s) * G
        tl.store(ACC + (base + rg[:, None]) * D + rd[None, :], acc, mask=gmask[:, None])
        tl.store(ML + (base + rg) * 2, m, mask=gmask)
        tl.store(ML + (base + rg) * 2 + 1, l_, mask=gmask)

    # a kernel finds the Triton functions it calls among its module's globals (the interpreter does not look in
    # closures): the bodies are published there when the kernels are built
    globals().update(_glue=_glue, _tile=_tile, _own_slot=_own_slot, _attend=_attend, tl=tl)  # the interpreter wants tl there too

    @triton.jit
    def _partial(Q, K, V, LEN, KVI, ACC, ML, scale, L, split_len,
                 sqb, sqh, skb, skh, skl, svb, svh, svl, len_stride,
                 HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                 NS: tl.constexpr, HAS_LEN: tl.constexpr, HAS_KVI: tl.constexpr, PREC: tl.constexpr):
        _attend(tl.program_id(0), tl.program_id(1), Q, K, V, LEN, KVI, ACC, ML, scale, L, split_len,
                sqb, sqh, skb, skh, skl, svb, svh, svl, len_stride,
                Q, Q, Q, Q, ML, ML, LEN, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0,
                HK, G, GP, D, BN, NS, HAS_LEN, HAS_KVI, PREC, False, False, False, False)

    @triton.jit
    def _combine(ACC, ML, O, sob, soh, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
                 SP: tl.constexpr, BD: tl.constexpr):
        pid = tl.program_id(0)  # (batch, kv head, group member) x a BD-column block of d: one pass, all splits
        g = pid % G
        bh = pid // G
        b = bh // HK
        h = bh % HK
        rd = tl.program_id(1) * BD + tl.arange(0, BD)
        rs = tl.arange(0, SP)
        smask = rs < NS
        ms = tl.load(ML + ((bh * NS + rs) * G + g) * 2, mask=smask, other=float("-inf"))
        ls = tl.load(ML + ((bh * NS + rs) * G + g) * 2 + 1, mask=smask, other=0.0)
        M = tl.max(ms, 0)
        w = tl.exp(ms - tl.where(M == float("-inf"), 0.0, M))  # empty splits: exp(-inf) = 0
        a = tl.load(ACC + ((bh * NS + rs[:, None]) * G + g) * D + rd[None, :], mask=smask[:, None], other=0.0)
        o = tl.sum(a * w[:, None], 0) / tl.sum(w * ls, 0)
        tl.store(O + b * sob + (h * G + g) * soh + rd, o.to(O.dtype.element_ty))

    @triton.jit
    def _combine_row(pid, ACC, ML, O, GATE, GAMMA, sob, soh, sgb, sgh, eps, HK: tl.constexpr, G: tl.constexpr,
                     D: tl.constexpr, NS: tl.constexpr, SC: tl.constexpr, HAS_GATE: tl.constexpr,
                     HAS_NORM: tl.constexpr):
        # one (batch, kv head, group member): a whole head row; the splits in chunks of SC (all at once up to 8192
        # partial values per program: one pass at decode-sized split counts). Shared with layer_tail.py's layer tail.
        g = pid % G
        bh = pid // G
        b = (bh // HK).to(tl.int64)
        h = bh % HK
        qh = h * G + g
        rd = tl.arange(0, D)
        if NS <= SC:  # one pass: every load issued at once
            rs = tl.arange(0, SC)
            sm = rs < NS
            ms = tl.load(ML + ((bh * NS + rs) * G + g) * 2, mask=sm, other=float("-inf"))
            ls = tl.load(ML + ((bh * NS + rs) * G + g) * 2 + 1, mask=sm, other=0.0)
            a = tl.load(ACC + ((bh * NS + rs[:, None]) * G + g) * D + rd[None, :], mask=sm[:, None], other=0.0)
            M = tl.max(ms, 0)
            w = tl.exp(ms - tl.where(M == float("-inf"), 0.0, M))
            num = tl.sum(a * w[:, None], 0)
            den = w * ls
        else:
            mv = tl.full([SC], float("-inf"), tl.float32)  # two passes over chunks of SC splits
            for s0 in range(0, NS, SC):
                rs = s0 + tl.arange(0, SC)
                mv = tl.maximum(mv, tl.load(ML + ((bh * NS + rs) * G + g) * 2, mask=rs < NS, other=float("-inf")))
            M = tl.max(mv, 0)
            M = tl.where(M == float("-inf"), 0.0, M)
            num = tl.zeros([D], tl.float32)
            den = tl.zeros([SC], tl.float32)
            for s0 in range(0, NS, SC):
                rs = s0 + tl.arange(0, SC)
                sm = rs < NS
                w = tl.exp(tl.load(ML + ((bh * NS + rs) * G + g) * 2, mask=sm, other=float("-inf")) - M)
                den += w * tl.load(ML + ((bh * NS + rs) * G + g) * 2 + 1, mask=sm, other=0.0)
                a = tl.load(ACC + ((bh * NS + rs[:, None]) * G + g) * D + rd[None, :], mask=sm[:, None], other=0.0)
                num += tl.sum(a * w[:, None], 0)
        DT = O.dtype.element_ty
        o = (num / tl.sum(den, 0)).to(DT).to(tl.float32)  # the attention output as the unfused path rounds it
        if HAS_GATE:  # the FA output gate σ(W_g x + b_g)
            o = o * tl.sigmoid(tl.load(GATE + b * sgb + qh * sgh + rd).to(tl.float32))
        if HAS_NORM:  # eq. 13–14: per-head RMSNorm, then γ_h
            o = o / tl.sqrt(tl.sum(o * o, 0) / D + eps) * tl.load(GAMMA + qh * D + rd)
        tl.store(O + b * sob + qh * soh + rd, o.to(DT))

    globals()["_combine_row"] = _combine_row

    @triton.jit
    def _combine_out(ACC, ML, O, GATE, GAMMA, sob, soh, sgb, sgh, eps, HK: tl.constexpr, G: tl.constexpr,
                     D: tl.constexpr, NS: tl.constexpr, SC: tl.constexpr, HAS_GATE: tl.constexpr,
                     HAS_NORM: tl.constexpr):
        _combine_row(tl.program_id(0), ACC, ML, O, GATE, GAMMA, sob, soh, sgb, sgh, eps, HK, G, D, NS, SC, HAS_GATE,
                     HAS_NORM)

    return {"partial": _partial, "combine": _combine, "combine_out": _combine_out, "attend": _attend,
            "combine_row": _combine_row}


def _build() -> dict:
    """The kernels, built on first use (see :func:`build_kernels`)."""
    return build_kernels(_kernels, _make)


def decode_attention(
    q: Float[Tensor, "batch q_head d"],
    k: Float[Tensor, "batch kv_head slots d"],
    v: Float[Tensor, "batch kv_head slots d"],
    length: Optional[Tensor],
    scale: float,
    n_splits: Optional[int] = None,
    block: Optional[int] = None,
    kv_index: Optional[Tensor] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    out: Optional[Tensor] = None,
    gate: Optional[Float[Tensor, "batch q_head d"]] = None,
    gamma: Optional[Float[Tensor, "q_head d"]] = None,
    eps: float = 1e-6,
) -> Float[Tensor, "batch q_head d"]:
    """Split-K (flash-decoding) softmax attention of one query token per sequence, GQA-native (query head i reads KV
    head i // r), in two Triton kernels (per-split partials, then the exact combination); fp32 accumulation, output
    in q's dtype.

    Args:
        q: [batch, q_head, d] (unit stride in d); k, v: [batch, kv_head, slots, d] cache buffers (views are fine).
        length: Long/Int[1] or [batch] valid slots on the device (no host sync, CUDA-graph safe); None: all slots.
        scale: logit scale; n_splits: pieces of the time axis (default :func:`n_splits_for`); block: slots per tile,
            a power of two ≥ 16; num_warps, num_stages: the partial kernel's launch settings.
        kv_index: Long[q_head], the KV head each query head reads (heads spread unevenly over the kept groups: one
            program per query head, no K/V copy); None: GQA order.
        out: the output buffer ([batch, q_head, d], q's dtype, unit stride in d); None: a new tensor.
        gate, gamma, eps: the hybrid's output fusion in the combination: o ← o · σ(gate), then γ_h · o / RMS(o)
            (eq. 13–14, ``gamma`` fp32 [q_head, d]), after rounding o to q's dtype as the unfused path does.

    Raises:
        ValueError: shapes that disagree, d or block not a power of two ≥ 16, CPU tensors outside
            ``TRITON_INTERPRET=1``, bf16 in the interpreter (its ``tl.dot`` is wrong in Triton 3.9), a wrong ``out``
            / ``gate`` / ``gamma`` (each message names :func:`decode_attention_torch`).
        ImportError: triton is not installed.

    Source: flash-decoding (Dao et al., 2023), FlashAttention's online softmax (Dao et al., 2022), eq. 13–14.
    """
    sp = setup(q, k, v, length, kv_index, block, n_splits, out, gate, gamma)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _build()["partial"][(sp.B * sp.Hk, sp.NS)](
            *partial_args(sp, q, k, v, scale), **sp.meta,
            num_warps=NUM_WARPS if num_warps is None else num_warps,
            num_stages=NUM_STAGES if num_stages is None else num_stages)
    return combine(sp, gate, gamma, eps)


def setup(q: Tensor, k: Tensor, v: Tensor, length: Optional[Tensor], kv_index: Optional[Tensor], block: Optional[int],
           n_splits: Optional[int], out: Optional[Tensor], gate: Optional[Tensor], gamma: Optional[Tensor],
           reserved: int = 0) -> Any:
    """The checks and buffers of a split-K launch (shared with ``one_launch.py``): shapes, the split count (``reserved``:
    programs of the same launch that are not splits), the partials' buffers, the output; the partial kernel's
    compile-time settings in ``.meta``. Raises the ValueErrors of :func:`decode_attention`."""
    B, Hq, Hk, L, d = _check(q, k, v, length, kv_index)
    if d < 16 or d & (d - 1):
        raise ValueError(f"split-K decode needs a head_dim that is a power of two ≥ 16, got {d}; "
                         "use decode_attention_torch")
    require_kernel("decode_attention", "decode_attention_torch", q, plural=True)
    if not q.is_cuda and q.dtype == torch.bfloat16:
        raise ValueError("Triton's CPU interpreter computes bf16 tl.dot wrongly (Triton 3.9): use fp32/fp16 "
                         "tensors there, or decode_attention_torch")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k and v need unit stride in their last dimension")
    block = tile_slots(d, q.element_size()) if block is None else block
    if block < 16 or block & (block - 1):
        raise ValueError(f"block (slots per tile) must be a power of two ≥ 16, got {block}")
    Hk = Hq if kv_index is not None else Hk  # with kv_index: one program (per split) per query head
    G = Hq // Hk
    NS = n_splits or n_splits_for(B * Hk, L, block, sms=_sm_count(q.device), reserved=reserved)
    split_len = -(-L // NS)
    split_len = -(-split_len // block) * block
    if out is not None and (out.shape != (B, Hq, d) or out.dtype != q.dtype or out.stride(-1) != 1
                            or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor on {q.device} of shape {(B, Hq, d)} with unit stride in d; "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if gate is not None and (gate.shape != (B, Hq, d) or gate.stride(-1) != 1):
        raise ValueError(f"gate must have shape {(B, Hq, d)} and unit stride in d; got {tuple(gate.shape)}")
    if gamma is not None and gamma.shape != (Hq, d):
        raise ValueError(f"gamma must have shape {(Hq, d)} (one γ_h per query head); got {tuple(gamma.shape)}")
    o, has_len = torch.empty(B, Hq, d, dtype=q.dtype, device=q.device) if out is None else out, length is not None
    return SimpleNamespace(
        B=B, Hq=Hq, Hk=Hk, L=L, d=d, G=G, NS=NS, split_len=split_len, o=o, has_len=has_len,
        acc=torch.empty(B * Hk * NS * G * d, dtype=torch.float32, device=q.device),
        ml=torch.empty(B * Hk * NS * G * 2, dtype=torch.float32, device=q.device),
        ln=length if has_len else o,  # any pointer; unused without HAS_LEN
        len_stride=0 if (not has_len or length.shape[0] == 1) else 1,
        kvi=kv_index if kv_index is not None else o,
        meta=dict(HK=Hk, G=G, GP=max(16, 1 << (G - 1).bit_length()), D=d, BN=block, NS=NS, HAS_LEN=has_len,
                  HAS_KVI=kv_index is not None,
                  PREC="ieee" if q.dtype == torch.float32 else "tf32"))  # fp32 caches: exact products (no TF32)


def partial_args(sp: Any, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple:
    """The partial kernel's run-time arguments (after :func:`setup`), in ``_attend``'s order."""
    return (q, k, v, sp.ln, sp.kvi, sp.acc, sp.ml, float(scale), sp.L, sp.split_len,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            sp.len_stride)


def combine_chunk(n_splits: int, d: int) -> int:
    """Splits per pass of the combination's body (``_combine_row``'s SC): all of them at once (the next power of two)
    up to 8192 partial values per program, else chunks of that many."""
    return max(2, min(1 << max(0, (n_splits - 1).bit_length()), max(2, 8192 // d)))


def combine(sp: Any, gate: Optional[Tensor], gamma: Optional[Tensor], eps: float) -> Tensor:
    """The exact combination of the partials into ``sp.o`` (with the output fusion when ``gate`` / ``gamma``)."""
    kern, o, NS, d, G, Hk = _build(), sp.o, sp.NS, sp.d, sp.G, sp.Hk
    with torch.cuda.device(o.device) if o.is_cuda else contextlib.nullcontext():
        if gate is not None or gamma is not None:
            gm = gamma.float().contiguous() if gamma is not None else sp.acc
            gt = gate if gate is not None else o
            kern["combine_out"][(sp.B * Hk * G,)](
                sp.acc, sp.ml, o, gt, gm, o.stride(0), o.stride(1), gt.stride(0), gt.stride(1), float(eps), HK=Hk, G=G,
                D=d, NS=NS, SC=combine_chunk(NS, d), HAS_GATE=gate is not None,
                HAS_NORM=gamma is not None)
            return o
        SP = 1 << max(0, (NS - 1).bit_length())
        BD = min(d, 32 if SP <= 128 else 16)
        kern["combine"][(sp.B * Hk * G, d // BD)](sp.acc, sp.ml, o, o.stride(0), o.stride(1), HK=Hk, G=G, D=d, NS=NS,
                                                    SP=SP, BD=BD)
    return o
