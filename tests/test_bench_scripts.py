"""The benchmark scripts' CPU checks (each script's --smoke path, and the variant parser they share)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_one_launch_smoke_runs_every_cell_and_they_agree():
    """bench_one_launch.py --smoke: every cell of the kernel's breakdown runs through Triton's interpreter and its FA
    output equals the default's (the script asserts it)."""
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, str(BENCH / "bench_one_launch.py"), "--smoke", "--out", "unused"],
                       capture_output=True, text=True, timeout=600, cwd=BENCH.parent,
                       env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("'smoke': 'ok'") == 2 and "fa_only_ns" in r.stdout


def test_variant_overrides_are_parsed_and_bad_items_name_the_fix():
    sys.path.insert(0, str(BENCH))
    try:
        from bench_timing import applied, parse_overrides
    finally:
        sys.path.remove(str(BENCH))
    from headscope.hybrid import lean, splitk, step

    name, ov = parse_overrides("one_launch:splitk.MIN_SPLIT=128,step.COMBINE=kernel,lean.DECODE_ONE_LAUNCH=False")
    assert name == "one_launch"
    assert ov == [(splitk, "MIN_SPLIT", 128), (step, "COMBINE", "kernel"), (lean, "DECODE_ONE_LAUNCH", False)]
    assert parse_overrides("again:") == ("again", [])
    with pytest.raises(ValueError, match="module.ATTR=value"):
        parse_overrides("x:splitk.NO_SUCH=1")
    with pytest.raises(ValueError, match="module.ATTR=value"):
        parse_overrides("x:torch.cuda=1")
    before = splitk.MIN_SPLIT
    with pytest.raises(RuntimeError):  # applied: the options hold inside the block and are restored after, also on error
        with applied(ov):
            assert (splitk.MIN_SPLIT, step.COMBINE, lean.DECODE_ONE_LAUNCH) == (128, "kernel", False)
            raise RuntimeError
    assert (splitk.MIN_SPLIT, step.COMBINE, lean.DECODE_ONE_LAUNCH) == (before, "launch", True)
