"""The committed anatomy figures (README's §5.7 table) follow from the committed per-pair IE.

``experiments/anatomy-*/run`` holds each model's Ranking (per-pair IE, Float[54, layers, heads]) and
``summary.json`` the statistics the README quotes; recomputing them from the IE with the library must give
the same numbers (a stale summary, or a change in the statistics, fails here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headscope.analysis import anatomy as an
from headscope.scores import Ranking

EXP = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("name,shape", [("anatomy-smollm2", (54, 30, 9)), ("anatomy-gemma3-270m", (54, 18, 4))])
def test_summary_recomputes_from_the_stored_ie(name, shape):
    s = json.loads((EXP / name / "summary.json").read_text())
    r = Ranking.load(EXP / name / "run")
    assert tuple(r.ie.shape) == shape and not torch.isnan(r.ie).any()
    assert s["n_pairs_used"] == 54 and s["n_ref"] == 48
    a = an.anatomy(r, n_boot=500, seed=0, ns=list(range(1, 7)), n_ref=48).to_dict()
    r6, want = a["stability"]["rho_at_6"], s["rho_at_6"]
    for k in ("rho_mean", "rho_std", "noise_rho_mean", "noise_rho_std", "topk_overlap"):
        assert r6[k] == pytest.approx(want[k], abs=1e-9), k
    # the stability reference is disjoint from the sample and 48 pairs wide: 6 + 48 = 54 pairs used
    assert r6["n_ref"] == 48
    crit = a["critical"]["ie_recv"]
    assert crit["n_critical"] == s["critical"]["n_critical"] == int((r.scores["ie_recv"] > 0.1).sum())
    assert a["gini"]["ie_recv"]["mean"] == pytest.approx(s["gini"]["mean"], abs=1e-9)
    # mean IE over pairs is the score table's ie_recv (eq. 10 averaged over pairs)
    m = r.ie.mean(0)
    assert torch.allclose(m, torch.as_tensor(r.matrix("ie_recv"), dtype=m.dtype), atol=1e-6)
