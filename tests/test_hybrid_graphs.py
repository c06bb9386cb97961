"""CUDA-graphed prefill of a whole hybrid model (StaticDecoder.prefill_graphed) against the eager prefill; the
device-position decode step (StaticDecoder.step_replayed, what transformers' generate replays) against eager steps;
the compiled layer tails; without CUDA, the clear error. The GPU tests skip on machines without CUDA."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dataclasses import replace

from headscope.hybrid import hybridize
from headscope.hybrid.inference.graphs import capture
from headscope.hybrid.backend_registry import replace_all
from headscope.hybrid.inference import DEFAULT
from inference_cfg import ON, plain, use
from headscope.hybrid.inference.decoder import StaticDecoder
from headscope.masks import HeadMask

from conftest import fast_first

H, KV, D = 4, 2, 16
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _greedy(dec, ids, n, replayed=False):
    """Greedy continuation [batch, T + n]: the decoder's prefill, then n − 1 steps — eager at the Python length, or
    ``replayed``: ``StaticDecoder.step_replayed`` (device-position steps, from one CUDA graph on CUDA)."""
    out = [ids, dec.prefill(ids).argmax(-1, keepdim=True)]
    for _ in range(n - 1):
        out.append((dec.step_replayed if replayed else dec.step)(out[-1]).argmax(-1).view(-1, 1))
    return torch.cat(out, 1)


def _hybrid(device="cpu", **opts):
    cfg = LlamaConfig(vocab_size=101, hidden_size=H * D, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=H, num_key_value_heads=KV, head_dim=D, max_position_embeddings=512)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(cfg).eval()
    return hybridize(teacher, HeadMask(2, H, KV, ((1,), (0, 3))), **opts).to(device).eval()


def test_capture_without_cuda_names_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="run the call eagerly"):
        capture(lambda: torch.zeros(1))
    dec = StaticDecoder(_hybrid(), batch=2, max_len=16)
    with pytest.raises(RuntimeError, match="CUDA"):
        dec.prefill_graphed(torch.zeros(2, 8, dtype=torch.long))


def test_capture_prefill_checks_the_shape():
    dec = StaticDecoder(_hybrid(), batch=2, max_len=16)
    with pytest.raises(ValueError, match="batch=2"):
        dec.capture_prefill(torch.zeros(3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="larger max_len"):
        dec.capture_prefill(torch.zeros(2, 17, dtype=torch.long))


@gpu
def test_graphed_prefill_equals_eager_prefill_and_decodes_on():
    """Replays for two different prompt batches of one shape equal the eager prefill of each (logits and
    the caches: the next eager step equals the eager path's); a new shape is captured anew."""
    model = _hybrid("cuda")
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, 101, (2, 40), generator=g).cuda() for _ in range(2))
    dec = StaticDecoder(model, batch=2, max_len=64)  # one decoder: the graph of a is replayed for b
    with torch.no_grad():
        for ids in (a, b):
            ref_dec = StaticDecoder(model, batch=2, max_len=64)
            ref = ref_dec.prefill(ids).clone()
            ref_step = ref_dec.step(ids[:, -1:]).clone()
            got = dec.prefill_graphed(ids).clone()
            assert dec.length == 40
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
            torch.testing.assert_close(dec.step(ids[:, -1:]), ref_step, rtol=0, atol=1e-5)
        graph = dec._pf_graph
        got = dec.prefill_graphed(a[:, :24])
        assert dec._pf_graph is not graph and dec.length == 24
        ref = StaticDecoder(model, batch=2, max_len=64).prefill(a[:, :24])
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_graphed_prefill_on_the_second_gpu():
    model = _hybrid("cuda:1")
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1)).to("cuda:1")
    with torch.no_grad():
        ref = StaticDecoder(model, batch=2, max_len=64).prefill(ids).clone()
        got = StaticDecoder(model, batch=2, max_len=64).prefill_graphed(ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.slow  # 54 one-launch decode steps in Triton's interpreter: ~11 s a case on 2 cores
@pytest.mark.parametrize("opts", [{}, {"fa_pos": "rope", "gdn_rope": False, "fa_gate": False}])
def test_device_position_decoding_equals_eager_steps(opts, monkeypatch):
    """transformers' greedy generate (growing and static cache), whose decode steps take the device-position step
    that a CUDA graph replays (StaticDecoder.step_replayed), gives the tokens of the reference path's eager steps, for
    NoPE and RoPE FA heads; every step of both layers is one launch (FA prep + split-K + GDN step: Triton's
    interpreter here, skipped without it), the GDN heads riding along; run eagerly here (CPU, lean path)."""
    from headscope.hybrid.inference import decode
    from headscope.hybrid.inference.kernels import splitk

    if not splitk.triton_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU model: the decode kernels run here through Triton's interpreter (needs triton; "
                    "tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA); on a GPU see "
                    "test_graphed_generate_equals_eager_steps")
    ones = []  # the one-launch step (FA prep + split-K + GDN step): its length argument, and whether GDN heads rode along
    real_one = decode.hybrid_decode_step
    monkeypatch.setattr(decode, "hybrid_decode_step",
                        lambda *a, **k: ones.append((a[5], k["gdn"] is not None)) or real_one(*a, **k))
    calls, preps, steps = [], [], []  # the separate kernels: none of them runs
    monkeypatch.setattr(decode, "decode_attention", lambda *a, **k: calls.append(a[3]))
    monkeypatch.setattr(decode, "fa_decode_prep", lambda *a, **k: preps.append(a[5]))
    monkeypatch.setattr(decode, "gdn_decode_step", lambda *a, **k: steps.append(1))
    cfg = LlamaConfig(vocab_size=101, hidden_size=H * D, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=H, num_key_value_heads=KV, head_dim=D, max_position_embeddings=512)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(cfg).eval()
    for p in teacher.parameters():  # larger weights: logits far apart, so greedy tokens vary along the run
        p.data.normal_(std=0.2)
    # layer 0: FA heads 0, 1 (KV group 0) and 3 (group 1): uneven groups (split-K by kv_index)
    model = hybridize(teacher, HeadMask(2, H, KV, ((0, 1, 3), (0, 3))), gdn_kernel="torch", **opts).eval()
    use(model)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with plain(model):  # the reference: eager steps through the layers' reference forward
            ref = _greedy(StaticDecoder(model, batch=2, max_len=24), ids, 10)
        assert len(set(ref[:, 9:].flatten().tolist())) > 2
        for n, kw in enumerate(({}, {"cache_implementation": "static"}), 1):
            assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, **kw), ref), kw
            # every decode step of both layers in one launch at a device position (one shared split-K length per
            # step), the GDN heads included; no separate kernel (the prefill is not a decode step)
            assert len(ones) == n * 2 * 9 and all(torch.is_tensor(x) and g for x, g in ones)
            assert len({id(x) for x, _ in ones[-18:]}) == 1 and not calls and not steps and not preps
        assert torch.equal(_greedy(StaticDecoder(model, batch=2, max_len=24), ids, 10), ref)
        assert len(ones) == 6 * 9 and ones[-1][0] is None  # host-length steps: the cache view's slots


def test_a_failed_step_capture_leaves_the_caches(monkeypatch):
    """A capture of step_replayed that fails after its warm-up steps (emulated on CPU) raises, and leaves the caches
    at their length and state with no device position; the next call captures again."""
    import headscope.hybrid.inference.decoder as decoder

    dec = StaticDecoder(_hybrid(gdn_kernel="torch"), batch=2, max_len=32, config=ON)  # the lean path on CPU
    ids = torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(3))

    def failing_capture(fn, warmup=2, device=None):
        for _ in range(warmup):  # the warm-up steps advance the GDN state
            fn()
        raise RuntimeError("capture failed")

    monkeypatch.setattr(decoder, "_graphable", lambda dev: True)
    monkeypatch.setattr(decoder, "_capture", failing_capture)
    with torch.no_grad():
        dec.prefill(ids)
        before = [c.S.clone() for c in dec.caches]
        for _ in range(2):
            with pytest.raises(RuntimeError, match="capture failed"):
                dec.step_replayed(ids[:, -1:])
    assert dec.length == 10 and dec._dgraph is None and dec._dp is None
    assert all(torch.equal(c.S, S) for c, S in zip(dec.caches, before))


def test_device_position_needs_the_lean_path():
    dec = StaticDecoder(_hybrid(), batch=2, max_len=16, config=replace_all(DEFAULT, "reference"))
    with torch.no_grad():
        dec.prefill(torch.zeros(2, 4, dtype=torch.long))
        with pytest.raises(ValueError, match="lean decode backend only"):
            dec.step_replayed(torch.zeros(2, 1, dtype=torch.long))
    assert dec.length == 4 and dec._dp is None


@gpu
def test_graphed_generate_equals_eager_steps():
    """transformers' greedy generate, its decode steps replayed from CUDA graphs (growing cache: eager tails; static
    cache: compiled tails and the tail kernel), gives the tokens of StaticDecoder's eager steps and of the reference
    path's steps (fp32 model: exact products)."""
    model = _hybrid("cuda")
    ids = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        ref = _greedy(StaticDecoder(model, batch=2, max_len=64), ids, 20)
        with plain(model):
            assert torch.equal(_greedy(StaticDecoder(model, batch=2, max_len=64), ids, 20), ref)
        for kw in ({}, {"cache_implementation": "static"}):
            assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False, **kw), ref), kw


def _eager_tail_reference():
    """A fresh Dynamo cache, the small hybrid, 2 prompts of 12 tokens and the eager-tail decoder's 5 greedy tokens."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _hybrid()
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = _greedy(StaticDecoder(model, batch=2, max_len=20), ids, 5)
    return model, ids, ref


@pytest.mark.slow
def test_compiled_layer_tail_equals_eager():
    """compile_tail=True (here with Dynamo's aot_eager backend: the tracing, one graph for every layer)
    gives the eager decoder's prefill and steps; so do the two compiled calls per layer that a hooked MLP gets."""
    import headscope.hybrid.inference.decoder as decoder

    model, ids, ref = _eager_tail_reference()
    cfg = replace(DEFAULT, tail_backend="aot_eager")
    with torch.no_grad():
        dec = StaticDecoder(model, batch=2, max_len=20, compile_tail=True, config=cfg)
        got = _greedy(dec, ids, 5)
        assert dec._post is not decoder._post  # still compiled: no fallback happened
        assert dec._embed is not decoder._embed and dec._head is not decoder._head  # the step's ends too
        assert dec._fused is not None  # the fused tail (gate/up in one GEMM, next input norm) ran
        assert torch.equal(got, ref)
        torch.testing.assert_close(dec.prefill(ids), StaticDecoder(model, batch=2, max_len=20).prefill(ids))
        handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
        try:
            with pytest.warns(UserWarning, match="forward hooks"):
                two_calls = StaticDecoder(model, batch=2, max_len=20, compile_tail=True, config=cfg)
            assert two_calls._fused is None and torch.equal(_greedy(two_calls, ids, 5), ref)
        finally:
            handle.remove()


@pytest.mark.parametrize("fusion", fast_first(["default", "none"]))
def test_tail_kernel_equals_the_compiled_tail(monkeypatch, fusion):
    """InferenceConfig.tail_kernel: the lean path's one-launch decode steps hand o_proj's input to tail_step's
    layer_tail (o_proj, MLP tail, next norm and next input projection in one launch; Triton's interpreter here),
    complete (the split-K combination in the attention's launch); the same tokens and step logits within fp32
    rounding as the compiled tail. ``fusion="none"`` with an
    all-FA mask: the teacher's decode (no output fusion: the plain combination). A GELU MLP is refused (warned)."""
    import torch._dynamo

    import headscope.hybrid.inference.decoder as decoder
    from headscope.hybrid.inference.kernels import layer_tail as tail_step

    if not tail_step.applies(2, H * D, H * D, 64, torch.device("cpu")) or not torch.cuda.is_available() and (
            os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("needs triton and CUDA or TRITON_INTERPRET=1")
    icfg = replace(ON, tail_backend="aot_eager")
    torch._dynamo.reset()
    if fusion == "none":
        cfg = LlamaConfig(vocab_size=101, hidden_size=H * D, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=H, num_key_value_heads=KV, head_dim=D, max_position_embeddings=512)
        torch.manual_seed(0)
        model = hybridize(LlamaForCausalLM(cfg).eval(), HeadMask(2, H, KV, (tuple(range(H)),) * 2), fusion="none").eval()
    else:
        model = _hybrid()
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(4))
    calls = []
    real = decoder.layer_tail
    monkeypatch.setattr(decoder, "layer_tail",
                        lambda *a, **k: calls.append((k["attn"] is not None, k["w_in"] is not None)) or real(*a, **k))
    with torch.no_grad():
        # the reference: the compiled tail
        ref_dec = StaticDecoder(model, batch=2, max_len=20, compile_tail=True, config=replace(icfg, tail_kernel=False))
        ref = _greedy(ref_dec, ids, 5)
        dec = StaticDecoder(model, batch=2, max_len=20, compile_tail=True, config=icfg)
        assert dec._tk is not None and calls == [(False, False)] * 2  # the construction's check: one call per layer
        calls.clear()
        assert torch.equal(_greedy(dec, ids, 5), ref)
        # 4 decode steps x 2 layers (the prefill, 24 rows, takes the compiled tail); the first layer's tail computes
        # the second layer's input projection
        assert calls == [(False, True), (False, False)] * 4
        ref_dec.prefill(ids), dec.prefill(ids)
        torch.testing.assert_close(dec.step(ids[:, -1:]), ref_dec.step(ids[:, -1:]), rtol=1e-5, atol=1e-5)
        act = model.model.layers[1].mlp.act_fn
        model.model.layers[1].mlp.act_fn = torch.nn.GELU()
        try:
            with pytest.warns(UserWarning, match="one-launch layer tail"):
                assert StaticDecoder(model, batch=2, max_len=20, compile_tail=True, config=icfg)._tk is None
        finally:
            model.model.layers[1].mlp.act_fn = act


def test_a_tail_compile_failure_warns_once_and_runs_eagerly():
    """A backend that fails: one warning, then the eager (still fused) tail, the same tokens."""
    import headscope.hybrid.inference.decoder as decoder

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    model, ids, ref = _eager_tail_reference()
    with torch.no_grad():
        dec = StaticDecoder(model, batch=2, max_len=20, compile_tail=True, config=replace(DEFAULT, tail_backend=broken))
        with pytest.warns(UserWarning, match="torch.compile of the layer tail failed") as rec:
            got = _greedy(dec, ids, 5)
    assert len([w for w in rec if "layer tail failed" in str(w.message)]) == 1
    assert dec._pre is decoder._pre and dec._fused is decoder._post_fused and torch.equal(got, ref)
    assert dec._embed is decoder._embed and dec._head is decoder._head


def test_fused_tail_matches_the_mlp_module_or_is_refused(monkeypatch):
    """The fused tail (gate/up in one GEMM + the next layer's input norm) equals the modules' two calls; an MLP
    whose forward is not the gated form is caught by the numerical check and the module is used (warned)."""
    import torch._dynamo

    import headscope.hybrid.inference.decoder as decoder

    cfg = replace(DEFAULT, tail_backend="aot_eager")
    torch._dynamo.reset()
    model = _hybrid()
    layers = model.model.layers
    dec = StaticDecoder(model, batch=2, max_len=8, compile_tail=True, config=cfg)
    h, a = torch.randn(2, 3, H * D), torch.randn(2, 3, H * D)
    with torch.no_grad():
        got_h, got_x = decoder._post_fused(layers[0], layers[1], h, a, *dec._gate_up(0))
        ref_h = h + a + layers[0].mlp(layers[0].post_attention_layernorm(h + a))
        torch.testing.assert_close(got_h, ref_h, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_x, layers[1].input_layernorm(ref_h), rtol=0, atol=1e-5)
        W, b = dec._gate_up(1)
        assert b is None and torch.equal(W, torch.cat([layers[1].mlp.gate_proj.weight, layers[1].mlp.up_proj.weight]))
        layers[1].mlp.up_proj.weight.mul_(2)  # a changed weight: the concatenation is rebuilt
        assert torch.equal(dec._gate_up(1)[0][W.shape[0] // 2:], layers[1].mlp.up_proj.weight)
        # large layers: the two projections, same result
        dec0 = StaticDecoder(model, batch=2, max_len=8, config=replace(cfg, fused_gate_up_max_bytes=0))
        assert dec0._gate_up(0) == (None, None)
        got_h2, _ = decoder._post_fused(layers[0], layers[1], h, a, *dec0._gate_up(0))
        torch.testing.assert_close(got_h2, ref_h, rtol=0, atol=1e-5)
    handle = layers[1].mlp.register_forward_hook(lambda *a: None)
    with pytest.warns(UserWarning, match="forward hooks"):
        assert StaticDecoder(model, batch=2, max_len=8, compile_tail=True, config=cfg)._fused is None
    handle.remove()
    mlp = layers[1].mlp  # the second layer only (an instance's forward): not just the first layer is checked
    monkeypatch.setattr(mlp, "forward", lambda x: mlp.down_proj(mlp.act_fn(mlp.up_proj(x)) * mlp.gate_proj(x)))
    with pytest.warns(UserWarning, match="differs from the MLP module"):
        assert StaticDecoder(model, batch=2, max_len=8, compile_tail=True, config=cfg)._fused is None



def test_device_position_step_of_one_layer_without_a_shared_mask():
    """A layer's device-position step computes its own slot mask / split-K length when no caller keeps one
    (DevicePosition.valid, .n_valid None): same output and cache as the step at the Python length."""
    from headscope.hybrid.inference.forward import DevicePosition, decode_step

    layer = _hybrid().model.layers[1].self_attn
    use(layer)  # FA heads 0 and 3 + GDN heads
    rope = _hybrid().model.rotary_emb
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 9, H * D, generator=g)
    pe = rope(x, torch.arange(9)[None])
    with torch.no_grad():
        outs = []
        for device_pos in (False, True):
            dc = layer.new_decode_cache(1, 16)
            layer(x[:, :8], position_embeddings=tuple(t[:, :8] for t in pe), cache=dc)
            dp = DevicePosition(torch.tensor([8])) if device_pos else None
            y = decode_step(layer, x[:, 8:], tuple(t[:, 8:] for t in pe), torch.tensor([[8]]), dc, dp)
            outs.append((y, dc.k[:, :, :9].clone(), dc.S.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
