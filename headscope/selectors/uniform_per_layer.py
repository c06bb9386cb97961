"""``uniform_per_layer``: the same number of FA heads in every layer (round robin over layers).

The ranking takes one head from every layer, then a second from every layer, and so on; so the top
K heads of the ranking (and :meth:`Ranking.mask` for any budget) spread FA heads as evenly over the
layers as the budget allows. Which head of a layer comes first is chosen at random (seeded), or by
head index with ``order="index"``.
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np

from ..models import LoadedModel
from ..scores import Ranking
from .base import make_ranking


def select_uniform_per_layer(model: LoadedModel, seed: int = 0, order: Literal["random", "index"] = "random") -> Ranking:
    """Round-robin ranking: heads of "round" r (the r-th head of each layer) rank before round r + 1.

    Within a round, layers are ordered by a seeded random permutation (``order="random"``) or from
    layer 0 up (``"index"``), so that a budget that is not a multiple of n_layers is not always
    filled from the first layers.

    Returns:
        Ranking with extra column ``round`` (0 = first head of its layer).

    Raises:
        ValueError: unknown ``order``.
    """
    if order not in ("random", "index"):
        raise ValueError(f"order={order!r}: use 'random' or 'index'")
    t0 = time.time()
    g = model.geometry
    rng = np.random.default_rng(seed)
    rounds = np.zeros((g.n_layers, g.n_heads))
    for layer in range(g.n_layers):
        perm = rng.permutation(g.n_heads) if order == "random" else np.arange(g.n_heads)
        rounds[layer, perm] = np.arange(g.n_heads)
    layer_order = rng.permutation(g.n_layers) if order == "random" else np.arange(g.n_layers)
    pos = np.empty(g.n_layers)
    pos[layer_order] = np.arange(g.n_layers)
    # position in the global round-robin sequence; higher score = earlier
    seq = rounds * g.n_layers + pos[:, None]
    score = 1.0 - seq / (g.n_layers * g.n_heads)
    return make_ranking(model, score, "uniform_per_layer", {"seed": seed, "order": order},
                        columns={"round": rounds}, seconds=time.time() - t0)
