"""The two-launch decode tail (headscope.hybrid.mlp_step): residual, RMSNorm, gated MLP, residual, next norm.

The kernels run through Triton's interpreter here (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA),
compiled on a GPU; skipped without triton. References: the Llama layer's own modules, and decode_mlp_torch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from headscope.hybrid import mlp_step
from headscope.hybrid.mlp_step import decode_mlp, decode_mlp_torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not mlp_step.applies(2, 64, 64, torch.device(DEV)),
                                  reason="needs triton and CUDA or TRITON_INTERPRET=1")


def _layers(hidden=40, inter=72, n=2):
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=10, num_hidden_layers=n, vocab_size=11, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    layers = [LlamaDecoderLayer(cfg, i).eval() for i in range(n)]
    with torch.no_grad():
        for layer in layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.add_(0.3 * torch.randn(hidden))
    return layers


def _args(layers, rows, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    l0, l1 = layers
    hidden = l0.mlp.gate_proj.weight.shape[1]
    h, a = torch.randn(rows, hidden, generator=g).to(dtype), torch.randn(rows, hidden, generator=g).to(dtype)
    W_gu = torch.cat([l0.mlp.gate_proj.weight, l0.mlp.up_proj.weight]).to(dtype)
    return (h, a, l0.post_attention_layernorm.weight.to(dtype), 1e-5, W_gu, l0.mlp.down_proj.weight.to(dtype),
            l1.input_layernorm.weight.to(dtype), 1e-5)


def test_torch_reference_equals_the_llama_modules():
    layers = _layers()
    h, a, *rest = _args(layers, 3)
    got_h, got_x = decode_mlp_torch(h, a, *rest)
    with torch.no_grad():
        r = h + a
        ref_h = r + layers[0].mlp(layers[0].post_attention_layernorm(r))
        ref_x = layers[1].input_layernorm(ref_h)
    assert (got_h - ref_h).abs().max() < 1e-6 and (got_x - ref_x).abs().max() < 1e-6


@needs_kernel
@pytest.mark.parametrize("rows,hidden,inter", [(3, 40, 72), (16, 64, 96), (1, 40, 72)])
@pytest.mark.parametrize("last", [False, True])
def test_kernels_equal_the_reference(rows, hidden, inter, last):
    """Hidden and intermediate sizes that are not multiples of the tiles (masks), one to 16 rows, with and
    without a next layer's norm; the partials in a fixed order (the same bits twice)."""
    args = list(_args(_layers(hidden, inter), rows))
    if last:
        args[6] = None
    ref_h, ref_x = decode_mlp_torch(*args)
    dev = [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in args]
    got_h, got_x = decode_mlp(*dev)
    assert (got_h.cpu() - ref_h).abs().max() < 1e-5
    if last:
        assert got_x is None
    else:
        assert (got_x.cpu() - ref_x).abs().max() < 1e-5
    again = decode_mlp(*dev)
    assert torch.equal(again[0], got_h)


@needs_kernel
def test_bad_input_names_the_fix():
    h, a, wp, ep, W_gu, W_d, wn, en = _args(_layers(), 3)
    h, a, wp, W_gu, W_d, wn = (t.to(DEV) for t in (h, a, wp, W_gu, W_d, wn))
    with pytest.raises(ValueError, match="shapes disagree"):
        decode_mlp(h, a, wp, ep, W_gu[:-1], W_d, wn, en)
    with pytest.raises(ValueError, match="1..16 rows"):
        decode_mlp(h.repeat(6, 1), a.repeat(6, 1), wp, ep, W_gu, W_d, wn, en)
    with pytest.raises(ValueError, match="contiguous"):
        decode_mlp(h, a, wp, ep, W_gu, W_d.t().contiguous().t(), wn, en)
    with pytest.raises(ValueError, match="one dtype"):
        decode_mlp(h, a.double(), wp, ep, W_gu, W_d, wn, en)


def test_applies_to_small_layers_and_few_rows_only():
    cpu_interp = mlp_step.kernel_applies(16, torch.device(DEV))
    assert mlp_step.applies(16, 576, 1536, torch.device(DEV)) == cpu_interp  # SmolLM2: 48 x 16 x 576 fp32 partials
    assert not mlp_step.applies(17, 576, 1536, torch.device(DEV))
    assert not mlp_step.applies(16, 2048, 6144, torch.device(DEV))  # Qwen3-1.7B: 25 MB of partials
    assert mlp_step.n_programs(1536) == 48 and mlp_step.n_programs(72) == 3


@needs_kernel
@pytest.mark.skipif(DEV != "cuda", reason="bf16 needs the compiled kernels (CUDA)")
def test_kernels_in_bf16_at_the_smollm2_shape():
    g = torch.Generator().manual_seed(0)
    H, I, M = 576, 1536, 16
    t = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(DEV, torch.bfloat16)  # noqa: E731
    args = (t(M, H), t(M, H), 1 + t(H, sc=0.1), 1e-5, t(2 * I, H, sc=H ** -0.5), t(H, I, sc=I ** -0.5), 1 + t(H, sc=0.1),
            1e-5)
    ref = decode_mlp_torch(*args)
    got = decode_mlp(*args)
    for r, o in zip(ref, got):
        assert ((o.float() - r.float()).abs() <= r.float().abs() * 2 ** -6 + 2e-2).all()  # bf16: GEMM rounding
