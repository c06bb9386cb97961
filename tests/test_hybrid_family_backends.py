"""The fast backends on the Mistral (sliding window 24), Gemma 3 (sliding window 8 between full layers, a RoPE
base per layer type, Gemma's QK-norm, scaled embedding, sandwich norms, here a final-logit soft-cap) and GPT-NeoX
(partial rotary, parallel residual, biases) hybrids (issue 61 item 4): each role's fast backend against
the reference forward of the same model — tiny random models of tests/families.py, CPU, fp32, prompts past every
window; the decode kernels run through Triton's interpreter where tests/conftest.py sets it (else their PyTorch
forms). GPU checks in bf16 against fp64: tests/test_hybrid_gpu_checks.py."""

from dataclasses import replace

import pytest
import torch
from transformers import masking_utils

from headscope import HeadscopeInputError
from headscope.hybrid import HybridCache, hybridize
from headscope.hybrid.backend_registry import Needs, replace_all, select
from headscope.hybrid.inference import DEFAULT, forward, model_step, train_forward, use_inference
from headscope.hybrid.inference.inference_config import own_mask
from headscope.hybrid.modeling_hybrid import attention_name, decoder_layers
from headscope.masks import HeadMask

from families import FAMILIES

V, T, T0 = 128, 40, 34  # prompts past every window; decode steps from T0 to T (one sequence: the interpreter)
REF = replace_all(DEFAULT, "reference")
ON = replace(DEFAULT, train="fused", prefill="lean", decode="lean", captured_decode="graph")
FAST = {"mistral_sw": ON, "gemma3": ON, "gpt_neox": ON}


@pytest.fixture(scope="module", params=sorted(FAST))
def hybrid(request):
    """(family, hybrid): FA heads l mod H (+ H − 1 on odd layers), GDN decay / β / γ moved off their initial values;
    Gemma 3's logits soft-capped at 2 (its real checkpoints have none; Gemma 2's 30 is the form)."""
    t = FAMILIES[request.param](V, 0).float().eval()
    c = t.config
    if request.param == "gemma3":
        c.final_logit_softcapping = 2.0
    L, H = c.num_hidden_layers, c.num_attention_heads
    KV = getattr(c, "num_key_value_heads", None) or H
    mask = HeadMask(L, H, KV, tuple(tuple(sorted({l % H} | ({H - 1} if l % 2 else set()))) for l in range(L)))
    h = hybridize(t, mask, gdn_kernel="torch").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in h.named_parameters():
            if any(k in n for k in ("A_log", "a_proj", "b_proj", "gamma")):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return request.param, h


def _ids(batch=2):
    return torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(0))


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _train_step(h, cfg):
    use_inference(h, cfg)
    h.zero_grad()
    logits = h(_ids(), use_cache=False).logits
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in h.named_parameters() if p.grad is not None}


def test_fused_training_forward_equals_the_reference(hybrid, monkeypatch):
    """Logits and every gradient of the fused train backend equal the reference's; it computes every layer, the
    sliding ones too (transformers' causal-window mask recognized as the layer's own and left to the backend)."""
    name, h = hybrid
    want, g_want = _train_step(h, REF)
    calls = _counting(monkeypatch, train_forward, "fast_forward")
    got, g_got = _train_step(h, FAST[name])
    assert len(calls) == len(decoder_layers(h))
    assert want.abs().max() > 0.5 and (got - want).abs().max() < 2e-5
    assert g_got.keys() == g_want.keys() and len(g_got) > 10
    for n in g_want:
        torch.testing.assert_close(g_got[n], g_want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_lean_prefill_and_decode_equal_the_reference(hybrid, monkeypatch):
    """The lean prefill's logits equal the reference forward's; decode steps into a HybridCache from T0 to T (past
    every window: the FA heads of sliding layers attend to their last w slots) equal the reference forward's logits
    at those positions; greedy generate (the default and the static cache) gives the reference's tokens. Every decode
    step runs as the captured whole-model step (``StaticDecoder.step_replayed``: device positions; on CPU eagerly),
    which calls the lean step itself, never the module."""
    name, h = hybrid
    ids = _ids()
    with torch.no_grad():
        use_inference(h, REF)
        want = h(ids).logits
        want_gen = h.generate(ids[:1, :T0], max_new_tokens=6, min_new_tokens=6, do_sample=False)
        pre, dec = _counting(monkeypatch, forward, "prefill"), _counting(monkeypatch, forward, "decode_step")
        captured = []
        real_step = model_step.model_forward
        monkeypatch.setattr(model_step, "model_forward",
                            lambda *a: (lambda out: captured.append(out is not None) or out)(real_step(*a)))
        use_inference(h, FAST[name])
        assert (h(ids).logits - want).abs().max() < 2e-5 and len(pre) == len(decoder_layers(h))
        cache = HybridCache(h.config, max_len=64)
        h(ids[:1, :T0], cache=cache, use_cache=True)
        steps = torch.stack([h(ids[:1, t: t + 1], cache=cache, use_cache=True).logits[:, -1] for t in range(T0, T)], 1)
        assert (steps - want[:1, T0:]).abs().max() < 2e-5 and want.abs().max() > 0.5
        for kw in ({}, {"cache_implementation": "static"}):  # Mistral's StaticCache holds only the window: not ours
            assert torch.equal(h.generate(ids[:1, :T0], max_new_tokens=6, min_new_tokens=6, do_sample=False, **kw),
                               want_gen), kw
    assert sum(captured) == T - T0 + 10 and len(dec) == 0  # every decode step: 6 here, 5 per generate


def test_static_decoder_with_compiled_tails_equals_the_reference(hybrid):
    """StaticDecoder driven directly (the benchmarks' tool), its step's ends and layer tails compiled whole
    (``fullgraph``, Dynamo's eager backend: no C++ compiler needed) as ``generate`` with the static cache compiles them
    on CUDA: a prefill to T0 and steps to T give the reference forward's logits (2e-5, fp32) — Gemma 3's per-type
    RoPE, sandwich norms and soft-cap, GPT-NeoX's parallel residual — with no compile failure (it would warn)."""
    import warnings

    from headscope.hybrid.inference.decoder import StaticDecoder

    name, h = hybrid
    ids = _ids()
    with torch.no_grad():
        use_inference(h, REF)
        want = h(ids).logits
        dec = StaticDecoder(h, 2, 64, compile_tail=True, config=replace(FAST[name], tail_backend="eager"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = torch.stack([dec.prefill(ids[:, :T0])] + [dec.step(ids[:, t: t + 1]) for t in range(T0, T - 1)], 1)
    assert dec.length == T - 1 and (got - want[:, T0 - 1: T - 1]).abs().max() < 2e-5


def test_own_mask_is_only_the_unpadded_causal_window():
    """transformers' sliding-window mask of an unpadded prompt is the layer's own (a backend may drop it); a padded
    one, another window, or a full layer given a window's mask is not."""
    t = FAMILIES["mistral_sw"](V, 0).float().eval()
    h = hybridize(t, HeadMask(2, 4, 2, ((0,), (1,))), gdn_kernel="torch").eval()
    layer = getattr(decoder_layers(h)[0], attention_name(decoder_layers(h)[0]))
    emb = torch.zeros(2, T, 64)
    pad = torch.ones(2, T, dtype=torch.long)
    pad[1, :3] = 0
    masks = {k: masking_utils.create_sliding_window_causal_mask(config=h.config, inputs_embeds=emb, attention_mask=m,
                                                               cache=None, position_ids=torch.arange(T)[None])
             for k, m in (("plain", None), ("padded", pad))}
    assert own_mask(layer, masks["plain"], None) and not own_mask(layer, masks["padded"], None)
    full = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    assert not own_mask(layer, full, None)  # a sliding layer given the full causal mask
    layer.spec = replace(layer.spec, window=None)
    try:
        assert own_mask(layer, full, None) and not own_mask(layer, masks["plain"], None)
    finally:
        layer.spec = replace(layer.spec, window=24)


def test_backends_say_what_they_lack():
    """auto picks the fast backends of every role for Mistral, Gemma 3 and GPT-NeoX on CUDA (the captured step from the
    hybrid models' own features); a backend named for a feature it lacks is refused, the message naming the feature
    and the fix: the captured step for a decoder layer of another form and for an attention soft-cap, the decode
    kernels for a soft-capped layer (Gemma 2 style)."""
    mistral, gemma, neox = (Needs(frozenset(f), "bfloat16", "cuda") for f in (
        {"window"}, {"window", "qk_norm_teacher", "logit_scale"}, {"biases", "partial_rotary"}))
    for needs in (mistral, gemma, neox):
        assert [select(r, "auto", needs).name for r in ("train", "prefill", "decode", "captured_decode")] == [
            "fused", "lean", "lean", "graph"]
    for name in ("gemma3", "gpt_neox"):
        t = FAMILIES[name](V, 0).float().eval()
        L, H = t.config.num_hidden_layers, t.config.num_attention_heads
        h = hybridize(t, HeadMask(L, H, getattr(t.config, "num_key_value_heads", None) or H,
                                  tuple((i % H,) for i in range(L))), gdn_kernel="torch").eval()
        assert select("captured_decode", "auto", replace(gemma, features=h.backends.features)).name == "graph", name
    layer = decoder_layers(h)[0]  # GPT-NeoX: a decoder layer of a class the captured step does not know
    layer.__class__ = type("OtherLayer", (type(layer),), {})
    with pytest.raises(HeadscopeInputError, match="lacks feature other_decoder_layer; use captured_decode='auto'"):
        use_inference(h, replace(DEFAULT, captured_decode="graph"))
    t = FAMILIES["gemma3"](V, 0).float().eval()
    h = hybridize(t, HeadMask(3, 4, 2, ((0,), (1,), (2,))), gdn_kernel="torch").eval()
    attn = getattr(decoder_layers(h)[1], attention_name(decoder_layers(h)[1]))
    attn.spec = replace(attn.spec, softcap=5.0)
    with pytest.raises(HeadscopeInputError, match="lacks feature softcap; use captured_decode='auto'"):
        use_inference(h, replace(DEFAULT, captured_decode="graph"))
    soft = Needs(frozenset({"softcap"}), "bfloat16", "cuda")
    assert select("prefill", "lean", soft).name == "lean" and select("decode", "auto", soft).name == "reference"
    with pytest.raises(HeadscopeInputError, match="lacks feature softcap; use decode='auto'"):
        select("decode", "lean", soft, " to layer 0")


# ------------------------------------------------------------------------------------------------- on the GPU
def _rel(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/recipes/gpu_tests.sh)")
@pytest.mark.parametrize("name", sorted(FAST))
def test_auto_backends_in_bf16_on_cuda_against_fp64(name):
    """On CUDA in bf16 with the default InferenceConfig ("auto": fused / lean / lean, the decode steps as the
    captured graph; the Triton decode kernels, fla and flash-attn where installed), head_dim 64: the training
    forward's logits, the prefill's and decode steps' past every window, each against the fp64 reference forward of
    the same weights (CPU), relative RMS error at most 2 × the bf16 reference forward's own + 0.01 (a wrong window,
    norm or scale gives errors of order 1)."""
    errs = _bf16_errors(name, "cuda")
    for fast, ref in zip(errs["auto"], errs["reference"]):
        assert fast <= 2 * ref + 0.01, errs


def _bf16_errors(name, device):
    """{"reference" | "auto": [train, prefill, decode] relative RMS errors of the bf16 model on ``device``}."""
    from headscope.arch.random_models import hybrid_families

    t = hybrid_families((3, 256, 4, 2))[name](V, 0).float().eval()
    mask = HeadMask(3, 4, getattr(t.config, "num_key_value_heads", None) or 4, ((0,), (1, 3), (2,)))
    h64 = hybridize(t, mask).double().eval()
    use_inference(h64, REF)
    ids = torch.randint(0, V, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = h64(ids).logits
    errs = {}
    for cfg_name, cfg in (("reference", REF), ("auto", DEFAULT)):
        h = hybridize(t, mask).to(device, torch.bfloat16).eval()
        h.load_state_dict({k: v.to(torch.bfloat16) for k, v in h64.state_dict().items()})
        use_inference(h, cfg)
        x = ids.to(device)
        train = h(x, use_cache=False).logits.float().cpu()  # gradients on: the train role
        with torch.no_grad():
            full = h(x).logits.float().cpu()
            cache = HybridCache(h.config, max_len=128)
            h(x[:, :88], cache=cache, use_cache=True)
            steps = torch.stack([h(x[:, t: t + 1], cache=cache, use_cache=True).logits[:, -1] for t in range(88, 96)], 1)
        errs[cfg_name] = [_rel(train, want), _rel(full, want), _rel(steps.float().cpu(), want[:, 88:])]
    print(name, "relative RMS error vs fp64 [train, prefill, decode]:", errs)
    return errs
