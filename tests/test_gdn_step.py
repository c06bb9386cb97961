"""The one-kernel GDN decode step (headscope.hybrid.inference.kernels.gdn_step) against the gated delta rule reference.

The Triton kernel runs through Triton's interpreter here (tests/conftest.py sets TRITON_INTERPRET=1 on
machines without CUDA), compiled on a GPU; skipped without triton.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from headscope.hybrid.inference.kernels import gdn_step
from headscope.hybrid.gdn_kernels import gdn_naive
from headscope.hybrid.inference.kernels.gdn_step import gdn_decode_step, gdn_decode_step_torch

from conftest import rope_and_qk_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not gdn_step.applies(64, torch.device(DEV)),
                                  reason="needs triton and CUDA or TRITON_INTERPRET=1")


def _inputs(B, N, d, dtype, seed=0, rope=True, qkn=True):
    g = torch.Generator().manual_seed(seed)
    cols = 3 * N * d + 2 * N + 5  # one fused projection row: q, k, v, a, b (+ padding): strided views
    z = torch.randn(B, cols, generator=g).to(dtype)
    q, k, v = (z[:, i * N * d:(i + 1) * N * d].unflatten(-1, (N, d)) for i in range(3))
    a, b = z[:, 3 * N * d:3 * N * d + N], z[:, 3 * N * d + N:3 * N * d + 2 * N]
    S = torch.randn(B, N, d, d, generator=g) * 0.3
    A_neg = -torch.rand(N, generator=g) * 2
    dtb = torch.randn(N, generator=g)
    kw = rope_and_qk_norm(B, d, dtype, g, rope, qkn)
    return (q, k, v, a, b, S, A_neg, dtb), kw


def test_torch_step_equals_naive_recurrence_on_the_glued_inputs():
    """gdn_decode_step_torch = glue (RMSNorm, RoPE, L2, g, β) + one token of gdn_naive (fp64)."""
    (q, k, v, a, b, S, A_neg, dtb), kw = _inputs(2, 3, 16, torch.float32)
    S0 = S.clone()
    y = gdn_decode_step_torch(q, k, v, a, b, S, A_neg, dtb, 0.25, **kw)

    def glue(x, w):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + kw["qk_eps"]) * w
        h = x.shape[-1] // 2
        x = x * kw["cos"][:, None] + torch.cat((-x[..., h:], x[..., :h]), -1) * kw["sin"][:, None]
        return F.normalize(x, dim=-1, eps=1e-6)

    g = A_neg * F.softplus(a + dtb)
    y_ref, S_ref = gdn_naive(glue(q, kw["q_norm"])[:, None], glue(k, kw["k_norm"])[:, None], v[:, None], g[:, None],
                             torch.sigmoid(b)[:, None], scale=0.25, initial_state=S0)
    assert (y - y_ref[:, 0]).abs().max() < 1e-5 and (S - S_ref).abs().max() < 1e-5


@needs_kernel
@pytest.mark.parametrize("dtype,d,rope,qkn", [(torch.float32, 64, True, True), (torch.float32, 32, False, False),
                                              (torch.float16, 128, True, False), (torch.float32, 16, False, True)])
def test_kernel_equals_torch_step(dtype, d, rope, qkn):
    args, kw = _inputs(2, 3, d, dtype, rope=rope, qkn=qkn)
    args = [t.to(DEV) for t in args]
    kw = {k: (t.to(DEV) if torch.is_tensor(t) else t) for k, t in kw.items()}
    S_ref = args[5].clone()
    ref = gdn_decode_step_torch(*args[:5], S_ref, *args[6:], d ** -0.5, **kw)
    got = gdn_decode_step(*args, d ** -0.5, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype and (got.float() - ref.float()).abs().max() < tol
    assert (args[5] - S_ref).abs().max() < 1e-5  # the state, in place


@needs_kernel
def test_kernel_off_cuda_names_the_fix(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    args, _ = _inputs(1, 2, 16, torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        gdn_decode_step(*args, 1.0)


def test_bad_input_names_the_fix():
    (q, k, v, a, b, S, A_neg, dtb), _ = _inputs(1, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        gdn_decode_step(q[..., :12], k[..., :12], v[..., :12], a, b, S[..., :12, :12].contiguous(), A_neg, dtb, 1.0)
    with pytest.raises(ValueError, match="contiguous fp32"):
        gdn_decode_step(q, k, v, a, b, S.double(), A_neg, dtb, 1.0)
    with pytest.raises(ValueError, match="together"):
        gdn_decode_step(q, k, v, a, b, S, A_neg, dtb, 1.0, cos=torch.ones(1, 16))
    with pytest.raises(ValueError, match="rotate all d features"):  # partial rotary (GPT-NeoX): the PyTorch forms
        gdn_decode_step(q, k, v, a, b, S, A_neg, dtb, 1.0, cos=torch.ones(1, 4), sin=torch.zeros(1, 4))


@needs_kernel
def test_kernel_writes_into_a_given_output():
    """out= (the side-stream path allocates y on the stream that reads it): the same y, in that tensor; a wrong
    out is refused."""
    args, kw = _inputs(2, 3, 32, torch.float32)
    args = [t.to(DEV) for t in args]
    kw = {k: (t.to(DEV) if torch.is_tensor(t) else t) for k, t in kw.items()}
    S2 = args[5].clone()
    ref = gdn_decode_step(*args, 32 ** -0.5, **kw)
    out = torch.full((2, 3, 32), float("nan"), device=DEV)
    got = gdn_decode_step(*args[:5], S2, *args[6:], 32 ** -0.5, out=out, **kw)
    assert got is out and (out - ref).abs().max() < 1e-6
    with pytest.raises(ValueError, match="out must be"):
        gdn_decode_step(*args[:5], S2, *args[6:], 32 ** -0.5, out=out[:, :2], **kw)


@needs_kernel
@pytest.mark.parametrize("dtype,d", [(torch.float32, 32), (torch.float16, 64), (torch.float16, 128)])
def test_kernel_folds_the_output_fusion_into_a_strided_output(dtype, d):
    """gamma=: the step writes γ_h · y / RMS(y) (eq. 13–14, y rounded to the dtype first, as plan_mod._glue_out sees
    it) into a strided slice of a layer-wide [B, heads, d] buffer; the columns of the other heads stay untouched
    and the state is the unfused step's."""
    args, kw = _inputs(2, 3, d, dtype)
    args = [t.to(DEV) for t in args]
    kw = {k: (t.to(DEV) if torch.is_tensor(t) else t) for k, t in kw.items()}
    gamma = (1 + 0.5 * torch.randn(3, d, generator=torch.Generator().manual_seed(7))).to(DEV)
    S_ref = args[5].clone()
    y = gdn_decode_step_torch(*args[:5], S_ref, *args[6:], d ** -0.5, **kw).float()
    ref = (gamma * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    buf = torch.full((2, 5, d), 7.0, dtype=dtype, device=DEV)  # 2 FA heads first, then the 3 GDN heads
    got = gdn_decode_step(*args, d ** -0.5, out=buf[:, 2:], gamma=gamma, out_eps=1e-5, **kw)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert got.data_ptr() == buf[:, 2:].data_ptr() and (buf[:, 2:].float() - ref.float()).abs().max() < tol
    assert (buf[:, :2] == 7.0).all() and (args[5] - S_ref).abs().max() < 1e-5
    with pytest.raises(ValueError, match="gamma must have shape"):
        gdn_decode_step(*args, d ** -0.5, gamma=gamma[:2], **kw)
