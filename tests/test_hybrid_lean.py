"""The lean inference path (hybrid/lean.py) computes the plain forward's function.

On CPU the glue runs eagerly (the same code that torch.compile compiles on CUDA), with the PyTorch GDN
kernels; the GPU tests (skipped without CUDA) run the compiled glue, SDPA and fla.
"""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from headscope.hybrid.convert import migrate_from
from headscope.hybrid.inference import prefill
from headscope import HeadscopeInputError
from headscope.hybrid import HeadwiseHybridAttention, HybridOptions
from headscope.hybrid.gdn_kernels import fla_available, gdn_naive
from headscope.hybrid.inference import DEFAULT, forward, inference_config, use_inference
from inference_cfg import plain, use


def _planned(layer):
    """Whether the layer's lean backend ran (it keeps its inference plan in layer.backends)."""
    return layer.backends is not None and layer.backends.plan is not None

HID, H, KV, D = 48, 6, 2, 8


def _cfg(qwen=False):
    kw = dict(hidden_size=HID, num_attention_heads=H, num_key_value_heads=KV, head_dim=D, intermediate_size=64,
              num_hidden_layers=1, vocab_size=50, rope_theta=10000.0)
    cfg = Qwen3Config(**kw) if qwen else LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def _layer(fa, qwen=False, seed=0, gdn_kernel="torch", lean_path=True, **opts):
    torch.manual_seed(seed)
    cfg = _cfg(qwen)
    teacher = (Qwen3Attention if qwen else LlamaAttention)(cfg, 0)
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer = HeadwiseHybridAttention(cfg, 0, fa, HybridOptions(gdn_kernel=gdn_kernel, **opts), qk_norm=qwen)
    migrate_from(layer, teacher)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if any(s in n for s in ("a_proj", "b_proj", "g_proj", "gamma", "dt_bias", "A_log", "norm")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    if lean_path:
        use(layer)
    return layer.eval(), teacher.eval(), cfg


def _inputs(cfg, B, T, seed=3, device="cpu"):
    x = torch.randn(B, T, HID, generator=torch.Generator().manual_seed(seed)).to(device)
    cos, sin = LlamaRotaryEmbedding(cfg).to(device)(x, torch.arange(T, device=device)[None].expand(B, -1))
    return x, cos, sin


def _plain(layer, *a, **kw):
    with plain(layer):
        return layer(*a, **kw)[0]


CASES = [((1,), False, {}), ((0, 3), False, dict(fa_pos="nope", fa_gate=True)), ((0, 1, 3), False, {}),
         ((), False, {}), ((0, 1), False, dict(gdn_rope=False)), ((2,), True, {}), ((0, 4), True, dict(fa_gate=True))]
IDS = ["1fa", "nope-gate-two-groups", "uneven-groups", "all-gdn", "no-gdn-rope", "qwen3-qk-norm", "qwen3-gate"]


@pytest.mark.parametrize("fa,qwen,opts", CASES, ids=IDS)
def test_lean_prefill_and_decode_equal_plain_forward(fa, qwen, opts):
    """... and the one-token decode steps with the GDN step fused into the compiled glue (head_dim 8 here: the
    Triton step's fallback; the kernel's own test is tests/test_gdn_step.py and the 16-dim models of
    test_hybrid_graphs.py)."""
    layer, _, cfg = _layer(fa, qwen, **opts)
    B, T = 2, 37
    x, cos, sin = _inputs(cfg, B, T)
    with torch.no_grad():
        ref = _plain(layer, x, position_embeddings=(cos, sin))
        out, _ = layer(x, position_embeddings=(cos, sin))
        use(layer, gdn_block_tokens=2 * 10)  # GDN in 4 time blocks, the state carried over
        blocked, _ = layer(x, position_embeddings=(cos, sin))
        use(layer)
        dc = layer.new_decode_cache(B, max_len=T)
        pre, _ = layer(x[:, :30], position_embeddings=(cos[:, :30], sin[:, :30]), cache=dc)
        steps = [layer(x[:, t : t + 1], position_embeddings=(cos[:, t : t + 1], sin[:, t : t + 1]), cache=dc)[0]
                 for t in range(30, 34)]
        chunk, _ = layer(x[:, 34:], position_embeddings=(cos[:, 34:], sin[:, 34:]), cache=dc)  # 3 tokens at once
    assert _planned(layer)
    assert dc.length == T
    for got, want in ((out, ref), (blocked, ref), (pre, ref[:, :30]), (torch.cat(steps + [chunk], 1), ref[:, 30:])):
        assert (got - want).abs().max() < 1e-5


def test_all_fa_lean_layer_equals_teacher():
    layer, teacher, cfg = _layer(tuple(range(H)), fusion="none")
    x, cos, sin = _inputs(cfg, 2, 17)
    with torch.no_grad():
        ref, _ = teacher(x, position_embeddings=(cos, sin), attention_mask=None)
        out, _ = layer(x, position_embeddings=(cos, sin))
    assert (out - ref).abs().max() < 1e-5


def test_lean_gdn_heads_equal_naive_recurrence():
    """A layer with only GDN heads, fusion off, identity o_proj: its output is the token recurrence of
    eq. 7-8 (gdn_naive, fp64) on the L2-normalized, rotated q/k — computed here by hand."""
    from headscope.hybrid.rope import apply_rope

    layer, _, cfg = _layer((), fusion="none")
    with torch.no_grad():
        layer.o_proj.weight.copy_(torch.eye(HID))
    x, cos, sin = _inputs(cfg, 1, 29)
    with torch.no_grad():
        out, _ = layer(x, position_embeddings=(cos, sin))
        q = apply_rope(layer.q_proj(x).view(1, 29, H, D), cos, sin)
        k = apply_rope(layer.gdn_k_proj(x).view(1, 29, H, D), cos, sin)
        v = layer.gdn_v_proj(x).view(1, 29, H, D)
        q, k = torch.nn.functional.normalize(q, dim=-1, eps=1e-6), torch.nn.functional.normalize(k, dim=-1, eps=1e-6)
        beta = torch.sigmoid(layer.b_proj(x))
        g = -layer.A_log.exp() * torch.nn.functional.softplus(layer.a_proj(x) + layer.dt_bias)
        y, _ = gdn_naive(q, k, v, g, beta, scale=D**-0.5)
    assert (out - y.reshape(1, 29, H * D)).abs().max() < 1e-5


def test_inference_plan_follows_parameter_changes():
    layer, _, cfg = _layer((1,))
    x, cos, sin = _inputs(cfg, 1, 9)
    with torch.no_grad():
        layer(x, position_embeddings=(cos, sin))
        plan = layer.backends.plan
        layer.gamma.mul_(2.0)  # in place: the version counter changes
        ref = _plain(layer, x, position_embeddings=(cos, sin))
        out, _ = layer(x, position_embeddings=(cos, sin))
    assert layer.backends.plan is not plan
    assert (out - ref).abs().max() < 1e-5


def test_lean_path_is_skipped_with_gradients_masks_or_conv():
    layer, _, cfg = _layer((1,))
    x, cos, sin = _inputs(cfg, 1, 9)
    layer(x, position_embeddings=(cos, sin))  # gradients on: plain path
    assert not _planned(layer)
    with torch.no_grad():
        layer(x, position_embeddings=(cos, sin), attention_mask=torch.ones(1, 9))
        assert not _planned(layer)
        with pytest.raises(HeadscopeInputError, match="prefill='lean' does not apply to layer 0: .* short_conv"):
            _layer((1,), gdn_conv=4)  # named, a backend that does not apply is refused
        conv, _, _ = _layer((1,), gdn_conv=4, lean_path=False)
        use_inference(conv, replace(DEFAULT, prefill="auto", decode="auto"))  # auto: the reference
        conv(x, position_embeddings=(cos, sin))
        assert not _planned(conv)


def test_block_tokens_rule():
    assert prefill.block_tokens(8, 64) == 65536  # SmolLM2 layer at 7:1: 8 GDN heads of d 64
    assert prefill.block_tokens(14, 128) == 9344  # Qwen3-1.7B shape: 14 GDN heads of d 128
    assert prefill.block_tokens(1, 8) == (1 << 31) // 64 // 64 * 64
    # captured in a CUDA graph: a quarter of the tokens, a multiple of 64, at least GDN_GRAPH_BLOCK_MIN
    assert prefill.block_tokens(8, 64, 65536, graphed=True) == 16384
    assert prefill.block_tokens(14, 128, 131072, graphed=True) == 32768
    assert prefill.block_tokens(8, 64, 16 * 3000, graphed=True) == 11968  # 12000 rounded down to 64
    assert prefill.block_tokens(8, 64, 4096, graphed=True) == 2048
    cfg = replace(DEFAULT, gdn_graph_block_divisor=0)
    assert prefill.block_tokens(8, 64, 65536, graphed=True, cfg=cfg) == 65536
    cfg = replace(cfg, gdn_block_tokens=4096)
    assert prefill.block_tokens(8, 64, cfg=cfg) == 4096 == prefill.block_tokens(8, 64, 65536, graphed=True, cfg=cfg)


def spy_gdn_calls(monkeypatch) -> list:
    """The time length of every GDN kernel call (prefill.gdn_consume) made after this, appended to the returned list."""
    calls = []
    real = prefill.gdn_consume

    def spy(ops, *a, **kw):
        calls.append(ops[0].shape[1])
        return real(ops, *a, **kw)

    monkeypatch.setattr(prefill, "gdn_consume", spy)
    return calls


def test_graph_recorded_blocks_are_a_quarter_of_the_tokens(monkeypatch):
    """While a call is recorded for a graph (prefill.graph_blocks, patched here: CPU), a prefill's GDN heads run in blocks of
    tokens / gdn_graph_block_divisor, the state carried over, and the output equals the plain forward's."""
    layer, _, cfg = _layer((1,))
    B, T = 2, 256
    x, cos, sin = _inputs(cfg, B, T)
    calls = spy_gdn_calls(monkeypatch)
    use(layer, gdn_graph_block_min=64)
    monkeypatch.setattr(prefill, "graph_blocks", lambda x: True)
    with torch.no_grad():
        ref = _plain(layer, x, position_embeddings=(cos, sin))
        out, _ = layer(x, position_embeddings=(cos, sin))
    assert calls == [64, 64, 64, 64]  # B*T/4 = 128 tokens per call: 64 time steps of both sequences
    assert (out - ref).abs().max() < 1e-5
    calls.clear()
    monkeypatch.setattr(prefill, "graph_blocks", lambda x: False)
    with torch.no_grad():
        layer(x, position_embeddings=(cos, sin))
    assert calls == [T]  # eager: the speed rule's one call


def test_lean_path_is_cuda_only_by_default():
    layer, _, cfg = _layer((1,), lean_path=False)
    x, cos, sin = _inputs(cfg, 1, 9)
    use_inference(layer, DEFAULT)
    assert inference_config(layer) is DEFAULT and DEFAULT.prefill == "auto"
    assert layer.backends.backend(layer, "prefill", layer.q_proj.weight).name == "reference"  # auto on CPU
    with torch.no_grad():
        layer(x, position_embeddings=(cos, sin))
    assert not _planned(layer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fa", [(1,), (0, 3), tuple(range(H))], ids=["1fa", "two-groups", "all-fa"])
def test_lean_cuda_bf16_matches_plain_path_and_graph_replay(fa):
    """On CUDA (compiled glue, SDPA, fla when installed): lean prefill vs the plain path in bf16; the
    decode step captured in a CUDA graph equals the eager step and the full forward's last position."""
    layer, _, cfg = _layer(fa, gdn_kernel="auto")
    layer = layer.cuda().to(torch.bfloat16)
    B, T = 2, 300
    x, cos, sin = _inputs(cfg, B, T + 1, device="cuda")
    x, cos, sin = x.bfloat16(), cos.bfloat16(), sin.bfloat16()
    with torch.no_grad():
        ref = _plain(layer, x, position_embeddings=(cos, sin))
        out, _ = layer(x, position_embeddings=(cos, sin))
        scale = ref.float().abs().max()
        assert (out.float() - ref.float()).abs().max() < 3e-2 * scale
        dc = layer.new_decode_cache(B, T + 1)
        layer(x[:, :T], position_embeddings=(cos[:, :T], sin[:, :T]), cache=dc)
        S0 = dc.S.clone() if dc.S is not None else None
        x1, pe1 = x[:, T:], (cos[:, T:].contiguous(), sin[:, T:].contiguous())

        def step():
            dc.length = T
            return layer(x1, position_embeddings=pe1, cache=dc)[0]

        eager = step().clone()
        from headscope.hybrid.inference.graphs import capture

        graph, static = capture(step, warmup=3)
        if S0 is not None:
            dc.S.copy_(S0)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(static, eager)
    assert (eager[:, 0].float() - out[:, -1].float()).abs().max() < 3e-2 * scale


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla")
def test_fla_low_memory_stages_equal_flas_one_call_and_free_intermediates():
    """prefill.gdn_consume: fla's chunk forward stage by stage equals its one call (prefill.gdn) bit for bit (the same kernels),
    with and without an initial state, and holds less at its peak (bf16, 8 heads of d 64, 8192 tokens)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, n, d = 1, 8192, 8, 64
    def mk():
        q = torch.nn.functional.normalize(torch.randn(B, T, n, d, device="cuda", generator=g), dim=-1).bfloat16()
        k = torch.nn.functional.normalize(torch.randn(B, T, n, d, device="cuda", generator=g), dim=-1).bfloat16()
        v = torch.randn(B, T, n, d, device="cuda", generator=g).bfloat16()
        gg = -torch.rand(B, T, n, device="cuda", generator=g) * 0.1
        beta = torch.rand(B, T, n, device="cuda", generator=g).bfloat16()
        return [q, k, v, gg, beta]
    h0 = torch.randn(B, n, d, d, device="cuda", generator=g) * 0.1
    for init in (None, h0):
        peaks, outs = {}, {}
        for low in (False, True):
            ops = mk() if not outs else [t.clone() for t in keep]
            if not outs:
                keep = [t.clone() for t in ops]
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            if low:
                outs[low] = prefill.gdn_consume(ops, d ** -0.5, init, "fla", flash_qla=False)
                assert ops == []  # the call took the inputs
            else:
                outs[low] = prefill.gdn(*ops, d ** -0.5, init, "fla", flash_qla=False)
                del ops
            torch.cuda.synchronize()
            peaks[low] = torch.cuda.max_memory_allocated() - base
        assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
        assert peaks[True] < 0.8 * peaks[False], peaks


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("eager_graphs", ["never", "always"], ids=["blocks", "graph-blocks"])
def test_static_decoder_equals_full_forward_and_generate(family, eager_graphs):
    """Whole model through StaticDecoder (per-layer HybridDecodeCache, lean path): prefill + steps equal
    the full forward's logits; an all-FA mask with fusion off equals the teacher; transformers' generate (growing
    and static cache) = a cache-free greedy loop. With
    ``graph-blocks`` the prefills run the GDN heads as padded fixed-shape blocks (eager_gdn_graphs; on CPU
    without graphs), the two layers sharing the blocks' static buffers."""
    prefill.release_eager_graphs()
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3ForCausalLM

    from headscope.hybrid import hybridize
    from headscope.hybrid.inference.decoder import StaticDecoder
    from headscope.masks import HeadMask

    kw = dict(vocab_size=101, hidden_size=HID, intermediate_size=64, num_hidden_layers=2, num_attention_heads=H,
              num_key_value_heads=KV, head_dim=D, max_position_embeddings=512)
    torch.manual_seed(0)
    if family == "qwen2":  # q/k/v biases, no o bias (Qwen2 / Qwen2.5); random biases so that they matter
        teacher = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in kw.items() if k != "head_dim"})).eval()
        with torch.no_grad():
            for n, b in teacher.named_parameters():
                if n.endswith("_proj.bias"):
                    b.normal_(0, 0.5)
    else:
        teacher = (LlamaForCausalLM(LlamaConfig(**kw)) if family == "llama" else Qwen3ForCausalLM(Qwen3Config(**kw))).eval()
    ids = torch.randint(0, 101, (2, 15), generator=torch.Generator().manual_seed(1))
    hyb = hybridize(teacher, HeadMask(2, H, KV, ((1,), (0, 4))), gdn_kernel="torch").eval()
    allfa = hybridize(teacher, HeadMask(2, H, KV, (tuple(range(H)),) * 2), fusion="none").eval()
    for model in (hyb, allfa):
        use(model, eager_gdn_graphs=eager_graphs, eager_graph_min=16)
        with torch.no_grad():  # the lean backend computes every layer
            assert all(forward.applies(layer.self_attn, torch.zeros(1, 1, HID)) for layer in model.model.layers)
    with torch.no_grad():
        for model, ref_model in ((hyb, hyb), (allfa, teacher)):
            with plain(ref_model):
                full = ref_model(ids).logits
            dec = StaticDecoder(model, batch=2, max_len=20)
            got = [dec.prefill(ids[:, :11])] + [dec.step(ids[:, t : t + 1]) for t in range(11, 15)]
            assert dec.length == 15
            assert (torch.stack(got, 1) - full[:, 10:]).abs().max() < 1e-4
        ref = ids[:, :11]
        for _ in range(4):
            ref = torch.cat([ref, hyb(ref).logits[:, -1:].argmax(-1)], 1)
        for kw in ({}, {"cache_implementation": "static"}):  # decode steps: StaticDecoder.step_replayed
            assert torch.equal(hyb.generate(ids[:, :11], max_new_tokens=4, do_sample=False, **kw), ref), kw


def test_graphs_for_graph_marks_the_calls_it_wraps():
    from headscope.hybrid.inference import graphs

    assert not graphs.recording()
    with graphs.for_graph():
        assert graphs.recording()
        with graphs.for_graph():
            assert graphs.recording()
        assert graphs.recording()
    assert not graphs.recording()
    x = torch.zeros(1)
    with graphs.for_graph():
        assert not prefill.graph_blocks(x)  # CPU tensors: no graph


def test_fla_stages_free_each_input_when_no_later_stage_reads_it(monkeypatch):
    """prefill._fla_chunk_low_memory (CPU, fla's stages replaced by recording fakes): the stages run in fla's order with
    fla's arguments, v, β and A are gone before the state pass, w and u before the output, and the caller's list
    is emptied (the GPU test checks the real kernels' outputs bit for bit and the lower peak)."""
    import gc
    import weakref

    seen, refs = [], {}

    def cumsum(g, chunk_size, scale):
        seen.append(("cumsum", chunk_size, scale))
        return g * 2

    def intra(k, v, g, beta, chunk_size):
        seen.append(("intra", chunk_size))
        refs.update(v=weakref.ref(v), beta=weakref.ref(beta))
        w, u, A = k + 1, v + 1, torch.zeros(3)
        refs.update(A=weakref.ref(A), w=weakref.ref(w), u=weakref.ref(u))
        return w, u, A

    def fwd_h(k, w, u, g, initial_state, output_final_state, chunk_size):
        gc.collect()
        seen.append(("fwd_h", [n for n in ("v", "beta", "A") if refs[n]() is not None], output_final_state))
        return k * 0 + 5, u - w, torch.ones(1) if initial_state is None else initial_state + 1

    def fwd_o(q, k, v, h, g, scale, chunk_size):
        gc.collect()
        seen.append(("fwd_o", [n for n in ("w", "u") if refs[n]() is not None], scale))
        return q + v

    monkeypatch.setattr(prefill, "_fla_chunk_parts", lambda: (cumsum, intra, fwd_h, fwd_o, 1.4427))
    ops = [torch.full((2,), float(i)) for i in range(5)]  # q, k, v, g, beta
    o, final = prefill._fla_chunk_low_memory(ops, 0.125, None, 64)
    assert ops == []
    assert seen == [("cumsum", 64, 1.4427), ("intra", 64), ("fwd_h", [], True), ("fwd_o", [], 0.125)]
    # o = q + (u - w) = q + (v + 1) - (k + 1) = 0 + 2 - 1
    assert torch.equal(o, torch.full((2,), 1.0)) and torch.equal(final, torch.ones(1))
