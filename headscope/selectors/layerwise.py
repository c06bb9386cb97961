"""``layerwise``: whole layers keep FA (the layer-wise hybrid baseline, e.g. 3:1 LA:FA).

Heads are ranked layer by layer: all heads of the first-chosen layer, then all heads of the next,
so the top ``k * n_heads`` heads are exactly ``k`` whole layers. Use ``ranking.mask(budget,
min_per_layer=0)`` for a layer-wise mask (``min_per_layer >= 1`` forces heads into other layers).

Layer order:

* ``by="even"`` (default): evenly spaced layers. With ``n_fa_layers`` given, those layers are
  ``round((i + 1) * L / n - 1)`` for i < n (n = 8 of 32 gives layers 3, 7, ..., 31: the usual
  "every 4th layer" 3:1 placement) and rank first; the remaining layers follow in a nested
  farthest-first order. Without ``n_fa_layers`` the whole order is nested farthest-first (starting at
  the last layer), so every prefix is spread over the depth.
* ``by="score"``: layers by a per-layer score: ``layer_scores`` (a sequence of n_layers numbers) or a
  :class:`~headscope.scores.Ranking` (per-layer mean of its ``score`` column, or ``agg="sum"``/"max").
"""

from __future__ import annotations

import time
from typing import Literal, Sequence

import numpy as np

from ..models import LoadedModel
from ..scores import Ranking
from .base import make_ranking


def farthest_first(n: int, first: Sequence[int] = ()) -> list[int]:
    """Order 0..n-1 so that each next layer is the one farthest from those already taken.

    Starts from ``first`` (or from the last layer); ties go to the deeper layer.
    """
    taken = list(dict.fromkeys(int(x) for x in first)) or [n - 1]
    while len(taken) < n:
        rest = [i for i in range(n) if i not in taken]
        dist = [min(abs(i - t) for t in taken) for i in rest]
        best = max(range(len(rest)), key=lambda j: (dist[j], rest[j]))
        taken.append(rest[best])
    return taken


def even_layers(n_layers: int, n_fa_layers: int) -> list[int]:
    """``n_fa_layers`` evenly spaced layers ending at the last: round((i+1)·L/n − 1).

    Raises:
        ValueError: n_fa_layers outside 1..n_layers.
    """
    if not 1 <= n_fa_layers <= n_layers:
        raise ValueError(f"n_fa_layers={n_fa_layers} must lie in 1..{n_layers}")
    return sorted({int(round((i + 1) * n_layers / n_fa_layers - 1)) for i in range(n_fa_layers)})


def select_layerwise(
    model: LoadedModel,
    by: Literal["even", "score"] = "even",
    n_fa_layers: int | None = None,
    layer_scores: Sequence[float] | Ranking | None = None,
    agg: Literal["mean", "sum", "max"] = "mean",
) -> Ranking:
    """Rank whole layers (see the module docstring); heads inside a layer by index.

    Returns:
        Ranking with extra columns ``layer_order`` (0 = first layer kept) and ``layer_score``.

    Raises:
        ValueError: unknown ``by``/``agg``, ``by="score"`` without ``layer_scores``, or a score
            vector whose length is not n_layers.
    """
    t0 = time.time()
    g = model.geometry
    L, H = g.n_layers, g.n_heads
    if by == "even":
        first = even_layers(L, n_fa_layers)[::-1] if n_fa_layers else []
        order = farthest_first(L, first)
        lscore = np.empty(L)
        lscore[order] = -np.arange(L, dtype=float)
    elif by == "score":
        if layer_scores is None:
            raise ValueError("layerwise by='score' needs layer_scores: a list of per-layer scores or a Ranking")
        if isinstance(layer_scores, Ranking):
            if agg not in ("mean", "sum", "max"):
                raise ValueError(f"agg={agg!r}: use 'mean', 'sum' or 'max'")
            m = layer_scores.matrix("score")
            lscore = getattr(np, agg)(m, axis=1)
        else:
            lscore = np.asarray(layer_scores, dtype=float)
        if lscore.shape != (L,):
            raise ValueError(f"layer_scores has {lscore.size} values; the model has {L} layers")
        order = list(np.argsort(-lscore, kind="stable"))
    else:
        raise ValueError(f"by={by!r}: use 'even' or 'score'")
    pos = np.empty(L)
    pos[np.asarray(order)] = np.arange(L)
    seq = pos[:, None] * H + np.arange(H)[None, :]
    score = 1.0 - seq / (L * H)
    settings = {"by": by, "n_fa_layers": n_fa_layers, "agg": agg,
                "layer_scores": None if layer_scores is None or isinstance(layer_scores, Ranking)
                else [float(x) for x in lscore]}
    return make_ranking(model, score, "layerwise", settings,
                        columns={"layer_order": np.repeat(pos[:, None], H, 1), "layer_score": np.repeat(lscore[:, None], H, 1)},
                        extras={"layer_order": [int(x) for x in order]}, seconds=time.time() - t0)
