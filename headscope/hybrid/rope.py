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
    """Rotary embedding in the half-split (Llama) convention, on a [batch, time, head, d] tensor."""
    return x * cos[:, :, None, :] + _rotate_half(x) * sin[:, :, None, :]


def nope_log_scale(positions: Tensor, a: float) -> Tensor:
    """HypeNet's log-scale query coefficient s_t = log(t + a) / log(a) (positions t in tokens, 0-based)."""
    return torch.log(positions.to(torch.float32) + a) / math.log(a)
