"""Softmax attention of one layer as the model computes it: causal, with an optional sliding window
and logit soft-capping, grouped K/V heads read without copies where the kernel allows.

Positions are absolute: keys sit at 0..T-1, queries at ``q_pos``. A key j is visible to query i iff
j <= i and, with a sliding window w, i - j < w (transformers' ``sliding_window_overlay``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from ..arch.parts import softcap as _softcap

# scaled_dot_product_attention broadcasts grouped K/V heads itself from torch 2.5 on (no K/V copies)
SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def visible(q_pos: Tensor, T: int, window: int | None) -> Bool[Tensor, "q T"]:
    """Mask [len(q_pos), T]: True where query position q_pos[i] may attend to key position j."""
    kp = torch.arange(T, device=q_pos.device)[None, :]
    m = kp <= q_pos[:, None]
    if window is not None:
        m &= kp > q_pos[:, None] - window
    return m


def scores(q: Tensor, k: Tensor, scaling: float, cap: float | None) -> Tensor:
    """Attention logits [B, H, S, T] (grouped K/V heads broadcast to their query heads), soft-capped."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
    return _softcap(torch.matmul(q, k.transpose(-1, -2)) * scaling, cap)


def probs(q: Tensor, k: Tensor, q_pos: Tensor, scaling: float, window: int | None = None,
          cap: float | None = None) -> Float[Tensor, "batch head q T"]:
    """Attention probabilities (softmax in float32, as transformers' eager attention)."""
    s = scores(q, k, scaling, cap).masked_fill(~visible(q_pos, k.shape[2], window), float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32)


def attend(
    q: Float[Tensor, "batch head q dh"],
    k: Float[Tensor, "batch_or_1 kv T dh"],
    v: Float[Tensor, "batch_or_1 kv T dh"],
    q_pos: Tensor,
    scaling: float,
    window: int | None = None,
    cap: float | None = None,
    matmul_dtype: torch.dtype | None = None,
) -> Float[Tensor, "batch q hd"]:
    """Causal attention of queries at absolute positions ``q_pos`` over keys 0..T-1 -> hook_z, flattened
    over heads. ``matmul_dtype``: compute in that dtype and cast back (low-precision screening)."""
    B, H, S, dh = q.shape
    T = k.shape[2]
    rep = H // k.shape[1]
    dt = q.dtype
    if matmul_dtype is not None:
        q, k, v = q.to(matmul_dtype), k.to(matmul_dtype), v.to(matmul_dtype)
    if cap is not None:  # soft-capping: no fused kernel applies it; eager softmax in float32
        p = probs(q, k, q_pos, scaling, window, cap).to(v.dtype)
        vv = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        out = torch.matmul(p, vv.expand(B, -1, -1, -1))
        return out.to(dt).transpose(1, 2).reshape(B, S, H * dh)
    contiguous = bool(S == 0 or (q_pos[-1] - q_pos[0] == S - 1 and int(q_pos[-1]) == T - 1))
    kw: dict = {}
    if rep > 1:
        if SDPA_GQA:
            kw["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            rep = 1
    if rep > 1 and q.device.type == "cpu" and k.shape[0] == B:
        # CPU: the query heads of one KV group become one longer query sequence over that group's K/V
        # (the same dot products; fewer, larger attention problems for the CPU kernel)
        mask = visible(q_pos, T, window).repeat(rep, 1)
        out = F.scaled_dot_product_attention(q.reshape(B, k.shape[1], rep * S, dh), k, v, attn_mask=mask,
                                             scale=scaling).view(B, H, S, dh)
    elif window is None and contiguous and S == T:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, **kw)
    elif window is None and contiguous:
        # queries are the last S positions: causal mask aligned to the lower right (flash/mem-efficient
        # kernels support it without materializing a mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(S, T), scale=scaling, **kw)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible(q_pos, T, window), scale=scaling, **kw)
    return out.to(dt).transpose(1, 2).reshape(B, S, H * dh)
