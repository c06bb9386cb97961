"""The conversion study's committed tables come from its committed records (experiments/conversion-generalization/
records/): the cells' per-prompt outcomes agree with retention.csv row by row (fast), and `tables.py` rebuilds every
table of the study folder from the records alone, byte for byte (slow: ~10 s on 2 cores)."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from headscope.evaluation.retention import EVAL_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "conversion-generalization"
TABLES = ("retention.csv", "retention_summary.csv", "retention_seeds.csv", "retention_depth.csv", "retention_distance.csv",
          "mask_coverage.csv", "levers.csv", "levers.md", "levers_paired.csv", "token_curve.csv", "token_curve.html",
          "anatomy.csv", "anatomy_knockout.csv", "comparison.md")


def _cells(name: str = "cells.jsonl.gz") -> list[dict]:
    with gzip.open(STUDY / "records" / name, "rt") as fh:
        return [json.loads(line) for line in fh]


def _check_rows(df: pd.DataFrame, cells: list[dict]) -> None:
    """Every cell is one row of ``df``: hits, accuracy, the teacher's accuracy on the same cell, agreement."""
    keys = [(c["model"], c["seed"], c["tokens"], c["task"], c["formats"], c["length"]) for c in cells]
    assert len(keys) == len(set(keys)) == len(df)
    teacher = {(c["task"], c["formats"], c["length"]): c for c in cells if c["model"] == "teacher"}
    rows = df.set_index(["model", "seed", "tokens", "task", "formats", "length"])
    for c, k in zip(cells, keys):
        r = rows.loc[k]
        assert r.n == len(c["correct"]) and r.hits == sum(c["correct"]) == c["hits"]
        assert r.accuracy == pytest.approx(c["hits"] / c["n"], abs=1e-15)
        t = teacher[(c["task"], c["formats"], c["length"])]
        assert r.teacher_accuracy == pytest.approx(sum(t["correct"]) / t["n"], abs=1e-15)
        assert r.agreement == pytest.approx(c["gen_agree"] / c["gen_n"]) if c["gen_n"] else pd.isna(r.agreement)


def test_records_cells_are_retention_csv_row_by_row():
    """Each committed cell is one row of retention.csv: hits = the sum of its per-prompt outcomes, accuracy =
    hits / n, the teacher's accuracy that of the teacher's cell on the same (task, formats, length), agreement the
    share of the generation-checked prompts where generation agreed with teacher forcing; the columns are those of
    `headscope eval`'s retention.csv. The study's cells (records/cells.jsonl.gz) are the rows of source 'study'; the
    cells `headscope eval` made (records/cli_cells.jsonl.gz, kept by run.py keep) those of source 'cli'."""
    cells = _cells()
    assert len(cells) == 232
    assert len({(c["task"], c["formats"], c["length"]) for c in cells if c["model"] == "teacher"}) == 40  # 4 x 2 x 5
    df = pd.read_csv(STUDY / "retention.csv")
    assert tuple(df.columns) == EVAL_COLUMNS and all(s in ("study", "cli") or s.startswith("cli:") for s in set(df.source))
    _check_rows(df[df.source == "study"], cells)
    cli = _cells("cli_cells.jsonl.gz")
    assert {c["model"] for c in cli} >= {"teacher"}
    # one eval folder per source (cli, or cli:TAG of run.py keep --tag): its rows are its cells, its teacher its own
    for src in set(df.source) - {"study"}:
        _check_rows(df[df.source == src], [c for c in cli if c.get("source", "cli") == src])


def test_records_hold_what_the_report_reads():
    """The anatomy's results and rankings, the masks and the settings are plain files; the arms' records hold every
    trained arm's three stages (done.json with its final loss) and each seed's documents' SHA-256."""
    rec = STUDY / "records"
    assert json.loads((rec / "settings.json").read_text())["suite"]["lengths"] == [1024, 2048, 4096, 8192, 16384]
    assert {f.stem for f in (rec / "masks").glob("*.json")} >= {"hydra-7to1", "layer-3to1", "layer-7to1", "random-7to1"}
    key = rec / "anatomy" / "unseen_niah_single@4096_p6"
    assert (key / "teacher" / "ranking" / "scores.csv").exists()
    assert sorted(p.parent.name for p in key.glob("*/anatomy.json")) == ["seed0_ie-7to1_t50000000", "seed2_hydra-7to1_t12500000"]
    with gzip.open(rec / "arms.jsonl.gz", "rt") as fh:
        arms = {r["path"]: r["json"] for r in map(json.loads, fh)}
    done = {p.rsplit("/", 2)[0] for p in arms if p.endswith("stage3/done.json") and "earlier_training" not in p}
    trained = {(c["model"], c["seed"], c["tokens"]) for c in _cells() if c["model"] != "teacher"}
    assert {(f"seed{s}/{m}_t{t}") for m, s, t in trained} <= done
    assert all(len(arms[f"seed{s}/data/info.json"]["docs_sha256"]) == 64 for s in {s for _, s, _ in trained})
    curves = pd.read_csv(rec / "loss_curves.csv.gz")
    final = curves.sort_values("step").groupby(["run", "stage"]).loss.last()
    for run in done:
        for k in (1, 2, 3):
            assert final[(run, k)] == pytest.approx(arms[f"{run}/stage{k}/done.json"]["final_loss"], rel=1e-12)


@pytest.mark.slow
def test_report_rebuilds_the_committed_tables_byte_for_byte(tmp_path):
    r = subprocess.run([sys.executable, str(STUDY / "tables.py"), "--out", str(tmp_path / "gen")], capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    differ = [t for t in TABLES if (tmp_path / "gen" / t).read_bytes() != (STUDY / t).read_bytes()]
    assert not differ, f"rebuilt from records/, these differ from the committed tables: {differ}"
