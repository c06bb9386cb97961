"""One weight for several projections of the same input: the fused input GEMM of the hybrid layer.

Both the training path (``train_forward.py``, rebuilt every call so that gradients flow into the parameters)
and the inference path (``plan.py``, built once per parameter version) stack the layer's projections
with :func:`stack_projections` and split the GEMM's output by the returned column sizes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ..shapes import Float


def stack_projections(
    parts: Sequence[tuple[nn.Linear, Optional[Tensor], int]], total_multiple: int = 1
) -> tuple[Float[Tensor, "rows hidden"], Optional[Float[Tensor, "rows"]], list[int]]:
    """Stack the rows of several linear maps into one weight (and bias).

    ``parts``: (module, rows, row_multiple) per projection — ``rows`` (Long[k] or None = all) selects output rows, zero
    rows pad the part to a multiple of ``row_multiple`` (later column slices start aligned); ``total_multiple``: zero
    rows at the end up to a multiple of this (16 columns keep views 16-byte aligned for SDPA). Returns (W [Σ rows,
    hidden], b or None, rows per part plus the trailing padding), differentiable in the parameters, so
    ``F.linear(x, W, b).split(sizes, -1)`` equals the separate projections. Raises ValueError: no parts, a multiple < 1.
    """
    if not parts or total_multiple < 1 or any(m < 1 for _, _, m in parts):
        raise ValueError("stack_projections needs at least one part and multiples >= 1")
    ws, bs, has_bias = [], [], any(mod.bias is not None for mod, _, _ in parts)
    for mod, rows, mult in parts:
        w = mod.weight if rows is None else mod.weight.index_select(0, rows)
        b = None
        if has_bias:
            b = mod.bias if rows is None or mod.bias is None else mod.bias.index_select(0, rows)
            b = w.new_zeros(w.shape[0]) if b is None else b
        pad = -w.shape[0] % mult
        if pad:
            w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
            b = None if b is None else torch.cat([b, b.new_zeros(pad)])
        ws.append(w)
        bs.append(b)
    sizes = [w.shape[0] for w in ws]
    pad = -sum(sizes) % total_multiple
    if pad:
        ws.append(ws[0].new_zeros(pad, ws[0].shape[1]))
        bs.append(None if not has_bias else ws[0].new_zeros(pad))
        sizes.append(pad)
    return torch.cat(ws), (torch.cat(bs) if has_bias else None), sizes
