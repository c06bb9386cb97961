"""The FA heads' one-kernel decode prep (headscope.hybrid.inference.kernels.fa_prep): q/k glue + K/V cache write.

The Triton kernel runs through Triton's interpreter here (tests/conftest.py sets TRITON_INTERPRET=1 on
machines without CUDA), compiled on a GPU; skipped without triton. The reference is checked against a
hand-written computation (RMSNorm, half-split RoPE, log-scale NoPE coefficient) and the lean path's glue.
"""

from __future__ import annotations

import math

import pytest
import torch

from headscope.hybrid.convert import migrate_from
from headscope.hybrid.inference import decode, forward as fwd, plan as plan_mod
from headscope.hybrid.inference.kernels import fa_prep as fa_step
from headscope.hybrid.inference.kernels.fa_prep import fa_decode_prep, fa_decode_prep_torch

from conftest import fast_first, rope_and_qk_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not fa_step.applies(64, torch.device(DEV)),
                                  reason="needs triton and CUDA or TRITON_INTERPRET=1")


def _inputs(B, nf, nk, d, L, dtype, seed=0, rope=True, qkn=True):
    g = torch.Generator().manual_seed(seed)
    cols = (nf + 2 * nk) * d + 3  # one fused projection row: q, k, v (+ padding): strided views
    z = torch.randn(B, cols, generator=g).to(dtype)
    q = z[:, : nf * d].unflatten(-1, (nf, d))
    k = z[:, nf * d:(nf + nk) * d].unflatten(-1, (nk, d))
    v = z[:, (nf + nk) * d:(nf + 2 * nk) * d].unflatten(-1, (nk, d))
    kc, vc = torch.randn(B, nk, L, d, generator=g).to(dtype), torch.randn(B, nk, L, d, generator=g).to(dtype)
    kw = rope_and_qk_norm(B, d, dtype, g, rope, qkn)
    return (q, k, v, kc, vc), kw


def _hand(q, k, v, kw, positions=None, a=None):
    """The prep written out by hand in fp64: RMSNorm · w, then RoPE (x1 c − x2 s, x2 c + x1 s) or q · log(t+a)/log(a)."""
    qf, kf = q.double(), k.double()
    if "q_norm" in kw:
        qf = qf / torch.sqrt(qf.pow(2).mean(-1, keepdim=True) + kw["qk_eps"]) * kw["q_norm"].double()
        kf = kf / torch.sqrt(kf.pow(2).mean(-1, keepdim=True) + kw["qk_eps"]) * kw["k_norm"].double()
    if "cos" in kw:
        c, s = kw["cos"].double()[:, None], kw["sin"].double()[:, None]
        h = qf.shape[-1] // 2

        def rot(x):
            return torch.cat([x[..., :h] * c[..., :h] - x[..., h:] * s[..., :h],
                              x[..., h:] * c[..., h:] + x[..., :h] * s[..., h:]], -1)

        qf, kf = rot(qf), rot(kf)
    if a is not None:
        t = positions.double().reshape(-1).expand(q.shape[0])
        qf = qf * (torch.log(t + a) / math.log(a))[:, None, None]
    return qf, kf, v.double()


@pytest.mark.parametrize("rope,qkn", [(True, True), (True, False), (False, True)])
def test_torch_prep_equals_hand_computation(rope, qkn):
    (q, k, v, kc, vc), kw = _inputs(3, 2, 1, 16, 9, torch.float32, rope=rope, qkn=qkn)
    kc0, vc0 = kc.clone(), vc.clone()
    pos = None if rope else torch.tensor([5, 6, 7])
    a = None if rope else 500.0
    got = fa_decode_prep_torch(q, k, v, kc, vc, 4, positions=pos, nope_a=a, **kw)
    qr, kr, vr = _hand(q, k, v, kw, pos, a)
    assert (got.double() - qr).abs().max() < 1e-5
    assert (kc[:, :, 4].double() - kr).abs().max() < 1e-5 and torch.equal(vc[:, :, 4], v)
    others = [i for i in range(9) if i != 4]  # no other slot touched
    assert torch.equal(kc[:, :, others], kc0[:, :, others]) and torch.equal(vc[:, :, others], vc0[:, :, others])


@needs_kernel
@pytest.mark.parametrize("dtype,d,rope,qkn,slot_kind", [
    (torch.float32, 64, True, True, "int"), (torch.float32, 32, False, False, "tensor1"),
    (torch.float16, 128, True, False, "tensorB"), (torch.float32, 16, False, True, "tensor1"),
    (torch.float32, 64, True, False, "int1"), (torch.float16, 64, False, False, "int0")])
def test_kernel_equals_torch_prep(dtype, d, rope, qkn, slot_kind):
    B, nf, nk, L = 3, 3, 2, 11
    (q, k, v, kc, vc), kw = _inputs(B, nf, nk, d, L, dtype, rope=rope, qkn=qkn)
    q, k, v, kc, vc = (t.to(DEV) for t in (q, k, v, kc, vc))
    kw = {n: (t.to(DEV) if torch.is_tensor(t) else t) for n, t in kw.items()}
    # int slots 0 and 1: Triton would make an int argument equal to 1 a compile-time constant (not here)
    slot = {"int": 7, "int1": 1, "int0": 0, "tensor1": torch.tensor([7], device=DEV),
            "tensorB": torch.tensor([7, 2, 10], device=DEV)}[slot_kind]
    # NoPE positions: one per sequence, or one for all with stride 0 (as lean passes expanded position ids)
    pos = torch.tensor([7, 2, 10], device=DEV) if slot_kind != "tensor1" else torch.tensor([7], device=DEV).expand(3)
    nope = {} if rope else {"positions": pos, "nope_a": 500.0}
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = fa_decode_prep_torch(q, k, v, kc_ref, vc_ref, slot, **nope, **kw)
    got = fa_decode_prep(q, k, v, kc, vc, slot, **nope, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype and got.shape == (B, nf, d) and (got.float() - ref.float()).abs().max() < tol
    assert (kc.float() - kc_ref.float()).abs().max() < tol and torch.equal(vc, vc_ref)


def test_bad_input_names_the_problem():
    (q, k, v, kc, vc), kw = _inputs(2, 2, 1, 16, 5, torch.float32)
    with pytest.raises(ValueError, match="exclude each other"):
        fa_decode_prep_torch(q, k, v, kc, vc, 0, nope_a=500.0, positions=torch.tensor([0]), **kw)
    with pytest.raises(ValueError, match="caches must be"):
        fa_decode_prep_torch(q, k, v, kc[:, :, :, :8], vc[:, :, :, :8], 0)
    with pytest.raises(ValueError, match="positions"):
        fa_decode_prep_torch(q, k, v, kc, vc, 0, nope_a=500.0)
    with pytest.raises(ValueError, match="slot must be"):
        fa_decode_prep_torch(q, k, v, kc, vc, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="cos and sin must be"):
        fa_decode_prep_torch(q, k, v, kc, vc, 0, cos=kw["cos"][:, :8], sin=kw["sin"][:, :8])
    if fa_step.applies(16, torch.device(DEV)):
        with pytest.raises(ValueError, match="outside the cache"):
            fa_decode_prep(*(t.to(DEV) for t in (q, k, v, kc, vc)), 5)


@needs_kernel
def test_kernel_off_cuda_names_the_fix(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    (q, k, v, kc, vc), _ = _inputs(1, 1, 1, 16, 4, torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="fa_decode_prep_torch"):
        fa_decode_prep(q, k, v, kc, vc, 0)


def test_torch_prep_equals_the_lean_glue():
    """The reference = the lean path's FA glue (the function the kernel replaces), RoPE and NoPE."""
    (q, k, v, kc, vc), kw = _inputs(2, 2, 2, 16, 6, torch.float32)
    for rope in (True, False):
        pos = torch.tensor([[3], [3]])
        qg, kg = plan_mod._glue_fa(q[:, None], k[:, None], kw["cos"][:, None], kw["sin"][:, None], pos, kw["q_norm"],
                               kw["k_norm"], eps=kw["qk_eps"], rope=rope, nope_a=500.0)
        extra = {"cos": kw["cos"], "sin": kw["sin"]} if rope else {"positions": pos[:, 0], "nope_a": 500.0}
        got = fa_decode_prep_torch(q, k, v, kc, vc, 3, q_norm=kw["q_norm"], k_norm=kw["k_norm"], qk_eps=kw["qk_eps"],
                                   **extra)
        assert (got - qg[:, 0]).abs().max() < 1e-5 and (kc[:, :, 3] - kg[:, 0]).abs().max() < 1e-5


@needs_kernel
@pytest.mark.parametrize("fused_out", fast_first([True, False]))
@pytest.mark.parametrize("qwen,opts", fast_first([(True, {}), (False, {"fa_pos": "nope", "fa_gate": True}),
                                                  (True, {"fa_pos": "rope"}), (False, {"fusion": "none"})]))
def test_lean_decode_steps_with_the_prep_kernel_equal_the_plain_forward(monkeypatch, qwen, opts, fused_out):
    """A hybrid layer (head_dim 16, FA heads over two KV groups) decoding token by token through the lean path's
    one-launch step (FA prep + split-K partials + GDN step, step.py) gives the plain forward's outputs (Qwen3
    QK-norm, RoPE and NoPE); up to ``fused_out_max_d`` the output fusion (gate, per-head RMSNorm, γ_h ≠ 1) runs
    inside the split-K combination and the GDN step (no output glue), above it (``fused_out_max_d=0``) in the
    compiled glue."""
    _decode_vs_forward(monkeypatch, qwen, opts, fused_out_max_d=64 if fused_out else 0)


@needs_kernel
@pytest.mark.slow
def test_lean_decode_fused_output_with_a_group_of_two_fa_heads_and_its_head_dim_limit(monkeypatch):
    """FA heads 0 and 1 share a KV group (split-K with G = 2): the fused output equals the plain forward; above
    ``fused_out_max_d`` the step keeps the output glue."""
    _decode_vs_forward(monkeypatch, False, {"fa_gate": True}, fa=(0, 1))
    _decode_vs_forward(monkeypatch, True, {}, fused_out_max_d=8)


@needs_kernel
@pytest.mark.slow
def test_lean_decode_fused_output_at_head_dim_128(monkeypatch):
    """Qwen3's head_dim 128 with the output fusion allowed there (``fused_out_max_d`` = 128): the fused split-K
    combination and the GDN step with its per-head norm give the plain forward's outputs."""
    _decode_vs_forward(monkeypatch, True, {}, d=128, fused_out_max_d=128)


def _decode_vs_forward(monkeypatch, qwen, opts, fa=(0, 3), d=16, fused_out_max_d=64):
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from headscope.hybrid import HeadwiseHybridAttention, HybridOptions

    from inference_cfg import plain, use

    preps = []
    real = decode.fa_decode_prep
    monkeypatch.setattr(decode, "fa_decode_prep", lambda *a, **k: preps.append(1) or real(*a, **k))
    real_one = decode.hybrid_decode_step
    monkeypatch.setattr(decode, "hybrid_decode_step", lambda *a, **k: preps.append(2) or real_one(*a, **k))
    glues = []
    real_glue = fwd.glue
    monkeypatch.setattr(fwd, "glue", lambda name, *a, **k: glues.append(name) or real_glue(name, *a, **k))
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=d, intermediate_size=64,
              num_hidden_layers=1, vocab_size=50, rope_theta=10000.0)
    cfg = Qwen3Config(**kw) if qwen else LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    teacher = (Qwen3Attention if qwen else LlamaAttention)(cfg, 0)
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer = HeadwiseHybridAttention(cfg, 0, fa, HybridOptions(gdn_kernel="torch", **opts), qk_norm=qwen)
    migrate_from(layer, teacher)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if "norm" in n or n == "gamma":
                p.add_(0.2 * torch.randn(p.shape))
    layer = layer.eval().to(DEV)
    use(layer, fused_out_max_d=fused_out_max_d)
    B, T = 2, 12
    x = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(3)).to(DEV)
    cos, sin = LlamaRotaryEmbedding(cfg).to(DEV)(x, torch.arange(T, device=DEV)[None].expand(B, -1))
    with torch.no_grad():
        with plain(layer):
            ref, _ = layer(x, position_embeddings=(cos, sin))
        dc = layer.new_decode_cache(B, max_len=T)
        pre, _ = layer(x[:, :8], position_embeddings=(cos[:, :8], sin[:, :8]), cache=dc)
        steps = [layer(x[:, t:t + 1], position_embeddings=(cos[:, t:t + 1], sin[:, t:t + 1]), cache=dc,
                       position_ids=torch.tensor([[t]], device=DEV).expand(B, 1))[0] for t in range(8, T)]
    assert preps == [2] * (T - 8)  # every step through the one-launch step
    fused = d <= fused_out_max_d
    assert glues.count("out") == 1 + (0 if fused else T - 8)  # the prefill's, and the unfused steps'
    assert (torch.cat([pre] + steps, 1) - ref).abs().max() < (1e-5 if DEV == "cpu" else 1e-4)


@needs_kernel
def test_kernel_takes_one_rotary_row_for_the_batch():
    """cos/sin [1, d] (the same position for every sequence) = the rows repeated over the batch."""
    (q, k, v, kc, vc), kw = _inputs(3, 2, 1, 16, 6, torch.float32, qkn=False)
    q, k, v, kc, vc = (t.to(DEV) for t in (q, k, v, kc, vc))
    c, s_ = kw["cos"][:1].to(DEV), kw["sin"][:1].to(DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    got = fa_decode_prep(q, k, v, kc, vc, 2, cos=c, sin=s_)
    ref = fa_decode_prep_torch(q, k, v, kc2, vc2, 2, cos=c.expand(3, -1), sin=s_.expand(3, -1))
    assert (got - ref).abs().max() < 1e-5 and (kc - kc2).abs().max() < 1e-5
