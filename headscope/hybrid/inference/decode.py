"""A hybrid layer's decode step on the inference path (one token per sequence through a HybridDecodeCache).

Where the Triton kernels apply (CUDA or Triton's interpreter, head_dim a power of two ≥ 16) the FA heads' q/k glue
and K/V cache write, their split-K attention over the kept KV groups and all GDN heads' step (state updated in place
in ``cache.S``) run in one launch (``kernels/one_launch.py``), then the split-K combination; the separate kernels
(``kernels/fa_prep.py``, ``kernels/splitk.py``, ``kernels/gdn_step.py``) where only some apply; PyTorch (SDPA, the
compiled recurrence) elsewhere. Up to ``InferenceConfig.fused_out_max_d`` the output fusion (FA gate, per-head
RMSNorm, γ) runs inside the split-K combination and the GDN step, which write one buffer for ``o_proj``. Every
write is in place, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..fa_kernels import fa_attention
from .inference_config import inference_config
from .kernels.fa_prep import applies as fa_prep_applies, fa_decode_prep
from .kernels.gdn_step import applies as gdn_step_applies, full_rotary, gdn_decode_step
from .kernels.one_launch import hybrid_decode_step
from .kernels.splitk import combine as _combine_partials, decode_attention, triton_available
from .plan import Plan, glue

if TYPE_CHECKING:  # pragma: no cover
    from ..layer import HeadwiseHybridAttention

class DevicePosition:
    """A decode step's position read from device memory, so that one captured CUDA graph decodes at every length
    (``StaticDecoder.step_replayed``): ``pos`` [1] long (the new token's slot; K/V written there, attention masked
    to slots ≤ pos), ``valid`` Bool[max_len] = slot ≤ pos and ``n_valid`` [1] = pos + 1 (kept by the caller for
    every layer; None: computed from ``pos``)."""

    __slots__ = ("pos", "valid", "n_valid")

    def __init__(self, pos: Tensor, valid: Optional[Tensor] = None, n_valid: Optional[Tensor] = None):
        self.pos, self.valid, self.n_valid = pos, valid, n_valid

    def length(self) -> Tensor:
        """[1] long: the attended length (pos + 1)."""
        return self.n_valid if self.n_valid is not None else self.pos + 1


def _as_long(slot: Any, dev: torch.device) -> Tensor:
    return slot if isinstance(slot, Tensor) else torch.full((1,), int(slot), dtype=torch.long, device=dev)


def _splitk_applies(q: Tensor, layer: "HeadwiseHybridAttention") -> bool:
    """Whether a decode step's FA heads go to :func:`~headscope.hybrid.inference.kernels.splitk.decode_attention`."""
    d = q.shape[-1]
    return (d >= 16 and not d & (d - 1) and triton_available()
            and (q.is_cuda or (os.environ.get("TRITON_INTERPRET") == "1" and q.dtype != torch.bfloat16)))


def fa_attend(layer: "HeadwiseHybridAttention", p: Plan, q: Tensor, k: Optional[Tensor], v: Optional[Tensor],
               cache: Any, dp: Optional[DevicePosition], past: int, prep: Optional[bool] = None, **out: Any) -> Tensor:
    """The FA heads' attention: q [B,T,nf,d], the new k, v [B,nk,T,d] (written into the cache when there is
    one) -> [B,T,nf,d]. A decode step goes to the split-K kernel where it applies; device-position steps
    write slot ``dp.pos`` and attend over the buffer up to it (the split-K length, or SDPA with a slot mask).
    ``prep``: q is already prepared and the token's K/V already in the cache (:func:`fa_decode_prep`); ``out``:
    the split-K kernel's ``out``/``gate``/``gamma``/``eps`` (the fused output)."""
    T, lo = q.shape[1], window_start(p, past)
    splitk = T == 1 and cache is not None and _splitk_applies(q, layer) and not (dp is not None and p.window)
    if splitk and prep:  # q prepared and K/V written into the cache by fa_decode_prep
        kc, vc, n_valid = cache.k, cache.v, None
        if dp is None:
            kc, vc = kc[:, :, lo: past + 1], vc[:, :, lo: past + 1]
        else:
            n_valid = dp.length()
        return decode_attention(q[:, 0], kc, vc, n_valid, layer.scaling,
                                kv_index=None if layer._fa_gqa else p.fa_kv, **out)[:, None]
    amask = None
    if dp is not None:
        cache.k.index_copy_(2, dp.pos, k)
        cache.v.index_copy_(2, dp.pos, v)
        k, v = cache.k, cache.v
        if not splitk:
            slots = torch.arange(cache.max_len, device=q.device)
            valid = dp.valid if dp.valid is not None else slots <= dp.pos
            amask = (valid & (slots > dp.pos - p.window) if p.window else valid)[None, None, None]
    elif cache is not None:
        k, v = cache._write(k, v, past)
    if splitk:  # flash-decoding over the kept KV groups; the length from device memory with device positions
        n_valid = None if dp is None else dp.length()
        return decode_attention(q[:, 0], k[:, :, lo:], v[:, :, lo:], n_valid, layer.scaling,
                                kv_index=None if layer._fa_gqa else p.fa_kv)[:, None]
    if not layer._fa_gqa:
        k, v = k.index_select(1, p.fa_kv), v.index_select(1, p.fa_kv)
    return fa_attention(q, k, v, layer.scaling, True, amask, p.fa_kernel, None if amask is not None else p.window,
                        p.softcap)


def window_start(p: Plan, past: int) -> int:
    """The first cache slot a decode step at slot ``past`` attends to: past + 1 − w for a sliding layer, else 0."""
    return max(0, past + 1 - p.window) if p.window else 0


def gdn_decode(layer: "HeadwiseHybridAttention", p: Plan, qg: Tensor, kg: Tensor, vg: Tensor, a: Tensor,
                b: Tensor, cs: tuple, S: Tensor, out: Optional[Tensor] = None, gamma: Optional[Tensor] = None) -> Tensor:
    """One token of every GDN head from the projection's views (q/k/v [B,1,n·d], a/b [B,1,n]), the state
    ``S`` (the cache's) updated in place -> y [B,1,n,d]: the Triton kernel where it applies (into ``out`` [B,n,d]
    when given, the output fusion folded in with ``gamma``), else the same function compiled from PyTorch."""
    ng, d = p.ng, p.d
    if gdn_step_applies(d, qg.device) and (not p.gdn_rope or full_rotary(cs[0], d)):
        return gdn_decode_step(**gdn_step_kw(layer, p, qg, kg, vg, a, b, cs, S, out, gamma))[:, None]
    q3, k3, v3 = (t.unflatten(-1, (ng, d)) for t in (qg, kg, vg))
    return glue("dec_gdn", (q3, k3, v3, a, b, *cs), (S, p.A_neg, p.dtb, p.qn, p.kn),
                 inference_config(layer).compile_glue, eps=p.qk_eps, rope=p.gdn_rope, scale=float(layer.gdn_scale))


def gdn_step_kw(layer: "HeadwiseHybridAttention", p: Plan, qg: Tensor, kg: Tensor, vg: Tensor, a: Tensor,
                 b: Tensor, cs: tuple, S: Tensor, out: Optional[Tensor], gamma: Optional[Tensor]) -> dict:
    """:func:`gdn_decode_step`'s arguments for one token from the projection's views (q/k/v [B,1,n·d],
    a/b [B,1,n]) and the state ``S``; shared by the separate GDN step and the one-launch step."""
    ng, d = p.ng, p.d
    rope = p.gdn_rope and cs[0] is not None
    return dict(q=qg[:, 0].unflatten(-1, (ng, d)), k=kg[:, 0].unflatten(-1, (ng, d)), v=vg[:, 0].unflatten(-1, (ng, d)),
                a=a[:, 0], b=b[:, 0], S=S, A_neg=p.A_neg, dt_bias=p.dtb, scale=float(layer.gdn_scale),
                cos=cs[0][:, 0] if rope else None, sin=cs[1][:, 0] if rope else None, q_norm=p.qn, k_norm=p.kn,
                qk_eps=p.qk_eps, out=out, gamma=gamma, out_eps=p.eps)


def _fa_glue_kw(layer: "HeadwiseHybridAttention", p: Plan, cos: Optional[Tensor], sin: Optional[Tensor],
                position_ids: Optional[Tensor], slot: Any, dev: torch.device) -> dict:
    """The FA glue's arguments of a decode step's prep (:func:`fa_decode_prep`, :func:`hybrid_decode_step`): the
    token's rotary row, or the NoPE scale with its positions, and the QK-norm weights."""
    rope = p.fa_rope and cos is not None
    positions = None
    if not p.fa_rope:
        positions = position_ids[:, -1] if position_ids is not None else _as_long(slot, dev)
    return dict(cos=cos[:, 0] if rope else None, sin=sin[:, 0] if rope else None, positions=positions,
                nope_a=None if p.fa_rope else float(layer.options.nope_a), q_norm=p.qn, k_norm=p.kn, qk_eps=p.qk_eps)


def fa_fused_out(p: Plan, y_buf: Optional[Tensor], gate: Optional[Tensor]) -> dict:
    """The split-K combination's output fusion into the FA heads' columns of ``y_buf`` (none without a buffer)."""
    if y_buf is None:
        return {}
    return {"out": y_buf[:, : p.nf], "gate": gate[:, 0] if gate is not None else None,
            "gamma": p.gamma[: p.nf] if p.gamma is not None else None, "eps": p.eps}


def prep_applies(layer: "HeadwiseHybridAttention", q: Tensor, T: int, cache: Any) -> bool:
    """Whether a decode step's FA glue and K/V write go to :func:`fa_decode_prep` (one Triton kernel)."""
    return (T == 1 and cache is not None and _splitk_applies(q, layer)
            and fa_prep_applies(q.shape[-1], q.device))


def prep_attend(layer: "HeadwiseHybridAttention", p: Plan, q: Tensor, k: Tensor, v: Tensor, cache: Any,
                dp: Optional[DevicePosition], past: int, cos: Optional[Tensor], sin: Optional[Tensor],
                position_ids: Optional[Tensor], y_buf: Optional[Tensor], gate: Optional[Tensor]) -> Tensor:
    """A decode step's FA heads through the separate kernels: q/k glue + the K/V cache write in one kernel
    (:func:`fa_decode_prep`), then split-K attention (its fused output into ``y_buf`` when given) -> [B,1,nf,d]."""
    slot = dp.pos if dp is not None else past
    qp = fa_decode_prep(q[:, 0], k[:, 0], v[:, 0], cache.k, cache.v, slot,
                        **_fa_glue_kw(layer, p, cos, sin, position_ids, slot, q.device))
    return fa_attend(layer, p, qp[:, None], None, None, cache, dp, past, prep=True, **fa_fused_out(p, y_buf, gate))


def one_launch(layer: "HeadwiseHybridAttention", p: Plan, q: Tensor, k: Tensor, v: Tensor, z: Tensor, cache: Any,
                dp: Optional[DevicePosition], past: int, cos: Optional[Tensor], sin: Optional[Tensor],
                position_ids: Optional[Tensor], y_buf: Optional[Tensor], gate: Optional[Tensor],
                g_out: Optional[dict], combine: Any = True) -> tuple[Any, Optional[Tensor]]:
    """A decode step's FA prep + split-K attention and GDN step through :func:`hybrid_decode_step` (one launch, then
    the combination): q [B,1,nf,d], k, v [B,1,nk,d] and the GDN rows of the projection z -> (o_fa [B,1,nf,d],
    y [B,ng,d] or None); with ``y_buf`` both write their fused outputs there. ``combine``: as
    :func:`hybrid_decode_step`'s; where it leaves the combination to the caller (``layer_tail.layer_tail``), the
    split-K namespace in place of o_fa."""
    ng, lo = p.ng, window_start(p, past)
    if dp is None:
        kc, vc, n_valid = cache.k[:, :, lo: past + 1], cache.v[:, :, lo: past + 1], None
    else:
        kc, vc, n_valid = cache.k, cache.v, dp.length()
    gdn = None
    if ng:
        qg, kg, vg, a, b = z[..., p.n_fa_rows:].split(p.g_sizes, dim=-1)
        gdn = gdn_step_kw(layer, p, qg, kg, vg, a[..., :ng], b[..., :ng], (cos, sin), cache.S,
                           g_out["out"] if g_out else None, g_out["gamma"] if g_out else None)
    o, y = hybrid_decode_step(q[:, 0], k[:, 0], v[:, 0], kc, vc, n_valid, layer.scaling,
                              kv_index=None if layer._fa_gqa else p.fa_kv, gdn=gdn,
                              **_fa_glue_kw(layer, p, cos, sin, position_ids, dp.pos if dp is not None else past,
                                            q.device), **fa_fused_out(p, y_buf, gate), combine=combine)
    return (o[:, None] if isinstance(o, Tensor) else o), y


class DeferredOutput:
    """A decode step's attention output left unfinished (:func:`forward` with ``defer=True``), for
    :func:`~headscope.hybrid.inference.kernels.layer_tail.layer_tail`, which combines the split-K partials and applies ``o_proj``
    inside the layer's tail launch.

    Attributes:
        y: o_proj's input [batch, heads·d] in the layer's dtype: the GDN heads' fused outputs written, the FA heads'
            columns still to come from ``attn``.
        attn: (the split-K launch's namespace, gate, gamma, eps) of :func:`~headscope.hybrid.inference.kernels.splitk.combine`, or
            None where the FA heads' columns of y are written too (combined inside the attention's launch).
        w_o, b_o: o_proj's weight (input columns in (FA, GDN) order) and bias.
    """

    __slots__ = ("y", "attn", "w_o", "b_o")

    def __init__(self, y: Tensor, attn: Optional[tuple], w_o: Tensor, b_o: Optional[Tensor]):
        self.y, self.attn, self.w_o, self.b_o = y, attn, w_o, b_o

    def finish(self) -> Tensor:
        """The layer's output [batch, 1, hidden] through the separate kernels (the combination, then o_proj)."""
        if self.attn is not None:
            _combine_partials(*self.attn)
        return F.linear(self.y[:, None], self.w_o, self.b_o)
