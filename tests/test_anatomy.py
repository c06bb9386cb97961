"""Head anatomy: Gini, critical shares, Spearman stability, DLA, layer cosine, figures, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from headscope.analysis import anatomy as an
from headscope.scores import Ranking, head_table


# ---- Gini ---------------------------------------------------------------------------------------
def gini_sorted(x):
    """The independent closed form on sorted values: G = 2 Σ_i i x_(i) / (n Σ x) − (n + 1) / n."""
    v = np.sort(np.asarray(x, dtype=float))
    n = v.size
    i = np.arange(1, n + 1)
    return 2 * (i * v).sum() / (n * v.sum()) - (n + 1) / n


def test_gini_hand_values():
    # [1,2,3,4]: Σ_ij |xi-xj| = 2(1+2+3+1+2+1) = 20, n=4, μ=2.5 -> 20 / (2·16·2.5) = 0.25
    assert an.gini([1, 2, 3, 4]) == pytest.approx(0.25)
    # all importance on one of n heads -> (n-1)/n
    assert an.gini([0, 0, 0, 5]) == pytest.approx(0.75)
    assert an.gini([2, 2, 2]) == pytest.approx(0.0)
    # negatives: clip (default, the paper's IE range [0, 1]) vs abs
    assert an.gini([-1, 1]) == pytest.approx(0.5)
    assert an.gini([-1, 1], negative="abs") == pytest.approx(0.0)
    # issue 20's example: [-1, 0.5, 0.5, 2] -> clip [0, .5, .5, 2]: Σ|xi-xj| = 2(.5+.5+2+0+1.5+1.5) = 12,
    # n=4, μ=0.75 -> 12 / (2·16·0.75) = 0.5; abs [1, .5, .5, 2]: 2(.5+.5+1+0+1.5+1.5) = 10, μ=1 -> 10/32
    assert an.gini([-1, 0.5, 0.5, 2]) == pytest.approx(0.5)
    assert an.gini([-1, 0.5, 0.5, 2], negative="abs") == pytest.approx(0.3125)
    assert an.gini([-1, 0.5, 0.5, 2], negative="abs") == pytest.approx(gini_sorted([1, 0.5, 0.5, 2]))
    assert math.isnan(an.gini([-1, 0]))  # nothing left after clipping
    with pytest.raises(ValueError, match="negative"):
        an.gini([-1, 1], negative="raise")
    assert math.isnan(an.gini([0, 0]))
    with pytest.raises(ValueError):
        an.gini([])


def test_gini_matches_sorted_formula():
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = rng.exponential(size=rng.integers(2, 40))
        assert an.gini(x) == pytest.approx(gini_sorted(x), rel=1e-12)


def test_layer_gini_summary():
    m = np.array([[1, 2, 3, 4], [0, 0, 0, 5], [0, 0, 0, 0]], dtype=float)
    g = an.layer_gini(m)
    assert g["per_layer"][:2] == pytest.approx([0.25, 0.75]) and g["per_layer"][2] is None
    assert (g["mean"], g["min"], g["max"]) == pytest.approx((0.5, 0.25, 0.75))
    assert (g["argmin_layer"], g["argmax_layer"]) == (0, 1)


# ---- critical share ------------------------------------------------------------------------------
def test_critical_share_counts():
    x = np.array([0.5, 0.11, 0.1, 0.05, -0.05, -0.2, 0.0, 0.3])
    c = an.critical_share(x, threshold=0.1)
    assert c["n_critical"] == 3  # 0.5, 0.11, 0.3 (strictly above)
    assert c["n_convertible"] == 4  # 0.1, 0.05, -0.05, 0.0
    assert c["n_negative"] == 1
    assert c["critical_share"] == pytest.approx(3 / 8) and c["convertible_share"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="NaN"):
        an.critical_share([0.1, float("nan")])


# ---- Spearman stability --------------------------------------------------------------------------
def spearman_hand(a, b):
    """ρ = 1 − 6 Σ d² / (n (n² − 1)) for vectors without ties."""
    ra = np.argsort(np.argsort(a))
    rb = np.argsort(np.argsort(b))
    n = len(a)
    return 1 - 6 * ((ra - rb) ** 2).sum() / (n * (n * n - 1))


def test_stability_curve_against_hand_spearman():
    rng = np.random.default_rng(0)
    signal = rng.normal(size=(3, 5))
    ie = signal[None] + rng.normal(scale=0.8, size=(7, 3, 5))
    ie[2] = np.nan  # a skipped pair is left out
    used = ie[[0, 1, 3, 4, 5, 6]].reshape(6, -1)
    # default: a reference disjoint from the sample (n_ref = 6 − max n = 3)
    curve = an.stability_curve(torch.tensor(ie), ns=[1, 2, 3], n_boot=25, seed=4, top_k=4)
    splits = an.stability_splits(6, [1, 2, 3], 25, n_ref=3, seed=4)
    for n in (1, 2, 3):
        sample, ref = splits[n]
        assert all(not set(s) & set(r) for s, r in zip(sample, ref))
        assert sample.shape == (25, n) and ref.shape == (25, 3)
        rhos = [spearman_hand(used[s].mean(0), used[r].mean(0)) for s, r in zip(sample, ref)]
        row = curve[curve.n == n].iloc[0]
        assert (row.n_ref, row.n_boot) == (3, 25)
        assert row.rho_mean == pytest.approx(np.mean(rhos), abs=1e-12)
        assert row.rho_std == pytest.approx(np.std(rhos, ddof=1), abs=1e-12)
        assert row.rho_lo == pytest.approx(np.percentile(rhos, 2.5), abs=1e-12)
        ov = [len(set(np.argsort(-used[r].mean(0))[:4]) & set(np.argsort(-used[s].mean(0))[:4])) / 4 for s, r in zip(sample, ref)]
        assert row.topk_overlap == pytest.approx(np.mean(ov))
    # the old reading, reference = all pairs (bootstrap with replacement)
    old = an.stability_curve(torch.tensor(ie), ns=[1, 3, 6], n_boot=25, seed=4, replace=True, reference="all")
    full = used.mean(0)
    idx = an.stability_samples(6, [1, 3, 6], 25, seed=4)
    for n in (1, 3, 6):
        rhos = [spearman_hand(used[i].mean(0), full) for i in idx[n]]
        assert old[old.n == n].rho_mean.iloc[0] == pytest.approx(np.mean(rhos), abs=1e-12)
    # all 6 of 6 pairs without replacement is the all-pairs ranking itself
    sub = an.stability_curve(torch.tensor(ie), ns=[6], n_boot=3, reference="all")
    assert sub.rho_mean.iloc[0] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="leave 3 to sample"):
        an.stability_curve(torch.tensor(ie), ns=[4], n_ref=3)
    with pytest.raises(ValueError, match="n_ref"):
        an.stability_curve(torch.tensor(ie), ns=[1], n_ref=6)
    with pytest.raises(ValueError, match="'split', 'all'"):
        an.stability_curve(torch.tensor(ie), reference="half")


def test_spearman_rows_matches_scipy_with_ties_and_nan():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(1)
    a = rng.integers(0, 4, size=(5, 12)).astype(float)  # many ties
    b = rng.integers(0, 4, size=(5, 12)).astype(float)
    got = an.spearman_rows(a, b)
    assert got == pytest.approx([spearmanr(x, y).statistic for x, y in zip(a, b)], abs=1e-12)
    a[1, 3] = np.nan
    a[2] = 1.0  # constant row
    got = an.spearman_rows(a, b[0])
    assert np.isnan(got[1]) and np.isnan(got[2])
    assert got[0] == pytest.approx(spearmanr(a[0], b[0]).statistic, abs=1e-12)


def _noise_sets(k=20, shape=(20, 4, 8)):
    return [np.random.default_rng(100 + s).normal(size=shape) for s in range(k)]


def test_stability_on_pure_noise_disjoint_vs_all_pairs():
    """Issue 20: IE of 20 pairs × 4 × 8 heads drawn at random has no ranking to find. Against a
    disjoint reference ρ stays near 0; against the mean of all pairs (which contains the sample) it
    climbs with n. For iid noise the biased reading's expectation follows from the draws: the
    sample mean Σ c_i x_i / n and the all-pairs mean Σ x_i / N correlate over heads with Pearson
    r = sqrt(n² / (N Σ c_i²)) (c_i: times pair i was drawn), Spearman ≈ (6/π) asin(r / 2)."""
    split, biased, theory = [], [], []
    N, n = 20, 6
    for x in _noise_sets():
        split.append(an.stability_curve(x, ns=[n], n_boot=200, n_ref=14).rho_mean.iloc[0])
        biased.append(an.stability_curve(x, ns=[n], n_boot=200, replace=True, reference="all").rho_mean.iloc[0])
    idx = an.stability_samples(N, [n], 200, seed=0, replace=True)[n]
    c2 = np.array([(np.bincount(i, minlength=N) ** 2).sum() for i in idx])
    theory = np.mean(6 / np.pi * np.arcsin(np.sqrt(n * n / (N * c2)) / 2))
    assert abs(np.mean(split)) < 0.1
    assert np.mean(biased) == pytest.approx(theory, abs=0.05)  # ≈ 0.47; the issue saw 0.42 on one draw
    assert np.mean(biased) > 0.35 and np.mean(biased) - np.mean(split) > 0.35
    # a separately drawn held-out reference is unbiased as well
    held = [an.stability_curve(x, ns=[n], n_boot=100, reference=y).rho_mean.iloc[0] for x, y in zip(_noise_sets(10), _noise_sets(10, (24, 4, 8))[::-1])]
    assert abs(np.mean(held)) < 0.1


def test_stability_noise_baseline_column():
    """The noise baseline shuffles heads within every pair: with a real signal ρ is high and the
    baseline stays at 0; the baseline is drawn on the figure."""
    rng = np.random.default_rng(2)
    signal = rng.exponential(size=(1, 30, 9))
    ie = signal + rng.normal(scale=1.0, size=(30, 30, 9))
    curve = an.stability_curve(ie, ns=[1, 6], n_boot=100, n_ref=24, noise=True)
    row = an.stability_at(curve, 6)
    assert row["n_ref"] == 24 and row["paper_rho"] == 0.921
    assert row["rho_mean"] > 0.5 and abs(row["noise_rho_mean"]) < 0.05
    assert row["noise_rho_std"] > 0 and row["noise_rho_lo"] < 0 < row["noise_rho_hi"]
    assert an.stability_at(curve, 7) is None
    # the baseline does not change the curve itself
    plain = an.stability_curve(ie, ns=[1, 6], n_boot=100, n_ref=24)
    assert np.allclose(plain.rho_mean, curve.rho_mean)
    from headscope.plots import stability_plot

    fig = stability_plot(curve)
    names = [t.name for t in fig.data]
    assert "noise baseline (heads shuffled per pair)" in names
    assert "24 other pairs" in fig.layout.title.text
    # on pure noise, the biased reading's baseline shows the same inflation as the data
    x = _noise_sets(1)[0]
    b = an.stability_curve(x, ns=[6], n_boot=100, replace=True, reference="all", noise=True).iloc[0]
    assert b.noise_rho_mean > 0.3 and b.rho_mean > 0.3


def test_n_for_rho():
    curve = pd.DataFrame({"n": [1, 2, 3, 4], "rho_mean": [0.5, 0.89, 0.91, 0.95]})
    assert an.n_for_rho(curve, 0.9) == 3
    assert an.n_for_rho(curve, 0.99) is None


# ---- DLA and cosine on the tiny model -------------------------------------------------------------
def _tiny_pairs(tiny, n=2):
    from headscope.tasks import niah_single

    return niah_single(tiny.tokenizer, n_pairs=n, seq_len=96, seed=1)


def test_dla_sums_to_logit_difference(tiny):
    pairs = _tiny_pairs(tiny)
    d = an.direct_logit_attribution(tiny, pairs, lam=0.9)
    assert d.heads.shape == (2, 2, 4)
    assert d.components == ["embed", "mlp.0", "mlp.1"]
    parts = d.heads.sum((1, 2)) + d.other.sum(1)
    torch.testing.assert_close(parts, d.total, rtol=1e-6, atol=1e-6)
    # the frozen-scale linearization is exact at the attributed run: equals m from the logits
    torch.testing.assert_close(d.total, d.m, rtol=1e-4, atol=1e-4)


def test_dla_single_head_by_hand(tiny):
    """Head (1, 2)'s DLA recomputed from the bridge's hook_z and HF weights, not the engine."""
    from headscope.patching.receivers import sequences
    from headscope.readout import span_weights

    pair = _tiny_pairs(tiny, 1)[0]
    d = an.direct_logit_attribution(tiny, [pair], lam=0.8)
    clean, _, read = sequences(pair)
    _, cache = tiny.bridge.run_with_cache(clean[None], names_filter=lambda n: n.endswith("hook_z") or n == "ln_final.hook_in" or n.endswith("hook_resid_post"))
    hf = tiny.hf_model
    z = cache["blocks.1.attn.hook_z"][0, read, 2]  # [ans, d_head]
    dh = tiny.geometry.d_head
    o = getattr(hf.model.layers[1].self_attn, "original_component", hf.model.layers[1].self_attn).o_proj
    out = z @ o.weight[:, 2 * dh : 3 * dh].T  # [ans, d_model]
    resid = cache["blocks.1.hook_resid_post"][0, read]
    eps = hf.config.rms_norm_eps
    norm_w = getattr(hf.model.norm, "original_component", hf.model.norm).weight
    scale = 1 / torch.sqrt(resid.pow(2).mean(-1, keepdim=True) + eps)
    WU = hf.lm_head.weight
    u = WU[pair.answer] - WU[pair.counter_answer]
    per_pos = (out * scale * norm_w * u).sum(-1)
    expected = (per_pos.double() * span_weights(len(read), 0.8)).sum()
    assert float(d.heads[0, 1, 2]) == pytest.approx(float(expected), rel=1e-4, abs=1e-5)


def test_layer_cosine_tiny(tiny):
    from headscope.patching.receivers import sequences

    pairs = _tiny_pairs(tiny, 1)
    c = an.layer_cosine(tiny, pairs)
    assert c.shape == (2, 2)
    clean, corr, read = sequences(pairs[0])
    hf = tiny.hf_model
    with torch.no_grad():
        hc = hf(clean[None], output_hidden_states=True).hidden_states
        hx = hf(corr[None], output_hidden_states=True).hidden_states
    # hidden_states[l+1] is the output of layer l except the last, which HF returns after the final norm
    cos00 = torch.nn.functional.cosine_similarity(hc[1][0, read], hx[1][0, read], dim=-1).mean()
    assert c[0, 0] == pytest.approx(float(cos00), abs=1e-5)
    assert np.all(c <= 1 + 1e-9)


# ---- Anatomy of a saved run, figures, CLI --------------------------------------------------------
def _fake_ranking(n_pairs=5, seed=0):
    rng = np.random.default_rng(seed)
    base = np.zeros((3, 4))
    base[2, 1] = 0.8
    base[1, 3] = 0.3
    ie = torch.tensor(base[None] + rng.normal(scale=0.03, size=(n_pairs, 3, 4)), dtype=torch.float32)
    df = head_table(ie, n_kv_heads=2)
    geo = {"n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "d_head": 8, "d_model": 32, "n_ctx": 128}
    return Ranking(df, geo, {"model": "fake", "tasks": ["niah_single"], "n_pairs": n_pairs, "lambda": 0.9}, ie)


@pytest.mark.slow
def test_anatomy_of_ranking_and_save(tmp_path):
    r = _fake_ranking()
    a = an.anatomy(r, n_boot=20)
    assert a.critical["ie_recv"]["n_critical"] == int((r.scores["ie_recv"] > 0.1).sum()) == 2
    assert a.gini["score"]["per_layer"][2] == pytest.approx(an.gini(np.clip(r.matrix("score")[2], 0, None)))
    assert a.n_rho == an.n_for_rho(a.stability, 0.9)
    # 5 pairs: n = 1..2 against a disjoint reference of 3, with the noise baseline
    assert a.stability.n.tolist() == [1, 2] and set(a.stability.n_ref) == {3}
    assert "noise_rho_mean" in a.stability
    paths = a.save(tmp_path, formats=("html", "png"))
    d = json.loads((tmp_path / "anatomy.json").read_text())
    assert d["critical"]["score"]["n_heads"] == 12
    # the Gini convention is recorded, with the other reading beside it
    assert d["gini_negative"]["negative"] == "clip" and "[0, 1]" in d["gini_negative"]["meaning"]
    assert d["gini"]["ie_recv"]["negative"] == "clip"
    absg = an.layer_gini(r.matrix("ie_recv"), "abs")
    assert d["gini_other"]["ie_recv"] == {"negative": "abs", "mean": pytest.approx(absg["mean"]),
                                          "min": pytest.approx(absg["min"]), "max": pytest.approx(absg["max"])}
    assert d["stability"]["reference"] == "split" and d["stability"]["n_ref"] == 3
    assert d["stability"]["rho_at_6"] is None  # 5 pairs cannot give n = 6 against a disjoint reference
    a_abs = an.anatomy(r, n_boot=5, negative="abs", noise=False)
    assert a_abs.to_dict()["gini_negative"]["negative"] == "abs" and a_abs.gini_other["score"]["negative"] == "clip"
    for name in ("heatmap_ie", "gini", "stability"):
        png = [p for p in paths[name] if p.suffix == ".png"][0]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_cli_anatomy(tmp_path):
    from typer.testing import CliRunner

    from headscope.cli import app

    r = _fake_ranking()
    r.save(tmp_path / "run")
    res = CliRunner().invoke(app, ["anatomy", str(tmp_path / "run"), "--no-model", "--format", "html", "--boot", "10"])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "run" / "anatomy" / "anatomy.json").read_text())
    assert d["critical"]["ie_recv"]["n_critical"] == 2
    assert d["gini_negative"]["negative"] == "clip" and "clipped" in res.output
    assert d["stability"]["n_ref"] == 3 and "noise" in res.output
    n = d["stability"]["n_at_target"]  # the printout names where rho reaches the target, or says it never does
    assert (f"from n = {n}" if n is not None else "stays below") in res.output and "n = None" not in res.output
    assert (tmp_path / "run" / "anatomy" / "stability.html").exists()
    bad = CliRunner().invoke(app, ["anatomy", str(tmp_path / "nothing")])
    assert bad.exit_code == 2 and "missing" in bad.output


def test_pairs_of_run_regenerates_and_checks_count(smol_tokenizer):
    from headscope.tasks import make_pairs

    settings = {"n_pairs": 2, "seq_len": 64, "seed": 5, "depth": [0.3, 0.6]}
    r = _fake_ranking(n_pairs=2)
    r.provenance["task_settings"] = settings
    pairs = an.pairs_of_run(r, smol_tokenizer)
    ref = make_pairs("niah_single", smol_tokenizer, n_pairs=2, seq_len=64, seed=5, depth=(0.3, 0.6))
    assert [torch.equal(a.clean, b.clean) and torch.equal(a.corrupted, b.corrupted) for a, b in zip(pairs, ref)] == [True, True]
    r5 = _fake_ranking(n_pairs=5)
    r5.provenance["task_settings"] = settings
    with pytest.raises(ValueError, match="pass the run's pairs"):
        an.pairs_of_run(r5, smol_tokenizer)
