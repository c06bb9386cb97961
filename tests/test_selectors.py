"""Selectors (issue 9): one interface, valid rankings and masks, deterministic gates, retrieval score by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headscope.masks import HeadMask
from headscope.selectors import SELECTORS, fa_layers, retrieval_scores, select
from headscope.selectors.layerwise import even_layers, farthest_first
from headscope.selectors.retrieval_score import answer_patterns
from headscope.selectors.rope_dependence import band_slices, kl_rows, rope_kl
from headscope.patching.engine import Engine

SMALL = {
    "causal": dict(n_pairs=2, seq_len=72, min_gap=0.0),
    "retrieval_score": dict(n_prompts=2, seq_lens=72),
    "duo_gates": dict(steps=3, n_prompts=2, seq_lens=72, window=8),
    "flashmorph_gates": dict(steps=3, n_prompts=2, seq_lens=72),
    "rope_dependence": dict(n_prompts=2, seq_lens=72, n_queries=16),
    "random": dict(seed=3),
    "uniform_per_layer": dict(seed=3),
    "layerwise": dict(),
}


@pytest.fixture(scope="module")
def rankings(tiny):
    return {m: select(tiny, m, **s) for m, s in SMALL.items()}


def test_every_selector_is_covered():
    assert set(SMALL) == set(SELECTORS)


@pytest.mark.parametrize("method", list(SMALL))
def test_ranking_and_mask_are_valid(rankings, tiny, method):
    r = rankings[method]
    g = tiny.geometry
    df = r.scores
    assert len(df) == g.n_layers * g.n_heads
    assert sorted(zip(df["layer"], df["head"])) == [(l, h) for l in range(g.n_layers) for h in range(g.n_heads)]
    assert sorted(df["rank"]) == list(range(1, g.n_total + 1))
    assert (df["kv_group"] == df["head"] // g.group_size).all()
    assert np.isfinite(df["score"]).all()
    # rank 1 has the highest score
    assert df.loc[df["rank"] == 1, "score"].item() == df["score"].max()
    for budget, mpl in ((3, 1), (0.5, 0), ("1:1", 1)):
        m = r.mask(budget, min_per_layer=mpl)
        assert isinstance(m, HeadMask) and m.n_fa == {3: 3, 0.5: 4, "1:1": 4}[budget]
        assert all(len(hs) >= mpl for hs in m.fa_heads)
        assert HeadMask.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="min_per_layer"):
        r.mask(1, min_per_layer=1)


@pytest.mark.parametrize("method", ["duo_gates", "flashmorph_gates"])
def test_gates_deterministic_with_seed(tiny, method, rankings):
    again = select(tiny, method, **SMALL[method])
    col = "alpha" if method == "duo_gates" else "gate"
    np.testing.assert_array_equal(again.scores[col].to_numpy(), rankings[method].scores[col].to_numpy())
    assert (again.scores["rank"] == rankings[method].scores["rank"]).all()
    # the gates did train: they moved off their initial value
    init = 1.0 if method == "duo_gates" else 1 / (1 + np.exp(-3.0))
    assert np.abs(again.scores[col].to_numpy() - init).max() > 1e-3
    assert len(again.extras["loss"]) == SMALL[method]["steps"]


def test_duo_kv_group_gates_shared(tiny):
    r = select(tiny, "duo_gates", steps=2, n_prompts=1, seq_lens=72, granularity="kv_group")
    a = r.matrix("alpha")
    assert np.array_equal(a[:, 0], a[:, 1]) and np.array_equal(a[:, 2], a[:, 3])


def test_flashmorph_layer_discretization(rankings, tiny):
    r = rankings["flashmorph_gates"]
    lg = r.scores.groupby("layer")["layer_gate"].first()
    best = int(lg.idxmax())
    assert fa_layers(r, 1) == [best]
    # the top n_heads heads are exactly the best layer: a whole-layer mask
    m = r.mask(tiny.geometry.n_heads, min_per_layer=0)
    assert m.fa_heads[best] == tuple(range(tiny.geometry.n_heads)) and m.n_fa == tiny.geometry.n_heads


def test_retrieval_score_hand_checked():
    """Head (0,0) always attends to the needle token being copied -> 1; head (0,1) never does -> 0;
    head (1,0) attends to the needle but to the wrong digit -> 0; head (1,1) copies only one of
    three digits -> 1/3."""
    tokens = torch.tensor([10, 11, 4, 8, 2, 12, 13, 14])  # needle "4 8 2" at positions 2..4
    needle = (2, 5)
    emitted = torch.tensor([4, 8, 2])
    S, T = 3, tokens.numel()
    pats = torch.full((S, 2, 2, T), 0.01)
    for j in range(S):
        pats[j, 0, 0, 2 + j] = 1.0  # copies needle token j
        pats[j, 0, 1, 0] = 1.0  # attends to the start (sink)
        pats[j, 1, 0, 2 + (j + 1) % 3] = 1.0  # in the needle, wrong token
        pats[j, 1, 1, 2 + j if j == 0 else 6] = 1.0  # copies the first digit, then looks elsewhere
    pats = pats / pats.sum(-1, keepdim=True)
    s = retrieval_scores(pats, tokens, emitted, needle)
    assert s.tolist() == [[1.0, 0.0], [0.0, pytest.approx(1 / 3)]]
    # steps greedy decoding never reaches do not count
    s2 = retrieval_scores(pats, tokens, emitted, needle, valid=torch.tensor([True, True, False]))
    assert s2[0, 0].item() == pytest.approx(2 / 3)
    # an emitted token that is not in the needle never counts, even if it matches the attended token
    s3 = retrieval_scores(pats, tokens, torch.tensor([4, 8, 12]), needle)
    assert s3[0, 0].item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="needle span"):
        retrieval_scores(pats, tokens, emitted, (5, 5))


def test_retrieval_score_counts_repeated_needle_tokens_once_per_position():
    """Issue 20 (as documented in retrieval_score.py): needle "4 4 2 1"; head 0 attends to the first
    "4" at both "4" steps -> 3 distinct positions of 4 = 0.75 (counting copying steps would give 1.0);
    head 1 attends to each "4" at its own step -> 1.0."""
    tokens = torch.tensor([9, 9, 4, 4, 2, 1, 9])  # needle at positions 2..5
    emitted = torch.tensor([4, 4, 2, 1])
    pats = torch.zeros(4, 1, 2, tokens.numel())
    for j, (first, own) in enumerate([(2, 2), (2, 3), (4, 4), (5, 5)]):
        pats[j, 0, 0, first] = 1.0
        pats[j, 0, 1, own] = 1.0
    s = retrieval_scores(pats, tokens, emitted, (2, 6))
    assert s.tolist() == [[0.75, 1.0]]


def test_answer_patterns_match_hf_eager_attention(tiny_dir):
    """The engine's patterns at the read positions equal transformers' eager attention weights."""
    from headscope.models import load_model

    model = load_model(str(tiny_dir), device="cpu")  # un-bridged: the bridge does not return attentions
    ids = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(0))
    read = [17, 18, 19]
    pats, logits = answer_patterns(Engine(model), ids, read)
    hf = model.hf_model
    old = hf.config._attn_implementation
    hf.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = hf(ids[None], output_attentions=True)
    finally:
        hf.config._attn_implementation = old
    ref = torch.stack([a[0][:, read].transpose(0, 1) for a in out.attentions], 1)  # [read, layer, head, key]
    torch.testing.assert_close(pats, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, out.logits[0, read], atol=1e-4, rtol=1e-4)


def test_rope_helpers():
    assert band_slices(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert band_slices(5, 2) == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="n_bands"):
        band_slices(4, 5)
    p = torch.tensor([0.5, 0.5, 0.0]).log()
    q = torch.tensor([0.25, 0.75, 0.0]).log()
    assert kl_rows(p, q).item() == pytest.approx(0.5 * np.log(2) + 0.5 * np.log(0.5 / 0.75))


def test_rope_dependence_columns(rankings):
    r = rankings["rope_dependence"]
    assert (r.scores["rpd"] > 0).all() and np.allclose(r.scores["score"], -r.scores["rpd"])
    bands = [c for c in r.scores if c.startswith("rfis_band_")]
    assert len(bands) == 4 and (r.scores[bands] >= -1e-6).all().all()


def test_rpd_brute_force_layer0(tiny):
    """RPD of layer 0 against a direct computation with transformers' RoPE and scipy's KL; with one
    band, removing band 0 is removing RoPE, so RFIS == RPD."""
    from scipy.stats import entropy
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = torch.randint(0, 1000, (24,), generator=torch.Generator().manual_seed(1))
    rpd, rfis = rope_kl(Engine(tiny), ids, n_queries=6, n_bands=1)
    torch.testing.assert_close(rfis[0], rpd)
    m = tiny.hf_model.model
    att = m.layers[0].self_attn
    with torch.no_grad():
        x = m.layers[0].input_layernorm(m.embed_tokens(ids[None]))
        q = att.q_proj(x).view(1, 24, 4, 16).transpose(1, 2)
        k = att.k_proj(x).view(1, 24, 2, 16).transpose(1, 2).repeat_interleave(2, 1)
        cos, sin = m.rotary_emb(x, torch.arange(24)[None])
        qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
    want = np.zeros(4)
    for h in range(4):
        kls = []
        for i in range(18, 24):
            p = torch.softmax((qr[0, h, i] @ kr[0, h, : i + 1].T) / 4.0, -1).double().numpy()
            r = torch.softmax((q[0, h, i] @ k[0, h, : i + 1].T) / 4.0, -1).double().numpy()
            kls.append(entropy(p, r))
        want[h] = np.mean(kls)
    np.testing.assert_allclose(rpd[0].numpy(), want, rtol=2e-3, atol=1e-7)


def test_layerwise_orders():
    assert even_layers(32, 8) == [3, 7, 11, 15, 19, 23, 27, 31]
    assert farthest_first(5) == [4, 0, 2, 3, 1]
    assert farthest_first(4, [3, 1]) == [3, 1, 2, 0]  # tie between 0 and 2 goes to the deeper layer


def test_layerwise_whole_layers(tiny):
    r = select(tiny, "layerwise", by="score", layer_scores=[0.1, 0.9])
    assert r.top(4)["layer"].tolist() == [1, 1, 1, 1]
    r2 = select(tiny, "layerwise", n_fa_layers=1)
    assert r2.mask(4, min_per_layer=0).fa_heads == ((), (0, 1, 2, 3))
    with pytest.raises(ValueError, match="2 layers"):
        select(tiny, "layerwise", by="score", layer_scores=[1.0, 2.0, 3.0])


def test_uniform_per_layer_spreads(tiny):
    r = select(tiny, "uniform_per_layer", seed=0)
    for k in (2, 4, 6):
        per = [len(h) for h in r.mask(k, min_per_layer=0).fa_heads]
        assert max(per) - min(per) <= 1 and sum(per) == k


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="unknown selector"):
        select(tiny, "nope")
    with pytest.raises(ValueError, match="does not take"):
        select(tiny, "random", steps=3)
    with pytest.raises(ValueError, match="granularity"):
        select(tiny, "duo_gates", granularity="layer")
