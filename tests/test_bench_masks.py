"""The whole-model benchmarks' hybrid masks (benchmarks/bench_hybrid_model.py: hybrid_mask)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_hybrid_model

        yield bench_hybrid_model
    finally:
        sys.path.remove(str(BENCH))


def test_hydrahead_mask_is_the_ranked_smollm2_mask(bench):
    """"hydrahead" = the mask file the 50M-token conversion trained: 34 FA heads, one KV group kept per layer."""
    m = bench.hybrid_mask("hydrahead")
    saved = json.loads(bench.HYDRAHEAD_MASK.read_text())
    assert m.n_fa == 34 == saved["summary"]["n_fa"]
    assert [len(g) for g in m.kv_groups()] == [1] * 30
    assert m.fa_heads[17] == (3, 4, 5) and m.fa_heads[0] == (0,)  # layer 17 keeps a whole KV group (file above)


def test_random_mask_and_bad_names(bench, tmp_path):
    r = bench.hybrid_mask("random")
    assert r.n_fa == 34 and all(len(h) >= 1 for h in r.fa_heads) and sum(len(g) for g in r.kv_groups()) == 34
    p = r.to_json(tmp_path / "m.json")
    assert bench.hybrid_mask(str(p)).fa_heads == r.fa_heads
    with pytest.raises(ValueError, match="use --mask random"):
        bench.hybrid_mask("hydrahead", layers=12)
    with pytest.raises(ValueError, match="want one of"):
        bench.hybrid_mask("hydra")


def test_masks_of_another_geometry(bench, tmp_path):
    """The Qwen3-1.7B shape (28 layers x 16 heads, 8 KV heads): a random 7:1 mask of 56 FA heads, >= 1 per layer;
    the SmolLM2 mask and a SmolLM2-shaped file are refused there."""
    q = bench.hybrid_mask("random", 28, 16, 8)
    assert (q.n_layers, q.n_heads, q.n_kv_heads, q.n_fa) == (28, 16, 8, 56)
    assert all(len(h) >= 1 for h in q.fa_heads)
    with pytest.raises(ValueError, match="use --mask random"):
        bench.hybrid_mask("hydrahead", 28, 16, 8)
    p = bench.hybrid_mask("random").to_json(tmp_path / "smol.json")
    with pytest.raises(ValueError, match="30 layers x 9 heads"):
        bench.hybrid_mask(str(p), 28, 16, 8)
