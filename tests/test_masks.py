import json
import warnings

import numpy as np
import pytest

from headscope.masks import BudgetRaisedWarning, HeadMask, parse_budget


def test_parse_budget():
    assert parse_budget(10, 270) == 10
    assert parse_budget("7:1", 270) == 34  # 270/8 = 33.75
    assert parse_budget("3:1", 448) == 112
    assert parse_budget(0.125, 448) == 56
    assert parse_budget("12", 270) == 12
    with pytest.raises(ValueError, match="outside 1..270"):
        parse_budget(271, 270)
    with pytest.raises(ValueError, match="leaves no FA head"):
        parse_budget("1:0", 270)
    with pytest.raises(ValueError, match="leaves no FA head"):
        parse_budget("1000:1", 270)
    with pytest.raises(ValueError, match="fraction"):
        parse_budget(1.5, 270)


def test_select_min_per_layer_and_count():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(30, 9))
    s[3] += 10  # layer 3 dominates the global ranking
    m = HeadMask.select(s, "7:1", n_kv_heads=3, min_per_layer=1)
    assert m.n_fa == 34
    assert all(len(h) >= 1 for h in m.fa_heads)
    # every layer's best head is in, and layer 3 takes the whole global fill
    for layer in range(30):
        assert int(np.argmax(s[layer])) in m.fa_heads[layer]
    # 30 heads go one per layer, the 4 left over all come from layer 3 (its top 5 in total)
    assert m.fa_heads[3] == tuple(sorted(np.argsort(-s[3])[:5].tolist()))
    assert sum(len(h) for i, h in enumerate(m.fa_heads) if i != 3) == 29
    with pytest.raises(ValueError, match="cannot give 2 head"):
        HeadMask.select(s, 40, 3, min_per_layer=2)


def test_json_round_trip(tmp_path):
    m = HeadMask.from_heads([(0, 1), (1, 3), (1, 0)], 2, 4, 2, meta={"model": "tiny", "seed": 3})
    p = m.to_json(tmp_path / "mask.json")
    m2 = HeadMask.from_json(p)
    assert m2 == m and m2.meta == {"model": "tiny", "seed": 3}
    d = json.loads(p.read_text())
    assert d["fa_heads"] == {"0": [1], "1": [0, 3]}


def test_kv_group_fraction_hand_made():
    # 2 layers, 4 query heads, 2 KV groups (heads 0,1 -> group 0; 2,3 -> group 1)
    m = HeadMask.from_heads([(0, 0), (0, 1), (1, 2)], 2, 4, 2)
    assert m.kv_groups() == ((0,), (1,))
    assert m.kv_cache_fraction == 2 / 4
    m = HeadMask.from_heads([(0, 0), (0, 3), (1, 2)], 2, 4, 2)
    assert m.kv_cache_fraction == 3 / 4
    # SmolLM2: 30 layers, 9 q heads, 3 KV heads; one FA head per layer keeps 1 of 3 groups
    m = HeadMask.from_heads([(layer, 4) for layer in range(30)], 30, 9, 3)
    assert m.kv_groups()[0] == (1,) and m.kv_cache_fraction == pytest.approx(1 / 3)


def test_bad_masks():
    with pytest.raises(ValueError, match="twice"):
        HeadMask(1, 4, 2, ((1, 1),))
    with pytest.raises(ValueError, match="outside"):
        HeadMask(1, 4, 2, ((5,),))
    with pytest.raises(ValueError, match="2 layers"):
        HeadMask(3, 4, 2, ((0,), (1,)))
    m = HeadMask(1, 4, 2, ((0,),))
    with pytest.raises(ValueError, match="rank this model first"):
        m.check_geometry(2, 4, 2)


def test_budget_raised_to_fit_min_per_layer():
    # 18 layers x 4 heads, one KV head per layer (e.g. Gemma 3 270M): 7:1 -> round(72 / 8) = 9 FA heads,
    # but one per layer needs 18
    rng = np.random.default_rng(1)
    s = rng.uniform(0, 1, size=(18, 4))
    s[5, 2] = s[5, 0] = 9.0  # layer 5's two best heads are the global best
    s[7, 3], s[7, 0] = 5.0, 4.0  # then layer 7's two best: every other score is below 1
    with pytest.raises(ValueError, match="raise_budget=True"):
        HeadMask.select(s, "7:1", 1, min_per_layer=1)
    with pytest.warns(BudgetRaisedWarning, match="raised to 18"):
        m = HeadMask.select(s, "7:1", 1, min_per_layer=1, raise_budget=True)
    assert m.n_fa == 18 and m.meta["n_fa"] == 18 and m.meta["n_fa_requested"] == 9
    # 18 is exactly one per layer: each layer's best head, and no other (not even layer 5's second)
    assert m.fa_heads == tuple((int(np.argmax(s[l])),) for l in range(18))
    assert m.fa_heads[5] == (0,)  # argmax takes the first of the tie
    # 2 per layer needs 36 heads
    with pytest.warns(BudgetRaisedWarning, match="raised to 36"):
        m2 = HeadMask.select(s, 20, 1, min_per_layer=2, raise_budget=True)
    assert m2.n_fa == 36 and all(len(h) == 2 for h in m2.fa_heads)
    # a budget that fits is untouched (no warning, no note)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m3 = HeadMask.select(s, 20, 1, min_per_layer=1, raise_budget=True)
    # 18 best-per-layer heads, then the global fill adds (5, 2) (9.0) and (7, 0) (4.0)
    assert m3.n_fa == 20 and "n_fa_requested" not in m3.meta
    assert m3.fa_heads[5] == (0, 2) and m3.fa_heads[7] == (0, 3)
    summ = m.summary()
    assert summ["kv_cache_fraction"] == 1.0 and summ["kv_groups_kept"] == 18
    budget_note, kv_note = summ["notes"]
    assert budget_note == m.meta["budget_note"]
    assert "9 FA head(s) of 72" in budget_note and "25.0% of the heads" in budget_note
    # a layer-wise mask of about the requested 9 heads: round(9 / 4) = 2 whole layers, 2/18 of the KV cache
    assert "one KV head per layer" in kv_note and "saves no KV cache" in kv_note
    assert "2 whole FA layer(s) (8 heads" in kv_note and "2/18 = 11.1%" in kv_note
    assert "`headscope mask RUN_DIR --kv-layers 2`" in kv_note  # the head-wise arm at that KV share
    d = HeadMask.from_dict(m.to_dict())
    assert d.summary()["notes"] == summ["notes"]
    # the layer-wise alternative: min_per_layer=0, whole layers -> KV cache kept 2/18, no note
    lw = HeadMask.from_heads([(l, h) for l in (3, 11) for h in range(4)], 18, 4, 1)
    assert lw.kv_cache_fraction == pytest.approx(2 / 18) and "notes" not in lw.summary()
    # GQA with spare KV groups: no note
    assert HeadMask.from_heads([(0, 0), (1, 1)], 2, 4, 2).kv_note() is None
