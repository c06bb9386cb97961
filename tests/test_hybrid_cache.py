"""The hybrid's transformers Cache (HybridCache): model(ids) and generate take it, and the fast paths through it.

Every check compares with a cache-free forward (the brute-force reference: the whole sequence again each step).
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from headscope.hybrid import HybridCache, InferenceConfig, hybridize, use_inference
from headscope.hybrid.inference import decoder as decoder_mod
from headscope.masks import HeadMask

L, H, KV, D = 3, 4, 2, 8
MIXED = HeadMask(L, H, KV, ((0,), (1, 2), (3,)))
KW = dict(pad_token_id=0, eos_token_id=None)


def _hybrid(seed=0, **opts):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=H,
                      num_key_value_heads=KV, head_dim=D, max_position_embeddings=1024)
    m = hybridize(LlamaForCausalLM(cfg).eval(), MIXED, **opts).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-trivial new parameters (decays, β, γ)
        for layer in m.model.layers:
            for p in layer.self_attn.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def _ids(B, T, seed=1):
    return torch.randint(2, 101, (B, T), generator=torch.Generator().manual_seed(seed))


def _greedy_loop(model, ids, n):
    out = ids
    with torch.no_grad():
        for _ in range(n):
            out = torch.cat([out, model(out, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return out


def _lean(model, where):
    """``where="always"``: the lean and graph backends named (on CPU too); ``"never"``: the reference everywhere."""
    names = ("lean", "lean", "graph") if where == "always" else ("reference",) * 3
    use_inference(model, dataclasses.replace(InferenceConfig(), **dict(zip(("prefill", "decode", "captured_decode"), names))))
    return model


@pytest.mark.parametrize("where", ["never", "always"])
def test_incremental_decoding_through_the_cache_equals_full_forward(where):
    """Prefill 250 tokens, a chunk of 300 (past the first 512-token allocation: the cache grows, K/V and state
    copied), then 3 single-token steps: every position's logits equal one cache-free forward's."""
    m = _lean(_hybrid(), where)
    ids = _ids(2, 553)
    with torch.no_grad():
        full = m(ids, use_cache=False).logits
        out = m(ids[:, :250])
        cache = out.cache
        assert isinstance(cache, HybridCache) and cache.get_seq_length() == 250
        assert cache.decode_caches[0].max_len == 512  # 250 + 256 rounded up to 256
        parts = [out.logits, m(ids[:, 250:550], cache=cache).logits]
        assert cache.decode_caches[0].max_len == 1024  # doubled
        for t in range(550, 553):
            o = m(ids[:, t:t + 1], cache=cache)
            assert o.cache is cache
            parts.append(o.logits)
    assert cache.get_seq_length() == 553
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-4


def test_empty_transformers_caches_are_replaced_and_filled_ones_kept():
    m = _hybrid()
    ids = _ids(1, 9)
    with torch.no_grad():
        assert isinstance(m(ids, cache=DynamicCache(config=m.config)).cache, HybridCache)
        st = m(ids, cache=StaticCache(config=m.config, max_cache_len=40)).cache
        assert isinstance(st, HybridCache) and st.static and st.max_len == 40
        assert m(ids, use_cache=False).cache is None


@pytest.mark.parametrize("where", ["never", "always"])
def test_greedy_generate_default_and_static_equal_the_cache_free_loop(where):
    m = _lean(_hybrid(), where)
    ids = _ids(2, 20)
    ref = _greedy_loop(m, ids, 8)
    for extra in ({}, {"cache_implementation": "static"}):
        got = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, **KW, **extra)
        assert torch.equal(got, ref), extra


def test_static_generate_takes_the_replayed_step_and_sampling_matches(monkeypatch):
    """With the lean and graph backends named on the CPU a static cache's decode steps go through StaticDecoder.step_replayed
    (run eagerly off CUDA: the same device-position step a GPU replays); sampled tokens (same seed) equal those of
    the reference path."""
    m = _hybrid()
    ids = _ids(3, 16)
    calls = []
    orig = decoder_mod.StaticDecoder.step_replayed
    monkeypatch.setattr(decoder_mod.StaticDecoder, "step_replayed", lambda self, x: calls.append(1) or orig(self, x))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True, top_k=20, temperature=1.5,
              cache_implementation="static", **KW)
    _lean(m, "never")
    torch.manual_seed(3)
    want = m.generate(ids, **kw)
    assert calls == []
    _lean(m, "always")
    torch.manual_seed(3)
    got = m.generate(ids, **kw)
    assert len(calls) == 5  # 6 new tokens: the prefill makes the first, 5 decode steps
    assert torch.equal(got, want)


@pytest.mark.parametrize("graphs,replayed", [("all", 5), ("static", 0), ("never", 0)])
def test_default_generate_replays_the_step_where_the_config_says(graphs, replayed, monkeypatch):
    """generate's default (growing) cache: decode steps through StaticDecoder.step_replayed with
    decode_graphs="all", layer by layer otherwise; greedy tokens equal the cache-free loop either way."""
    m = _hybrid()
    use_inference(m, dataclasses.replace(InferenceConfig(), prefill="lean", decode="lean", captured_decode="graph", decode_graphs=graphs))
    ids = _ids(2, 16)
    calls = []
    orig = decoder_mod.StaticDecoder.step_replayed
    monkeypatch.setattr(decoder_mod.StaticDecoder, "step_replayed", lambda self, x: calls.append(1) or orig(self, x))
    got = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, **KW)
    assert len(calls) == replayed
    assert torch.equal(got, _greedy_loop(m, ids, 6))


@pytest.mark.parametrize("static", [False, True], ids=["default", "static"])
def test_a_short_convolution_decodes_through_the_models_own_forward(static, monkeypatch):
    """A hybrid with the GDN short convolution (gdn_conv=4: no lean path, so no device-position step) decodes through
    its own forward, not the replayed step: generate gives the cache-free loop's greedy tokens. "auto" picks the
    reference for it even on CUDA; naming the lean backend is refused."""
    from headscope import HeadscopeInputError
    from headscope.hybrid.backend_registry import Needs, select

    m = _hybrid(gdn_conv=4, gdn_kernel="torch")
    with pytest.raises(HeadscopeInputError, match="short_conv"):
        _lean(m, "always")
    feats = m.model.layers[0].self_attn.backends.features
    assert select("decode", "auto", Needs(feats, "bfloat16", "cuda")).name == "reference"
    ids = _ids(2, 12)
    calls = []
    orig = decoder_mod.StaticDecoder.step_replayed
    monkeypatch.setattr(decoder_mod.StaticDecoder, "step_replayed", lambda self, x: calls.append(1) or orig(self, x))
    got = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, **KW,
                     **({"cache_implementation": "static"} if static else {}))
    assert calls == [] and torch.equal(got, _greedy_loop(m, ids, 5))


def test_generate_under_autocast_decodes_through_the_models_own_forward(monkeypatch):
    """Under autocast the lean path (and so the device-position step) does not run: generate's decode steps go
    through the model's own forward (they raised before) and give 4 new tokens."""
    m = _lean(_hybrid(), "always")
    ids = _ids(2, 12)
    calls = []
    orig = decoder_mod.StaticDecoder.step_replayed
    monkeypatch.setattr(decoder_mod.StaticDecoder, "step_replayed", lambda self, x: calls.append(1) or orig(self, x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                         do_sample=False, **KW)
    assert calls == [] and got.shape == (2, 16) and torch.equal(got[:, :12], ids)


def test_replayed_step_follows_a_cache_that_grows():
    """Steps into a growing HybridCache replay the whole-model step; when a layer's cache is reallocated the step
    is rebuilt over the new buffers (logits still equal the cache-free forward's)."""
    m = _lean(_hybrid(), "always")
    ids = _ids(1, 262)
    with torch.no_grad():
        full = m(ids, use_cache=False).logits
        cache = HybridCache(m.config, initial_len=0)
        outs = [m(ids[:, :254], cache=cache, attention_mask=torch.ones(1, 254, dtype=torch.long)).logits[:, -1]]
        first = None
        for t in range(254, 262):  # capacity 512 after the prefill: no growth yet
            outs.append(m(ids[:, t:t + 1], cache=cache).logits[:, -1])
            first = first or cache.headscope_decoder
        assert cache.headscope_decoder is first
        # force a reallocation: a chunk past the capacity, then one more step
        more = _ids(1, 300, seed=9)
        m(more, cache=cache)
        ids2 = torch.cat([ids, more], 1)
        step = m(ids2[:, -1:], cache=cache).logits[:, -1]
        assert cache.headscope_decoder is not first and cache.decode_caches[0].max_len == 1024
        full2 = m(torch.cat([ids2, ids2[:, -1:]], 1), use_cache=False).logits[:, -1]
    assert (torch.stack(outs[:-1], 1) - full[:, 253:261]).abs().max() < 1e-4
    assert (step - full2).abs().max() < 1e-4


def test_padded_static_generate_equals_each_row_alone():
    m = _lean(_hybrid(), "always")
    a, b = _ids(1, 6, seed=4), _ids(1, 9, seed=5)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), a], 1), b], 0)
    am = torch.ones_like(batch)
    am[0, :3] = 0
    kw = dict(max_new_tokens=5, do_sample=False, cache_implementation="static", **KW)
    out = m.generate(batch, attention_mask=am, **kw)
    assert torch.equal(out[0, 9:], _greedy_loop(m, a, 5)[0, 6:])
    assert torch.equal(out[1, 9:], _greedy_loop(m, b, 5)[0, 9:])


def test_beam_search_reorders_the_gdn_state():
    """Beam search through the HybridCache (reorder_cache moves K/V, GDN state and convolution tail) equals beam
    search without a cache."""
    m = _hybrid(gdn_conv=4)
    ids = _ids(2, 12)
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, **KW)
    assert torch.equal(m.generate(ids, **kw), m.generate(ids, use_cache=False, **kw))


def test_cache_limits_are_errors_that_name_the_fix():
    m = _hybrid()
    ids = _ids(1, 10)
    cache = HybridCache(m.config, max_len=12, static=True)
    with torch.no_grad():
        m(ids, cache=cache)
        with pytest.raises(ValueError, match="larger max_len"):
            m(_ids(1, 3), cache=cache)
        with pytest.raises(ValueError, match="cannot be cropped"):
            cache.crop(-5)
        with pytest.raises(ValueError, match="new cache for a new batch"):
            m(_ids(2, 1), cache=cache)
    with pytest.raises(ValueError, match="needs max_len"):
        HybridCache(m.config, static=True)


@pytest.mark.parametrize("where", ["never", "always"])
def test_base_model_alone_gets_a_hybrid_cache(where):
    """The base model called on its own (``model.model(ids)``: transformers would make a DynamicCache, which the
    layers refuse) gets a HybridCache from the hybrid's pre-hook: its hidden states equal the causal LM's, and decoding
    through the cache it returns equals a cache-free forward. A user's hook elsewhere still turns the fast model step
    off; the hybrid's own pre-hook does not."""
    from headscope.hybrid.inference.model_step import _user_hooks

    m = _lean(_hybrid(), where)
    ids = _ids(2, 20)
    with torch.no_grad():
        full = m(ids, use_cache=False, output_hidden_states=True).hidden_states[-1]
        out = m.model(ids[:, :16])
        cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
        assert isinstance(cache, HybridCache) and cache.get_seq_length() == 16
        steps = [out.last_hidden_state]
        for t in range(16, 20):
            steps.append(m.model(ids[:, t : t + 1], past_key_values=cache).last_hidden_state)
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-5
    assert not _user_hooks(m.model)
    h = m.model.norm.register_forward_hook(lambda *a: None)
    assert _user_hooks(m.model.norm)
    h.remove()
