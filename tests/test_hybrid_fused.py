"""hybrid/fused.stack_projections: one GEMM equals the separate projections (values, padding, gradients)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headscope.hybrid.inference.projections import stack_projections


@pytest.mark.parametrize("bias", [(False, False, False), (True, False, True), (True, True, True)])
def test_one_gemm_equals_the_separate_projections(bias):
    torch.manual_seed(0)
    q, k, a = nn.Linear(12, 8, bias=bias[0]), nn.Linear(12, 4, bias=bias[1]), nn.Linear(12, 3, bias=bias[2])
    rows = torch.tensor([6, 7, 0, 1])  # two "heads" of q, reordered
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    for m in (q, k, a):
        m.double()
    W, b, sizes = stack_projections([(q, rows, 1), (k, None, 1), (a, None, 8)], total_multiple=16)
    # 4 + 4 + (3 padded to 8) = 16 rows: no trailing block
    assert sizes == [4, 4, 8] and W.shape == (16, 12) and (b is None) == (not any(bias))
    zq, zk, za = nn.functional.linear(x, W, b).split(sizes, dim=-1)
    torch.testing.assert_close(zq, q(x)[..., rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(zk, k(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(za[..., :3], a(x), rtol=0, atol=1e-12)
    assert (za[..., 3:] == 0).all()
    # gradients reach the modules exactly as through the separate maps
    (zq.pow(2).sum() + zk.sum() + za[..., :3].sin().sum()).backward()
    g_fused = [m.weight.grad.clone() for m in (q, k, a)]
    for m in (q, k, a):
        m.weight.grad = None
    (q(x)[..., rows].pow(2).sum() + k(x).sum() + a(x).sin().sum()).backward()
    for gf, m in zip(g_fused, (q, k, a)):
        torch.testing.assert_close(gf, m.weight.grad, rtol=1e-12, atol=1e-12)


def test_trailing_padding_and_bad_arguments():
    lin = nn.Linear(6, 5)
    W, b, sizes = stack_projections([(lin, None, 1)], total_multiple=16)
    assert sizes == [5, 11] and W.shape == (16, 6) and b.shape == (16,)
    assert (W[5:] == 0).all() and (b[5:] == 0).all()
    with pytest.raises(ValueError, match="at least one part"):
        stack_projections([])
    with pytest.raises(ValueError, match="multiples"):
        stack_projections([(lin, None, 0)])
