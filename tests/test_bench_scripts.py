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

    name, ch = parse_variant("compiled_tail:tail_kernel=False,gdn_block_tokens=4096,tail_mode=None,fast_path=always")
    assert name == "compiled_tail"
    assert ch == {"tail_kernel": False, "gdn_block_tokens": 4096, "tail_mode": None, "fast_path": "always"}
    cfg = variant_config(ch)
    assert (cfg.tail_kernel, cfg.gdn_block_tokens, cfg.fast_path) == (False, 4096, "always")
    assert cfg.flash_qla == DEFAULT.flash_qla  # the rest: the defaults
    assert parse_variant("again:") == ("again", {})
    with pytest.raises(ValueError, match="field=value"):
        parse_variant("x:no_such=1")
    with pytest.raises(ValueError, match="field=value"):
        parse_variant("x:lean.DECODE_GDN=kernel")  # the old module switches are gone
    with pytest.raises(ValueError, match="fast_path must be one of"):
        parse_variant("x:fast_path=sometimes")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError):  # configured: the config holds inside the block and is restored after an error
        with configured([model], cfg):
            assert inference_config(model) is cfg
            raise RuntimeError
    assert inference_config(model) is DEFAULT
