"""notebooks/quickstart.ipynb: committed executed (PNG figures, small file), and it runs top to bottom on the real
default model at small settings, its summary agreeing with the ranking it saved."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

NB = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def _text(cell) -> str:
    return "\n".join(
        o.get("text", "") if o.output_type == "stream" else str(o.get("data", {}).get("text/plain", ""))
        for o in cell.outputs
    )


def test_quickstart_committed_with_outputs():
    """Every code cell ran in order without an error; figures are PNGs (no plotly JSON), the file stays under 1 MB;
    the heads knocked out are the first K rows of the ranking table the notebook printed."""
    nbformat = pytest.importorskip("nbformat")
    assert NB.stat().st_size < 1_000_000
    nb = nbformat.read(NB, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "execute the whole notebook in order"
    assert all(c.outputs for c in code), "a code cell has no output"
    outputs = [o for c in code for o in c.outputs]
    assert "error" not in {o.output_type for o in outputs}
    mimes = [m for o in outputs for m in o.get("data", {})]
    assert mimes.count("image/png") >= 2  # the heatmap and the attention figure
    assert not any("plotly" in m for m in mimes)
    text = "\n".join(_text(c) for c in code)
    m = re.search(r"ranked (\d+) heads on (\d+) pairs", text)
    assert m and int(m.group(1)) == 30 * 9
    # the ranking table (ranking.top(10)): columns rank, layer, head, ie_recv, score
    table = _text(code[1]).splitlines()
    rows = [ln.split() for ln in table[1:] if ln.split() and ln.split()[0].isdigit()]
    assert len(rows) == 10
    assert [int(r[1]) for r in rows] == sorted(int(r[1]) for r in rows)  # ranks 1..10 in order
    ko = re.search(r"top-(\d+) heads (\[.*?\]) knocked out: ([0-9.]+)", text)
    k, heads = int(ko.group(1)), ast.literal_eval(ko.group(2))
    assert heads == [(int(r[2]), int(r[3])) for r in rows[:k]]
    for frac in re.findall(r"L\d+H\d+: ([0-9.]+) of its attention on the needle", text):
        assert 0.0 <= float(frac) <= 1.0


@pytest.mark.slow
def test_quickstart_runs(notebook_runs):
    """The notebook top to bottom on the real default model at small settings (2 ranking pairs of 64 tokens, 4
    evaluation pairs, K = 3; beside the anatomy notebook's run: tests/notebook_runs.py)."""
    from headscope.scores import Ranking

    out = notebook_runs["quickstart"].result()
    s = json.loads((out / "quickstart.json").read_text())
    ranking = Ranking.load(out / "ranking")
    assert [tuple(h) for h in s["top_k"]] == [(int(r.layer), int(r.head)) for r in ranking.top(3).itertuples()]
    assert not set(map(tuple, s["random_k"])) & set(map(tuple, s["top_k"]))
    # the mask the hybrid was built with is the one the saved ranking gives for the same budget
    assert s["mask"]["fa_heads"] == ranking.mask("7:1", min_per_layer=1).to_dict()["fa_heads"]
    for name, row in s["attention_rows"].items():  # softmax rows over the prompt
        assert row["sum"] == pytest.approx(1.0, abs=1e-4), name
        assert 0.0 <= row["on_needle"] <= row["sum"] + 1e-6
    for acc in s["accuracy"].values():
        assert acc * 4 == pytest.approx(round(acc * 4))  # a count of the 4 evaluation pairs
    assert 1 <= s["new_tokens"]["hybrid"] <= 12 and 1 <= s["new_tokens"]["teacher"] <= 12
