"""experiments/knockout.py: the head sets of one K, and the subset --sets picks."""

from __future__ import annotations

from conftest import experiment_module


import pandas as pd




def _scores(n_layers=3, n_heads=4):
    rows = [(l, h, float(l * n_heads + h)) for l in range(n_layers) for h in range(n_heads)]
    df = pd.DataFrame(rows, columns=["layer", "head", "score"])
    df["rank"] = df["score"].rank(ascending=False, method="first").astype(int)
    return df


def test_head_sets_all_and_subset():
    ko = experiment_module("knockout")
    sets = ko.head_sets(_scores(), 4, 3, random_seeds=2)
    assert set(sets) == {"top", "bottom", "random0", "random1", "layers"}
    assert sets["top"] == [(2, 3), (2, 2), (2, 1)] and sets["bottom"] == [(0, 2), (0, 1), (0, 0)]
    assert sets["layers"] == [(2, h) for h in range(4)]  # round(3 / 4) = 1 layer, the best one
    assert all(len(v) == 3 and len(set(v)) == 3 for k, v in sets.items() if k.startswith("random"))
    sub = ko.head_sets(_scores(), 4, 3, random_seeds=2, kinds=("top", "random"))
    assert set(sub) == {"top", "random0", "random1"} and sub["random0"] == sets["random0"]
