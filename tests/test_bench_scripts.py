"""The benchmark scripts' CPU checks (each script's --smoke path, and the variant parser they share)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_bench_one_launch_smoke_runs_every_cell_and_they_agree():
    """bench_one_launch.py --smoke: every cell of the kernel's breakdown runs through Triton's interpreter and its FA
    output equals the default's (the script asserts it)."""
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, str(BENCH / "bench_one_launch.py"), "--smoke", "--out", "unused"],
                       capture_output=True, text=True, timeout=600, cwd=BENCH.parent,
                       env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("'smoke': 'ok'") == 2 and "fa_only_ns" in r.stdout


def test_variants_are_parsed_into_configs_and_bad_items_name_the_fix():
    sys.path.insert(0, str(BENCH))
    try:
        from bench_timing import configured, parse_variant, variant_config
    finally:
        sys.path.remove(str(BENCH))
    from headscope.hybrid.inference import DEFAULT, inference_config

    name, ch = parse_variant("compiled_tail:tail_kernel=False,gdn_block_tokens=4096,tail_mode=None,prefill=lean")
    assert name == "compiled_tail"
    assert ch == {"tail_kernel": False, "gdn_block_tokens": 4096, "tail_mode": None, "prefill": "lean"}
    cfg = variant_config(ch)
    assert (cfg.tail_kernel, cfg.gdn_block_tokens, cfg.prefill) == (False, 4096, "lean")
    assert cfg.flash_qla == DEFAULT.flash_qla  # the rest: the defaults
    assert parse_variant("again:") == ("again", {})
    with pytest.raises(ValueError, match="field=value"):
        parse_variant("x:no_such=1")
    with pytest.raises(ValueError, match="field=value"):
        parse_variant("x:lean.DECODE_GDN=kernel")  # the old module switches are gone
    with pytest.raises(ValueError, match="prefill must be a backend name"):
        parse_variant("x:prefill=5")
    from transformers import LlamaConfig

    from headscope.hybrid import HeadwiseHybridAttention

    model = HeadwiseHybridAttention(LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                                head_dim=16), 0, [0])
    with pytest.raises(RuntimeError):  # configured: the config holds inside the block and is restored after an error
        with configured([model], cfg):
            assert inference_config(model) is cfg
            raise RuntimeError
    assert inference_config(model) is DEFAULT


def _rank8b():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_rank_8b
    finally:
        sys.path.remove(str(BENCH))
    return gpu_rank_8b


def test_rank8b_merge_into_adds_the_screen_with_recall_and_keeps_the_stored_result(tmp_path):
    """gpu_rank_8b --merge-into: recall@10 of a screen piece against the exact IE of rerun engine pieces, written
    into a merged result that has no per-head IE, everything stored kept. 2 layers x 6 heads, m_clean 1 and
    m_corrupt 0 in both pairs, so exact IE = 1 - patched: head i (row-major) has IE 0.1 i, exact top 10 = heads
    2..11; the screen ranks in reverse (top 10 = heads 0..9): 8 in common -> recall 0.8."""
    import json

    g = _rank8b()
    cfg = {"shape": {"hidden_size": 8}, "dtype": "bfloat16", "init": "x", "planted_head": {"layer": 0},
           "tokenizer": "tok", "tokenizer_vocab": 100, "task": "niah_single", "seq_len": 64, "depths": [0.1, 0.9],
           "n_pairs": 2, "readout": "r", "precision": {"residual": "model"}, "budget_s": 540.0}
    ie = [[0.1 * (6 * lay + h) for h in range(6)] for lay in range(2)]
    patched = [[1.0 - v for v in row] for row in ie]

    def engine(i):
        return {str(i): {"seconds": 10.0 + i, "counted_flops": 1.0, "m_clean": 1.0, "m_corrupt": 0.0,
                         "patched": patched}}

    a = {"piece": ["engine"], "pair_idx": [0], "config": cfg, "pair_lengths": [60, 60], "heads": 12,
         "engine": engine(0), "wall_seconds": 20.0}
    b = {"piece": ["engine", "screen"], "pair_idx": [1], "config": cfg, "pair_lengths": [60, 60], "heads": 12,
         "engine": engine(1), "wall_seconds": 30.0,
         "screen": {"seconds": 5.0, "pairs": 2, "verified": 7, "certified": True, "top10": [],
                    "stats": {"n_verified": 7}, "mean_ie": [[1.1 - v for v in row] for row in ie]}}
    stored = {"heads": 12, "seconds": 99.0, "gaps": {"0": 1.0, "1": 0.9}, "config": {**cfg, "tokenizer": "other"},
              "pair_lengths": [60, 60], "fp32_reference": {"pair": 0, "ie": {"0,1": 0.2}},
              "pieces": [{"piece": ["engine"], "pair_idx": [0, 1]}]}
    pa, pb, ps = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "stored.json"
    for path, obj in ((pa, a), (pb, b), (ps, stored)):
        path.write_text(json.dumps(obj))
    with pytest.raises(SystemExit, match=r"engine pairs \[0\] are in none"):
        g.merge_into([str(pb)], str(ps))
    assert json.loads(ps.read_text()) == stored  # refused before writing
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**a, "config": {**cfg, "depths": [0.5, 0.5]}}))
    with pytest.raises(SystemExit, match=r"differs .* in \['depths'\]"):
        g.merge_into([str(other), str(pb)], str(ps))

    out = g.merge_into([str(pa), str(pb)], str(ps))
    assert json.loads(ps.read_text()) == out
    assert {k: out[k] for k in stored if k != "pieces"} == {k: v for k, v in stored.items() if k != "pieces"}
    assert out["pieces"][0] == stored["pieces"][0] and [p["used_for"] for p in out["pieces"][1:]] == ["screen"] * 2
    sc = out["screen"]
    assert sc["recall_at_10"] == 0.8 and sc["verified"] == 7 and sc["seconds"] == 5.0 and "mean_ie" not in sc
    assert sc["exact_top10"] == [[1, 5], [1, 4], [1, 3], [1, 2], [1, 1], [1, 0], [0, 5], [0, 4], [0, 3], [0, 2]]
    ref = sc["exact_reference"]
    assert ref["pairs"] == ["0", "1"] and ref["seconds_per_pair"] == {"0": 10.0, "1": 11.0}
    assert ref["max_abs_gap_diff_vs_stored"] == pytest.approx(0.1)  # gaps 1.0 rerun vs 1.0 / 0.9 stored
    assert ref["max_abs_diff_ie_vs_stored_fp32_reference"] == pytest.approx(0.1)  # head (0, 1): 0.1 vs 0.2
