"""Issue 62's figures and paired tests (experiments/conversion-generalization/figures.py) on a tiny synthetic
retention.csv whose values are computed here by hand: the paired t-test across seeds with df = 1 (a Cauchy
distribution: p = 1 − 2·arctan|t|/π) and df = 2 (p = 1 − |t|/√(2 + t²)), McNemar's exact p on prompts pooled over the
seeds, the traces of the three figures (fast); the command writing HTML and PNG at each figure's own size (slow)."""
import importlib.util
import math
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from headscope.evaluation.retention import EVAL_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "conversion-generalization"
L = "+s2_retrieval=0.25+s3_wordings=6"
SRC, GSRC = "cli:smollm2-62", "cli:gemma3-62"


def _figures():
    spec = importlib.util.spec_from_file_location("study_figures", STUDY / "figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _retention(path: Path) -> Path:
    rows = []

    def add(model, seed, task, length, acc, teacher, source=SRC, tokens=12_500_000):
        rows.append({"model": model, "seed": seed, "tokens": 0 if model == "teacher" else tokens, "task": task,
                     "formats": "unseen", "length": length, "n": 100, "hits": round(acc * 100), "accuracy": acc,
                     "teacher_accuracy": teacher, "agreement": 1.0, "source": source})

    for length, t in ((1024, 1.0), (8192, 0.7), (16384, 0.1)):
        add("teacher", 0, "niah_single", length, t, t)
    add("teacher", 0, "niah_multikey", 1024, 0.8, 0.8)
    for s, (a8, a16) in enumerate(((0.90, 0.85), (0.86, 0.89))):
        add("hydra-7to1" + L, s, "niah_single", 8192, a8, 0.7)
        add("hydra-7to1" + L, s, "niah_single", 16384, a16, 0.1)
    for s, (h, lw) in enumerate(((0.90, 0.60), (0.80, 0.55))):  # df = 1: differences 0.30, 0.25
        add("headwise-7to1" + L, s, "niah_single", 1024, h, 1.0)
        add("layerwise-7to1" + L, s, "niah_single", 1024, lw, 1.0)
    for s, h in enumerate((0.5, 0.6, 0.7)):  # df = 2: differences 0.1, 0.2, 0.3
        add("headwise-3to1" + L, s, "niah_multikey", 1024, h, 0.8)
        add("layerwise-3to1" + L, s, "niah_multikey", 1024, 0.4, 0.8)
    for s in (0, 1):  # differences that do not vary: the t-test is undefined
        add("headwise-15to1" + L, s, "niah_single", 1024, 0.7, 1.0)
        add("layerwise-15to1" + L, s, "niah_single", 1024, 0.6, 1.0)
    add("headwise-31to1" + L, 0, "niah_single", 1024, 0.5, 1.0)  # one seed
    add("layerwise-31to1" + L, 0, "niah_single", 1024, 0.1, 1.0)
    add("layerwise-31to1" + L, 1, "niah_single", 1024, 0.2, 1.0)  # a seed the lever lacks
    add("headwise-7to1" + L, 0, "niah_single", 16384, 0.9, 0.1)  # teacher below 0.2: no retention point
    add("teacher", 0, "niah_single", 1024, 0.5, 0.5, GSRC)
    for s, (h, lw) in enumerate(((0.4, 0.2), (0.3, 0.2))):  # df = 1: differences 0.2, 0.1
        add("gemma-headwise-kv3" + L, s, "niah_single", 1024, h, 0.5, GSRC)
        add("gemma-layerwise-kv3" + L, s, "niah_single", 1024, lw, 0.5, GSRC)
    f = path / "retention.csv"
    pd.DataFrame(rows)[list(EVAL_COLUMNS)].to_csv(f, index=False)
    return f


def test_paired_test_across_seeds_by_hand(tmp_path):
    fg = _figures()
    df = fg.read_retention(_retention(tmp_path))
    cells = {(SRC, "headwise-7to1" + L, 0, 12_500_000, "niah_single", "unseen", 1024): [1, 1, 1, 0],
             (SRC, "layerwise-7to1" + L, 0, 12_500_000, "niah_single", "unseen", 1024): [0, 0, 1, 0],
             (SRC, "headwise-7to1" + L, 1, 12_500_000, "niah_single", "unseen", 1024): [1, 1, 0, 0],
             (SRC, "layerwise-7to1" + L, 1, 12_500_000, "niah_single", "unseen", 1024): [0, 1, 0, 0]}
    t = fg.paired_table(df, cells=cells).set_index(["lever", "task", "length"])
    r = t.loc[("headwise-7to1" + L, "niah_single", 1024)]
    # d = 0.30, 0.25: mean 0.275, sd 0.25 / sqrt(50), se sd / sqrt(2) = 0.025, t = 11, df 1
    assert r.seeds == "0 1" and r.differences == "+0.30 +0.25" and r.mean_difference == pytest.approx(0.275)
    assert r.p_seeds == pytest.approx(1 - 2 * math.atan(11) / math.pi, rel=1e-9)  # 0.0577: not moved at 0.05
    assert not r.moved
    # McNemar on the 8 pooled prompts: only the lever right on 3 (2 + 1), never only the reference: p = 2 / 2^3
    assert (r.n_prompts, r.only_lever, r.only_reference) == (8, 3, 0) and r.p_prompts == pytest.approx(0.25)
    r = t.loc[("headwise-3to1" + L, "niah_multikey", 1024)]
    tt = 0.2 / (0.1 / math.sqrt(3))  # d = 0.1, 0.2, 0.3: mean 0.2, sd 0.1, df 2
    assert r.p_seeds == pytest.approx(1 - tt / math.sqrt(2 + tt ** 2), rel=1e-9) and not r.moved  # 0.0742
    assert pd.isna(r.p_prompts)  # no per-prompt cells for this pair
    r = t.loc[("headwise-15to1" + L, "niah_single", 1024)]
    assert r.differences == "+0.10 +0.10" and pd.isna(r.p_seeds) and not r.moved
    r = t.loc[("headwise-31to1" + L, "niah_single", 1024)]
    assert r.seeds == "0" and pd.isna(r.p_seeds) and r.reference_accuracy == pytest.approx(0.1)
    r = t.loc[("gemma-headwise-kv3" + L, "niah_single", 1024)]  # d = 0.2, 0.1: t = 0.15 / 0.05 = 3
    assert r.source == GSRC and r.p_seeds == pytest.approx(1 - 2 * math.atan(3) / math.pi, rel=1e-9)
    # the student against the teacher of its eval folder: the teacher's one row beside each seed
    s = t.loc[("hydra-7to1" + L, "niah_single", 8192)]
    assert s.reference == "teacher" and s.differences == "+0.20 +0.16"
    assert s.p_seeds == pytest.approx(1 - 2 * math.atan(0.18 / 0.02) / math.pi, rel=1e-9)
    assert ("headwise-7to1" + L, "niah_single", 16384) not in t.index  # its reference has no such cell
    one = fg.paired_table(df, pairs=[("headwise-7to1" + L, "layerwise-7to1" + L)], alpha=0.06)
    assert one.moved.tolist() == [True]  # p = 0.0577 < 0.06 with two seeds
    text = fg.paired_text(t.reset_index())
    assert "headwise-7to1 " in text and L not in text


def test_figures_traces_by_hand(tmp_path):
    fg = _figures()
    df = fg.read_retention(_retention(tmp_path))
    lc = fg.long_context_figure(df)
    tr = {x.name: x for x in lc.data}
    assert list(tr["teacher"].x) == [1024, 8192, 16384] and list(tr["teacher"].y) == pytest.approx([1.0, 0.7, 0.1])
    st = tr["hydra-7to1"]
    assert list(st.x) == [8192, 16384] and list(st.y) == pytest.approx([0.88, 0.87])  # mean over the two seeds
    assert list(st.error_y.array) == pytest.approx([0.02, 0.02]) and list(st.error_y.arrayminus) == pytest.approx([0.02, 0.02])
    bc = fg.budget_figure(df)
    pts = {(x.name, x.xaxis): (list(x.x), list(x.y)) for x in bc.data}
    # single needle 1K: head-wise at 1/32, 1/16, 1/8 (R = 31, 15, 7), layer-wise at 1/32 (seeds 0 and 1: 0.1, 0.2)
    assert pts[("headwise, 1K", "x")] == (pytest.approx([1 / 32, 1 / 16, 1 / 8]), pytest.approx([0.5, 0.7, 0.85]))
    assert pts[("layerwise, 1K", "x")][1] == pytest.approx([0.15, 0.6, 0.575])
    # multi-key 1K (teacher 0.8): head-wise 3:1 retention 0.5 / 0.8, 0.6 / 0.8, 0.7 / 0.8 -> mean 0.75 at 1/4
    assert pts[("headwise, 1K", "x2")] == (pytest.approx([0.25]), pytest.approx([0.75]))
    assert not [k for k in pts if k[0].endswith("16K")]  # the 16K cell's teacher (0.1) is below 0.2
    gm = fg.gemma_figure(df)
    bars = {x.name: list(x.y) for x in gm.data}
    assert bars == {"teacher": pytest.approx([0.5]), "gemma-headwise-kv3": pytest.approx([0.35]),
                    "gemma-layerwise-kv3": pytest.approx([0.2])}
    assert fg.arm_budget("layerwise-15to1" + L) == ("layerwise", 15, L) and fg.arm_budget("teacher") is None


def _png_size(p: Path) -> tuple[int, int]:
    b = p.read_bytes()
    assert b[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", b[16:24])


@pytest.mark.slow
def test_figures_command_writes_html_and_png_at_their_sizes(tmp_path):
    """The command (run.py figures runs it on the study's retention.csv): three figures as HTML and PNG, each PNG at its
    figure's layout size (plots.save_figures gives write_images each figure's width and height), paired.csv."""
    fg = _figures()
    f = _retention(tmp_path)
    r = subprocess.run([sys.executable, str(STUDY / "figures.py"), "--retention", str(f), "--out", str(tmp_path / "fig")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    df = fg.read_retention(f)
    want = {"long_context": fg.long_context_figure(df), "budget_curve": fg.budget_figure(df), "gemma3": fg.gemma_figure(df)}
    for name, fig in want.items():
        assert (tmp_path / "fig" / f"{name}.html").stat().st_size > 1000
        assert _png_size(tmp_path / "fig" / f"{name}.png") == (fig.layout.width, fig.layout.height)
    t = pd.read_csv(tmp_path / "fig" / "paired.csv")
    assert len(t) == 7 and "headwise-7to1" in r.stdout
