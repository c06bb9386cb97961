"""The ``lean`` backends of :class:`~headscope.hybrid.HeadwiseHybridAttention` (``headscope/hybrid/backend_registry.py``):
the reference forward's function with one fused input projection and the compiled glue (``plan.py``), outputs in
(FA, GDN) head order and ``o_proj``'s input columns permuted instead; reached through ``layer.backends`` when no
gradient is needed, there is no attention mask and the weights are in the input's dtype.

- :func:`prefill`: the FA heads' kept KV groups to SDPA / flash-attn, all GDN heads in one kernel call per time
  block (``prefill.py``), the state carried from block to block;
- :func:`decode_step`: one token into a ``HybridDecodeCache`` through the Triton decode kernels where they apply
  (``decode.py``), every write in place (capturable in a CUDA graph; a :class:`~.decode.DevicePosition` makes one
  graph serve every length).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import prefill as blocks
from .inference_config import inference_call, inference_config
from .decode import (DeferredOutput, DevicePosition, fa_attend, fa_fused_out, gdn_decode, one_launch, prep_applies,
                     prep_attend)
from .kernels.gdn_step import applies as gdn_step_applies, full_rotary
from .kernels.one_launch import applies as step_applies
from .plan import Plan, glue, plan

if TYPE_CHECKING:  # pragma: no cover
    from ..layer import HeadwiseHybridAttention

__all__ = ["DeferredOutput", "DevicePosition", "applies", "decode_step", "plan", "prefill"]


def applies(layer: "HeadwiseHybridAttention", x: Tensor) -> bool:
    """True when a call of the layer on ``x`` takes the lean backend (inference call, decode role attached)."""
    b = layer.backends
    return b is not None and inference_call(layer, x) and b.fn(layer, "decode") is decode_step


def _rotary(p: Plan, x: Tensor, position_embeddings: Optional[tuple]) -> tuple:
    """(cos, sin) expanded to x's batch (None, None without them). Raises ValueError when RoPE needs them."""
    cos = sin = None
    if position_embeddings is not None:
        cos, sin = position_embeddings
        if cos.shape[0] != x.shape[0]:
            cos, sin = cos.expand(x.shape[0], -1, -1), sin.expand(x.shape[0], -1, -1)
    if ((p.fa_rope and p.nf) or (p.gdn_rope and p.ng)) and cos is None:
        raise ValueError("position_embeddings=(cos, sin) is required (RoPE is on); compute it with "
                         "model.model.rotary_emb(hidden_states, position_ids)")
    return cos, sin


def _room(cache: Any, need: int) -> None:
    if cache is not None and need > cache.max_len:
        raise ValueError(f"HybridDecodeCache holds {cache.max_len} tokens but {need} are needed; "
                         "make it with a larger max_len")


def _fa_parts(p: Plan, z_fa: Tensor) -> tuple:
    """The FA heads' q, k, v [B,T,heads,d] and gate (or None): views of their rows of the projection."""
    parts = z_fa.split(p.fa_sizes, dim=-1)
    q, k, v = (t.unflatten(-1, (-1, p.d)) for t in parts[:3])
    return q, k, v, (parts[3].unflatten(-1, (p.nf, p.d)) if p.gate else None)


def _fa_glued(layer: "HeadwiseHybridAttention", p: Plan, q: Tensor, k: Tensor, v: Tensor, cache: Any,
              dp: Optional[DevicePosition], past: int, cos: Any, sin: Any, position_ids: Any) -> Tensor:
    """The FA heads through the glue (QK-norm, RoPE / NoPE) and :func:`~.decode.fa_attend` -> [B,T,nf,d]."""
    B, T = q.shape[:2]
    pos = None
    if not p.fa_rope:
        pos = position_ids if position_ids is not None else torch.arange(past, past + T, device=q.device)[None]
        pos = pos.expand(B, T)
    q, k = glue("fa", (q, k, cos, sin, pos), (p.qn, p.kn), inference_config(layer).compile_glue, eps=p.qk_eps,
                rope=p.fa_rope, nope_a=float(layer.options.nope_a))
    return fa_attend(layer, p, q, k.transpose(1, 2), v.transpose(1, 2), cache, dp, past)


def _output(p: Plan, o_fa: Optional[Tensor], gate: Optional[Tensor], y_g: Optional[Tensor], cfg: Any) -> Tensor:
    """Fusion (eq. 13–14) in (FA, GDN) order, then o_proj with permuted input columns -> [B, T, hidden]."""
    if p.gamma is None and gate is None and (o_fa is None or y_g is None):
        t = o_fa if o_fa is not None else y_g
        y = t.reshape(*t.shape[:2], -1)
    else:
        y = glue("out", (o_fa, gate, y_g), (p.gamma,), cfg.compile_glue, eps=p.eps)
    return F.linear(y, p.Wo, p.bo)


def _blocks(x: Tensor, p: Plan, cfg: Any) -> tuple[bool, int]:
    """(GDN blocks replayed from graphs?, time steps per GDN block) of a prefill of x [B, T, hidden]."""
    B, T = x.shape[:2]
    if blocks.eager_blocks_apply(x, p, T, cfg):
        return True, blocks.eager_graph_block(B, T, cfg)
    return False, max(1, blocks.block_tokens(p.ng, p.d, B * T, T > 1 and blocks.graph_blocks(x), cfg) // B)


def prefill(layer: "HeadwiseHybridAttention", x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]],
            position_ids: Optional[Tensor], cache: Any) -> Tensor:
    """The layer's output [B, T, hidden] (before the residual add) of a prompt x [B, T, hidden]; ``cache`` None or a
    HybridDecodeCache, filled from its length (its GDN state carried in).

    Raises:
        ValueError: RoPE without position_embeddings, or the cache too small."""
    p, cfg = plan(layer), inference_config(layer)
    B, T, _ = x.shape
    past = cache.length if cache is not None else 0
    cos, sin = _rotary(p, x, position_embeddings)
    _room(cache, past + T)
    graphed, tb = _blocks(x, p, cfg)
    one_gemm = T <= tb
    z = F.linear(x, p.W, p.b) if one_gemm else None
    o_fa = gate = None
    if p.nf:
        b_fa = None if p.b is None else p.b[: p.n_fa_rows]
        q, k, v, gate = _fa_parts(p, z[..., : p.n_fa_rows] if one_gemm else F.linear(x, p.W[: p.n_fa_rows], b_fa))
        o_fa = _fa_glued(layer, p, q, k, v, cache, None, past, cos, sin, position_ids)
        del q, k, v
    st = {"z": z, "gate": gate, "free": one_gemm}  # the GDN branch frees the projection after its first block
    del z, gate
    y_g = _gdn_prefill(layer, p, x, st, cos, sin, cache, past, tb, graphed, cfg) if p.ng else None
    if cache is not None:
        cache.length = past + T
    return _output(p, o_fa, st["gate"], y_g, cfg)


def _gdn_prefill(layer: "HeadwiseHybridAttention", p: Plan, x: Tensor, st: dict, cos: Any, sin: Any, cache: Any,
                 past: int, tb: int, graphed: bool, cfg: Any) -> Tensor:
    """All GDN heads of a prefill, one kernel call per time block of ``tb`` steps, the state carried over (from and
    into ``cache.S``) -> [B, T, ng, d]. ``st["z"]``: the whole projection (one GEMM) or None (one GEMM per block);
    dropped after the first block (the FA gate cloned out of it first), so fla's intermediates can reuse it."""
    B, T, _ = x.shape
    S = cache.S if (cache is not None and past) else None
    W_g, b_g = p.W[p.n_fa_rows:], None if p.b is None else p.b[p.n_fa_rows:]
    spans = [(s, min(s + tb, T)) for s in range(0, T, tb)]
    y_g = x.new_empty(B, T, p.ng, p.d) if len(spans) > 1 else None
    for t0, t1 in spans:
        zg = st["z"][..., p.n_fa_rows:] if st["z"] is not None else F.linear(x[:, t0:t1], W_g, b_g)
        cs = (cos[:, t0:t1], sin[:, t0:t1]) if cos is not None and p.gdn_rope else (None, None)
        ops = None
        if graphed:  # the glue and the chunk forward in a graph-replayed block (zg copied into its input)
            y, S = blocks.gdn_block_graphed(layer, zg, *cs, S, tb)
            y = y[:, : t1 - t0]
        else:
            ops = blocks.gdn_ops(blocks.gdn_cfg(layer, p, cs[0] is not None), zg, *cs, None, p.A_neg, p.dtb, p.qn, p.kn)
        del zg
        if st["free"]:  # the projection is no longer needed: free it before fla's intermediates
            st.update(z=None, free=False, gate=None if st["gate"] is None else st["gate"].clone())
        if ops is not None:
            y, S = blocks.gdn_consume(ops, layer.gdn_scale, S, p.gdn_kernel, layer.options.chunk_size, cfg.flash_qla)
        if y_g is None:
            y_g = y
        else:
            y_g[:, t0:t1] = y
    if cache is not None:
        cache.S.copy_(S)
    return y_g


def decode_step(layer: "HeadwiseHybridAttention", x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]],
                position_ids: Optional[Tensor], cache: Any, dp: Optional[DevicePosition] = None, defer: bool = False,
                z_in: Optional[Tensor] = None) -> Any:
    """One token x [B, 1, hidden] into the HybridDecodeCache ``cache`` -> the layer's output [B, 1, hidden].

    Args:
        dp: the step's position in device memory (K/V written there, attention up to it; ``cache.length`` is left
            to the caller), with explicit ``position_ids``; None: the position is ``cache.length``.
        defer: where the one-launch step runs, return a :class:`DeferredOutput` (the split-K combination and o_proj
            left to the caller's layer tail, ``kernels/layer_tail.py``).
        z_in: the input projection ``x @ plan(layer).Wᵀ + b`` [B, 1, rows of W], already computed (by the layer tail
            before); x then gives only shape, dtype and device.

    Raises:
        ValueError: not one token, no cache, ``dp`` without position_ids, a full cache, z_in of the wrong shape."""
    p, cfg = plan(layer), inference_config(layer)
    B, T, _ = x.shape
    if T != 1 or cache is None or (dp is not None and position_ids is None):
        raise ValueError("a decode step takes one token per sequence, a HybridDecodeCache and, with a device "
                         "position, explicit position_ids")
    past = cache.length
    cos, sin = _rotary(p, x, position_embeddings)
    if dp is None:
        _room(cache, past + 1)
    if z_in is not None and z_in.shape != (B, 1, p.W.shape[0]):
        raise ValueError(f"z_in must be the input projection [{B}, 1, {p.W.shape[0]}]; got {tuple(z_in.shape)}: "
                         "pass hidden states instead")
    z = z_in if z_in is not None else F.linear(x, p.W, p.b)
    S = cache.S if (past or dp is not None) else None
    q, k, v, gate = _fa_parts(p, z[..., : p.n_fa_rows]) if p.nf else (None,) * 4
    prep = (bool(p.nf) and (not p.fa_rope or full_rotary(cos, p.d)) and prep_applies(layer, q, 1, cache)
            and not (dp is not None and p.window))  # a window at a device position: SDPA with the slot mask
    gdn_triton = not p.ng or (S is not None and (not p.gdn_rope or full_rotary(cos, p.d))
                              and gdn_step_applies(p.d, x.device))
    y_buf = g_out = None  # the fused output of the step: every head writes its fused output here
    if (p.d <= cfg.fused_out_max_d and (p.gamma is not None or p.gate or (p.nf and p.ng)) and (prep or not p.nf)
            and gdn_triton):
        y_buf = x.new_empty(B, p.nf + p.ng, p.d)
        g_out = {"out": y_buf[:, p.nf:], "gamma": p.gamma[p.nf:] if p.gamma is not None else None}
    one = prep and step_applies(p.d, x.device) and gdn_triton  # FA prep + split-K partials + GDN step: one launch
    deferred = defer and one and (y_buf is not None or not p.ng)
    if deferred and y_buf is None:
        y_buf = x.new_empty(B, p.nf, p.d)
    o_fa = y_one = None
    if one:  # deferred: the partials go to the tail kernel unless the launch combines them (rows of few heads)
        o_fa, y_one = one_launch(layer, p, q, k, v, z, cache, dp, past, cos, sin, position_ids, y_buf, gate, g_out,
                                 combine="defer" if deferred else True)
    elif prep:  # one kernel: q/k glue + the K/V cache write, then split-K
        o_fa = prep_attend(layer, p, q, k, v, cache, dp, past, cos, sin, position_ids, y_buf, gate)
    elif p.nf:
        o_fa = _fa_glued(layer, p, q, k, v, cache, dp, past, cos, sin, position_ids)
    del q, k, v
    y_g = y_one[:, None] if y_one is not None else _gdn_step(layer, p, z, cos, sin, S, cache, g_out, cfg)
    if dp is None:
        cache.length = past + 1
    if deferred:  # o_fa is the split-K namespace, or the FA heads' output already in y_buf
        if isinstance(o_fa, Tensor):
            return DeferredOutput(y_buf.view(B, -1), None, p.Wo, p.bo)
        f = fa_fused_out(p, y_buf, gate)
        return DeferredOutput(y_buf.view(B, -1), (o_fa, f["gate"], f["gamma"], f["eps"]), p.Wo, p.bo)
    if y_buf is not None:  # done by the kernels
        return F.linear(y_buf.view(B, 1, -1), p.Wo, p.bo)
    return _output(p, o_fa, gate, y_g, cfg)


def _gdn_step(layer: "HeadwiseHybridAttention", p: Plan, z: Tensor, cos: Any, sin: Any, S: Optional[Tensor],
              cache: Any, g_out: Optional[dict], cfg: Any) -> Optional[Tensor]:
    """The GDN heads of one token from their rows of the projection z -> [B, 1, ng, d] (None without GDN heads):
    the state ``S`` (the cache's) updated in place by the step kernel, or a fresh sequence's first token through the
    prefill's ops (the new state copied into ``cache.S``)."""
    if not p.ng:
        return None
    zg = z[..., p.n_fa_rows:]
    cs = (cos, sin) if cos is not None and p.gdn_rope else (None, None)
    if S is not None:  # glue + recurrence + state write in one call (the state stays in cache.S)
        qg, kg, vg, a, b = zg.split(p.g_sizes, dim=-1)
        return gdn_decode(layer, p, qg, kg, vg, a[..., : p.ng], b[..., : p.ng], cs, S, **(g_out or {}))
    ops = blocks.gdn_ops(blocks.gdn_cfg(layer, p, cs[0] is not None), zg, *cs, None, p.A_neg, p.dtb, p.qn, p.kn)
    y, S = blocks.gdn_consume(ops, layer.gdn_scale, None, p.gdn_kernel, layer.options.chunk_size, cfg.flash_qla)
    cache.S.copy_(S)
    return y
