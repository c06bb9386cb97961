"""The inference forward of :class:`~headscope.hybrid.HeadwiseHybridAttention`: prefill and decode steps.

Taken (through ``dispatch.py``) when no gradient is needed, there is no attention mask, the cache is None or a
:class:`~headscope.hybrid.HybridDecodeCache`, the layer has no short convolution and its weights are in the input's
dtype (no autocast); by default on CUDA only (``InferenceConfig.fast_path``, read from the layer:
:func:`~headscope.hybrid.inference.use_inference`). It computes the reference forward's function with one fused
input projection and the compiled glue (``plan.py``), the FA heads' kept KV groups to SDPA / flash-attn or, in a
decode step, the split-K kernels, and all GDN heads in one kernel call per time block (``prefill.py``) or one step
kernel (``decode.py``), the state carried from block to block; outputs stay in (FA, GDN) head order and ``o_proj``'s
input columns are permuted instead.

A decode step through a HybridDecodeCache writes the FA K/V into the cache slot and the new GDN state into
``cache.S`` in place, so it can be captured in a CUDA graph (after a warm-up call: the glue compiles on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import prefill
from .config import inference_config
from .decode import DeferredOutput, fa_attend, fa_fused_out, gdn_decode, one_launch, prep_applies, prep_attend
from .kernels.gdn_step import applies as gdn_step_applies, full_rotary
from .kernels.one_launch import applies as step_applies
from .plan import glue, plan

if TYPE_CHECKING:  # pragma: no cover
    from ..layer import HeadwiseHybridAttention

__all__ = ["DeferredOutput", "applies", "forward", "plan"]


def applies(layer: "HeadwiseHybridAttention", x: Tensor, attention_mask: Any) -> bool:
    """True when the lean path computes this call (see the module docstring; the layer admits no cache but a
    HybridDecodeCache)."""
    where = inference_config(layer).fast_path
    if where == "never" or (where == "cuda" and x.device.type != "cuda"):
        return False
    if attention_mask is not None or layer.gdn_conv is not None:
        return False
    w = layer.q_proj.weight
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    if x.dim() != 3 or w.dtype != x.dtype or w.device != x.device:
        return False
    return not torch.is_autocast_enabled(x.device.type)


def forward(layer: "HeadwiseHybridAttention", x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]],
            position_ids: Optional[Tensor], cache: Any, defer: bool = False, z_in: Optional[Tensor] = None) -> Any:
    """The layer's output [B, T, hidden] (before the residual add); ``cache`` is None or a
    HybridDecodeCache (filled / advanced in place). ``defer``: a decode step that takes the one-launch path
    returns a :class:`DeferredOutput` instead (the combination and o_proj left to the caller's layer tail).
    ``z_in``: the input projection ``x @ plan(layer).Wᵀ + b`` [B, 1, rows of W], already computed (by the layer
    tail before: ``layer_tail.layer_tail``'s ``w_in``); then only x's shape, dtype and device are read."""
    p = plan(layer)
    B, T, _ = x.shape
    d, nf, ng = p.d, p.nf, p.ng
    past = cache.length if cache is not None else 0
    # device-position decoding (cache.pos, a [1] long tensor on the device; StaticDecoder.step_replayed): the
    # step reads its position from device memory, so one captured CUDA graph serves every length
    dpos = getattr(cache, "pos", None) if cache is not None else None
    if dpos is not None and (T != 1 or position_ids is None):
        raise ValueError("a HybridDecodeCache with a device position (cache.pos) takes one token per step "
                         "and explicit position_ids; set cache.pos = None for prefill")
    cos = sin = None
    if position_embeddings is not None:
        cos, sin = position_embeddings
        if cos.shape[0] != B:
            cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    need_rope = (p.fa_rope and nf) or (p.gdn_rope and ng)
    if need_rope and cos is None:
        raise ValueError("position_embeddings=(cos, sin) is required (RoPE is on); compute it with "
                         "model.model.rotary_emb(hidden_states, position_ids)")
    if cache is not None and dpos is None and past + T > cache.max_len:
        raise ValueError(f"HybridDecodeCache holds {cache.max_len} tokens but {past + T} are needed; "
                         "make it with a larger max_len")
    cfg = inference_config(layer)
    eg = prefill.eager_blocks_apply(x, p, T, cfg)  # the GDN heads as graph-replayed fixed-shape blocks
    if eg:
        tb = prefill.eager_graph_block(B, T, cfg)
    else:
        tb = max(1, prefill.block_tokens(ng, d, B * T, T > 1 and prefill.graph_blocks(x), cfg) // B)
    one_gemm = T <= tb
    if z_in is not None and (not one_gemm or z_in.shape != (B, T, p.W.shape[0])):
        raise ValueError(f"z_in must be the input projection [{B}, {T}, {p.W.shape[0]}] of a step that fits one "
                         f"GEMM; got {tuple(z_in.shape)}: pass hidden states instead")
    z = z_in if z_in is not None else (F.linear(x, p.W, p.b) if one_gemm else None)
    z_fa = z[..., : p.n_fa_rows] if one_gemm else (F.linear(x, p.W[: p.n_fa_rows], None if p.b is None else p.b[: p.n_fa_rows]) if nf else None)

    S_dec = cache.S if (cache is not None and (past or dpos is not None)) else None
    o_fa = gate = q = k = v = None
    if nf:
        parts = z_fa.split(p.fa_sizes, dim=-1)
        q, k, v = (t.unflatten(-1, (-1, d)) for t in parts[:3])
        gate = parts[3].unflatten(-1, (nf, d)) if p.gate else None
    prep = bool(nf) and (not p.fa_rope or full_rotary(cos, d)) and prep_applies(layer, q, T, cache)
    gdn_triton = not ng or (S_dec is not None and (not p.gdn_rope or full_rotary(cos, d)) and gdn_step_applies(d, x.device))
    # ---- the fused output of a decode step: every head writes its fused output here
    y_buf = g_out = None
    if (T == 1 and cache is not None and d <= cfg.fused_out_max_d and (p.gamma is not None or p.gate or (nf and ng))
            and (prep or not nf) and gdn_triton):
        y_buf = x.new_empty(B, nf + ng, d)
        g_out = {"out": y_buf[:, nf:], "gamma": p.gamma[nf:] if p.gamma is not None else None}

    # ---- one launch for the FA prep + split-K partials and the GDN step
    one = prep and step_applies(d, x.device) and gdn_triton
    # ---- the combination and o_proj left to the caller (defer: StaticDecoder's tail kernel)
    deferred = defer and one and T == 1 and (y_buf is not None or not ng)
    if deferred and y_buf is None:
        y_buf = x.new_empty(B, nf, d)
    y_one = None

    # ---- FA heads: softmax attention over the kept KV groups
    if nf:
        if one:
            # deferred: the partials go to the tail kernel unless the launch combines them (rows of few heads)
            o_fa, y_one = one_launch(layer, p, q, k, v, z, cache, dpos, past, cos, sin, position_ids, y_buf, gate,
                                     g_out, combine="defer" if deferred else True)
            combined = isinstance(o_fa, Tensor)
        elif prep:  # one kernel: q/k glue + the K/V cache write, then split-K
            o_fa = prep_attend(layer, p, q, k, v, cache, dpos, past, cos, sin, position_ids, y_buf, gate)
        else:
            pos = None
            if not p.fa_rope:
                pos = position_ids if position_ids is not None else torch.arange(past, past + T, device=x.device)[None]
                pos = pos.expand(B, T)
            q, k = glue("fa", (q, k, cos, sin, pos), (p.qn, p.kn), cfg.compile_glue, eps=p.qk_eps, rope=p.fa_rope,
                         nope_a=float(layer.options.nope_a))
            o_fa = fa_attend(layer, p, q, k.transpose(1, 2), v.transpose(1, 2), cache, dpos, past)  # B, T, nf, d
        del q, k, v

    # ---- GDN heads: all in one kernel call per time block, the state carried over
    y_g = None
    if y_one is not None:
        y_g = y_one[:, None]
    elif ng:
        S = S_dec
        fused_step = T == 1 and S is not None
        W_g = p.W[p.n_fa_rows:]
        b_g = None if p.b is None else p.b[p.n_fa_rows:]
        blocks = [(0, T)] if one_gemm else [(s, min(s + tb, T)) for s in range(0, T, tb)]
        if len(blocks) > 1:
            y_g = x.new_empty(B, T, ng, d)
        for t0, t1 in blocks:
            zg = z[..., p.n_fa_rows:] if one_gemm else F.linear(x[:, t0:t1], W_g, b_g)
            cs = (cos[:, t0:t1], sin[:, t0:t1]) if cos is not None and p.gdn_rope else (None, None)
            ops = None
            if eg:  # the glue and the chunk forward in a graph-replayed block (zg copied into its input)
                y, S = prefill.gdn_block_graphed(layer, zg, *cs, S, tb)
                y = y[:, : t1 - t0]
            elif fused_step:  # one token: glue + recurrence + state write in one call (the state stays in cache.S)
                qg, kg, vg, a, b = zg.split(p.g_sizes, dim=-1)
                y_g = gdn_decode(layer, p, qg, kg, vg, a[..., :ng], b[..., :ng], cs, S, **(g_out or {}))
                S = None
                break
            else:
                ops = prefill.gdn_ops(prefill.gdn_cfg(layer, p, cs[0] is not None), zg, *cs, None, p.A_neg, p.dtb, p.qn, p.kn)
            del zg
            if one_gemm:  # the projection is no longer needed: free it before fla's intermediates
                gate = gate.clone() if gate is not None else None
                del z, z_fa
                z = z_fa = None
            if ops is not None:
                y, S = prefill.gdn_consume(ops, layer.scaling, S, p.gdn_kernel, layer.options.chunk_size, cfg.flash_qla)
            if len(blocks) > 1:
                y_g[:, t0:t1] = y
            else:
                y_g = y
        if cache is not None and S is not None:
            cache.S.copy_(S)
    del z, z_fa
    if cache is not None and dpos is None:
        cache.length = past + T

    # ---- fusion (eq. 13–14) in (FA, GDN) order, then o_proj with permuted input columns
    if deferred:  # o_fa is the split-K namespace, or the FA heads' output already in y_buf
        if combined:
            return DeferredOutput(y_buf.view(B, -1), None, p.Wo, p.bo)
        f = fa_fused_out(p, y_buf, gate)
        return DeferredOutput(y_buf.view(B, -1), (o_fa, f["gate"], f["gamma"], f["eps"]), p.Wo, p.bo)
    if y_buf is not None:  # done by the kernels
        del o_fa, y_g, gate
        return F.linear(y_buf.view(B, 1, -1), p.Wo, p.bo)
    if p.gamma is None and gate is None and (o_fa is None or y_g is None):
        y = (o_fa if o_fa is not None else y_g).reshape(B, T, -1)
    else:
        y = glue("out", (o_fa, gate, y_g), (p.gamma,), cfg.compile_glue, eps=p.eps)
    del o_fa, y_g, gate
    return F.linear(y, p.Wo, p.bo)
