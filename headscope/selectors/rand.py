"""``random``: a seeded random ordering of all heads (the reference point every selector must beat)."""

from __future__ import annotations

import time

import numpy as np

from ..models import LoadedModel
from ..scores import Ranking
from .base import make_ranking


def select_random(model: LoadedModel, seed: int = 0) -> Ranking:
    """Scores drawn i.i.d. uniform in [0, 1) from ``numpy.random.default_rng(seed)``.

    Returns:
        Ranking with columns layer, head, kv_group, score, rank.
    """
    t0 = time.time()
    g = model.geometry
    s = np.random.default_rng(seed).random((g.n_layers, g.n_heads))
    return make_ranking(model, s, "random", {"seed": seed}, seconds=time.time() - t0)
