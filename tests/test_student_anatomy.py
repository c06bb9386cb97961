"""Anatomy after conversion (headscope/analysis/student_anatomy.py): knockout on a hybrid, kinds, comparisons by hand."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from inference_cfg import plain, use
from test_hybrid_patching import FA, tiny_hybrid

from headscope.analysis.knockout import ablate, generate_answers, retrieval_correct
from headscope.patching.hybrid_engine import head_kinds
from headscope.scores import Ranking, head_table
from headscope.analysis.student_anatomy import (compare_rankings, head_comparison, kind_summary, knockout_accuracy,
                                       random_gdn_heads, rank_heads)
from headscope.tasks import niah_single

KINDS = [["gdn", "fa", "gdn", "gdn"], ["fa", "gdn", "gdn", "fa"]]
T_IE = [[0.9, 0.1, 0.0, 0.2], [0.5, 0.05, 0.3, 0.0]]
S_IE = [[0.2, 0.8, 0.0, 0.1], [0.6, 0.0, 0.05, 0.4]]


def _ranking(ie, kinds=None):
    df = head_table(torch.tensor([ie], dtype=torch.float64), n_kv_heads=2)
    if kinds is not None:
        df.insert(3, "kind", [kinds[int(lay)][int(h)] for lay, h in zip(df["layer"], df["head"])])
    return Ranking(df, {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_head": 16, "d_model": 64, "n_ctx": 1024})


def _zeroed(lm, heads):
    """A copy of the hybrid whose o_proj input columns of ``heads`` are deleted (zero ablation by hand)."""
    ref = copy.deepcopy(lm.hf_model)
    d = lm.geometry.d_head
    with torch.no_grad():
        for lay, h in heads:
            ref.model.layers[lay].self_attn.o_proj.weight[:, h * d:(h + 1) * d] = 0
    return ref


def test_ablate_reaches_the_lean_path(smol_tokenizer):
    """knockout.ablate hooks o_proj; the hybrid's lean inference path (on by default on CUDA; forced here on the
    CPU) applies o_proj's weights itself, so a hooked layer must take the reference forward: zero ablation equals
    deleting the heads' W_O columns, in a forward and in cached greedy generation."""
    lm = tiny_hybrid(smol_tokenizer)
    heads = [(0, 1), (1, 2)]  # one FA head, one GDN head
    ref = _zeroed(lm, heads)
    ids = torch.arange(100, 160)[None]
    use(lm.hf_model)
    try:
        with torch.no_grad(), plain(ref):
            want = ref(ids, use_cache=False).logits
            base = lm.hf_model(ids, use_cache=False).logits
            with ablate(lm, heads):
                got = lm.hf_model(ids, use_cache=False).logits
        assert (base - want).abs().max() > 1e-2  # the ablation matters
        assert (got - want).abs().max() <= 1e-5
        pairs = niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.2, 0.8], seed=3)
        ref_lm = copy.copy(lm)
        ref_lm.hf_model = ref
        with plain(ref):
            want_gen = generate_answers(ref_lm, pairs)
        with ablate(lm, heads):
            got_gen = generate_answers(lm, pairs)
        assert all(torch.equal(a, b) for a, b in zip(got_gen, want_gen))
    finally:
        from headscope.hybrid.inference import DEFAULT, use_inference

        use_inference(lm.hf_model, DEFAULT)


def test_knockout_accuracy_and_random_gdn_heads(smol_tokenizer):
    lm = tiny_hybrid(smol_tokenizer)
    kinds = head_kinds(lm.hf_model)
    assert kinds == KINDS
    r = random_gdn_heads(kinds, 3, seed=0)
    assert len(set(r)) == 3 and all(kinds[lay][h] == "gdn" for lay, h in r)
    assert r == random_gdn_heads(kinds, 3, seed=0) and r == sorted(r)
    assert {tuple(random_gdn_heads(kinds, 3, seed=s)) for s in range(8)} != {tuple(r)}
    with pytest.raises(ValueError):
        random_gdn_heads(kinds, 6, seed=0)  # only 5 GDN heads
    pairs = niah_single(smol_tokenizer, n_pairs=3, seq_len=64, depth=[0.2, 0.5, 0.8], seed=3)
    base = knockout_accuracy(lm, pairs, [])
    assert base["correct"] == [int(x) for x in retrieval_correct(lm, pairs).tolist()] and base["n_heads"] == 0
    k = knockout_accuracy(lm, pairs, FA)
    ref_lm = copy.copy(lm)
    ref_lm.hf_model = _zeroed(lm, FA)
    assert k["correct"] == [int(x) for x in retrieval_correct(ref_lm, pairs).tolist()]
    assert k["n_heads"] == 3 and k["accuracy"] == sum(k["correct"]) / 3


def test_rank_heads_kind_column(smol_tokenizer):
    lm = tiny_hybrid(smol_tokenizer)
    pairs = niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=0)
    from headscope.readout import Readout

    r = rank_heads(lm, pairs, Readout(min_gap=0.0))
    df = r.scores
    assert list(df.columns[:4]) == ["layer", "head", "kv_group", "kind"]
    assert [[df[(df.layer == lay) & (df["head"] == h)].kind.item() for h in range(4)] for lay in range(2)] == KINDS
    assert r.provenance["path"] == "hybrid" and r.ie.shape == (2, 2, 4)
    assert np.allclose(r.matrix("score"), r.ie.double().mean(0).numpy())
    m = r.mask(4, min_per_layer=1)  # HeadMask.select takes it
    assert m.n_fa == 4
    s = kind_summary(r)
    assert s["fa"]["n_heads"] == 3 and s["gdn"]["n_heads"] == 5
    assert s["fa"]["positive_mass_share"] + s["gdn"]["positive_mass_share"] == pytest.approx(1.0)


def test_kind_summary_by_hand():
    s = kind_summary(_ranking(S_IE, KINDS))
    total = 0.2 + 0.8 + 0.1 + 0.6 + 0.05 + 0.4
    assert s["fa"]["positive_mass_share"] == pytest.approx((0.8 + 0.6 + 0.4) / total)
    assert s["fa"]["mean_ie"] == pytest.approx(1.8 / 3) and s["gdn"]["mean_ie"] == pytest.approx(0.35 / 5)
    assert (s["fa"]["top5"], s["gdn"]["top5"], s["all"]["top5"]) == (3, 2, 5)
    assert s["fa"]["critical"]["n_critical"] == 3 and s["gdn"]["critical"]["n_critical"] == 1  # IE > 0.1
    with pytest.raises(ValueError, match="no 'kind' column"):
        kind_summary(_ranking(S_IE))


def test_compare_rankings_by_hand():
    t, s = _ranking(T_IE), _ranking(S_IE, KINDS)
    c = compare_rankings(t, s, k=3)
    # teacher top 3: (0,0) .9, (1,0) .5, (1,2) .3; student top 3: (0,1) .8, (1,0) .6, (1,3) .4
    assert c["overlap"] == pytest.approx(1 / 3)
    assert c["teacher_top_kept_fa"] == 1  # (1,0)
    assert [(r["layer"], r["head"]) for r in c["teacher_top"]] == [(0, 0), (1, 0), (1, 2)]
    assert [(r["layer"], r["head"], r["kind"]) for r in c["student_top"]] == [(0, 1, "fa"), (1, 0, "fa"), (1, 3, "fa")]
    a, b = np.array(T_IE).ravel(), np.array(S_IE).ravel()
    assert c["spearman"] == pytest.approx(spearmanr(a, b).statistic)
    fa = np.array([k == "fa" for ks in KINDS for k in ks])
    assert c["spearman_fa"] == pytest.approx(spearmanr(a[fa], b[fa]).statistic)
    assert c["spearman_gdn"] == pytest.approx(spearmanr(a[~fa], b[~fa]).statistic)
    df = head_comparison(t, s)
    assert len(df) == 8 and df.loc[(df.layer == 1) & (df["head"] == 3), "ie_teacher"].item() == 0.0
    assert df.loc[(df.layer == 1) & (df["head"] == 3), "ie_student"].item() == pytest.approx(0.4)
