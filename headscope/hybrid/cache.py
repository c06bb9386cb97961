"""The preallocated decode cache of a hybrid layer and the attention-mask reading shared by its paths."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class HybridDecodeCache:
    """Preallocated cache of one hybrid layer (fixed shapes, written in place: CUDA-graph friendly).

    Attributes (n_keep = kept KV groups, n_gdn = GDN heads, d = head_dim, C = 3 · n_gdn · d):
        k, v: [batch, n_keep, max_len, d] K/V of the kept KV groups (None without FA heads).
        S: [batch, n_gdn, d, d] fp32 GDN state (None without GDN heads).
        conv: [batch, gdn_conv − 1, C] short-convolution tail (None without it).
        length: tokens cached (a Python int; a captured CUDA graph replays the step at the length it
            was captured with, writing K/V into the same slot).
        pos: None, or a [1] long tensor on the cache's device: the position of the next token, read by
            the step from device memory (device-position decoding, lean path only: one token per step,
            K/V written at ``pos``, attention masked to slots ≤ pos), so that one captured graph decodes at
            every length. The caller advances it and keeps ``length`` (see ``StaticDecoder.generate``).
        valid: None, or Bool[max_len] = slot ≤ pos, kept by that caller (one mask for every layer);
            without it the step computes it from ``pos``.
        n_valid: None, or a [1] long tensor = pos + 1 (the split-K decode's length), kept by that caller
            likewise; without it the step computes it.
        max_len: capacity in tokens.

    Made by :meth:`HeadwiseHybridAttention.new_decode_cache`; pass it as ``cache=`` to the layer.
    """

    def __init__(self, k: Optional[Tensor], v: Optional[Tensor], S: Optional[Tensor], conv: Optional[Tensor], max_len: int):
        self.k, self.v, self.S, self.conv = k, v, S, conv
        self.max_len = max_len
        self.length = 0
        self.pos: Optional[Tensor] = None
        self.valid: Optional[Tensor] = None
        self.n_valid: Optional[Tensor] = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def nbytes(self, length: Optional[int] = None) -> int:
        """Bytes held for ``length`` cached tokens (default: the current length): K/V up to the length
        plus the fixed GDN state and convolution tail."""
        n = self.length if length is None else length
        total = 0
        for t in (self.k, self.v):
            if t is not None:
                total += t[:, :, :n].numel() * t.element_size()
        for t in (self.S, self.conv):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def _write(self, k: Tensor, v: Tensor, past: int) -> tuple[Tensor, Tensor]:
        T = k.shape[2]
        if past + T > self.max_len:
            raise ValueError(
                f"HybridDecodeCache holds {self.max_len} tokens but {past + T} are needed; "
                "make it with a larger max_len"
            )
        self.k[:, :, past : past + T].copy_(k)
        self.v[:, :, past : past + T].copy_(v)
        return self.k[:, :, : past + T], self.v[:, :, : past + T]


def valid_tokens(mask: Optional[Tensor], q_len: int) -> Optional[Tensor]:
    """Bool[batch, q_len] — which of the current tokens are real, read off an attention mask.

    Accepts a 2-D padding mask [batch, kv_len] (1 = real), or a 4-D bool / additive float mask
    [batch, 1, q_len, kv_len] from ``transformers.masking_utils`` (a token is real iff it may attend
    to itself: the diagonal entry at kv index kv_len − q_len + i).
    """
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask[:, -q_len:].bool()
    if mask.dim() != 4:
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} is not understood (want 2-D or 4-D)")
    kv_len = mask.shape[-1]
    i = torch.arange(q_len, device=mask.device)
    if mask.shape[2] != q_len:
        raise ValueError(f"4-D attention mask has {mask.shape[2]} query rows but the input has {q_len} tokens")
    diag = mask[:, 0, i, kv_len - q_len + i]
    if diag.dtype == torch.bool:
        return diag
    return diag > torch.finfo(diag.dtype).min / 2  # additive mask: 0 = keep, very negative = masked
