"""notebooks/head_anatomy.ipynb runs top to bottom on the real default model and its figures render."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

NB = Path(__file__).resolve().parents[1] / "notebooks" / "head_anatomy.ipynb"


def test_notebook_has_no_stored_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NB, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "strip outputs before committing"


@pytest.mark.slow
def test_notebook_runs_and_exports_png(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    out = tmp_path / "out"
    monkeypatch.setenv("HEADSCOPE_NB_OUT", str(out))
    monkeypatch.setenv("HEADSCOPE_NB_BOOT", "50")
    nb = nbformat.read(NB, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    # every figure was exported as a real PNG
    for name in ("heatmap_ie", "heatmap_dla", "gini", "stability", "cosine"):
        png = out / "anatomy" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 5000, name
    # the numbers in anatomy.json agree with the saved ranking
    d = json.loads((out / "anatomy" / "anatomy.json").read_text())
    scores = pd.read_csv(out / "run" / "scores.csv")
    assert len(scores) == 30 * 9
    assert d["critical"]["ie_recv"]["n_critical"] == int((scores["ie_recv"] > 0.1).sum())
    assert d["dla"]["m_mean"] == pytest.approx(
        d["dla"]["heads_sum_mean"] + sum(d["dla"]["other_mean"].values()), rel=1e-3
    )
