import numpy as np
import pytest
import torch

from headscope.patching import receiver_patching
from headscope.patching.attribution import attribution_ie, recall_at_k
from headscope.patching.screen import screen_then_verify
from headscope.patching.engine import Engine
from headscope.patching.receivers import sequences
from headscope.readout import logit_diff
from headscope.tasks import niah_single


@pytest.fixture(scope="module")
def pairs(smol_tokenizer):
    return niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=0)


def test_atp_is_the_first_order_term(tiny, pairs):
    """AtP of one head equals the directional derivative, checked by a finite difference."""
    atp, m_c, m_x = attribution_ie(tiny, pairs[:1])
    e = Engine(tiny)
    p = pairs[0]
    clean_seq, corr_seq, read = sequences(p)
    clean, corr = e.run(clean_seq, read), e.run(corr_seq, read)
    layer, h, dh = 0, 1, tiny.geometry.d_head
    sl = slice(h * dh, (h + 1) * dh)
    eps = 1e-2  # central difference: O(eps^2) truncation, float32 rounding ~1e-5

    def m_at(t):
        def override(lay, z):
            if lay == layer:
                z = z.clone()
                z[0, :, sl] = clean.z[layer][:, sl] + t * (corr.z[layer][:, sl] - clean.z[layer][:, sl])
            return z

        return float(logit_diff(e.run(clean_seq, read, z_override=override).logits, p.answer, p.counter_answer))

    deriv = (m_at(eps) - m_at(-eps)) / (2 * eps)
    gap = float(m_c[0] - m_x[0])
    assert float(atp[0, layer, h]) == pytest.approx(-deriv / gap, rel=1e-3, abs=1e-5)


def test_atp_exact_for_last_layer_linear_heads(tiny, pairs):
    """In the last layer a head's output reaches the logits through o_proj and the final RMSNorm only;
    AtP and exact patching agree in sign and roughly in size there (a sanity check on real numbers)."""
    atp, _, _ = attribution_ie(tiny, pairs, lam=0.9)
    exact = receiver_patching(tiny, pairs, min_gap=0.0, progress=False).ie
    a, b = atp[:, 1].flatten(), exact[:, 1].flatten()
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.9


def test_screen_then_verify(tiny, pairs):
    res = screen_then_verify(tiny, pairs, verify=3, spot_checks=2, min_gap=0.0, progress=False)
    exact = receiver_patching(tiny, pairs, min_gap=0.0, progress=False).ie
    assert len(res.verified) == 3 and len(res.spot_checked) == 2
    for layer, h in res.verified + res.spot_checked:
        assert torch.allclose(res.ie[:, layer, h], exact[:, layer, h])
    assert res.details["n_unverified"] == 8 - 3 - 2
    assert 0 <= res.spot_hits <= 2 and res.missed_upper95 >= res.missed_estimate
    # verifying every head makes the screen exact
    full = screen_then_verify(tiny, pairs, verify=8, spot_checks=0, min_gap=0.0, progress=False)
    assert torch.allclose(full.ie, exact)


def test_missed_upper95_when_every_spot_check_is_a_miss(tiny, pairs, monkeypatch):
    """Issue 20: x = n spot-check misses gave beta.ppf(0.95, n + 1, 0) = NaN; the one-sided 95 %
    Clopper–Pearson bound on the miss rate is 1.0 there, so the bound is 1.0 × unverified heads."""
    from scipy import stats

    import headscope.patching.attribution as att
    import headscope.patching.screen as scr

    assert np.isnan(stats.beta.ppf(0.95, 4, 0))  # the expression the bound used for 3 of 3
    exact = receiver_patching(tiny, pairs, min_gap=0.0, progress=False).ie
    real = att.attribution_ie

    def reversed_screen(*a, **k):  # a screen that ranks heads in the reverse of their exact IE
        _, m_c, m_x = real(*a, **k)
        return -exact.clone(), m_c, m_x

    monkeypatch.setattr(scr, "attribution_ie", reversed_screen)
    res = scr.screen_then_verify(tiny, pairs, verify=2, spot_checks=3, min_gap=0.0, progress=False)
    # the 2 "verified" heads are the 2 lowest exact heads, so every other head reaches them
    means = exact.double().mean(0)
    assert sorted(res.verified) == sorted(divmod(int(i), 4) for i in means.flatten().argsort()[:2])
    assert (res.spot_hits, len(res.spot_checked), res.details["n_unverified"]) == (3, 3, 3)
    assert res.missed_estimate == pytest.approx(3.0)
    assert res.missed_upper95 == 1.0 * 3


def test_recall_at_k():
    a = np.arange(10.0)
    assert recall_at_k(a, a, 3) == 1.0
    assert recall_at_k(a, -a, 3) == 0.0
    assert recall_at_k(a, np.array([0, 1, 2, 3, 4, 5, 9, 6, 7, 8.0]), 3) == 2 / 3


def test_rank_screen_mode(tiny_dir, tmp_path):
    import headscope

    exact = headscope.rank(str(tiny_dir), n_pairs=2, seq_len=64, min_gap=0.0, device="cpu", progress=False)
    r = headscope.rank(str(tiny_dir), n_pairs=2, seq_len=64, min_gap=0.0, device="cpu", progress=False,
                       mode="screen", verify=2, spot_checks=1, out_dir=tmp_path / "s")
    ver = r.scores[r.scores["verified"]]
    assert len(ver) == 3 and r.provenance["screen"]["verified"] == 2
    merged = ver.merge(exact.scores, on=["layer", "head"])
    assert np.allclose(merged["ie_recv_x"], merged["ie_recv_y"], atol=1e-6)
    unver = r.scores[~r.scores["verified"]]
    assert np.allclose(unver["ie_recv"], unver["ie_atp"])
    with pytest.raises(ValueError, match="mode="):
        headscope.rank(str(tiny_dir), n_pairs=1, seq_len=64, mode="fast", device="cpu")


def test_rank_screen_mode_defaults_to_the_certified_auto_screen(tiny_dir):
    """rank(mode="screen") uses verify="auto"; on a model with fewer heads than its top 10 it certifies
    every head, so the table equals the exact sweep."""
    import headscope

    exact = headscope.rank(str(tiny_dir), n_pairs=2, seq_len=64, min_gap=0.0, device="cpu", progress=False)
    r = headscope.rank(str(tiny_dir), n_pairs=2, seq_len=64, min_gap=0.0, device="cpu", progress=False, mode="screen")
    assert r.provenance["screen"]["verified"] == 8 and r.scores["verified"].all()
    merged = r.scores.merge(exact.scores, on=["layer", "head"])
    assert np.allclose(merged["ie_recv_x"], merged["ie_recv_y"], atol=1e-6)


def test_run_suffix_matches_full_pass(tiny, pairs):
    """run_suffix of the corrupted prompt from the clean cache equals a full pass of it, and its
    gradient pass gives the full pass's hook_z gradients at the suffix positions."""
    e = Engine(tiny)
    p = pairs[0]
    clean_seq, corr_seq, read = sequences(p)
    start = min(p.first_diff(), read[0])
    assert start > 0
    clean, full = e.run(clean_seq, read), e.run(corr_seq, read)
    logits, zs, cache = e.run_suffix(clean, corr_seq, start, read)
    for a, b in ((cache.resid, full.resid), (cache.z, full.z), (cache.k, full.k), (cache.v, full.v),
                 (cache.logits, full.logits), (logits, full.logits)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    lg, zg = e.run_with_grad(corr_seq, read)
    g_full = torch.autograd.grad(logit_diff(lg, p.answer, p.counter_answer), zg)
    lg2, zg2, none = e.run_suffix(clean, corr_seq, start, read, grad=True)
    assert none is None
    g_suf = torch.autograd.grad(logit_diff(lg2, p.answer, p.counter_answer), zg2)
    for a, b in zip(g_suf, g_full):
        torch.testing.assert_close(a[0], b[0, start:], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="first read position"):
        e.run_suffix(clean, corr_seq, read[0] + 1, read)


def test_low_precision_engine_close_to_exact(tiny, pairs):
    """The bf16 screening engine (fused q|k|v and gate|up, activations in bf16) stays close to the exact
    engine on full passes and patched suffix passes (bf16 rounding only)."""
    e, low = Engine(tiny), Engine(tiny, matmul_dtype=torch.bfloat16)
    p = pairs[1]
    clean_seq, corr_seq, read = sequences(p)
    ref, approx = e.run(clean_seq, read), low.run(clean_seq, read)
    scale = float(ref.logits.abs().max())
    assert float((approx.logits - ref.logits).abs().max()) < 0.05 * scale
    assert float((approx.logits - ref.logits).abs().max()) > 0  # it is a different computation
    corr = e.run(corr_seq, read)
    start = min(p.first_diff(), read[0])
    z = corr.z[0, start:][None]
    a = e.patched_logits_multi(ref, [(0, z)], start, read)
    b = low.patched_logits_multi(ref, [(0, z)], start, read)
    assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())
