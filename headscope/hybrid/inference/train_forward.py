"""The training-time forward of :class:`~headscope.hybrid.HeadwiseHybridAttention`, written for speed.

The plain forward (``layer.py``) projects with seven ``nn.Linear`` calls, gathers the FA and GDN heads
out of the query activations with ``index_select`` and scatters the two branches back into the
teacher's head order (``index_copy`` / ``cat`` + ``index_select``) before the fusion and ``o_proj``.
This path computes the same function with:

- **one input GEMM**: the rows of ``q_proj`` are gathered into (FA heads, GDN heads) order and stacked
  with ``k_proj``, ``v_proj``, ``g_proj``, ``gdn_k_proj``, ``gdn_v_proj``, ``a_proj`` and ``b_proj``
  into one weight; the output is split by columns. Gathering weight rows (a few hundred KB) replaces
  gathering activations (batch · time · heads · d);
- **no head permutation of activations**: the branch outputs are concatenated in (FA, GDN) order and
  the fusion's γ rows and ``o_proj``'s input columns are permuted to match, so
  ``o_proj(fuse(y))`` is unchanged;
- **all GDN heads of the layer in one kernel call**, behind :func:`torch.compiler.disable`, so a
  ``torch.compile`` of the decoder layer breaks the graph there once and compiles the two sides;
- only tensor indices and integer head counts read inside, so every layer with the same head counts
  shares one compiled graph (Dynamo guards on the counts, not on which heads).

It is taken when the layer has been prepared (:func:`prepare_fast`, done by the fast training step),
gradients are on, there is no cache and no attention mask, and the layer has no short convolution;
otherwise the plain forward runs. The numbers equal the plain forward's up to the summation order of
the fused GEMM (tested on CPU in fp32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from ..shapes import Float
from torch import Tensor

from ..attn import fa_attention, flash_attn_available
from .projections import stack_projections
from ..gdn import gated_delta_rule
from ..rope import apply_rope, nope_log_scale

if TYPE_CHECKING:  # pragma: no cover
    from ..layer import HeadwiseHybridAttention


@torch.compiler.disable
def _gdn_call(q, k, v, g, beta, scale, kernel, chunk_size):
    """The GDN kernel, outside any compiled graph (fla's kernels are opaque to Dynamo anyway)."""
    return gated_delta_rule(q, k, v, g, beta, scale=scale, kernel=kernel, chunk_size=chunk_size)[0]


def prepare_fast(layer: "HeadwiseHybridAttention", device: Optional[torch.device] = None) -> None:
    """Build the index tensors of the fast path on ``device`` (default: the layer's) and enable it.

    Sets plain attributes (not buffers: nothing enters the state dict): ``_fast_counts`` (n_fa, n_gdn,
    n_keep), ``_fast_rows`` (Long[H·d]: q_proj rows / o_proj columns in (FA, GDN) head order),
    ``_fast_heads`` (Long[H]: the head order, for γ) and ``_fast_fa_kv`` (Long[n_fa]: kept KV group of
    each FA head; used only when the FA heads are spread unevenly over their groups).
    """
    device = layer.q_proj.weight.device if device is None else torch.device(device)
    d = layer.head_dim
    order = list(layer.fa_heads) + list(layer.gdn_heads)
    layer._fast_rows = torch.tensor([h * d + i for h in order for i in range(d)], dtype=torch.long, device=device)
    layer._fast_heads = torch.tensor(order, dtype=torch.long, device=device)
    layer._fast_fa_kv = torch.tensor(layer._index_lists["fa_kv"] or [0], dtype=torch.long, device=device)
    # head counts as plain ints: Dynamo guards on their values only, not on which heads
    layer._fast_counts = (len(layer.fa_heads), len(layer.gdn_heads), len(layer.kv_keep))
    fa = layer.options.fa_kernel
    layer._fast_fa_kernel = "sdpa" if fa == "auto" and not flash_attn_available() else fa


def unprepare_fast(layer: "HeadwiseHybridAttention") -> None:
    """Turn the fast path off again (the plain forward runs)."""
    for name in ("_fast_rows", "_fast_heads", "_fast_fa_kv", "_fast_fa_kernel", "_fast_counts"):
        layer.__dict__.pop(name, None)


def fast_ready(layer: "HeadwiseHybridAttention", x: Tensor) -> bool:
    """True when the fast path applies to this call (prepared on x's device, gradients on, no short
    convolution); the caller checks that there is no cache and no attention mask."""
    rows = layer.__dict__.get("_fast_rows")
    return (
        rows is not None
        and torch.is_grad_enabled()
        and layer.gdn_conv is None
        and rows.device == x.device
    )


def _l2norm(x: Tensor, dtype: torch.dtype) -> Tensor:
    return F.normalize(x.float(), p=2, dim=-1, eps=1e-6).to(x.dtype).to(dtype)


def fast_forward(
    layer: "HeadwiseHybridAttention",
    x: Float[Tensor, "batch time hidden"],
    cos: Optional[Float[Tensor, "batch time d"]],
    sin: Optional[Float[Tensor, "batch time d"]],
    position_ids: Optional[Tensor] = None,
) -> Float[Tensor, "batch time hidden"]:
    """The layer's output (before the residual add) on a fresh sequence, without cache or mask.

    Args:
        layer: a prepared :class:`HeadwiseHybridAttention` (:func:`prepare_fast`).
        x: the layer's normalized input.
        cos, sin: rotary tables [batch or 1, time, d] (None only when no branch uses RoPE).
        position_ids: absolute positions for the NoPE coefficient (default 0..time-1).

    Returns:
        [batch, time, hidden], the same function as the plain forward.
    """
    B, T, _ = x.shape
    d, H, opts = layer.head_dim, layer.n_heads, layer.options
    n_fa, n_gdn, n_keep = layer._fast_counts
    if cos is not None and cos.shape[0] != B:
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    rows = layer._fast_rows

    # ---- one input GEMM over every projection of the layer
    parts = [(layer.q_proj, rows, 1)]
    if n_keep:
        parts += [(layer.k_proj, None, 1), (layer.v_proj, None, 1)]
    if layer.g_proj is not None:
        parts.append((layer.g_proj, None, 1))
    if n_gdn:
        parts += [(m, None, 1) for m in (layer.gdn_k_proj, layer.gdn_v_proj, layer.a_proj, layer.b_proj)]
    # a row width of 16·k columns keeps the q/k/v views aligned for SDPA (see sdpa_aligned)
    W, bias, sizes = stack_projections(parts, total_multiple=16)
    z = F.linear(x, W, bias).split(sizes, dim=-1)
    q = z[0].view(B, T, H, d)
    if layer.q_norm is not None:
        q = layer.q_norm(q)
    i = 1
    outs = []

    # ---- FA heads: softmax attention over their kept KV groups (GQA-native)
    if n_fa:
        q_fa = q[:, :, :n_fa]
        k = z[i].view(B, T, n_keep, d)
        v = z[i + 1].view(B, T, n_keep, d)
        i += 2
        if layer.k_norm is not None:
            k = layer.k_norm(k)
        if opts.fa_pos == "rope":
            q_fa, k = apply_rope(q_fa, cos, sin), apply_rope(k, cos, sin)
        else:
            pos = position_ids if position_ids is not None else torch.arange(T, device=x.device)[None]
            q_fa = q_fa * nope_log_scale(pos.expand(B, T), opts.nope_a)[..., None, None].to(q_fa.dtype)
        if not layer._fa_gqa:
            k, v = k.index_select(2, layer._fast_fa_kv), v.index_select(2, layer._fast_fa_kv)
        o = fa_attention(q_fa, k.transpose(1, 2), v.transpose(1, 2), layer.scaling, causal=True,
                         kernel=layer._fast_fa_kernel)
        if layer.g_proj is not None:
            o = o * torch.sigmoid(z[i].view(B, T, n_fa, d))
            i += 1
        outs.append(o)

    # ---- GDN heads: all of them in one kernel call
    if n_gdn:
        qg = q[:, :, n_fa:]
        kg = z[i].view(B, T, n_gdn, d)
        vg = z[i + 1].view(B, T, n_gdn, d)
        a, b = z[i + 2], z[i + 3]
        if layer.k_norm is not None:
            kg = layer.k_norm(kg)
        if opts.gdn_rope:
            qg, kg = apply_rope(qg, cos, sin), apply_rope(kg, cos, sin)
        qg, kg = _l2norm(qg, x.dtype), _l2norm(kg, x.dtype)
        beta = torch.sigmoid(b.float())
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
        y = _gdn_call(qg, kg, vg, g, beta.to(x.dtype) if x.dtype != torch.float32 else beta, layer.scaling,
                      opts.gdn_kernel, opts.chunk_size)
        outs.append(y.to(x.dtype))

    # ---- fusion (eq. 13–14) with γ in (FA, GDN) order, then o_proj with permuted input columns
    if len(outs) > 1:
        dt = torch.promote_types(outs[0].dtype, outs[1].dtype)
        y = torch.cat([o.to(dt) for o in outs], dim=2)
    else:
        y = outs[0]
    if layer.gamma is not None:
        yf = y.float()
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + opts.norm_eps)
        y = (layer.gamma.index_select(0, layer._fast_heads).float() * yf).to(y.dtype)
    w_o = layer.o_proj.weight.index_select(1, rows)
    return F.linear(y.reshape(B, T, H * d), w_o, layer.o_proj.bias)
