"""The ``fused`` backend of the ``train`` role: the training-time forward of a HeadwiseHybridAttention with one input
GEMM, no head permutation of activations and all GDN heads in one operator (``gdn_op``: no graph break under
torch.compile); taken where InferenceConfig chooses it (``train="fused"``, or ``"auto"`` on CUDA) with gradients, no
cache and no mask. Equal to the reference up to summation order. Design: docs/hybrid.md, "Fused training forward"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from ..shapes import Float
from torch import Tensor

from ..fa_kernels import fa_attention, flash_attn_available, flash_attn_function
from .projections import stack_projections
from ..gdn_kernels import gated_delta_rule, gdn_op
from ..rope import apply_rope, nope_log_scale

if TYPE_CHECKING:  # pragma: no cover
    from ..layer import HeadwiseHybridAttention


class TrainIndex:
    """The fused training step's index tensors of one layer on one device (``LayerBackends.train_index``):
    ``rows`` (Long[H·d]: q_proj rows / o_proj columns in (FA, GDN) head order), ``heads`` (Long[H]: the head order,
    for γ), ``fa_kv`` (Long[n_fa]: kept KV group of each FA head; used only when the FA heads are spread unevenly
    over their groups), ``counts`` (n_fa, n_gdn, n_keep as plain ints: Dynamo guards on their values only, not on
    which heads), ``fa_kernel`` and ``flash_fn`` (flash-attn's function where it applies, else None)."""

    def __init__(self, layer: "HeadwiseHybridAttention", device: torch.device):
        d = layer.head_dim
        order = list(layer.fa_heads) + list(layer.gdn_heads)
        self.rows = torch.tensor([h * d + i for h in order for i in range(d)], dtype=torch.long, device=device)
        self.heads = torch.tensor(order, dtype=torch.long, device=device)
        self.fa_kv = torch.tensor(layer._index_lists["fa_kv"] or [0], dtype=torch.long, device=device)
        self.counts = (len(layer.fa_heads), len(layer.gdn_heads), len(layer.kv_keep))
        fa = layer.options.fa_kernel
        self.fa_kernel = "sdpa" if fa == "auto" and not flash_attn_available() else fa
        # flash-attn imported here, not while torch.compile traces fa_attention (an import breaks the graph)
        self.flash_fn = flash_attn_function() if self.fa_kernel != "sdpa" and flash_attn_available() else None


def train_index(layer: "HeadwiseHybridAttention", device: Optional[torch.device] = None) -> TrainIndex:
    """The layer's :class:`TrainIndex` on ``device`` (default: the layer's), built once and kept in
    ``layer.backends`` (a compiled step builds it before capture: ``headscope.train.fast``)."""
    device = layer.q_proj.weight.device if device is None else torch.device(device)
    held = layer.backends
    ix = held.train_index if held is not None else None
    if ix is None or ix.rows.device != device:
        ix = TrainIndex(layer, device)
        if held is not None:
            held.train_index = ix
    return ix


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
        layer: a :class:`HeadwiseHybridAttention` (the ``fused`` train backend: LayerSpec features of Llama, Qwen2,
            Qwen3, GPT-NeoX; no short convolution).
        x: the layer's normalized input.
        cos, sin: rotary tables [batch or 1, time, d] (None only when no branch uses RoPE).
        position_ids: absolute positions for the NoPE coefficient (default 0..time-1).

    Returns:
        [batch, time, hidden], the same function as the plain forward.
    """
    B, T, _ = x.shape
    d, H, opts = layer.head_dim, layer.n_heads, layer.options
    ix = train_index(layer, x.device)
    n_fa, n_gdn, n_keep = ix.counts
    if cos is not None and cos.shape[0] != B:
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    rows = ix.rows

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

    if n_fa:  # FA heads: softmax attention over their kept KV groups (GQA-native)
        outs.append(_fa_heads(layer, ix, x, q[:, :, :n_fa], z[i:], cos, sin, position_ids))
        i += 3 if layer.g_proj is not None else 2
    if n_gdn:  # GDN heads: one kernel call; compiled: one operator (gdn_op: no graph break), eager: its own autograd
        a = (*_gdn_inputs(layer, n_gdn, x, q[:, :, n_fa:], z[i:], cos, sin), layer.gdn_scale, opts.gdn_kernel,
             opts.chunk_size)
        yg = gdn_op(*a) if torch.compiler.is_compiling() else gated_delta_rule(*a[:6], None, *a[6:])[0]
        outs.append(yg.to(x.dtype))

    # ---- fusion (eq. 13–14) with γ in (FA, GDN) order, then o_proj with permuted input columns
    if len(outs) > 1:
        dt = torch.promote_types(outs[0].dtype, outs[1].dtype)
        y = torch.cat([o.to(dt) for o in outs], dim=2)
    else:
        y = outs[0]
    if layer.gamma is not None:
        yf = y.float()
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + opts.norm_eps)
        y = (layer.gamma.index_select(0, ix.heads).float() * yf).to(y.dtype)
    w_o = layer.o_proj.weight.index_select(1, rows)
    return F.linear(y.reshape(B, T, H * d), w_o, layer.o_proj.bias)


def _fa_heads(layer: "HeadwiseHybridAttention", ix: TrainIndex, x: Tensor, q_fa: Tensor, z: tuple, cos: Any,
              sin: Any, position_ids: Optional[Tensor]) -> Tensor:
    """The FA heads' output [B, T, n_fa, d] from their queries and the projection's next parts z (k, v[, gate])."""
    B, T, _ = x.shape
    d, opts = layer.head_dim, layer.options
    n_fa, n_keep = ix.counts[0], ix.counts[2]
    k, v = z[0].view(B, T, n_keep, d), z[1].view(B, T, n_keep, d)
    if layer.k_norm is not None:
        k = layer.k_norm(k)
    if opts.fa_pos == "rope":
        if layer.spec.rope:  # a NoPE layer of the teacher stays without positions
            q_fa, k = apply_rope(q_fa, cos, sin), apply_rope(k, cos, sin)
    else:
        pos = position_ids if position_ids is not None else torch.arange(T, device=x.device)[None]
        q_fa = q_fa * nope_log_scale(pos.expand(B, T), opts.nope_a)[..., None, None].to(q_fa.dtype)
    if not layer._fa_gqa:
        k, v = k.index_select(2, ix.fa_kv), v.index_select(2, ix.fa_kv)
    o = fa_attention(q_fa, k.transpose(1, 2), v.transpose(1, 2), layer.scaling, True, None, ix.fa_kernel,
                     layer.spec.window, layer.spec.softcap, ix.flash_fn)
    if layer.g_proj is not None:
        o = o * torch.sigmoid(z[2].view(B, T, n_fa, d))
    return o


def _gdn_inputs(layer: "HeadwiseHybridAttention", n_gdn: int, x: Tensor, qg: Tensor, z: tuple, cos: Any,
                sin: Any) -> tuple:
    """The GDN kernel's q, k, v [B, T, n_gdn, d], g, beta [B, T, n_gdn] from the GDN queries and z (k, v, a, b);
    ``n_gdn`` from TrainIndex.counts (``len(layer.gdn_heads)`` would guard on which heads: a graph per head set)."""
    (B, T, _), d = x.shape, layer.head_dim
    kg, vg, a, b = z[0].view(B, T, n_gdn, d), z[1].view(B, T, n_gdn, d), z[2], z[3]
    if layer.k_norm is not None:
        kg = layer.k_norm(kg)
    if layer.options.gdn_rope and layer.spec.rope:
        qg, kg = apply_rope(qg, cos, sin), apply_rope(kg, cos, sin)
    qg, kg = _l2norm(qg, x.dtype), _l2norm(kg, x.dtype)
    beta = torch.sigmoid(b.float())
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    return qg, kg, vg, g, beta.to(x.dtype) if x.dtype != torch.float32 else beta
