"""Every engine through the contract (headscope/patching/contract.py): the same receiver-patching case (one pair, every
head of a 2-layer model) run with only the members of :class:`PatchingEngine` on the fast engine, the generic bridge
engine and the hybrid engine, each against brute force: one plain forward of the transformers model per head, that
head's ``o_proj`` input columns (its hook_z) replaced at every position by the corrupted run's."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import scaled_llama

from headscope.masks import HeadMask
from headscope.models import wrap
from headscope.patching import PatchingEngine, PlanEngine, make_engine
from headscope.patching.layer_ops import head_slice
from headscope.patching.receivers import sequences
from headscope.readout import logit_diff
from headscope.tasks import niah_single


@pytest.fixture(scope="module")
def models(smol_tokenizer):
    import headscope

    plain = scaled_llama(smol_tokenizer)
    hy = headscope.hybridize(scaled_llama(smol_tokenizer), HeadMask.from_heads([(0, 1), (1, 0), (1, 3)], 2, 4, 2),
                             fa_pos="nope", gdn_rope=True, fa_gate=True, gdn_kernel="torch").eval()
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in hy.named_parameters():
            if any(s in name for s in ("a_proj", "b_proj", "g_proj", "gamma", "dt_bias", "A_log")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return wrap(plain, smol_tokenizer, name="tiny-llama-std0.1"), wrap(hy, smol_tokenizer, name="tiny-hybrid")


@pytest.fixture(scope="module")
def pair(smol_tokenizer):
    return niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.5, seed=0)[0]


@torch.no_grad()
def brute_force(lm, pair) -> tuple[torch.Tensor, float, float]:
    """(patched m [layer, head], m(x), m(x')): one full forward of the transformers model per head."""
    hf, g = lm.hf_model, lm.geometry
    clean, corr, read = sequences(pair)
    o_proj = [layer.self_attn.o_proj for layer in hf.model.layers]
    z_corr: dict[int, torch.Tensor] = {}
    hooks = [o.register_forward_pre_hook(lambda m, a, i=i: z_corr.__setitem__(i, a[0][0].clone()))
             for i, o in enumerate(o_proj)]
    try:
        m_x = float(logit_diff(hf(corr[None], use_cache=False).logits[0, read], pair.answer, pair.counter_answer))
    finally:
        for h in hooks:
            h.remove()
    m_c = float(logit_diff(hf(clean[None], use_cache=False).logits[0, read], pair.answer, pair.counter_answer))
    out = torch.empty(g.n_layers, g.n_heads, dtype=torch.float64)
    for lay in range(g.n_layers):
        for h in range(g.n_heads):
            sl = head_slice(h, g.d_head)

            def pre(m, a, lay=lay, sl=sl):
                z = a[0].clone()
                z[0, :, sl] = z_corr[lay][:, sl]
                return (z,)

            hk = o_proj[lay].register_forward_pre_hook(pre)
            try:
                lg = hf(clean[None], use_cache=False).logits[0, read]
            finally:
                hk.remove()
            out[lay, h] = float(logit_diff(lg, pair.answer, pair.counter_answer))
    return out, m_c, m_x


@torch.no_grad()
def through_contract(eng: PatchingEngine, pair) -> tuple[torch.Tensor, float, float]:
    """The same case with the contract's members only: two base passes, the patched-row check, one batch of
    patched rows (every head of every layer, the cached prefix up to the first differing position)."""
    g = eng.g
    clean, corr, read = sequences(pair)
    base, src = eng.run(clean, read), eng.run(corr, read)
    start = min(pair.first_diff(), read[0])
    assert start > 0  # the shortcuts (prefix, rows joining at their layer) are exercised
    assert eng.check_patches(clean, base, src, start, read) <= 1e-4
    entries = []
    for lay in range(g.n_layers):
        z = base.z[lay, start:][None].repeat(g.n_heads, 1, 1)
        for h in range(g.n_heads):
            sl = head_slice(h, g.d_head)
            z[h, :, sl] = src.z[lay, start:][:, sl]
        entries.append((lay, z))
    logits = eng.patched_logits_multi(base, entries, start, read)
    m = torch.tensor([float(logit_diff(lg, pair.answer, pair.counter_answer)) for lg in logits], dtype=torch.float64)
    m_c = float(logit_diff(base.logits, pair.answer, pair.counter_answer))
    m_x = float(logit_diff(src.logits, pair.answer, pair.counter_answer))
    return m.reshape(g.n_layers, g.n_heads), m_c, m_x


def test_every_engine_matches_brute_force_through_the_contract(models, pair):
    plain, hybrid = models
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no engine gives a shortcut up on these models
        engines = [make_engine(plain, "fast"), make_engine(plain, "generic"), make_engine(hybrid, "auto")]
    assert [e.path for e in engines] == ["fast", "generic", "hybrid"]
    assert all(isinstance(e, PatchingEngine) for e in engines)
    assert [isinstance(e, PlanEngine) for e in engines] == [True, False, False]
    assert engines[1].mode == "plain" and engines[1].prefix and engines[1].join  # the generic path's shortcuts
    for eng, lm in zip(engines, (plain, plain, hybrid)):
        ref, m_c, m_x = brute_force(lm, pair)
        got, g_c, g_x = through_contract(eng, pair)
        assert abs(m_c - m_x) > 0.1, (eng.path, m_c, m_x)  # a gap the patches can move
        assert ((m_c - ref).abs() / abs(m_c - m_x)).max() > 0.05  # patches that move m: the comparison can fail
        assert g_c == pytest.approx(m_c, abs=1e-5) and g_x == pytest.approx(m_x, abs=1e-5), eng.path
        assert (got - ref).abs().max() <= 1e-5, (eng.path, float((got - ref).abs().max()))
