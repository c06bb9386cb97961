"""Softmax attention of the FA heads with PyTorch SDPA (what the saved modeling code runs).

Queries ``[batch, time, q_head, d]``, keys/values ``[batch, kv_head, kv_time, d]``; GQA-native (SDPA ``enable_gqa``);
causality bottom-right aligned (query i of T sees keys ≤ S − T + i, the transformers cache convention). flash-attn
and the kernel choice (``HybridOptions.fa_kernel``) are headscope's: ``headscope/hybrid/fa_kernels.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .shapes import Float


def sdpa_aligned(t: Tensor, align_bytes: int = 16) -> Tensor:
    """``t`` itself when its storage offset and every stride but the last (which must be 1) are
    multiples of ``align_bytes``; else a contiguous copy.

    PyTorch's fused SDPA kernels on CUDA load rows with vector loads and do not check that a strided
    view starts and steps on aligned addresses: a view into a fused projection whose row width is not
    a multiple of 16 bytes (e.g. 64 + 3 + 3 fp32 columns) raised "CUDA error: misaligned address" on an
    H200 (torch 2.11; issue 16). CPU tensors are returned unchanged, as is any tensor while torch.compile traces
    (``storage_offset()`` is a graph break there; Inductor aligns SDPA's inputs itself, ``sdpa_constraint``).
    """
    if not needs_alignment(t) or torch.compiler.is_compiling() or is_aligned(t, align_bytes):
        return t
    return t.contiguous()


def needs_alignment(t: Tensor) -> bool:
    """Whether SDPA reads ``t`` with vector loads that need aligned rows: on CUDA (a test emulates it on the CPU)."""
    return t.device.type == "cuda"


def is_aligned(t: Tensor, align_bytes: int = 16) -> bool:
    """Whether ``t`` starts on, and steps (every dimension of size > 1 but the last) by, a multiple of
    ``align_bytes``, with unit stride in the last dimension."""
    el = t.element_size()
    return t.stride(-1) == 1 and (t.storage_offset() * el) % align_bytes == 0 and all(
        (s * el) % align_bytes == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def fa_attention(q: Float[Tensor, "batch time q_head d"], k: Float[Tensor, "batch kv_head kv_time d"],
                 v: Float[Tensor, "batch kv_head kv_time d"], scale: float, causal: bool = True,
                 mask: Optional[Tensor] = None, window: Optional[int] = None,
                 softcap: Optional[float] = None) -> Float[Tensor, "batch time q_head d"]:
    """softmax(scale · q kᵀ + mask) v per query head -> [batch, time, q_head, d] in q's dtype (SDPA, GQA-native).

    ``mask``: bool (True = attend) or additive, broadcastable to [batch, q_head, time, kv_time] (else ``causal``);
    ``window`` w: query at position i sees key j iff 0 ≤ i − j < w (only when ``mask`` is None: a model's 4-D mask
    holds it); ``softcap`` c: logits s → c·tanh(s/c) before the mask, in fp32. Raises ValueError: q heads not a
    multiple of KV heads.
    """
    B, T, Hq, d = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if Hq % Hk:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hk} KV heads (GQA needs q_head = r · kv_head)")
    if window is not None and mask is None:
        i = torch.arange(S - T, S, device=q.device)[:, None]
        j = torch.arange(S, device=q.device)[None]
        mask = (j <= i) & (i - j < window)
    if softcap is not None:
        return _softcapped_attention(q, k, v, scale, mask, softcap, causal)
    is_causal = mask is None and causal and T > 1 and T == S
    if mask is None and causal and T > 1 and T != S:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    o = F.scaled_dot_product_attention(sdpa_aligned(q.transpose(1, 2)), sdpa_aligned(k), sdpa_aligned(v),
                                       attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=Hq != Hk)
    return o.transpose(1, 2)


def _softcapped_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Optional[Tensor], cap: float,
                          causal: bool) -> Tensor:
    """softmax(c·tanh(scale · q kᵀ / c) + mask) v in fp32 (eager, as transformers' Gemma 2 computes it);
    layouts as :func:`fa_attention`."""
    B, T, Hq, d = q.shape
    Hk, S = k.shape[1], k.shape[2]
    r = Hq // Hk
    kf, vf = k.float().repeat_interleave(r, 1), v.float().repeat_interleave(r, 1)
    s = torch.matmul(q.float().transpose(1, 2), kf.transpose(-1, -2)) * scale  # B, Hq, T, S
    s = torch.tanh(s / cap) * cap
    if mask is None and causal and T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    o = torch.matmul(torch.softmax(s, dim=-1), vf)
    return o.transpose(1, 2).to(q.dtype)
