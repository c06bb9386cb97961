"""Receiver patching of a hybrid's heads (headscope/patching/hybrid_engine.py) against brute force: one forward of the
model per head with that head's o_proj input columns taken from the corrupted run."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import scaled_llama

from headscope.masks import HeadMask
from headscope.models import wrap
from headscope.patching import receiver_patching
from headscope.patching.contract import make_engine
from headscope.patching.hybrid_engine import HybridEngine, head_kinds, is_hybrid
from headscope.patching.receivers import sequences
from headscope.readout import logit_diff
from headscope.tasks import niah_single

FA = [(0, 1), (1, 0), (1, 3)]  # layer 0: one FA head of KV group 0; layer 1: one FA head in each group


def tiny_hybrid(tokenizer, gdn_conv: int = 0, seed: int = 7):
    """A 2-layer hybrid (4 heads, 2 KV heads, d_head 16) of a random Llama with weights of std 0.1 (so that
    niah pairs have clean-corrupted gaps of ~0.3 logits, not ~0.003), the hybrid's new parameters perturbed."""
    import headscope

    t = scaled_llama(tokenizer, seed)
    mask = HeadMask.from_heads(FA, 2, 4, 2)
    hy = headscope.hybridize(t, mask, fa_pos="nope", gdn_rope=True, fa_gate=True, gdn_kernel="torch",
                             gdn_conv=gdn_conv).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hy.named_parameters():
            if any(s in name for s in ("a_proj", "b_proj", "g_proj", "gamma", "dt_bias", "A_log", "gdn_conv")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return wrap(hy, tokenizer, name=f"tiny-hybrid-conv{gdn_conv}")


@pytest.fixture(scope="module")
def pairs(smol_tokenizer):
    return niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=0)


@torch.no_grad()
def brute_force(lm, pair):
    """(patched m [layer, head], m(x), m(x')): one plain forward per head, the head's o_proj input columns
    replaced at every position by the corrupted run's."""
    hf, g = lm.hf_model, lm.geometry
    clean, corr, read = sequences(pair)
    layers = hf.model.layers
    z_corr = {}
    hooks = [layers[i].self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: z_corr.__setitem__(i, a[0][0].clone()))
             for i in range(g.n_layers)]
    try:
        m_x = float(logit_diff(hf(corr[None], use_cache=False).logits[0, read], pair.answer, pair.counter_answer))
    finally:
        for h in hooks:
            h.remove()
    m_c = float(logit_diff(hf(clean[None], use_cache=False).logits[0, read], pair.answer, pair.counter_answer))
    d = g.d_head
    out = torch.empty(g.n_layers, g.n_heads, dtype=torch.float64)
    for lay in range(g.n_layers):
        for h in range(g.n_heads):
            def pre(m, a, lay=lay, h=h):
                z = a[0].clone()
                z[0, :, h * d:(h + 1) * d] = z_corr[lay][:, h * d:(h + 1) * d]
                return (z,)

            hk = layers[lay].self_attn.o_proj.register_forward_pre_hook(pre)
            try:
                lg = hf(clean[None], use_cache=False).logits[0, read]
            finally:
                hk.remove()
            out[lay, h] = float(logit_diff(lg, pair.answer, pair.counter_answer))
    return out, m_c, m_x


@pytest.mark.parametrize("gdn_conv", [0, 4])
def test_receiver_ie_equals_brute_force(smol_tokenizer, pairs, gdn_conv):
    lm = tiny_hybrid(smol_tokenizer, gdn_conv)
    assert head_kinds(lm.hf_model) == [["gdn", "fa", "gdn", "gdn"], ["fa", "gdn", "gdn", "fa"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no shortcut may be given up on this model
        res = receiver_patching(lm, pairs, min_gap=0.0, progress=False, batch_size=3)
    assert res.path == "hybrid"
    for i, p in enumerate(pairs):
        ref, m_c, m_x = brute_force(lm, p)
        assert abs(m_c - m_x) > 0.1  # a gap that resolves IE (else the comparison below says little)
        assert res.m_clean[i].item() == pytest.approx(m_c, abs=1e-6)
        assert res.m_corrupt[i].item() == pytest.approx(m_x, abs=1e-6)
        ref_ie = (m_c - ref) / (m_c - m_x)
        assert ref_ie.abs().max() > 0.05  # patches that move m: the comparison can fail
        assert (res.patched[i] - ref).abs().max() <= 1e-5
        assert (res.ie[i].double() - ref_ie).abs().max() <= 1e-5


def test_shortcuts_on_and_batching_invariant(smol_tokenizer, pairs):
    lm = tiny_hybrid(smol_tokenizer)
    eng = make_engine(lm)
    assert isinstance(eng, HybridEngine)
    a = receiver_patching(lm, pairs, min_gap=0.0, progress=False, batch_size=1).patched
    b = receiver_patching(lm, pairs, min_gap=0.0, progress=False, batch_size=8).patched
    assert (a - b).abs().max() <= 1e-5
    # the engine's own rows, the shortcuts on, against full forwards without them
    from headscope.patching.receivers import PairState, patch_rows
    from headscope.readout import Readout

    st = PairState(eng, pairs[0], Readout(min_gap=0.0))
    assert st.start > 0  # the prefix shortcut has something to skip
    assert eng.check_patches(st.base_ids, st.base, st.src, st.start, st.read) <= 1e-4
    assert eng.prefix and eng.join and not eng.why
    rows = [(lay, h) for lay in range(2) for h in range(4)]
    fast = torch.cat([m for _, m in patch_rows(eng, st, rows, batch_size=8)])
    eng.prefix = eng.join = False
    slow = torch.cat([m for _, m in patch_rows(eng, st, rows, batch_size=8)])
    assert (fast - slow).abs().max() <= 1e-5 and (slow - st.m_clean).abs().max() > 1e-3


def test_broken_shortcut_is_given_up(smol_tokenizer, pairs, monkeypatch):
    """A prefix cache that lost its GDN state is caught by the check; the ranking then runs without it, exactly."""
    import headscope.patching.hybrid_engine as H

    lm = tiny_hybrid(smol_tokenizer)
    real = H._copy_cache

    def broken(cache, config, rows, max_len):
        c = real(cache, config, rows, max_len)
        for slot in c.layers:
            if slot.dc.S is not None:
                slot.dc.S.zero_()
        return c

    monkeypatch.setattr(H, "_copy_cache", broken)
    from headscope.patching.receivers import PairState, patch_rows
    from headscope.readout import Readout

    eng = HybridEngine(lm)
    st = PairState(eng, pairs[0], Readout(min_gap=0.0))
    with pytest.warns(UserWarning, match="running without the 'prefix' shortcut"):
        eng.check_patches(st.base_ids, st.base, st.src, st.start, st.read)
    assert not eng.prefix and eng.join and len(eng.why) == 1
    rows = [(lay, h) for lay in range(2) for h in range(4)]
    got = torch.cat([m for _, m in patch_rows(eng, st, rows, batch_size=8)]).view(2, 4)
    ref, _, _ = brute_force(lm, pairs[0])
    assert (got - ref).abs().max() <= 1e-5


def test_make_engine_paths(smol_tokenizer, tiny):
    lm = tiny_hybrid(smol_tokenizer)
    assert is_hybrid(lm.hf_model) and not is_hybrid(tiny.hf_model)
    assert make_engine(lm, "hybrid").path == "hybrid"
    with pytest.raises(ValueError, match="head-wise hybrid"):
        make_engine(lm, "fast")
    with pytest.raises(ValueError, match="needs a head-wise hybrid"):
        make_engine(tiny, "hybrid")
