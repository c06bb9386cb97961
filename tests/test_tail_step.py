"""The one-launch layer tail of a decode step (headscope.hybrid.inference.kernels.layer_tail): split-K combination, o_proj, residual,
RMSNorm, gated MLP, residual, next layer's input norm.

The kernel runs through Triton's interpreter here (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA; there
the phases are five launches), compiled on a GPU (one launch, grid-wide barriers); skipped without triton.
References: layer_tail_torch (itself checked against the Llama layer's modules), splitk.combine for the first phase.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from headscope.hybrid.inference.kernels import layer_tail as tail_step, one_launch as step, splitk
from headscope.hybrid.inference.kernels.layer_tail import layer_tail, layer_tail_torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not tail_step.applies(2, 64, 64, 64, torch.device(DEV)),
                                  reason="needs triton and CUDA or TRITON_INTERPRET=1")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weights(hidden, k_o, inter, dtype, g, bias=False, last=False, n_in=0):
    t = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(DEV, dtype)  # noqa: E731
    w = dict(w_o=t(hidden, k_o, sc=k_o ** -0.5), b_o=t(hidden) if bias else None, w_post=1 + t(hidden, sc=0.2),
             eps_post=1e-5, w_gu=t(2 * inter, hidden, sc=hidden ** -0.5), b_gu=t(2 * inter) if bias else None,
             w_down=t(hidden, inter, sc=inter ** -0.5), b_down=t(hidden) if bias else None,
             w_next=None if last else 1 + t(hidden, sc=0.2), eps_next=1e-6)
    if n_in:  # the next layer's input projection
        w.update(w_in=t(n_in, hidden, sc=hidden ** -0.5), b_in=t(n_in) if bias else None)
    return w


def test_torch_reference_equals_the_llama_modules():
    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                      num_hidden_layers=2, vocab_size=11, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    l0, l1 = (LlamaDecoderLayer(cfg, i).eval() for i in range(2))
    with torch.no_grad():
        for norm in (l0.post_attention_layernorm, l1.input_layernorm):
            norm.weight.add_(0.3 * torch.randn(48))
        h, y = torch.randn(3, 48), torch.randn(3, 48)
        W_gu = torch.cat([l0.mlp.gate_proj.weight, l0.mlp.up_proj.weight])
        got_h, got_x = layer_tail_torch(y, h, l0.self_attn.o_proj.weight, None, l0.post_attention_layernorm.weight,
                                        1e-5, W_gu, None, l0.mlp.down_proj.weight, None, l1.input_layernorm.weight,
                                        1e-5)
        h1 = h + l0.self_attn.o_proj(y)
        ref_h = h1 + l0.mlp(l0.post_attention_layernorm(h1))
        torch.testing.assert_close(got_h, ref_h, rtol=0, atol=1e-6)
        torch.testing.assert_close(got_x, l1.input_layernorm(ref_h), rtol=0, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("rows,hidden,k_o,inter,bias,last,n_in", [
    (3, 64, 48, 96, False, False, 0),    # k_o, hidden in 16-/64-column chunks; the next layer's input norm
    (1, 48, 80, 32, True, False, 80),    # biases, one row, k_o 80 = 5 chunks of 16; the next input projection
    (16, 32, 32, 160, False, True, 0),   # 16 rows, the last layer (no next norm)
    (2, 16, 16, 1120, True, False, 32),  # the down projection in 5 pieces of 224 columns (the last adds them)
])
def test_kernel_equals_the_reference(rows, hidden, k_o, inter, bias, last, n_in):
    g = torch.Generator().manual_seed(rows)
    w = _weights(hidden, k_o, inter, torch.float32, g, bias, last, n_in)
    y, h = torch.randn(rows, k_o, generator=g).to(DEV), torch.randn(rows, hidden, generator=g).to(DEV)
    ref_h, ref_x = layer_tail_torch(y, h, **w)
    got_h, got_x = layer_tail(y, h, **w)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-5)
    if last:
        assert got_x is None and ref_x is None
    else:
        torch.testing.assert_close(got_x, ref_x, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("Hq,Hk,kvi,fused", [(3, 1, False, True), (4, 2, False, False), (3, 2, True, True)])
def test_first_phase_is_the_split_k_combination(Hq, Hk, kvi, fused):
    """With ``attn`` (the one-launch step's partials, combine=False) the tail writes the FA heads' columns of y as
    splitk.combine does (the same Triton body: bit-equal), then continues as the reference on the completed y."""
    g = torch.Generator().manual_seed(Hq + Hk)
    B, d, L, ng, dt = 3, 16, 200, 2, torch.float32
    q = torch.randn(B, Hq, d, generator=g).to(DEV)
    k, v = torch.randn(B, Hk, d, generator=g).to(DEV), torch.randn(B, Hk, d, generator=g).to(DEV)
    kc, vc = torch.randn(B, Hk, L, d, generator=g).to(DEV), torch.randn(B, Hk, L, d, generator=g).to(DEV)
    length = torch.tensor([150, 31, 200]).to(DEV)
    gate = torch.randn(B, Hq, d, generator=g).to(DEV) if fused else None
    gamma = (1 + 0.2 * torch.randn(Hq, d, generator=g)).to(DEV) if fused else None
    y = torch.randn(B, Hq + ng, d, generator=g).to(DEV)  # the GDN columns: written before the tail
    sp, _ = step.hybrid_decode_step(q, k, v, kc, vc, length, d ** -0.5, kv_index=torch.tensor([0, 1, 1]).to(DEV)
                                    if kvi else None, out=y[:, :Hq], gate=gate, gamma=gamma, eps=1e-6, n_splits=3,
                                    combine=False)
    assert isinstance(sp.acc, torch.Tensor) and sp.o.data_ptr() == y.data_ptr()
    hidden, inter = 32, 48
    w = _weights(hidden, (Hq + ng) * d, inter, dt, g)
    h = torch.randn(B, hidden, generator=g).to(DEV)
    got_h, got_x = layer_tail(y.view(B, -1), h, **w, attn=(sp, gate, gamma, 1e-6))
    got_y = y.clone()
    splitk.combine(sp, gate, gamma, 1e-6)  # the separate combination kernel writes y's FA columns again
    assert torch.equal(got_y, y)
    ref_h, ref_x = layer_tail_torch(y.view(B, -1), h, **w)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_x, ref_x, rtol=1e-5, atol=1e-5)


def test_applies_and_bad_input_name_the_fix():
    interp = tail_step.applies(2, 64, 64, 64, torch.device(DEV))
    assert tail_step.applies(16, 576, 576, 1536, torch.device(DEV)) == interp  # SmolLM2
    assert not tail_step.applies(17, 576, 576, 1536, torch.device(DEV))  # more rows than one tile
    assert not tail_step.applies(2, 40, 64, 64, torch.device(DEV))  # hidden not a multiple of 16
    assert not tail_step.applies(2, 64, 72, 64, torch.device(DEV))  # o_proj input not a multiple of 16
    assert tail_step.applies(16, 2048, 2048, 6144, torch.device(DEV)) == interp  # Qwen3-1.7B
    assert [tail_step._chunk(k) for k in (576, 1536, 48, 80, 8)] == [64, 64, 16, 16, 0]
    assert [tail_step._stages(k) for k in (576, 1536, 2048, 48, 16)] == [10, 25, 25, 4, 2]  # every chunk in flight
    assert [tail_step.down_pieces(n) for n in (1536, 6144, 96, 1120, 8)] == [3, 12, 1, 5, 1]
    if not interp:
        return
    g = torch.Generator().manual_seed(0)
    w = _weights(32, 32, 48, torch.float32, g)
    y, h = torch.randn(2, 32).to(DEV), torch.randn(2, 32).to(DEV)
    with pytest.raises(ValueError, match="sizes disagree"):
        layer_tail(y, h[:, :16], **w)
    with pytest.raises(ValueError, match="rows a multiple of 16"):  # the next projection's rows
        layer_tail(y, h, **w, w_in=torch.randn(24, 32).to(DEV))
    with pytest.raises(ValueError, match="contiguous"):
        layer_tail(torch.randn(32, 2).to(DEV).t(), h, **w)
    with pytest.raises(ValueError, match="layer_tail_torch"):
        layer_tail(torch.randn(17, 32).to(DEV), torch.randn(17, 32).to(DEV), **w)


def test_a_precomputed_input_projection_equals_the_layers_own():
    """The lean decode step's z_in (what the tail kernel hands the next layer): the same output and cache as the layer
    computing x @ Wᵀ + b itself; a wrong shape names the fix."""
    from headscope.hybrid.inference import plan as plan_mod
    from headscope.hybrid.inference.forward import decode_step
    from inference_cfg import use
    from test_hybrid_graphs import _hybrid

    attn = _hybrid().model.layers[0].self_attn
    use(attn)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, attn.q_proj.weight.shape[1], generator=g)
    cos, sin = torch.randn(2, 1, attn.head_dim, generator=g), torch.randn(2, 1, attn.head_dim, generator=g)
    p = plan_mod.plan(attn)
    with torch.no_grad():
        z = torch.nn.functional.linear(x, p.W, p.b)
        c1, c2 = attn.new_decode_cache(2, 8), attn.new_decode_cache(2, 8)
        ref, _ = attn(x, position_embeddings=(cos, sin), cache=c1)
        got = decode_step(attn, torch.zeros_like(x), (cos, sin), None, c2, z_in=z)
        assert torch.equal(got, ref) and torch.equal(c1.S, c2.S) and torch.equal(c1.k, c2.k) and c2.length == 1
        with pytest.raises(ValueError, match="z_in must be the input projection"):
            decode_step(attn, x, (cos, sin), None, attn.new_decode_cache(2, 8), z_in=z[..., :-1])


def test_a_deferred_output_finishes_as_the_layers_own():
    """defer=True on a lean decode step of the one-launch path: a DeferredOutput (the split-K partials, o_proj's
    input with the GDN heads' columns written) whose finish() (the combination, then o_proj) is the plain output."""
    from headscope.hybrid.inference import decode
    from headscope.hybrid.inference.forward import decode_step
    from inference_cfg import use
    from test_hybrid_graphs import _hybrid

    if not tail_step.applies(2, 64, 64, 64, torch.device(DEV)) or DEV == "cuda":
        pytest.skip("the CPU model through Triton's interpreter")
    attn = _hybrid().model.layers[0].self_attn
    use(attn)
    g = torch.Generator().manual_seed(1)
    x0, x1 = (torch.randn(2, 1, attn.q_proj.weight.shape[1], generator=g) for _ in range(2))
    pe = [(torch.randn(2, 1, attn.head_dim, generator=g), torch.randn(2, 1, attn.head_dim, generator=g))
          for _ in range(2)]
    with torch.no_grad():
        c1, c2 = attn.new_decode_cache(2, 8), attn.new_decode_cache(2, 8)
        for c in (c1, c2):
            attn(x0, position_embeddings=pe[0], cache=c)
        ref, _ = attn(x1, position_embeddings=pe[1], cache=c1)
        d = decode_step(attn, x1, pe[1], None, c2, defer=True)
        assert isinstance(d, decode.DeferredOutput) and d.y.shape == (2, attn.q_proj.weight.shape[0])
        torch.testing.assert_close(d.finish(), ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(c1.S, c2.S) and torch.equal(c1.k, c2.k) and c2.length == 2


@gpu
def test_kernel_in_bf16_at_the_smollm2_shape_and_in_a_graph():
    """One launch with grid-wide barriers (132 programs on the H200): equals the reference within bf16 GEMM
    rounding, and replayed from a CUDA graph 50 times (the barrier counter only grows) gives the same result."""
    g = torch.Generator().manual_seed(0)
    w = _weights(576, 576, 1536, torch.bfloat16, g, n_in=1856)  # the hybrid's next input projection
    y, h = (torch.randn(16, 576, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    ref = layer_tail_torch(y, h, **w)
    got = layer_tail(y, h, **w)
    w0 = {k: v for k, v in w.items() if k not in ("w_in", "b_in")}  # the next input norm alone
    for r, o in zip(layer_tail_torch(y, h, **w0), layer_tail(y, h, **w0)):
        assert ((o.float() - r.float()).abs() <= r.float().abs() * 2 ** -6 + 2e-2).all()
    for r, o in zip(ref, got):
        assert ((o.float() - r.float()).abs() <= r.float().abs() * 2 ** -6 + 2e-2).all()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer_tail(y, h, **w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer_tail(y, h, **w)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], got[0]) and torch.equal(out[1], got[1])


@gpu
@pytest.mark.gpu
def test_kernel_in_fp32_at_the_mistral_shape():
    """Mistral-7B's layer sizes in fp32 (hidden 4096, o_proj input 4096, MLP 14336, the next input projection): the
    launch loads (with 25 pipeline stages it asked 305,152 B of shared memory, above the H100's 232,448; fp32 now takes
    12, layer_tail._stages) and equals the reference."""
    g = torch.Generator().manual_seed(1)
    w = _weights(4096, 4096, 14336, torch.float32, g, n_in=4608)
    y, h = (torch.randn(2, 4096, generator=g).to(DEV) for _ in range(2))
    for r, o in zip(layer_tail_torch(y, h, **w), layer_tail(y, h, **w)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)


@gpu
def test_graphed_greedy_decoding_with_the_tail_kernel(monkeypatch):
    """StaticDecoder with InferenceConfig.tail_kernel on CUDA (fp32: exact products): the greedy tokens of its graphed
    steps (step_replayed, what transformers' generate replays) equal the compiled tail's, one step's logits agree
    within fp32 rounding, and every decode step's layers took the kernel, with the split-K combination in the
    attention's launch (rows of ≤ 2 heads here)."""
    from dataclasses import replace

    import headscope.hybrid.inference.decoder as decoder
    from test_hybrid_graphs import _greedy, _hybrid

    from headscope.hybrid.inference import DEFAULT
    from headscope.hybrid.inference.decoder import StaticDecoder

    model = _hybrid("cuda")
    ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(3)).cuda()
    calls = []
    real = decoder.layer_tail
    with torch.no_grad():
        # the reference: the compiled tail
        ref_dec = StaticDecoder(model, batch=2, max_len=40, compile_tail=True,
                                config=replace(DEFAULT, tail_kernel=False))
        ref = _greedy(ref_dec, ids, 8, replayed=True)
        monkeypatch.setattr(decoder, "layer_tail", lambda *a, **k: calls.append(k["attn"] is not None) or real(*a, **k))
        dec = StaticDecoder(model, batch=2, max_len=40, compile_tail=True, config=DEFAULT)
        assert dec._tk is not None
        calls.clear()
        got = _greedy(dec, ids, 8, replayed=True)
        assert calls and not any(calls)  # the captured step's layers (and the warm-ups)
        assert torch.equal(got, ref)
        ref_dec.prefill(ids), dec.prefill(ids)
        torch.testing.assert_close(dec.step(ids[:, -1:]), ref_dec.step(ids[:, -1:]), rtol=1e-4, atol=1e-4)
