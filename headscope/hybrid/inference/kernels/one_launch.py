"""A decode step's attention work of one hybrid layer in one kernel launch: the FA prep folded into the split-K
partials, the GDN step as the launch's first programs, the combination by each row's last split (rows of ≤
:data:`LAUNCH_COMBINE_MAX_G` query heads); the same Triton bodies as the separate kernels. Design:
docs/hybrid.md, "How the kernels work: One launch".
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import Tensor

from . import gdn_step, splitk
from .fa_prep import check_args as _check_prep, glue_args
from ...shapes import Float

_kernels: dict = {}
# Where hybrid_decode_step's split-K combination runs by default (combine=True): inside the one launch, by the last
# split of each (sequence, KV head) to finish (a per-row counter; saves the second launch, or the tail kernel's first
# phase and its barrier), for rows of at most this many query heads (G); rows of more heads take splitk.combine's
# separate launch (docs/performance-variants.md: why 2).
LAUNCH_COMBINE_MAX_G = 2


def combine_mode(g: int) -> str:
    """Where :func:`hybrid_decode_step` combines by default (``combine=True``) for rows of ``g`` query heads:
    ``"launch"`` or ``"kernel"`` (:data:`LAUNCH_COMBINE_MAX_G`)."""
    return "launch" if g <= LAUNCH_COMBINE_MAX_G else "kernel"


def _make(triton, tl) -> dict:
    """The one-launch kernel (its bodies from splitk's and gdn_step's kernels, built first)."""
    globals().update(_attend=splitk._build()["attend"], _combine_row=splitk._build()["combine_row"],
                     _gdn_head=gdn_step._build()["head"], tl=tl)

    @triton.jit
    def _one_launch(Q, K, V, LEN, KVI, ACC, ML, scale, L, split_len, sqb, sqh, skb, skh, skl, svb, svh, svl, len_stride,
                    KN, VN, COS, SIN, QN, KNW, POS, qk_eps, inv_log_a, nope_a, sknb, sknh, svnb, svnh, scb, ssb,
                    pos_stride,
                    gQ, gK, gV, gA, gB, gCOS, gSIN, gQN, gKN, gANEG, gDTB, gS, gY, gGAMMA, g_scale, g_qk_eps, g_out_eps,
                    gsqb, gsqh, gskb, gskh, gsvb, gsvh, gsab, gsbb, gscb, gssb, gsyb, gsyh,
                    O, GATE, GAMMA, sob, soh, sgb, sgh, out_eps, SCNT,
                    HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                    NS: tl.constexpr, HAS_LEN: tl.constexpr, HAS_KVI: tl.constexpr, PREC: tl.constexpr,
                    ROPE: tl.constexpr, QKN: tl.constexpr, NOPE: tl.constexpr,
                    N: tl.constexpr, BV: tl.constexpr, GROPE: tl.constexpr, GQKN: tl.constexpr, NORM: tl.constexpr,
                    NGP: tl.constexpr, NCB: tl.constexpr, COMB: tl.constexpr,
                    SC: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, SYNC: tl.constexpr):
        pid = tl.program_id(0)
        if NGP > 0:
            if pid < NGP:  # a GDN program: one (sequence, head, value block)
                _gdn_head((pid // NCB).to(tl.int64), pid % NCB, gQ, gK, gV, gA, gB, gCOS, gSIN, gQN, gKN, gANEG, gDTB,
                          gS, gY, gGAMMA, g_scale, g_qk_eps, g_out_eps, gsqb, gsqh, gskb, gskh, gsvb, gsvh, gsab,
                          gsbb, gscb, gssb, gsyb, gsyh, N, D, BV, GROPE, GQKN, NORM)
        j = pid - NGP
        if j >= 0:  # a split of one (sequence, KV head)
            _attend(j // NS, j % NS, Q, K, V, LEN, KVI, ACC, ML, scale, L, split_len,
                    sqb, sqh, skb, skh, skl, svb, svh, svl, len_stride,
                    KN, VN, COS, SIN, QN, KNW, POS, qk_eps, inv_log_a, nope_a, sknb, sknh, svnb, svnh, scb, ssb,
                    pos_stride, HK, G, GP, D, BN, NS, HAS_LEN, HAS_KVI, PREC, True, ROPE, QKN, NOPE)
            if COMB:  # the row's last split to finish combines its G heads (the splits' partials released first)
                bh = j // NS
                if SYNC:  # a per-row counter that grows by NS per launch: the NS-th arrival is the last
                    tl.debug_barrier()
                    last = tl.atomic_add(SCNT + bh, 1, sem="acq_rel", scope="gpu") % NS == NS - 1
                else:  # Triton's interpreter runs the programs in order
                    last = j % NS == NS - 1
                if last:
                    for g in tl.static_range(G):
                        _combine_row(bh * G + g, ACC, ML, O, GATE, GAMMA, sob, soh, sgb, sgh, out_eps, HK, G, D, NS,
                                     SC, HAS_GATE, HAS_NORM)

    return {"step": _one_launch}


def _build() -> dict:
    """The kernel, built on first use (see :func:`headscope.hybrid.inference.kernels.splitk.build_kernels`)."""
    return splitk.build_kernels(_kernels, _make)


def applies(d: int, device: torch.device) -> bool:
    """Whether :func:`hybrid_decode_step` runs here: triton, and CUDA or Triton's interpreter, head_dim a power
    of two ≥ 16 (as the split-K kernel)."""
    return d >= 16 and not d & (d - 1) and splitk.kernel_applies(d, device)


def hybrid_decode_step(
    q: Float[Tensor, "batch fa_head d"],
    k: Float[Tensor, "batch kv_group d"],
    v: Float[Tensor, "batch kv_group d"],
    k_cache: Float[Tensor, "batch kv_group slots d"],
    v_cache: Float[Tensor, "batch kv_group slots d"],
    length: Optional[Tensor],
    scale: float,
    cos: Optional[Float[Tensor, "batch d"]] = None,
    sin: Optional[Float[Tensor, "batch d"]] = None,
    positions: Optional[Tensor] = None,
    nope_a: Optional[float] = None,
    q_norm: Optional[Float[Tensor, " d"]] = None,
    k_norm: Optional[Float[Tensor, " d"]] = None,
    qk_eps: float = 0.0,
    kv_index: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
    gate: Optional[Float[Tensor, "batch fa_head d"]] = None,
    gamma: Optional[Float[Tensor, "fa_head d"]] = None,
    eps: float = 1e-6,
    gdn: Optional[dict] = None,
    n_splits: Optional[int] = None,
    combine: Any = True,
) -> tuple[Any, Optional[Float[Tensor, "batch gdn_head d"]]]:
    """One decode token of a hybrid layer's attention in one launch: the FA heads' prep and split-K partials (=
    :func:`~.fa_prep.fa_decode_prep`, the token's K/V written at slot ``length − 1``, then
    :func:`~.splitk.decode_attention` over slots ``[0, length)``), their combination (see ``combine``) and the GDN heads'
    step (= :func:`~.gdn_step.gdn_decode_step` with the arguments ``gdn``, its ``S`` updated in place; None: no GDN).

    Args: q [batch, fa_head, d] raw FA queries; k, v [batch, kv_group, d] the token's raw keys / values (views of the
    fused projection: unit stride in d); k_cache, v_cache [batch, kv_group, slots, d]; length Long/Int[1] or [batch]
    valid slots after this token on the device (None: all slots); scale; the FA glue (cos, sin, positions, nope_a,
    q_norm, k_norm, qk_eps) as fa_decode_prep's; kv_index, out, gate, gamma, eps as decode_attention's (kv_index must
    name every KV group of the cache); n_splits (default :func:`splitk.n_splits_for`, GDN programs reserved);
    combine: ``"launch"`` (this launch, by each row's last split to finish), ``"kernel"`` (a second launch), True
    (:func:`combine_mode`), False (the caller's: ``layer_tail``'s first phase; the split-K namespace is returned in
    place of o), ``"defer"`` (``"launch"`` where combine_mode says so, else as False; a tensor returned is combined).

    Returns (o [batch, fa_head, d] in q's dtype or the namespace, y [batch, gdn_head, d] or None). Raises ValueError:
    the three functions' errors, GDN heads of another head_dim, another ``combine`` (``length`` ≥ 1 is not checked:
    no host sync); ImportError without triton. Source: flash-decoding (Dao et al., 2023), HydraHead eq. 7–8, 13–14.
    """
    _check_prep(q, k, v, k_cache, v_cache, cos, sin, q_norm, k_norm, nope_a)
    d = q.shape[-1]
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in its last dimension")
    NGP, NCB, gargs, gmeta, y = _gdn_programs(gdn, d)
    sp = splitk.setup(q, k_cache, v_cache, length, kv_index, None, n_splits, out, gate, gamma, reserved=NGP)
    if not gargs:  # dummies of the right kinds: never read without GDN programs
        gargs = (q,) * 5 + (sp.ml,) * 7 + (q, sp.ml, 0.0, 0.0, 0.0) + (0,) * 12
    cos_t, sin_t, qn, kn, pos, inv_log_a, a, scb, ssb, pos_stride, rope, qkn, nope = glue_args(
        q, cos, sin, positions, nope_a, q_norm, k_norm, sp.ml)
    fa_args = (k, v, cos_t, sin_t, qn, kn, pos, float(qk_eps), inv_log_a, a, k.stride(0), k.stride(1), v.stride(0),
               v.stride(1), scb, ssb, pos_stride)
    mode = _combine_where(combine, sp.G)
    o, rows = sp.o, sp.B * sp.Hk
    comb = (o, gate if gate is not None else o, gamma.float().contiguous() if gamma is not None else sp.ml,
            o.stride(0), o.stride(1), gate.stride(0) if gate is not None else 0,
            gate.stride(1) if gate is not None else 0, float(eps),
            splitk.counters(("splits", str(q.device), rows, sp.NS), rows, q.device) if mode == "launch" else sp.ml)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _build()["step"][(NGP + rows * sp.NS,)](
            *splitk.partial_args(sp, q, k_cache, v_cache, scale), *fa_args, *gargs, *comb, **sp.meta, ROPE=rope,
            QKN=qkn, NOPE=nope, **gmeta, NGP=NGP, NCB=max(NCB, 1), COMB=mode == "launch",
            SC=splitk.combine_chunk(sp.NS, sp.d), HAS_GATE=gate is not None, HAS_NORM=gamma is not None,
            SYNC=q.is_cuda, num_warps=splitk.NUM_WARPS, num_stages=splitk.NUM_STAGES)
    if mode == "kernel":
        return splitk.combine(sp, gate, gamma, eps), y
    return (o if mode == "launch" else sp), y


def _gdn_programs(gdn: Optional[dict], d: int) -> tuple:
    """(GDN programs, their column blocks, launch arguments, meta-parameters, output y or None) of
    :func:`hybrid_decode_step`'s ``gdn`` (nothing without GDN heads)."""
    NGP, NCB, gargs, y = 0, 0, (), None
    gmeta: dict = dict(N=1, BV=16, GROPE=False, GQKN=False, NORM=False)
    if gdn is not None:
        extra = {"block_v"} & set(gdn)
        if extra:
            raise ValueError(f"gdn takes gdn_decode_step's arguments except {sorted(extra)}")
        grid, gargs, gm, y = gdn_step.setup(**gdn)
        if gm["D"] != d:
            raise ValueError(f"the GDN heads' head_dim {gm['D']} differs from the FA heads' {d}")
        NCB = grid[1]
        NGP = grid[0] * NCB
        gmeta = dict(N=gm["N"], BV=gm["BV"], GROPE=gm["ROPE"], GQKN=gm["QKN"], NORM=gm["NORM"])
    return NGP, NCB, gargs, gmeta, y


def _combine_where(combine: Any, G: int) -> Any:
    """Where :func:`hybrid_decode_step`'s split-K combination runs for ``combine`` and rows of G query heads:
    ``"launch"``, ``"kernel"`` or False (the caller). Raises ValueError for another ``combine``."""
    auto = combine_mode(G)
    mode = auto if combine is True else (auto == "launch" and "launch") if combine == "defer" else combine
    if mode not in ("launch", "kernel", False):
        raise ValueError(f"combine must be True, False, 'launch', 'kernel' or 'defer', got {combine!r}")
    return mode
