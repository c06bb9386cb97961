"""Gated delta rule (eq. 7–8): chunked PyTorch form vs brute-force recurrence, hand numbers, dispatch."""

import math

import pytest
import torch
import torch.nn.functional as F

from headscope.hybrid.convert import migrate_from
from headscope.hybrid.gdn_kernels import fla_available, gated_delta_rule, gdn_chunked_torch, gdn_naive


def _inputs(B=2, T=37, H=3, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, dk, generator=g)
    k = F.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
    v = torch.randn(B, T, H, dv, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 2.0)
    beta = torch.rand(B, T, H, generator=g)
    h0 = torch.randn(B, H, dk, dv, generator=g)
    return q, k, v, gate, beta, h0


@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 16), (64, 64), (100, 64), (129, 32)])
def test_chunked_equals_naive_recurrence(T, chunk):
    q, k, v, g, beta, h0 = _inputs(T=T)
    y_ref, s_ref = gdn_naive(q, k, v, g, beta, initial_state=h0)
    y, s = gdn_chunked_torch(q, k, v, g, beta, initial_state=h0, chunk_size=chunk)
    assert (y - y_ref).abs().max() < 1e-5
    assert (s - s_ref).abs().max() < 1e-5


def test_state_carries_over_split_sequence():
    q, k, v, g, beta, h0 = _inputs(T=50)
    y_full, s_full = gdn_chunked_torch(q, k, v, g, beta, initial_state=h0, chunk_size=16)
    y1, s1 = gdn_chunked_torch(q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], initial_state=h0, chunk_size=16)
    y2, s2 = gdn_chunked_torch(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], beta[:, 23:], initial_state=s1, chunk_size=16)
    assert (torch.cat([y1, y2], 1) - y_full).abs().max() < 1e-5
    assert (s2 - s_full).abs().max() < 1e-5


def test_one_step_by_hand():
    # S_0 = 0: S_1 = β k vᵀ, y_1 = scale · β (k·q) v
    q = torch.tensor([1.0, 2.0]).view(1, 1, 1, 2)
    k = torch.tensor([0.6, 0.8]).view(1, 1, 1, 2)
    v = torch.tensor([3.0, -1.0, 0.5]).view(1, 1, 1, 3)
    g = torch.tensor([math.log(0.5)]).view(1, 1, 1)
    beta = torch.tensor([0.25]).view(1, 1, 1)
    for fn in (gdn_naive, gdn_chunked_torch):
        y, s = fn(q, k, v, g, beta, scale=1.0)
        # k·q = 0.6 + 1.6 = 2.2 ; y = 0.25 * 2.2 * v = 0.55 v
        assert torch.allclose(y.flatten(), torch.tensor([1.65, -0.55, 0.275]), atol=1e-6)
        assert torch.allclose(s[0, 0], 0.25 * torch.outer(k.flatten(), v.flatten()), atol=1e-6)
    # second step with k orthogonal to the first: state decays by α = 0.5 and the delta rule erases nothing
    q2 = torch.tensor([[[[1.0, 2.0]], [[0.0, 1.0]]]]).view(1, 2, 1, 2)
    k2 = torch.tensor([[0.6, 0.8], [-0.8, 0.6]]).view(1, 2, 1, 2)
    v2 = torch.tensor([[3.0, -1.0, 0.5], [1.0, 1.0, 1.0]]).view(1, 2, 1, 3)
    g2 = torch.full((1, 2, 1), math.log(0.5))
    b2 = torch.tensor([0.25, 1.0]).view(1, 2, 1)
    y, s = gdn_chunked_torch(q2, k2, v2, g2, b2, scale=1.0, chunk_size=2)
    s_hand = 0.5 * 0.25 * torch.outer(k2[0, 0, 0], v2[0, 0, 0]) + 1.0 * torch.outer(k2[0, 1, 0], v2[0, 1, 0])
    assert torch.allclose(s[0, 0], s_hand, atol=1e-6)
    assert torch.allclose(y[0, 1, 0], s_hand.T @ q2[0, 1, 0], atol=1e-6)


def test_padding_tokens_with_zero_beta_and_gate_leave_state_unchanged():
    q, k, v, g, beta, h0 = _inputs(T=10)
    beta[:, 3:6] = 0
    g[:, 3:6] = 0
    keep = [0, 1, 2, 6, 7, 8, 9]
    _, s_all = gdn_chunked_torch(q, k, v, g, beta, initial_state=h0, chunk_size=4)
    _, s_keep = gdn_naive(q[:, keep], k[:, keep], v[:, keep], g[:, keep], beta[:, keep], initial_state=h0)
    assert (s_all - s_keep).abs().max() < 1e-5


@pytest.mark.skipif(not fla_available(), reason="flash-linear-attention not installed (extra 'gdn')")
def test_matches_fla_naive_reference():
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, g, beta, h0 = _inputs(T=45)
    y_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    y, s = gdn_chunked_torch(q, k, v, g, beta, initial_state=h0, chunk_size=16)
    assert (y - y_ref).abs().max() < 1e-5
    assert (s - s_ref).abs().max() < 1e-5


def test_dispatch_errors():
    q, k, v, g, beta, _ = _inputs(T=4)
    with pytest.raises((ValueError, ImportError), match="gdn_kernel='torch'"):
        gated_delta_rule(q, k, v, g, beta, kernel="fla")
    with pytest.raises(ValueError, match="'auto', 'torch' or 'fla'"):
        gated_delta_rule(q, k, v, g, beta, kernel="cuda")
    with pytest.raises(ValueError, match="g and beta"):
        gdn_chunked_torch(q, k, v, g[:, :2], beta)
    y, _ = gated_delta_rule(q, k, v, g, beta, kernel="auto")
    assert (y - gdn_naive(q, k, v, g, beta)[0]).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla")
def test_fla_kernels_match_reference_bf16():
    q, k, v, g, beta, h0 = (t.cuda() for t in _inputs(B=1, T=300, H=4, dk=64, dv=64))
    y_ref, s_ref = gdn_chunked_torch(q, k, v, g, beta, initial_state=h0)
    bf = torch.bfloat16
    y, s = gated_delta_rule(q.to(bf), k.to(bf), v.to(bf), g, beta.to(bf), initial_state=h0, kernel="fla")
    assert (y.float() - y_ref).abs().max() < 5e-2 * y_ref.abs().max()
    assert (s.float() - s_ref).abs().max() < 5e-2 * s_ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla")
def test_fla_training_step_under_autocast_matches_torch_kernel():
    """How the trainer runs on a GPU: fp32 weights under bf16 autocast, so q/k (L2-normalized in fp32),
    v (bf16) and beta (fp32) come in mixed dtypes. fla's forward and backward must run and agree with
    the PyTorch kernel within bf16 tolerance (fla once failed to compile here)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from headscope.hybrid import HeadwiseHybridAttention, HybridOptions

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=64, num_hidden_layers=1, vocab_size=50)
    torch.manual_seed(0)
    teacher = LlamaAttention(cfg, 0)
    outs, grads = {}, {}
    for kernel in ("torch", "fla"):
        layer = HeadwiseHybridAttention(cfg, 0, (1,), HybridOptions(gdn_kernel=kernel)).cuda()
        migrate_from(layer, teacher.cuda())
        x = torch.randn(2, 300, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        cos, sin = LlamaRotaryEmbedding(cfg).cuda()(x, torch.arange(300, device="cuda")[None].expand(2, -1))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = layer(x, position_embeddings=(cos, sin))
        y.float().pow(2).mean().backward()
        outs[kernel] = y.float().detach()
        grads[kernel] = layer.q_proj.weight.grad.float().clone()
    scale = outs["torch"].abs().max()
    assert (outs["fla"] - outs["torch"]).abs().max() < 5e-2 * scale
    gs = grads["torch"].abs().max()
    assert (grads["fla"] - grads["torch"]).abs().max() < 1e-1 * gs


def test_flash_qla_takes_only_the_shapes_it_compiles():
    """FlashQLA 0.1.3's gate cumsum fails tilelang 0.1.15's layout inference at an odd number of heads ≥ 3 (lowered
    for sm_90 on the CPU at 1..40 heads; the H100 log benchmarks/results/logs/h100_generate_mistral_failed.log.gz):
    such calls, and head_dims other than 128, go to fla; the lean prefill backend's report says so. The Mistral-shape
    benchmark's random 7:1 mask (bench_generate.py --family mistral) has layers of both kinds."""
    import sys
    from pathlib import Path

    from headscope.hybrid import backends
    from headscope.hybrid.inference.prefill import flash_qla_applies, flash_qla_shape

    assert [n for n in range(1, 41) if flash_qla_shape(n, 128, 128)] == [1] + list(range(2, 41, 2))
    assert not any(flash_qla_shape(n, d, d) for n in (1, 2, 14, 28) for d in (64, 256))
    assert not flash_qla_shape(2, 128, 64)
    assert not flash_qla_applies(torch.zeros(1, 64, 28, 128, dtype=torch.bfloat16), torch.zeros(1, 64, 28, 128))
    lean = next(b for b in backends() if (b["role"], b["name"]) == ("prefill", "lean"))
    assert "flash_qla_shape" in lean["doc"] and "even number of GDN heads" in lean["doc"]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_hybrid_model import mask_7to1

    n_gdn = [32 - len(fa) for fa in mask_7to1(8, 32, 8).fa_heads]
    assert {flash_qla_shape(n, 128, 128) for n in n_gdn} == {True, False}, n_gdn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("H", [4, 3, 27])
def test_flash_qla_prefill_matches_reference_bf16(H):
    """prefill.gdn with flash_qla on (head_dim 128, bf16): FlashQLA's forward (H even) or fla's (H odd: FlashQLA's
    cumsum does not compile there) against the fp32 chunked reference, output and final state; with flash_qla off the
    same call takes fla's path."""
    from headscope.hybrid.inference import prefill

    if prefill._flash_qla_fwd() is None:
        pytest.skip("flash-qla not installed")
    q, k, v, g, beta, h0 = (t.cuda() for t in _inputs(B=1, T=1000, H=H, dk=128, dv=128))
    bf = torch.bfloat16
    args = (q.to(bf), k.to(bf), v.to(bf), g, beta.to(bf), 1.0 / math.sqrt(128), h0)
    y_ref, s_ref = gdn_chunked_torch(q, k, v, g, beta, scale=args[5], initial_state=h0)
    assert prefill.flash_qla_applies(args[0], args[2], True) == (H % 2 == 0)
    y, s = prefill.gdn(*args, kernel="fla", flash_qla=True)
    assert (y.float() - y_ref).abs().max() < 5e-2 * y_ref.abs().max()
    assert (s.float() - s_ref).abs().max() < 5e-2 * s_ref.abs().max()
    assert not prefill.flash_qla_applies(args[0], args[2], False)
