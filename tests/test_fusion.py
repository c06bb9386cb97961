"""κ, per-capability scores and fusion (SPEC.md §6), and headscope.rank with senders."""

import json

import numpy as np
import pytest
import torch

import headscope
from headscope.masks import HeadMask
from headscope.patching import Engine
from headscope.patching.receivers import sequences
from headscope.analysis.kappa import retrieval_focus
from headscope.scores import capability_score, check_weights, fused_table, normalize_score
from headscope.tasks import niah_single
from test_senders import plain_forward


@pytest.fixture(scope="module")
def pairs(smol_tokenizer):
    return niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=2)


def test_attention_mass_and_kappa_match_plain_patterns(tiny, pairs):
    eng = Engine(tiny)
    ks = []
    for p in pairs:
        seq, _, read = sequences(p)
        _, rec = plain_forward(tiny, seq)
        s, e = p.evidence
        ref = torch.stack([pat[:, read, s:e].sum(-1).mean(-1) for pat in rec["pattern"]]).double()
        got = eng.attention_mass(seq, read, (s, e))
        assert torch.allclose(got, ref, atol=1e-5)
        ks.append(ref / ((e - s) / (read[0] + 1)))
    k = torch.stack(ks).mean(0)
    assert torch.allclose(retrieval_focus(tiny, pairs).double(), (k / k.max()).clamp(0, 1), atol=1e-5)


def test_scores_by_hand():
    recv = torch.tensor([[0.5, -0.2], [0.1, 0.0]])
    send = torch.tensor([[0.0, 0.4], [0.3, 0.0]])
    kap = torch.tensor([[1.0, 0.5], [0.5, 0.0]])
    s = capability_score(recv, send, kap)
    assert torch.allclose(s, torch.tensor([[0.5, 0.2], [0.15, 0.0]], dtype=torch.float64))
    assert torch.allclose(normalize_score(s, "max"), torch.tensor([[1.0, 0.4], [0.3, 0.0]], dtype=torch.float64))
    mm = normalize_score(torch.tensor([[1.0, 3.0], [2.0, 5.0]]), "minmax")
    assert torch.allclose(mm, torch.tensor([[0.0, 0.5], [0.25, 1.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="no head has a positive score"):
        normalize_score(torch.zeros(2, 2) - 1, "max")
    with pytest.raises(ValueError, match="normalize"):
        normalize_score(s, "zscore")
    assert check_weights(None, ["a", "b"]) == {"a": 0.5, "b": 0.5}
    assert check_weights([0.25, 0.75], ["a", "b"]) == {"a": 0.25, "b": 0.75}
    with pytest.raises(ValueError, match="sum to 1.1"):
        check_weights([0.5, 0.6], ["a", "b"])
    with pytest.raises(ValueError, match="1 weight\\(s\\) for 2 task"):
        check_weights([1.0], ["a", "b"])
    with pytest.raises(ValueError, match="one weight per task"):
        check_weights({"a": 0.5, "c": 0.5}, ["a", "b"])


def test_fused_table_by_hand():
    # two capabilities on a 1-layer, 2-head model (1 KV head); ie given per pair
    a = {"ie": torch.tensor([[[0.4, 0.2]], [[0.6, 0.2]]]), "ie_send": torch.tensor([[0.1, 0.8]]),
         "kappa": torch.tensor([[1.0, 0.5]])}
    b = {"ie": torch.tensor([[[0.1, 0.3]]]), "ie_send": None, "kappa": None}
    df = fused_table({"a": a, "b": b}, 1, {"a": 0.75, "b": 0.25})
    # s_a = max(.5,.1)*1, max(.2,.8)*.5 = [.5, .4] -> /.5 = [1, .8]; s_b = [.1, .3] -> [1/3, 1]
    assert np.allclose(df["s_a"], [1.0, 0.8]) and np.allclose(df["s_b"], [1 / 3, 1.0])
    assert np.allclose(df["score"], [0.75 + 0.25 / 3, 0.6 + 0.25])
    assert np.allclose(df["ie_recv_a"], [0.5, 0.2]) and df["n_pairs"].iloc[0] == 3
    assert df.sort_values("rank")["head"].tolist() == [1, 0]  # 0.85 > 0.8333


@pytest.mark.slow
def test_rank_fused_on_tiny(tiny, tmp_path):
    r = headscope.rank(tiny, tasks=("niah_single", "niah_multikey"), n_pairs=1, seq_len=128, senders=True,
                       top_k=3, min_gap=0.0, progress=False, out_dir=tmp_path / "run")
    df = r.scores
    for c in ("layer", "head", "kv_group", "ie_recv", "ie_recv_std", "n_pairs", "ie_send", "kappa",
              "s_niah_single", "s_niah_multikey", "score", "rank"):
        assert c in df.columns
    for c in ("niah_single", "niah_multikey"):
        s = np.maximum(df[f"ie_recv_{c}"], df[f"ie_send_{c}"]) * df[f"kappa_{c}"]
        assert np.allclose(df[f"s_{c}"], s / s.max())
    assert np.allclose(df["score"], 0.5 * df["s_niah_single"] + 0.5 * df["s_niah_multikey"])
    assert (df.loc[df.layer == 1, "ie_send"] == 0).all()  # last layer: no path to any receiver
    rounds = r.extras["sender_rounds"]["niah_single"]
    assert 1 <= rounds["n_rounds"] <= 3 and len(rounds["rounds"][0]["receivers"]) == 3
    m = r.mask(3, min_per_layer=1)
    assert m.n_fa == 3 and all(len(h) >= 1 for h in m.fa_heads)
    m2 = HeadMask.from_json(m.to_json(tmp_path / "mask.json"))
    assert m2 == m and m2.meta["tasks"] == ["niah_single", "niah_multikey"]
    assert json.loads((tmp_path / "mask.json").read_text())["meta"]["n_pairs"] == 2
    # resume: the same call reads the stored items back and gives the same scores
    again = headscope.rank(tiny, tasks=("niah_single", "niah_multikey"), n_pairs=1, seq_len=128, senders=True,
                           top_k=3, min_gap=0.0, progress=False, out_dir=tmp_path / "run")
    assert np.allclose(again.scores["score"], df["score"])
    # κ ≡ 1 and receivers only: score is the normalized receiver IE
    one = headscope.rank(tiny, tasks=("niah_single",), n_pairs=1, seq_len=128, kappa="one", min_gap=0.0,
                         progress=False)
    assert np.allclose(one.scores["kappa"], 1.0)
    assert np.allclose(one.scores["score"], one.scores["ie_recv"] / one.scores["ie_recv"].max())


def test_rank_bad_input(tiny):
    with pytest.raises(ValueError, match="unknown task"):
        headscope.rank(tiny, tasks=("niah_single", "niah_everything"), n_pairs=1, seq_len=128)
    with pytest.raises(ValueError, match="sum to"):
        headscope.rank(tiny, tasks=("niah_single", "niah_multikey"), weights=[0.5, 0.6], n_pairs=1, seq_len=128)
    with pytest.raises(ValueError, match="one weight per task"):
        headscope.rank(tiny, tasks=("niah_single", "niah_multikey"), weights=[1.0], n_pairs=1, seq_len=128)
    with pytest.raises(ValueError, match="kappa"):
        headscope.rank(tiny, tasks=("niah_single",), kappa="attention", n_pairs=1, seq_len=128)
    with pytest.raises(ValueError, match="context is 1024"):
        headscope.rank(tiny, tasks=("niah_single", "niah_multikey"), n_pairs=1, seq_len=1100, progress=False)
