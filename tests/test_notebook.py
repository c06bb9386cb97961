"""notebooks/head_anatomy.ipynb runs top to bottom on the real default model and its figures render."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

NB = Path(__file__).resolve().parents[1] / "notebooks" / "head_anatomy.ipynb"


def test_committed_outputs_are_the_readme_anatomy_run():
    """The notebook is committed executed at the README's settings (issue 15): every code cell has run, in
    order, on the stored 54-pair SmolLM2 ranking, and the numbers it printed are those of the committed
    summaries of both models (so a rerun that changed them, or a stale notebook, fails here)."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NB, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "execute the whole notebook in order"
    assert all(c.outputs for c in code), "a code cell has no output"
    text = "\n".join(
        o.get("text", "") if o.output_type == "stream" else "\n".join(str(v) for v in o.get("data", {}).values())
        for c in code for o in c.outputs
    )
    assert "error" not in {o.output_type for c in code for o in c.outputs}
    assert "stored run experiments/anatomy-smollm2/run" in text
    root = NB.parents[1] / "experiments"
    smol = json.loads((root / "anatomy-smollm2" / "summary.json").read_text())
    gemma = json.loads((root / "anatomy-gemma3-270m" / "summary.json").read_text())
    assert smol["n_pairs_used"] >= 54 and smol["n_ref"] >= 48 and gemma["n_ref"] >= 48
    r6 = smol["rho_at_6"]
    assert f"rho at n = 6: {r6['rho_mean']:.3f} +- {r6['rho_std']:.3f}" in text
    # the side-by-side table shows both models' stored figures
    for s in (smol, gemma):
        assert f"{s['rho_at_6']['rho_mean']:.3f} +- {s['rho_at_6']['rho_std']:.3f} (ref {s['n_ref']} pairs)" in text
        assert f"{s['gini']['mean']:.3f} ({s['gini']['min']:.3f}-{s['gini']['max']:.3f})" in text
    c = smol["critical"]
    assert f"critical heads (IE > 0.1): {c['n_critical']} of {c['n_heads']}" in text


@pytest.mark.slow
def test_notebook_runs_and_exports_png(notebook_runs):
    """The notebook top to bottom on the real default model, ranking 3 pairs of 64 tokens itself (beside the
    quickstart's run: tests/notebook_runs.py): every figure exported as a PNG, anatomy.json agrees with the ranking."""
    out = notebook_runs["head_anatomy"].result()
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
