"""Softmax attention of the FA heads: flash-attn when importable (GQA-native), else PyTorch SDPA.

One entry point, :func:`fa_attention`, with one layout: queries ``[batch, time, q_head, d]`` (the
layer's layout), keys/values ``[batch, kv_head, kv_time, d]`` (the transformers cache layout). Grouped
query attention is native in both kernels: query head i reads KV head i // (q_head / kv_head), so no
K/V copy per query head is made (SDPA ``enable_gqa``; flash-attn takes fewer K/V heads as they are).

Kernel choice (``kernel``):

- ``"auto"``: flash-attn's ``flash_attn_func`` when the package imports, the tensors are on CUDA in
  fp16/bf16 and no explicit mask is given; otherwise ``torch.nn.functional.scaled_dot_product_attention``.
- ``"sdpa"``: always SDPA.
- ``"flash_attn"``: flash-attn (errors without it or on a device/dtype it cannot run); explicit masks
  (padding) still go to SDPA, since ``flash_attn_func`` takes none.

Causality is bottom-right aligned (query i of T sees keys ≤ S − T + i), as flash-attn ≥ 2.1 and the
transformers cache convention do; SDPA's ``is_causal`` is top-left aligned, so it is only used when
T = S and an explicit triangle is built otherwise.
"""

from __future__ import annotations

import importlib
import sys
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .gdn import module_found
from .shapes import Float

FAKernel = Literal["auto", "sdpa", "flash_attn"]
FA_KERNELS = ("auto", "sdpa", "flash_attn")


def flash_attn_available() -> bool:
    """True when the ``flash_attn`` package can be imported (no binary wheel exists for every Python/CUDA pair; it is optional).

    The package search runs once per process (a decode step must not pay for it)."""
    if "flash_attn" in sys.modules:
        return sys.modules["flash_attn"] is not None
    return module_found("flash_attn")


def _flash_attn_func():
    try:
        mod = importlib.import_module("flash_attn")
    except ImportError as e:
        raise ImportError(
            "fa_kernel='flash_attn' needs the flash-attn package (pip install flash-attn), "
            "or use fa_kernel='sdpa' / 'auto'"
        ) from e
    return mod.flash_attn_func


def flash_attn_usable(q: Tensor) -> bool:
    """flash-attn runs on CUDA tensors in fp16 / bf16 only."""
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def sdpa_aligned(t: Tensor, align_bytes: int = 16) -> Tensor:
    """``t`` itself when its storage offset and every stride but the last (which must be 1) are
    multiples of ``align_bytes``; else a contiguous copy.

    PyTorch's fused SDPA kernels on CUDA load rows with vector loads and do not check that a strided
    view starts and steps on aligned addresses: a view into a fused projection whose row width is not
    a multiple of 16 bytes (e.g. 64 + 3 + 3 fp32 columns) raised "CUDA error: misaligned address" on an
    H200 (torch 2.11; issue 16). CPU tensors are returned unchanged.
    """
    if t.device.type != "cuda" or is_aligned(t, align_bytes):
        return t
    return t.contiguous()


def is_aligned(t: Tensor, align_bytes: int = 16) -> bool:
    """Whether ``t`` starts on, and steps (every dimension of size > 1 but the last) by, a multiple of
    ``align_bytes``, with unit stride in the last dimension."""
    el = t.element_size()
    return t.stride(-1) == 1 and (t.storage_offset() * el) % align_bytes == 0 and all(
        (s * el) % align_bytes == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1
    )


def fa_attention(
    q: Float[Tensor, "batch time q_head d"],
    k: Float[Tensor, "batch kv_head kv_time d"],
    v: Float[Tensor, "batch kv_head kv_time d"],
    scale: float,
    causal: bool = True,
    mask: Optional[Tensor] = None,
    kernel: FAKernel = "auto",
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> Float[Tensor, "batch time q_head d"]:
    """softmax(scale · q kᵀ + mask) v per query head, GQA-native (query head i ↔ KV head i // r).

    Args:
        q: queries, time-major (the layer's layout); any strides.
        k, v: keys / values, head-major (the cache layout; a slice of a longer buffer is fine).
        scale: logit scale (1/√d for the teacher's attention).
        causal: bottom-right aligned causal mask (ignored when ``mask`` is given).
        mask: explicit bool (True = attend) or additive mask broadcastable to
            [batch, q_head, time, kv_time]; forces SDPA.
        kernel: ``"auto"``, ``"sdpa"`` or ``"flash_attn"`` (see the module docstring).
        window: sliding window w: query i (at position S − T + i) sees key j iff 0 ≤ pos_i − j < w
            (Mistral, Gemma 3 sliding layers; keys are the whole sequence from position 0). Applied
            only when ``mask`` is None (a model's 4-D mask of a sliding layer already holds it); forces SDPA.
        softcap: logit soft-capping c: s → c·tanh(s/c) before the mask (Gemma 2); computed
            explicitly in fp32 (no fused kernel takes it).

    Returns:
        attention output, [batch, time, q_head, d], in q's dtype.

    Raises:
        ValueError: unknown kernel, q heads not a multiple of KV heads, or ``"flash_attn"`` on a
            non-CUDA / non-half tensor.
        ImportError: ``"flash_attn"`` without the package.
    """
    if kernel not in FA_KERNELS:
        raise ValueError(f"fa_kernel must be one of {FA_KERNELS}, got {kernel!r}")
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
    use_flash = mask is None and (
        kernel == "flash_attn" or (kernel == "auto" and flash_attn_usable(q) and flash_attn_available())
    )
    if use_flash:
        if not flash_attn_usable(q):
            raise ValueError(
                f"fa_kernel='flash_attn' runs on CUDA in fp16/bf16, got {q.dtype} on {q.device}; "
                "use fa_kernel='sdpa' or 'auto'"
            )
        fn = _flash_attn_func()
        # flash-attn layout: [batch, time, head, d] for q, k and v; causal is bottom-right aligned
        return fn(q, k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=bool(causal and T > 1))
    is_causal = False
    if mask is None and causal and T > 1:
        if T == S:
            is_causal = True
        else:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    o = F.scaled_dot_product_attention(
        sdpa_aligned(q.transpose(1, 2)), sdpa_aligned(k), sdpa_aligned(v), attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=Hq != Hk
    )
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
