import json

import numpy as np
import pytest

from headscope.masks import HeadMask, parse_budget


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
