"""The fast training step on CPU (tiny models): the hybrid layers' fast path, the fused LM-head losses,
FastStep (eager and through Dynamo) and the trainer with it, each against the plain step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from headscope.hybrid import HeadwiseHybridAttention, HybridOptions, hybridize
from headscope.hybrid.config import LayerSpec
from headscope.hybrid.backend_registry import layer_needs
from headscope.hybrid.gdn_kernels import gdn_op
from headscope.hybrid.inference import DEFAULT, use_inference


def prepare_fast(layer):
    use_inference(layer, replace(DEFAULT, train="fused"))


def unprepare_fast(layer):
    use_inference(layer, replace(DEFAULT, train="reference"))
from headscope.masks import HeadMask
from headscope.train import TokenRows, TrainConfig, Trainer, distillation_loss, lm_loss, trainable_parameters
from headscope.train.fast import FastStep, flops_per_token, model_body
from headscope.train.fused_loss import ce_chunk, kl_chunk, linear_ce_loss, linear_kl_loss
from headscope.train.stages import _capture_attention_io

from conftest import Vocab, counting_backend, fast_first, plain_step_grads, tiny_llama


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama(Vocab(), seed=3, n_layers=2, n_heads=4, n_kv=2, d_model=64)


def _student(teacher, kind):
    if kind == "dense":
        return tiny_llama(Vocab(), seed=4, n_layers=2, n_heads=4, n_kv=2, d_model=64)
    st = hybridize(teacher, HeadMask(2, 4, 2, ((0,), (1, 3))))
    with torch.no_grad():  # move the GDN gates off their exact initial values
        for n, p in st.named_parameters():
            if any(k in n for k in ("A_log", "a_proj", "b_proj")):
                p.add_(0.1 * torch.randn_like(p))
    return st


def _close(a, b, tol=1e-5):
    """Equal up to float32 summation order: ‖a − b‖ ≤ tol · ‖b‖."""
    assert torch.linalg.vector_norm((a - b).double()) <= tol * torch.linalg.vector_norm(b.double()) + 1e-12


def _batch(B=3, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.rand(B, T, generator=g) > 0.2


# ------------------------------------------------------------------------------ the layer's fast path
_CFG = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)


@pytest.mark.parametrize(
    "fa,opts,qk,bias",
    [
        ([0], {}, False, False),
        ([1, 3], dict(fa_pos="nope", fa_gate=True), False, False),
        ([0, 1], dict(gdn_rope=False, fusion="none"), True, True),
        ([0, 1, 2], {}, False, False),  # FA heads spread unevenly over their KV groups
        ([], {}, False, False),
        ([0, 1, 2, 3], {}, False, False),
        ([2], {}, False, "qkv"),  # Qwen2: q/k/v biases, none on o_proj
    ],
)
def test_fast_layer_path_equals_plain_path(fa, opts, qk, bias):
    _CFG.attention_bias = bias is True
    spec = LayerSpec(q_bias=True, k_bias=True, v_bias=True) if bias == "qkv" else None
    torch.manual_seed(0)
    layer = HeadwiseHybridAttention(_CFG, 0, fa, HybridOptions(**opts), qk_norm=qk, spec=spec).double()
    assert not layer_needs(layer) - {"biases"} and (layer.q_proj.bias is not None) == bool(bias) and (layer.o_proj.bias is not None) == (bias is True)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 24, 64, dtype=torch.double, requires_grad=True)
    cos, sin = torch.randn(1, 24, 16, dtype=torch.double), torch.randn(1, 24, 16, dtype=torch.double)
    res = []
    for fast in (False, True):
        (prepare_fast if fast else unprepare_fast)(layer)
        layer.zero_grad()
        x.grad = None
        y, _ = layer(x, position_embeddings=(cos, sin))
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        res.append([y.detach(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    _CFG.attention_bias = False


def test_fast_path_only_with_gradients_and_without_cache(teacher):
    st = _student(teacher, "hybrid")
    layer = st.model.layers[0].self_attn
    prepare_fast(layer)
    calls = []
    from headscope.hybrid.inference import train_forward as L

    orig = L.fast_forward  # the fused train backend (registry.py)
    L.fast_forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        x = torch.randn(1, 8, 64)
        cs = st.model.rotary_emb(x, torch.arange(8)[None])
        layer(x, position_embeddings=cs)
        with torch.no_grad():
            layer(x, position_embeddings=cs)
        assert calls == [1]
        unprepare_fast(layer)
        layer(x, position_embeddings=cs)
        assert calls == [1]
    finally:
        L.fast_forward = orig


# ------------------------------------------------------------------------------ fused losses
@pytest.mark.parametrize("chunk", [7, 30, 1000])
def test_linear_kl_loss_equals_distillation_loss(chunk):
    torch.manual_seed(0)
    B, T, D, V = 3, 10, 16, 50
    hs = torch.randn(B, T, D, requires_grad=True)
    ws = torch.randn(V, D, requires_grad=True)
    bs = torch.randn(V, requires_grad=True)
    ht, wt = torch.randn(B, T, D), torch.randn(V, D)
    mask = torch.rand(B, T) > 0.3
    ref = distillation_loss(hs @ ws.T + bs, ht @ wt.T, mask)
    g_ref = torch.autograd.grad(ref, (hs, ws, bs))
    loss = linear_kl_loss(hs.reshape(-1, D), ws, ht.reshape(-1, D), wt, mask.reshape(-1), b_s=bs, chunk_rows=chunk)
    g = torch.autograd.grad(loss, (hs, ws, bs))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # an explicit denominator (data-parallel style) scales the loss
    l2 = linear_kl_loss(hs.reshape(-1, D), ws, ht.reshape(-1, D), wt, mask.reshape(-1), b_s=bs,
                        denominator=torch.tensor(2.0 * mask.sum()), chunk_rows=chunk)
    torch.testing.assert_close(l2, ref / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [7, 1000])
def test_linear_ce_loss_equals_lm_loss(chunk):
    torch.manual_seed(1)
    B, T, D, V = 3, 10, 16, 50
    h = torch.randn(B, T, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    ids = torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) > 0.3
    ref = lm_loss(h @ w.T, ids, mask)
    g_ref = torch.autograd.grad(ref, (h, w))
    keep = torch.zeros_like(mask)
    keep[:, :-1] = mask[:, 1:] & mask[:, :-1]
    loss = linear_ce_loss(h.reshape(-1, D), w, ids.roll(-1, 1).reshape(-1), keep.reshape(-1), chunk_rows=chunk)
    g = torch.autograd.grad(loss, (h, w))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_fused_losses_check_shapes():
    h, w = torch.randn(6, 4), torch.randn(9, 4)
    m = torch.ones(6, dtype=torch.bool)
    with pytest.raises(ValueError, match="must match"):
        linear_kl_loss(h, w, torch.randn(5, 4), w, m)
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_kl_loss(h, w, h, w, m, chunk_rows=0)
    with pytest.raises(ValueError, match="must match"):
        linear_ce_loss(h, w, torch.zeros(5, dtype=torch.long), m)


def test_chunk_math_compiles_to_the_same_numbers():
    torch.manual_seed(2)
    s, t, m = torch.randn(8, 40), torch.randn(8, 40), (torch.rand(8) > 0.3).float()
    inv = torch.tensor(0.25)
    tgt = torch.randint(0, 40, (8,))
    for fn, ref in ((kl_chunk, t), (ce_chunk, tgt)):
        a = fn(s, ref, m, inv)
        b = torch.compile(fn, backend="aot_eager", dynamic=False)(s, ref, m, inv)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)


# ------------------------------------------------------------------------------ FastStep
def test_model_body_and_teacher_io_match_the_model(teacher):
    ids, _ = _batch()
    with torch.no_grad():
        ref = teacher.model(input_ids=ids, use_cache=False).last_hidden_state
        torch.testing.assert_close(model_body(teacher, ids), ref)
        rec = _capture_attention_io(teacher, ids, torch.ones_like(ids, dtype=torch.bool))
        fs = FastStep(1, _student(teacher, "hybrid"), teacher, [])
        from headscope.train.fast import _teacher_io

        h = teacher.model.embed_tokens(ids)
        cos, sin = teacher.model.rotary_emb(h, torch.arange(ids.shape[1])[None])
        for layer, r in zip(teacher.model.layers, rec):
            hn, a, h = _teacher_io(layer, h, cos, sin)
            torch.testing.assert_close(hn, r["h"])
            torch.testing.assert_close(a, r["out"])
        del fs


@pytest.mark.parametrize("backend", fast_first([None, "aot_eager"]))
@pytest.mark.parametrize("stage", fast_first([1, 2, 3]))
@pytest.mark.parametrize("kind", fast_first(["hybrid", "dense"]))
def test_fast_step_equals_plain_step(teacher, kind, stage, backend):
    """Loss, logged values and gradients of the fast step equal stage_loss + backward on one batch."""
    torch.manual_seed(0)
    st = _student(teacher, kind)
    params = [p for _, p in trainable_parameters(st, stage)]
    ids, m = _batch()
    loss, scalars, g_ref = plain_step_grads(stage, st, teacher, params, ids, m)
    fs = FastStep(stage, st, teacher, params, compile=backend is not None, backend=backend or "inductor")
    logged = fs(ids, m)
    torch.testing.assert_close(logged, torch.tensor(list(scalars.values())), rtol=1e-5, atol=1e-6)
    for p, g in zip(params, g_ref):
        _close(p.grad, g)
    fs.close()
    assert all(p.grad is None for p in params)
    assert "_fast_rows" not in getattr(st.model.layers[0].self_attn, "__dict__", {})


@pytest.mark.slow
def test_fast_step_compiles_once_per_head_count(teacher):
    """Layers with the same FA / GDN head counts share compiled graphs, whichever heads they are."""
    t6 = tiny_llama(Vocab(), seed=5, n_layers=6, n_heads=4, n_kv=2, d_model=64)
    st = hybridize(t6, HeadMask(6, 4, 2, ((0,), (1,), (2,), (3,), (0, 1), (2, 3))))
    n = {"graphs": 0}

    def backend(gm, example_inputs):
        n["graphs"] += 1
        return gm.forward

    fs = FastStep(2, st, t6, [p for _, p in trainable_parameters(st, 2)], compile=True, backend=backend)
    ids, m = _batch(2, 12)
    fs(ids, m)
    first = n["graphs"]
    fs(ids, m)
    assert n["graphs"] == first
    # teacher layer 1 + one per head-count configuration (2; a hybrid layer is one graph, its GDN call an operator)
    # + the chunk loss (8 while the GDN call was a graph break)
    assert first <= 4, first


@pytest.mark.parametrize("kind,stage", [("hybrid", 1), ("hybrid", 2), ("hybrid", 3), ("dense", 2), ("dense", 3)])
@pytest.mark.parametrize("family", ["mistral_sw", "gemma3"])
def test_fast_step_equals_plain_step_with_sliding_windows(family, kind, stage):
    """A Mistral teacher (sliding window 24) and a Gemma 3 one (window 8 between full layers, RoPE per layer type,
    sandwich norms, scaled embedding) on 32-token rows: the fast step's loss, logged values and gradients equal
    stage_loss + backward (the window masks given to the dense sliding layers, the hybrid layers' fused training
    backend applying their own windows), with and without gradient accumulation. (Stage 1 aligns a hybrid's
    attention layers: no dense student.)"""
    from families import FAMILIES
    from headscope.train.fast import layer_masks

    t = FAMILIES[family](256, 0).float().eval()
    L = t.config.num_hidden_layers
    st = FAMILIES[family](256, 1).float().eval() if kind == "dense" else hybridize(
        t, HeadMask(L, 4, 2, ((0,), (1, 3), (2,))[:L]), gdn_kernel="torch")
    params = [p for _, p in trainable_parameters(st, stage)]
    ids, m = _batch(2, 32)
    masks = layer_masks(t, 32, ids.device)
    assert [x is None for x in masks] == {"mistral_sw": [False, False], "gemma3": [False, True, False]}[family]
    assert masks[0].sum() < 32 * 33 // 2 and layer_masks(t, 8, ids.device) == [None] * L
    loss, scalars, g_ref = plain_step_grads(stage, st, t, params, ids, m)
    for k in (1, 2):  # and with gradient accumulation over two one-row micro-batches
        fs = FastStep(stage, st, t, params, compile=False, grad_accum=k)
        logged = fs(ids, m)
        torch.testing.assert_close(logged, torch.tensor(list(scalars.values())), rtol=1e-5, atol=1e-6)
        for p, g in zip(params, g_ref):  # fp32 summation order (with Gemma 3's scaled embedding up to 4e-5 relative)
            _close(p.grad, g, tol=1e-4)
        fs.close()


@pytest.mark.parametrize("kind,stage", [("hybrid", 1), ("hybrid", 2), ("hybrid", 3), ("dense", 2)])
def test_fast_step_equals_plain_step_for_qwen2_biases(kind, stage):
    """Qwen2 (q/k/v biases) takes the fast step (its decoder body is Llama's): loss, logged values and gradients equal
    stage_loss + backward on 32-token rows; Phi-3 (Llama's attribute names, another body) is refused by name."""
    from headscope.arch.random_models import FAMILIES, hybrid_families
    from headscope.train.fast import fast_step_problem

    fam = hybrid_families()
    t = fam["qwen2"](256, 0).float().eval()
    assert t.model.layers[0].self_attn.q_proj.bias is not None
    st = fam["qwen2"](256, 1).float() if kind == "dense" else hybridize(t, HeadMask(2, 4, 2, ((0,), (1, 3))),
                                                                         gdn_kernel="torch")
    assert fast_step_problem(stage, st, t) is None
    phi3 = FAMILIES["phi3"](256, 0)
    assert "Phi3ForCausalLM" in fast_step_problem(2, phi3, phi3)
    named = trainable_parameters(st, stage)
    params = [p for _, p in named]
    ids, m = _batch(2, 32)
    loss, scalars, g_ref = plain_step_grads(stage, st, t, params, ids, m)
    st.zero_grad()
    fs = FastStep(stage, st, t, params, compile=False)
    logged = fs(ids, m)
    torch.testing.assert_close(logged, torch.tensor(list(scalars.values())), rtol=1e-5, atol=1e-6)
    biases = [p for n, p in named if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    assert len(biases) >= 6 and all(p.grad.abs().max() > 0 for p in biases)  # the biases train through the fast step
    for p, g in zip(params, g_ref):
        _close(p.grad, g, tol=1e-4)
    fs.close()


def _neox(parallel, seed):
    """The tests' tiny GPT-NeoX (2 layers x 4 heads of 16, fused q/k/v with biases, rotary on a quarter of each head,
    untied LM head) with the parallel or the sequential residual, every parameter moved off its initial value
    (LayerNorm weights off 1, biases off 0: they change the numbers)."""
    from headscope.arch.random_models import hybrid_families

    m = hybrid_families()["gpt_neox"](256, seed).float()
    m.config.use_parallel_residual = parallel
    for layer in m.gpt_neox.layers:
        layer.use_parallel_residual = parallel
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def _neox_student(t, kind, seed=1):
    if kind == "dense":
        return _neox(t.config.use_parallel_residual, seed)
    st = hybridize(t, HeadMask(2, 4, 4, ((0,), (1, 3))), gdn_kernel="torch")
    with torch.no_grad():  # the new parameters off their initial values too
        for n, p in st.named_parameters():
            if any(k in n for k in ("A_log", "a_proj", "b_proj", "gamma")):
                p.add_(0.1 * torch.randn_like(p))
    return st


@pytest.mark.parametrize("parallel", [True, False])
def test_model_body_and_teacher_io_of_gpt_neox(parallel):
    """GPT-NeoX's body by hand (embed_in, partial-rotary tables, parallel or sequential residual, final LayerNorm, the
    untied head) gives the model's own final hidden states and logits, and the teacher's per-layer attention input and
    output equal what the plain step's hooks record."""
    from headscope.train.fast import _teacher_io, layer_positions
    from headscope.train.fast_body import output_head

    t = _neox(parallel, 0)
    ids, _ = _batch(2, 16)
    with torch.no_grad():
        ref = t.gpt_neox(input_ids=ids, use_cache=False).last_hidden_state
        got = model_body(t, ids)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(output_head(t)(got), t(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
        assert output_head(t).weight.data_ptr() != t.gpt_neox.embed_in.weight.data_ptr()
        rec = _capture_attention_io(t, ids, torch.ones_like(ids, dtype=torch.bool))
        h = t.gpt_neox.embed_in(ids)
        pe = layer_positions(t, h, torch.arange(16)[None])
        assert pe[0][0].shape[-1] == 4  # rotary on 4 of 16 features
        for layer, r, (cos, sin) in zip(t.gpt_neox.layers, rec, pe):
            hn, a, h = _teacher_io(layer, h, cos, sin)
            torch.testing.assert_close(hn, r["h"])
            torch.testing.assert_close(a, r["out"])
        torch.testing.assert_close(t.gpt_neox.final_layer_norm(h), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind,stage", [("hybrid", 1), ("hybrid", 2), ("hybrid", 3), ("dense", 2), ("dense", 3)])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_fast_step_equals_plain_step_for_gpt_neox(parallel, kind, stage, monkeypatch):
    """GPT-NeoX (Pythia) takes the fast step, parallel and sequential residual: loss, logged values and gradients equal
    stage_loss + backward on 32-token rows (LayerNorm and q/k/v/o biases, partial rotary, untied head), with and
    without activation checkpointing; every hybrid layer goes through the fused train backend (once per layer and
    forward, twice with checkpointing: the recomputation) and its biases get gradients."""
    import headscope.hybrid.inference.train_forward as tf

    calls = [0]
    fused = tf.fast_forward
    monkeypatch.setattr(tf, "fast_forward", lambda *a: calls.__setitem__(0, calls[0] + 1) or fused(*a))
    t = _neox(parallel, 0)
    st = _neox_student(t, kind)
    from headscope.train.fast import fast_step_problem

    assert fast_step_problem(stage, st, t) is None
    named = trainable_parameters(st, stage)
    params = [p for _, p in named]
    ids, m = _batch(2, 32)
    loss, scalars, g_ref = plain_step_grads(stage, st, t, params, ids, m)
    biases = [p for n, p in named if n.endswith("bias")]
    assert len(biases) >= 4
    for ckpt in (False, True):
        calls[0] = 0
        fs = FastStep(stage, st, t if stage < 3 else None, params, compile=False, activation_checkpointing=ckpt)
        logged = fs(ids, m)
        torch.testing.assert_close(logged, torch.tensor(list(scalars.values())), rtol=1e-5, atol=1e-6)
        for p, g in zip(params, g_ref):
            _close(p.grad, g, tol=1e-4)
        assert all(p.grad.abs().max() > 0 for p in biases)
        assert calls[0] == (0 if kind == "dense" else (4 if ckpt else 2)), (ckpt, calls)
        fs.close()


def test_compiled_fast_step_of_gpt_neox_compiles_once():
    """The compiled GPT-NeoX step (aot_eager, fullgraph, activation checkpointing; stage 2: the teacher's dense layers
    and the hybrid's) over 3 steps: no graph break, no graph compiled after the first step, at most 4 (the teacher's
    layer, the two FA/GDN head-count configurations, the chunk loss), and the loss and gradients of the plain step."""
    t = _neox(True, 0)
    st = _neox_student(t, "hybrid")
    params = [p for _, p in trainable_parameters(st, 2)]
    ids, m = _batch(2, 24)
    loss, _, g_ref = plain_step_grads(2, st, t, params, ids, m)
    torch._dynamo.reset()
    backend, n = counting_backend(torch._dynamo.lookup_backend("aot_eager"))

    fs = FastStep(2, st, t, params, compile=True, backend=backend, activation_checkpointing=True)
    graphs = []
    for _ in range(3):
        logged = fs(ids, m)
        graphs.append(n[0])
    assert graphs == [graphs[0]] * 3 and 2 <= graphs[0] <= 4 and not fs.graph_breaks, (graphs, fs.graph_breaks)
    assert float(logged[0]) == pytest.approx(float(loss), rel=1e-5)
    for p, g in zip(params, g_ref):
        _close(p.grad, g, tol=1e-4)
    fs.close()
    torch._dynamo.reset()


def test_flops_per_token_of_gpt_neox():
    """GPT-NeoX's layers (``gpt_neox.layers``, attention ``attention``): 2 FLOPs per weight of every linear map, 2·2·(T/2)·d
    per FA head; its hybrid counts GDN heads; attention only: the fused q/k/v and dense maps of each layer."""
    from headscope.arch.random_models import hybrid_families

    neox = hybrid_families()["gpt_neox"](256, 0)  # 2 layers x 4 heads of 16, width 64, MLP 128
    f = flops_per_token(neox, 20, backward=False)
    lin = sum(m.weight.numel() for m in neox.modules() if isinstance(m, torch.nn.Linear))
    assert f["linear"] == 2 * lin and f["gdn"] == 0 and f["attention"] == 2 * 2 * 10 * 16 * 4 * 2
    a = flops_per_token(neox, 20, backward=False, attention_only=True)
    assert a["linear"] == 2 * 2 * (64 * 3 * 64 + 64 * 64)  # per layer: query_key_value 64 -> 192, dense 64 -> 64
    h = flops_per_token(hybridize(neox, HeadMask(2, 4, 4, ((0,), (1, 3)))), 20)
    assert h["gdn"] == 2 * (5 * 64 * 16 + 3 * 16 * 16) * 5 * 3 and h["attention"] == 2 * 2 * 10 * 16 * 3 * 3


def test_fast_step_rejects_bad_input(teacher):
    st = _student(teacher, "hybrid")
    with pytest.raises(ValueError, match="stage"):
        FastStep(4, st, teacher, [])
    with pytest.raises(ValueError, match="teacher"):
        FastStep(2, st, None, [])
    with pytest.raises(ValueError, match="Llama"):
        FastStep(3, torch.nn.Linear(2, 2), None, [])


def test_flops_per_token_counts_linear_maps(teacher):
    f = flops_per_token(teacher, 20, backward=False)
    lin = sum(m.weight.numel() for m in teacher.modules() if isinstance(m, torch.nn.Linear))
    assert f["linear"] == 2 * lin and f["gdn"] == 0
    assert f["attention"] == 2 * 2 * 10 * 16 * 4 * 2  # 2·2·(T/2)·d per head, 4 heads, 2 layers
    h = flops_per_token(_student(teacher, "hybrid"), 20)
    assert h["gdn"] > 0 and h["total"] == pytest.approx(h["linear"] + h["attention"] + h["gdn"])
    a = flops_per_token(teacher, 20, attention_only=True)
    assert a["linear"] < f["linear"] * 3


# ------------------------------------------------------------------------------ the trainer
@pytest.mark.parametrize("stage", fast_first([1, 2, 3]))
def test_trainer_fast_and_plain_steps_agree(teacher, stage, tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (8, 24), generator=g)
    rows = TokenRows(ids, torch.ones_like(ids, dtype=torch.bool))
    losses = {}
    for fast in (False, True):
        torch.manual_seed(0)
        st = _student(teacher, "hybrid")
        cfg = TrainConfig(stage=stage, tokens=3 * 4 * 24, batch_size=4, progress=False, ckpt_on_exit=False,
                          save_student=False, fast=fast)
        tr = Trainer(st, teacher, rows, cfg, tmp_path / f"{fast}")
        assert tr.plan.fast == fast
        out = tr.run()
        assert out["finished"]
        import json

        losses[fast] = [json.loads(x) for x in (tmp_path / f"{fast}" / "log.jsonl").read_text().splitlines()]
    for a, b in zip(losses[False], losses[True]):
        for k in a:
            if k in ("seconds",):
                continue
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


@pytest.mark.slow
def test_bench_train_smoke(tmp_path):
    """benchmarks/bench_train.py runs end to end on CPU (tiny model) and writes its JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_train.py"), "--smoke", "--out", str(out),
         "--variants", "hybrid_fast,hybrid_old", "--variants13", "", "--ladder-variants", ""],
        cwd=root, capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert not rep["errors"]
    for key in ("stage2_2x32", "stage2_1x64"):
        acc = rep["acceptance"][key]
        assert acc["hybrid_tok_s"] > 0 and acc["speedup_vs_old"] > 0
        assert rep["loss_agreement"][key]["hybrid_fast"]["rel_diff"] < 1e-4


def test_sdpa_alignment_check_and_padded_fused_projection():
    """Views into a fused projection whose rows are 70 fp32 columns wide (280 bytes) are misaligned for
    CUDA SDPA's vector loads (issue 16's "misaligned address"); 72 columns (288 bytes) are not; an odd
    storage offset is. The fast layer pads its fused projection to a multiple of 16 columns."""
    from headscope.hybrid.attn import is_aligned

    z = torch.zeros(2, 5, 70)
    assert not is_aligned(z[..., :64].view(2, 5, 4, 16).transpose(1, 2))
    z = torch.zeros(2, 5, 72)
    q = z[..., :64].view(2, 5, 4, 16)
    assert is_aligned(q.transpose(1, 2)) and is_aligned(z[..., 16:32])
    assert not is_aligned(z[..., 3:19])  # offset 12 bytes
    assert not is_aligned(z[..., :64].view(2, 5, 4, 16)[..., ::2])  # last stride 2
    assert is_aligned(torch.zeros(1, 4, 1, 16)[..., :16])  # size-1 dims do not count


@pytest.mark.parametrize("stage", fast_first([2, 1, 3]))
def test_activation_checkpointing_same_gradients_fewer_saved_bytes(teacher, stage):
    """Activation checkpointing (the fast step: every student layer, stage 1 every attention module; the plain step:
    transformers' layer checkpointing, stages 2-3) gives the same loss and gradients (to 1e-6 of each gradient's
    norm: the recomputation repeats the same float ops) while autograd keeps fewer bytes for the backward (the
    tensors packed by saved-tensor hooks around the step, measured)."""
    from headscope.train.step_plan import PlainStep

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (4, 24), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 17:] = False
    makers = [("fast", lambda st, ps, on: FastStep(stage, st, teacher if stage < 3 else None, ps, activation_checkpointing=on))]
    if stage != 1:
        makers.append(("plain", lambda st, ps, on: PlainStep(stage, st, teacher if stage < 3 else None, ps,
                                                              activation_checkpointing=on)))
    for name, make in makers:
        res = {}
        for on in (False, True):
            torch.manual_seed(0)
            st = _student(teacher, "hybrid")
            params = [p for _, p in trainable_parameters(st, stage)]
            step = make(st, params, on)
            saved = [0]

            def pack(t):
                saved[0] += t.numel() * t.element_size()
                return t

            st.train()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logged = step(ids, mask)
            res[on] = (logged.clone(), {n: p.grad.clone() for n, p in st.named_parameters() if p.grad is not None}, saved[0])
            step.close()
        (l0, g0, b0), (l1, g1, b1) = res[False], res[True]
        assert torch.allclose(l0, l1, rtol=1e-6, atol=0), (name, l0, l1)
        assert sorted(g0) == sorted(g1) and g0
        for k in g0:
            assert float((g0[k] - g1[k]).norm()) <= 1e-6 * float(g0[k].norm()) + 1e-12, (name, k)
        assert b1 < 0.7 * b0, (name, b0, b1)


def _gdn_stand_in(monkeypatch):
    """Replaces the GDN kernel inside ``gdn_op`` by a function Dynamo cannot trace (as fla's Triton kernels) that counts
    its calls; returns the count list."""
    import headscope.hybrid.gdn_kernels as gk

    calls, kernel = [0], gk.gated_delta_rule

    @torch.compiler.disable
    def opaque(*a, **kw):
        calls[0] += 1
        return kernel(*a, **kw)

    monkeypatch.setattr(gk, "gated_delta_rule", opaque)
    return calls


@pytest.mark.parametrize("stage", fast_first([3, 2, 1]))
def test_checkpointed_compiled_step_compiles_once_and_equals_the_step_without(teacher, stage, monkeypatch):
    """Issue 63: activation checkpointing around the compiled layers, with the GDN kernel opaque to Dynamo and the CUDA
    branch of ``sdpa_aligned`` taken (its ``storage_offset()`` was a graph break inside the FA helper: Dynamo guarded on
    the caller's ``outs`` list and compiled a resume graph per call, 18 graphs after one step and 4 more every step,
    until its limit, where the recomputation ran eagerly and its saved tensors differed from the compiled forward's).
    Now, over 5 steps (aot_eager: the backward compiled too): no graph break (``fullgraph``), no graph compiled after the
    first step and at most 4 (one per region: teacher layer, the 2 head-count configurations of the student's hybrid
    layers, the chunked loss), the GDN kernel called 3 times per hybrid layer and step (forward, recomputation, the
    operator's backward) against 2 without checkpointing, and the loss and gradients equal to the uncheckpointed
    compiled step's (to 1e-6 of each gradient's norm: the recomputation replays the same graph)."""
    import headscope.hybrid.attn as attn

    monkeypatch.setattr(attn, "needs_alignment", lambda t: True)  # sdpa_aligned as on CUDA
    calls = _gdn_stand_in(monkeypatch)
    ids, m = _batch(2, 20)
    res = {}
    for on in (False, True):
        torch._dynamo.reset()
        backend, n = counting_backend(torch._dynamo.lookup_backend("aot_eager"))

        torch.manual_seed(0)
        st = _student(teacher, "hybrid")
        params = [p for _, p in trainable_parameters(st, stage)]
        fs = FastStep(stage, st, teacher if stage < 3 else None, params, compile=True, backend=backend,
                      activation_checkpointing=on)
        graphs, kernel_calls = [], []
        for _ in range(5):
            calls[0] = 0
            logged = fs(ids, m)
            graphs.append(n[0])
            kernel_calls.append(calls[0])
        print(f"stage {stage}, checkpointing {on}: {graphs[0]} graphs")
        assert graphs == [graphs[0]] * 5 and 2 <= graphs[0] <= 4, (on, graphs)
        assert kernel_calls == [(3 if on else 2) * len(st.model.layers)] * 5, (on, kernel_calls)
        res[on] = (logged.clone(), {k: p.grad.clone() for k, p in st.named_parameters() if p.grad is not None})
        fs.close()
    (l0, g0), (l1, g1) = res[False], res[True]
    assert torch.allclose(l0, l1, rtol=1e-6, atol=0), (l0, l1)
    assert sorted(g0) == sorted(g1) and g0
    for k in g0:
        _close(g1[k], g0[k], tol=1e-6)


def test_a_graph_break_in_a_compiled_layer_is_recompiled_or_refused(teacher, monkeypatch):
    """A graph break in a compiled region (the GDN call behind ``torch.compiler.disable``, as before issue 63) shows at
    the first step: without activation checkpointing the region is compiled again allowing breaks, warned, listed in
    ``graph_breaks``, and the step computes what the uncompiled step computes; with checkpointing it is refused (the
    recomputation could differ from the forward)."""
    import headscope.hybrid.inference.train_forward as tf

    monkeypatch.setattr(tf, "gdn_op", torch.compiler.disable(lambda *a: gdn_op(*a)))
    st = _student(teacher, "hybrid")
    params = [p for _, p in trainable_parameters(st, 3)]
    batch = _batch(2, 8)
    ref = FastStep(3, st, None, params, compile=False)
    want = float(ref(*batch)[0])
    ref.close()
    torch._dynamo.reset()  # Dynamo's caches hang on the code objects: each case compiles afresh
    fc = FastStep(3, st, None, params, compile=True, backend="eager", activation_checkpointing=True)
    with pytest.raises(RuntimeError, match="activation checkpointing"):
        fc(*batch)
    fc.close()
    torch._dynamo.reset()
    fs = FastStep(3, st, None, params, compile=True, backend="eager")
    with pytest.warns(UserWarning, match="graph break"):
        got = float(fs(*batch)[0])
    assert len(fs.graph_breaks) >= 1 and all(b.startswith("_") for b in fs.graph_breaks), fs.graph_breaks
    assert got == pytest.approx(want, rel=1e-6)
    fs.close()
    torch._dynamo.reset()
