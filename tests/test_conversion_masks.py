"""experiments/conversion.py: the masks of the comparison (four share one budget; layer-wise 3:1 beside them)."""

from __future__ import annotations

from conftest import experiment_module


import numpy as np




def test_masks_at_7_to_1_on_the_smollm2_geometry():
    conv = experiment_module("conversion")
    scores = np.arange(270, dtype=float).reshape(30, 9)  # the last layers score highest
    m = conv.build_masks(30, 9, 3, scores, "7:1", min_per_layer=1, seed=0)
    hyd, rnd, lw, ag = m["hydrahead"], m["random"], m["layerwise"], m["allgdn"]
    assert hyd.n_fa == rnd.n_fa == round(270 / 8) == 34
    for mask in (hyd, rnd):
        assert all(len(h) >= 1 for h in mask.fa_heads)
    # hydrahead: the best head of every layer (head 8) plus the 4 next best overall (layer 29, heads 7..4)
    assert all(8 in h for h in hyd.fa_heads) and hyd.fa_heads[29] == (4, 5, 6, 7, 8)
    assert rnd != hyd and conv.build_masks(30, 9, 3, scores, seed=0)["random"] == rnd
    # layer-wise: round(34 / 9) = 4 whole layers, centred in 4 equal blocks of the 30 layers
    assert [l for l, h in enumerate(lw.fa_heads) if h] == [3, 11, 18, 26]
    assert all(h in ((), tuple(range(9))) for h in lw.fa_heads) and lw.n_fa == 36
    assert ag.n_fa == 0 and ag.kv_cache_fraction == 0.0
    # layer-wise 3:1: round(30 / 4) = 8 whole layers (the paper's comparison), centred in 8 blocks
    lw3 = m["layerwise3"]
    assert [l for l, h in enumerate(lw3.fa_heads) if h] == [1, 5, 9, 13, 16, 20, 24, 28]
    assert lw3.n_fa == 72 and lw3.kv_cache_fraction == 8 / 30
