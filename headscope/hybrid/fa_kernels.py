"""The FA heads' kernel choice beside the saved SDPA form (:mod:`.attn`): :func:`fa_attention` with ``kernel``
(``HybridOptions.fa_kernel``) — ``"auto"``: flash-attn's ``flash_attn_func`` where it imports and applies (CUDA,
fp16/bf16, no explicit mask; a sliding window as its ``window_size``, a soft-cap as its ``softcap``), else SDPA;
``"sdpa"``; ``"flash_attn"`` (errors without it; masks still go to SDPA). flash-attn is GQA-native and bottom-right
causal, as :mod:`.attn` is.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from . import attn
from .gdn_kernels import module_found
from .shapes import Float

FAKernel = Literal["auto", "sdpa", "flash_attn"]
FA_KERNELS = ("auto", "sdpa", "flash_attn")


def flash_attn_available() -> bool:
    """True when the ``flash_attn`` package can be found (no binary wheel exists for every Python/CUDA pair; it is
    optional). The package search runs once per process (a decode step must not pay for it)."""
    return module_found("flash_attn")


def flash_attn_function():
    """flash-attn's ``flash_attn_func`` (an import: a compiled caller resolves it beforehand and passes it to
    :func:`fa_attention` as ``flash_fn``). Raises ImportError: flash-attn not installed."""
    try:
        return importlib.import_module("flash_attn").flash_attn_func
    except ImportError as e:
        raise ImportError("fa_kernel='flash_attn' needs the flash-attn package (pip install flash-attn), "
                          "or use fa_kernel='sdpa' / 'auto'") from e


def flash_attn_usable(q: Tensor) -> bool:
    """flash-attn runs on CUDA tensors in fp16 / bf16 only."""
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def fa_attention(q: Float[Tensor, "batch time q_head d"], k: Float[Tensor, "batch kv_head kv_time d"],
                 v: Float[Tensor, "batch kv_head kv_time d"], scale: float, causal: bool = True,
                 mask: Optional[Tensor] = None, kernel: FAKernel = "auto", window: Optional[int] = None,
                 softcap: Optional[float] = None, flash_fn: Any = None) -> Float[Tensor, "batch time q_head d"]:
    """:func:`.attn.fa_attention` (same arguments, layouts and result) with the kernel choice of the module docstring;
    ``flash_fn``: :func:`flash_attn_function` resolved beforehand (a compiled caller: an import breaks the graph).

    Raises:
        ValueError: unknown kernel, q heads not a multiple of KV heads, or ``"flash_attn"`` on a non-CUDA /
            non-half tensor.
        ImportError: ``"flash_attn"`` without the package.
    """
    if kernel not in FA_KERNELS:
        raise ValueError(f"fa_kernel must be one of {FA_KERNELS}, got {kernel!r}")
    use_flash = mask is None and (kernel == "flash_attn" or (
        kernel == "auto" and flash_attn_usable(q) and flash_attn_available()))
    if not use_flash:
        return attn.fa_attention(q, k, v, scale, causal, mask, window, softcap)
    if not flash_attn_usable(q):
        raise ValueError(f"fa_kernel='flash_attn' runs on CUDA in fp16/bf16, got {q.dtype} on {q.device}; "
                         "use fa_kernel='sdpa' or 'auto'")
    if q.shape[2] % k.shape[1]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[1]} KV heads")
    # flash-attn layout: [batch, time, head, d] for q, k and v; causal and the window (i − j ≤ w − 1) bottom-right
    return (flash_fn or flash_attn_function())(q, k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                               causal=bool(causal and q.shape[1] > 1), softcap=float(softcap or 0.0),
                                               window_size=(int(window) - 1, 0) if window is not None else (-1, -1))
