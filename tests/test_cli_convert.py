"""``headscope convert``'s plan lines before the teacher loads: a budget that whole steps raise by more than 10 % gets a
one-line note (``--tokens 1K`` at the CPU sizes trained 1,536 tokens without a word)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import headscope.models
from headscope.cli import app
from headscope.masks import HeadMask
from headscope.train.recipe import ConvertRecipe

CPU = ["--seq-len", "128", "--long-len", "256", "--batch-size", "4", "--batch-long", "2", "--docs", "16",
       "--doc-len", "64", "--device", "cpu"]


class Loaded(Exception):
    pass


def _plan_lines(tmp_path, monkeypatch, tokens: str) -> str:
    """convert's stderr up to the teacher's load (stopped there)."""
    def stop(*a, **k):
        raise Loaded

    monkeypatch.setattr(headscope.models, "load_hf", stop)
    mask = HeadMask.select(np.random.default_rng(0).random((30, 9)), "7:1", 3, 1).to_json(tmp_path / "mask.json")
    res = CliRunner().invoke(app, ["convert", "--mask", str(mask), "--tokens", tokens, "--out", str(tmp_path / tokens),
                                   *CPU])
    assert isinstance(res.exception, Loaded), res.output
    return res.stderr


def test_rounding_note_when_whole_steps_raise_the_budget(tmp_path, monkeypatch):
    err = _plan_lines(tmp_path, monkeypatch, "1K")
    assert "stage 1: 512 tokens = 1 step of 4 x 128" in err and "stage 3: 512 tokens = 1 step of 2 x 256" in err
    notes = [ln for ln in err.splitlines() if ln.startswith("note: ")]
    assert notes == ["note: 1,536 tokens will be trained, 54% more than the 1,000 asked for: each stage trains whole "
                     "steps of rows x row length, at least one (stage 1: 4 x 128, stage 2: 4 x 128, stage 3: 2 x 256); "
                     "lower --batch-size / --batch-long or --seq-len / --long-len for a finer budget"]


def test_no_note_when_the_rounding_is_small(tmp_path, monkeypatch):
    err = _plan_lines(tmp_path, monkeypatch, "10K")  # 1,536 + 5,632 + 3,072 = 10,240 tokens: 2.4 % more
    assert "stage 2: 5,632 tokens = 11 steps of 4 x 128" in err and "note:" not in err


def test_rounding_note_per_stage_and_with_stage_tokens():
    r = ConvertRecipe(tokens=1000, seq_len=128, long_len=256, batch_size=4, batch_long=2)
    assert r.rounding_note((2,)) is None  # 550 asked, 512 trained
    assert r.rounding_note((1,)).startswith("note: 512 tokens will be trained, 241% more than the 150 asked for")
    r = ConvertRecipe(tokens=1000, stage_tokens=(512, 520, 512), seq_len=128, long_len=256, batch_size=4, batch_long=2)
    assert r.rounding_note((1, 3)) is None  # whole steps already
    assert r.rounding_note((2,)).startswith("note: 1,024 tokens will be trained, 97% more than the 520 asked for")
    assert r.rounding_note().startswith("note: 2,048 tokens will be trained, 33% more than the 1,544 asked for")


def test_summary_labels_cpu_memory_as_the_process_max_rss(capsys):
    """On a CPU the recorded peak is ru_maxrss, the process's maximum so far (stage 3's includes stage 2's): the summary
    says so; on CUDA it is the stage's peak allocation."""
    from headscope.cli_convert import _convert_report

    stage = {"steps": 3, "total_steps": 3, "tokens": 1536, "final_loss": 1.23456, "seconds": 7, "folder": "o/stage1"}
    result = {"finished": True, "folder": "o/stage2", "stages": {
        1: {**stage, "peak_memory": {"bytes": 3 * 2**30, "kind": "ru_maxrss (process)"}},
        2: {**stage, "folder": "o/stage2", "peak_memory": {"bytes": 2**29, "kind": "torch.cuda.max_memory_allocated"}}}}
    _convert_report(result, Path("o"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "stage 1: 3/3 steps, 1,536 tokens, final loss 1.2346, 7 s, process max RSS so far 3.00 GiB -> o/stage1"
    assert lines[1] == "stage 2: 3/3 steps, 1,536 tokens, final loss 1.2346, 7 s, peak memory 0.50 GiB -> o/stage2"
