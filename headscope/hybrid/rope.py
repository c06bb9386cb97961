"""Rotary embedding (Llama half-split convention) and HypeNet's NoPE query coefficient."""

from __future__ import annotations

import math

import torch
from .shapes import Float
from torch import Tensor


def _rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(
    x: Float[Tensor, "batch time head d"], cos: Float[Tensor, "batch time d"], sin: Float[Tensor, "batch time d"]
) -> Float[Tensor, "batch time head d"]:
    """Rotary embedding in the half-split (Llama / GPT-NeoX) convention, on a [batch, time, head, d] tensor.

    cos/sin narrower than the head (``r = cos.shape[-1] < d``: partial rotary, GPT-NeoX ``rotary_pct``)
    rotate the first r features; the rest pass through unchanged."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    return x * cos[:, :, None, :] + _rotate_half(x) * sin[:, :, None, :]


def nope_log_scale(positions: Tensor, a: float) -> Tensor:
    """HypeNet's log-scale query coefficient s_t = log(t + a) / log(a) (positions t in tokens, 0-based)."""
    return torch.log(positions.to(torch.float32) + a) / math.log(a)
