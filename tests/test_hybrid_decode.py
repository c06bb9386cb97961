"""Hybrid layer: static decode cache (decode step = full forward), low-memory path, FA kernel dispatch."""

import dataclasses
import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

import headscope.hybrid.fa_kernels as attn_mod
import headscope.hybrid.gdn_kernels as gdn_kernels
import headscope.hybrid.layer as layer_mod
from headscope.hybrid.convert import migrate_from
from headscope.hybrid import HeadwiseHybridAttention, HybridCache, HybridOptions, use_inference
from headscope.hybrid.gdn_kernels import gdn_naive, gdn_recurrent_torch

HID, H, KV, D = 48, 6, 2, 8  # groups of 3 query heads


def _cfg():
    cfg = LlamaConfig(hidden_size=HID, num_attention_heads=H, num_key_value_heads=KV, head_dim=D,
                      intermediate_size=64, num_hidden_layers=1, vocab_size=50, rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"  # the teacher module alone: SDPA is causal without a mask
    return cfg


def _layer(fa, seed=0, **opts):
    torch.manual_seed(seed)
    cfg = _cfg()
    teacher = LlamaAttention(cfg, 0)
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer = HeadwiseHybridAttention(cfg, 0, fa, HybridOptions(gdn_kernel="torch", **opts))
    use_inference(layer)  # headscope's kernels (flash-attn where it applies) for the reference forward
    migrate_from(layer, teacher)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-trivial new parameters
        for n, p in layer.named_parameters():
            if any(s in n for s in ("a_proj", "b_proj", "g_proj", "gdn_conv", "gamma", "dt_bias", "A_log")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return layer.eval(), teacher.eval(), cfg


def _inputs(cfg, B, T, seed=3):
    x = torch.randn(B, T, HID, generator=torch.Generator().manual_seed(seed))
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(T)[None].expand(B, -1))
    return x, cos, sin


FULL = dict(gdn_conv=4, fa_pos="nope", fa_gate=True)


@pytest.mark.parametrize(
    "fa,opts",
    [((1,), FULL), ((0, 1), {}), ((0, 3), FULL), ((0, 1, 3), {}), ((), FULL), (tuple(range(H)), {})],
    ids=["1fa-full", "2fa-one-group", "1+1-two-groups", "uneven-groups", "all-gdn", "all-fa"],
)
def test_decode_cache_steps_equal_full_forward(fa, opts):
    layer, _, cfg = _layer(fa, **opts)
    B, T = 2, 21
    x, cos, sin = _inputs(cfg, B, T)
    with torch.no_grad():
        full, _ = layer(x, position_embeddings=(cos, sin))
        dc = layer.new_decode_cache(B, max_len=T + 3)
        pre, _ = layer(x[:, :-3], position_embeddings=(cos[:, :-3], sin[:, :-3]), cache=dc)
        assert dc.length == T - 3
        steps = []
        for t in range(T - 3, T):
            o, _ = layer(x[:, t : t + 1], position_embeddings=(cos[:, t : t + 1], sin[:, t : t + 1]), cache=dc)
            steps.append(o)
        # the same through the model-level HybridCache (growing: the layer's slot allocated on its first call)
        cache = HybridCache(cfg)
        layer(x[:, :-1], position_embeddings=(cos[:, :-1], sin[:, :-1]), cache=cache)
        dyn, _ = layer(x[:, -1:], position_embeddings=(cos[:, -1:], sin[:, -1:]), cache=cache)
        # any other transformers Cache is refused, naming the fix
        with pytest.raises(ValueError, match="HybridCache, not a DynamicCache.*new_decode_cache"):
            layer(x, position_embeddings=(cos, sin), cache=DynamicCache())
    assert dc.length == T and cache.get_seq_length() == T
    assert (pre - full[:, :-3]).abs().max() < 1e-5
    assert (torch.cat(steps, 1) - full[:, -3:]).abs().max() < 1e-5
    assert (dyn[:, 0] - full[:, -1]).abs().max() < 1e-5
    # bytes by hand: K and V of the kept groups x T tokens x d x 4 B, + n_gdn d x d fp32 state, + conv tail
    n_keep, n_gdn = len({h // 3 for h in fa}), H - len(fa)
    conv = n_gdn * 3 * D * 3 * 4 if (opts.get("gdn_conv") and n_gdn) else 0
    assert dc.nbytes() == B * (2 * n_keep * T * D * 4 + n_gdn * D * D * 4) + B * conv


def test_decode_cache_overflow_is_a_clear_error():
    layer, _, cfg = _layer((0,))
    x, cos, sin = _inputs(cfg, 1, 5)
    dc = layer.new_decode_cache(1, max_len=4)
    with torch.no_grad(), pytest.raises(ValueError, match="larger max_len"):
        layer(x, position_embeddings=(cos, sin), cache=dc)
    with pytest.raises(ValueError, match="max_len"):
        layer.new_decode_cache(1, max_len=0)


def test_all_fa_layer_equals_teacher_gqa_native():
    layer, teacher, cfg = _layer(tuple(range(H)), fusion="none")
    assert layer._fa_gqa  # all heads FA: SDPA reads the 2 KV heads directly (enable_gqa), no copy
    x, cos, sin = _inputs(cfg, 2, 17)
    with torch.no_grad():
        ref, _ = teacher(x, position_embeddings=(cos, sin), attention_mask=None)
        out, _ = layer(x, position_embeddings=(cos, sin))
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_memory_path_is_bit_identical(monkeypatch, dtype):
    layer, _, cfg = _layer((0, 4), gdn_conv=4, fa_gate=True)
    layer = layer.to(dtype)
    x, cos, sin = _inputs(cfg, 2, 19)
    x, cos, sin = x.to(dtype), cos.to(dtype), sin.to(dtype)
    monkeypatch.setattr(layer_mod, "BLOCK", 4)  # several blocks per stage
    with torch.no_grad():
        low, _ = layer(x, position_embeddings=(cos, sin))
    # with gradients the plain (out-of-place) path runs: in-place stages would break autograd
    ref, _ = layer(x.clone().requires_grad_(), position_embeddings=(cos, sin))
    ref.float().sum().backward()
    assert torch.equal(low, ref.detach())
    assert layer.gamma.grad is not None and torch.isfinite(layer.gamma.grad).all()


def test_recurrent_torch_step_equals_naive():
    g = torch.Generator().manual_seed(0)
    B, T, Hh, d = 2, 5, 3, 8
    q = F.normalize(torch.randn(B, T, Hh, d, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, Hh, d, generator=g), dim=-1)
    v = torch.randn(B, T, Hh, d, generator=g)
    gg = F.logsigmoid(torch.randn(B, T, Hh, generator=g) + 2)
    beta = torch.rand(B, T, Hh, generator=g)
    h0 = torch.randn(B, Hh, d, d, generator=g) * 0.3
    y, s = gdn_recurrent_torch(q, k, v, gg, beta, scale=0.7, initial_state=h0)
    y_ref, s_ref = gdn_naive(q, k, v, gg, beta, scale=0.7, initial_state=h0)
    assert (y - y_ref).abs().max() < 1e-5 and (s - s_ref).abs().max() < 1e-5


# ----------------------------------------------------------------------------- flash-attn dispatch
def _fake_flash_attn(calls):
    """A stand-in ``flash_attn`` package: records its calls and computes flash-attn's contract
    (layout [batch, time, head, d], GQA by head // r, bottom-right aligned causal) with the math."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        **kw):
        calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "causal": causal, "scale": softmax_scale,
                      "window_size": window_size, "softcap": softcap})
        T, S, r = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
        kk = k.repeat_interleave(r, dim=2).transpose(1, 2)
        vv = v.repeat_interleave(r, dim=2).transpose(1, 2)
        s = (q.transpose(1, 2).float() @ kk.float().transpose(-1, -2)) * softmax_scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if causal:
            s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
        if window_size[0] >= 0:  # key j visible iff j >= i + S - T - left (and, right = 0, causal)
            i, j = torch.arange(T)[:, None] + S - T, torch.arange(S)[None]
            s = s.masked_fill((j < i - window_size[0]) | (j > i + window_size[1]), float("-inf"))
        return (s.softmax(-1) @ vv.float()).to(q.dtype).transpose(1, 2)

    mod = types.ModuleType("flash_attn")
    mod.flash_attn_func = flash_attn_func
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    return mod


@pytest.fixture
def fake_flash(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(calls))
    monkeypatch.setitem(gdn_kernels._found, "flash_attn", None)  # searched again: the stand-in is found
    monkeypatch.setattr(attn_mod, "flash_attn_usable", lambda q: True)  # pretend CUDA + bf16
    return calls


def test_fa_attention_dispatch(fake_flash):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hk, d = 2, 6, 2, 8
    for T, S in ((7, 7), (3, 10), (1, 12)):
        q = torch.randn(B, T, Hq, d, generator=g)
        k, v = torch.randn(B, Hk, S, d, generator=g), torch.randn(B, Hk, S, d, generator=g)
        n = len(fake_flash)
        out = attn_mod.fa_attention(q, k, v, 0.3, causal=True, kernel="auto")
        assert len(fake_flash) == n + 1
        call = fake_flash[-1]
        assert call["k"] == (B, S, Hk, d)  # GQA-native: the 2 KV heads as they are, time-major
        assert call["causal"] == (T > 1) and call["scale"] == 0.3
        ref = attn_mod.fa_attention(q, k, v, 0.3, causal=True, kernel="sdpa")
        assert len(fake_flash) == n + 1  # "sdpa" never calls flash-attn
        # brute force: expand K/V per query head, bottom-right causal mask, softmax
        kk, vv = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) * 0.3
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
        brute = (s.softmax(-1) @ vv).transpose(1, 2)
        assert (out - brute).abs().max() < 1e-5 and (ref - brute).abs().max() < 1e-5
    # a sliding window and a soft-cap go to flash-attn as window_size (w − 1, 0) and softcap, equal to SDPA's
    for T, S in ((7, 7), (3, 10), (1, 12)):
        q = torch.randn(B, T, Hq, d, generator=g)
        k, v = torch.randn(B, Hk, S, d, generator=g), torch.randn(B, Hk, S, d, generator=g)
        out = attn_mod.fa_attention(q, k, v, 0.3, kernel="auto", window=4, softcap=2.0)
        assert fake_flash[-1]["window_size"] == (3, 0) and fake_flash[-1]["softcap"] == 2.0
        ref = attn_mod.fa_attention(q, k, v, 0.3, kernel="sdpa", window=4, softcap=2.0)
        full = attn_mod.fa_attention(q, k, v, 0.3, kernel="sdpa", softcap=2.0)
        assert (out - ref).abs().max() < 1e-5 and (full - ref).abs().max() > 1e-2
    # an explicit (padding) mask always goes to SDPA
    n = len(fake_flash)
    attn_mod.fa_attention(q, k, v, 0.3, mask=torch.ones(B, 1, 1, 12, dtype=torch.bool), kernel="flash_attn")
    assert len(fake_flash) == n


def test_fa_attention_dispatch_without_cuda_or_package(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(calls))
    monkeypatch.setitem(gdn_kernels._found, "flash_attn", None)
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4, 8)
    attn_mod.fa_attention(q, k, k, 0.3, kernel="auto")  # CPU fp32: auto keeps SDPA
    assert calls == []
    with pytest.raises(ValueError, match="fa_kernel='sdpa'"):
        attn_mod.fa_attention(q, k, k, 0.3, kernel="flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    monkeypatch.setitem(gdn_kernels._found, "flash_attn", None)
    monkeypatch.setattr(attn_mod, "flash_attn_usable", lambda q: True)
    assert not attn_mod.flash_attn_available()
    with pytest.raises(ImportError, match="pip install flash-attn"):
        attn_mod.fa_attention(q, k, k, 0.3, kernel="flash_attn")
    with pytest.raises(ValueError, match="fa_kernel must be"):
        attn_mod.fa_attention(q, k, k, 0.3, kernel="xformers")
    with pytest.raises(ValueError, match="fa_kernel"):
        HybridOptions(fa_kernel="xformers")


def test_fused_train_forward_with_flash_attn_compiles_without_a_graph_break(fake_flash):
    """The fused training forward with flash-attn traces whole under ``torch.compile(fullgraph=True)``, as FastStep
    compiles it: the package is imported when the layer's TrainIndex is built, not while Dynamo traces (an import
    inside the graph is a graph break: issue 63); the compiled output equals the eager one."""
    from headscope.hybrid.inference import DEFAULT

    layer, _, cfg = _layer((0, 1), fa_kernel="flash_attn")
    use_inference(layer, dataclasses.replace(DEFAULT, train="fused"))
    x, cos, sin = _inputs(cfg, 2, 12)
    ref = layer(x, position_embeddings=(cos, sin))[0]
    assert len(fake_flash) == 1 and fake_flash[0]["q"] == (2, 12, 2, D)
    f = torch.compile(lambda x: layer(x, position_embeddings=(cos, sin))[0], backend="eager", fullgraph=True)
    torch.testing.assert_close(f(x), ref)
    assert len(fake_flash) == 2


def test_hybrid_layer_with_flash_attn_equals_sdpa(fake_flash):
    layer, _, cfg = _layer((0, 1, 3), gdn_conv=4, fa_gate=True)  # uneven groups: K/V expanded per FA head
    layer2, _, _ = _layer((0, 1), fa_pos="nope")  # 2 FA heads in one group: GQA-native
    B, T = 2, 15
    x, cos, sin = _inputs(cfg, B, T)
    for lay in (layer, layer2):
        with torch.no_grad():
            lay.options = dataclasses.replace(lay.options, fa_kernel="sdpa")
            ref, _ = lay(x, position_embeddings=(cos, sin))
            assert fake_flash == []
            lay.options = dataclasses.replace(lay.options, fa_kernel="auto")
            out, _ = lay(x, position_embeddings=(cos, sin))
            dc = lay.new_decode_cache(B, T)
            lay(x[:, :-1], position_embeddings=(cos[:, :-1], sin[:, :-1]), cache=dc)
            step, _ = lay(x[:, -1:], position_embeddings=(cos[:, -1:], sin[:, -1:]), cache=dc)
        assert len(fake_flash) == 3
        assert fake_flash[-1]["q"] == (B, 1, len(lay.fa_heads), D) and fake_flash[-1]["causal"] is False
        assert (out - ref).abs().max() < 1e-5
        assert (step[:, 0] - ref[:, -1]).abs().max() < 1e-5
        fake_flash.clear()


def test_low_memory_path_under_autocast_matches_plain_path(monkeypatch):
    """fp32 weights under bf16 autocast (how the trainer and the evaluation run on a GPU): the branch
    outputs are bf16 while the input is fp32; the low-memory path must give the plain path's output
    (it once failed with an index_copy_ dtype error)."""
    layer, _, cfg = _layer((0, 4), gdn_conv=4, fa_gate=True)
    x, cos, sin = _inputs(cfg, 2, 19)
    monkeypatch.setattr(layer_mod, "BLOCK", 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            low, _ = layer(x, position_embeddings=(cos, sin))
        ref, _ = layer(x.clone().requires_grad_(), position_embeddings=(cos, sin))  # the plain path
        ref = ref.detach()
    assert ref.dtype == low.dtype == torch.bfloat16
    assert torch.equal(low, ref)
