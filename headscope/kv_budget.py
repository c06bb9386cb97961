"""Masks at a KV-cache budget: head-wise FA heads confined to the KV cache of L layers, against L whole FA layers
(``headscope mask``; issue 62 item 4).

A KV group (the key/value heads its query heads share) stays cached as soon as one of its query heads is FA
(:meth:`headscope.masks.HeadMask.kv_groups`). On a model with one KV head per layer (Gemma 3 270M: 18 layers of 4
query heads) any FA head keeps its layer's whole cache, so a head-wise mask keeps the KV-cache share of a layer-wise
one with L FA layers only if its FA heads sit in at most L layers. The unit of the budget is the KV group: L layers'
worth is L · n_kv_heads groups (with one KV head per layer: L layers), the share L / n_layers.

The head-wise arm (:func:`select_in_kv_budget`) maximizes the summed score of its FA heads (the objective of
:meth:`HeadMask.select`, whose top-K is its optimum without the KV budget) under two budgets:

* a head budget K (a count, fraction or ``"LA:FA"`` ratio of all heads): the best K heads lying in at most
  L · n_kv_heads KV groups. Exact, by dynamic programming over the groups: for a group the best j of its heads are
  its top j, so a solution is a choice of groups and of a count j ≥ 1 for each; the table holds the best sum for
  every (groups used, heads used). The groups chosen are those whose best heads carry the most score; how many FA
  heads each gets follows from the scores.
* or ``heads_per_group`` k: exactly k FA heads in each of the L · n_kv_heads groups whose top-k heads have the largest
  summed score (k = n_heads / n_kv_heads: whole layers, ranked by score).

The layer-wise arm (:func:`layerwise_at`): L whole FA layers, evenly spaced (``by="even"``, the layer-wise arms of the
conversion studies: :func:`headscope.selectors.layerwise.even_layers`) or the L layers of the largest summed score.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np

from .errors import HeadscopeInputError
from .masks import Budget, HeadMask, parse_budget
from .validate import check_int

#: score given to a head without one (NaN): below every real score, finite so that sums stay ordered
_MISSING = -1e18


def _groups(scores: np.ndarray, n_kv_heads: int) -> tuple[list[tuple[int, int]], list[np.ndarray], list[np.ndarray]]:
    """Per KV group (layer-major): its (layer, group), its query heads best first, and their prefix sums of score."""
    n_layers, n_heads = scores.shape
    per = n_heads // n_kv_heads
    keys, heads, prefix = [], [], []
    for layer in range(n_layers):
        for g in range(n_kv_heads):
            hs = np.arange(g * per, (g + 1) * per)
            order = hs[np.argsort(-scores[layer, hs], kind="stable")]
            keys.append((layer, g))
            heads.append(order)
            prefix.append(np.concatenate([[0.0], np.cumsum(scores[layer, order])]))
    return keys, heads, prefix


def check_kv_budget(n_layers: int, n_heads: int, n_kv_heads: int, kv_layers: int, budget: Optional[Budget] = None,
                    heads_per_group: Optional[int] = None, cli: bool = False) -> Optional[int]:
    """The budgets of :func:`select_in_kv_budget` against a geometry -> the head count K (None with ``heads_per_group``);
    ``cli``: the messages name ``headscope mask``'s options.

    Raises:
        HeadscopeInputError: ``kv_layers`` outside 1..n_layers; neither or both of ``budget`` and ``heads_per_group``;
            ``heads_per_group`` outside 1..(query heads per KV group); a head budget that does not fit the KV budget.
    """
    n = (lambda f: "--" + f.replace("_", "-")) if cli else (lambda f: f)
    check_int(n("kv_layers"), kv_layers, lo=1, hi=n_layers,
              fix=f"the KV budget counts whole layers' caches and the model has {n_layers} layers")
    if (budget is None) == (heads_per_group is None):
        raise HeadscopeInputError(f"give a head budget ({n('budget')}: a count, fraction or 'LA:FA' ratio) or "
                                  f"{n('heads_per_group')}, one of the two")
    per = n_heads // n_kv_heads
    if heads_per_group is not None:
        check_int(n("heads_per_group"), heads_per_group, lo=1, hi=per, fix=f"a KV group has {per} query heads")
        return None
    k = parse_budget(budget, n_layers * n_heads)  # type: ignore[arg-type]
    room = kv_layers * n_heads
    if k > room:
        raise HeadscopeInputError(f"{n('budget')} {budget!r} = {k} FA heads does not fit the KV cache of {kv_layers} "
                                  f"layer(s) ({room} query heads); raise {n('kv_layers')} or lower {n('budget')}")
    return k


def select_in_kv_budget(scores: np.ndarray, n_kv_heads: int, kv_layers: int, budget: Optional[Budget] = None,
                        heads_per_group: Optional[int] = None, meta: Optional[dict[str, Any]] = None) -> HeadMask:
    """The head-wise arm at the KV cache of ``kv_layers`` layers (module docstring).

    Args:
        scores: Float[ndarray, "layer head"], higher = more important (NaN: below every score).
        n_kv_heads: KV heads per layer.
        kv_layers: the KV budget L: FA heads in at most L · n_kv_heads KV groups (share L / n_layers).
        budget: the head budget K (count, fraction or ``"LA:FA"``); or
        heads_per_group: exactly this many FA heads in each chosen group.
        meta: provenance merged into the mask's ``meta``.

    Returns:
        HeadMask whose ``meta`` holds ``selection="kv_budget"``, the budgets, ``score_sum`` and the chosen ``layers``.

    Raises:
        HeadscopeInputError: as :func:`check_kv_budget`; ``scores`` not 2-D or n_heads not a multiple of n_kv_heads.
    """
    s = np.asarray(scores, dtype=float)
    if s.ndim != 2 or n_kv_heads < 1 or s.shape[1] % n_kv_heads:
        raise HeadscopeInputError(f"scores of shape {s.shape} with {n_kv_heads} KV heads: need [layer, head] with heads a "
                                  "multiple of the KV heads")
    n_layers, n_heads = s.shape
    k = check_kv_budget(n_layers, n_heads, n_kv_heads, kv_layers, budget, heads_per_group)
    s = np.where(np.isnan(s), _MISSING, s)
    keys, heads, prefix = _groups(s, n_kv_heads)
    n_groups = kv_layers * n_kv_heads
    if heads_per_group is not None:
        j = int(heads_per_group)
        order = sorted(range(len(keys)), key=lambda u: (-prefix[u][j], u))[:n_groups]
        take = {u: j for u in order}
    else:
        take = _best_counts(prefix, n_groups, int(k))  # type: ignore[arg-type]
    chosen = [(keys[u][0], int(h)) for u, j in take.items() for h in heads[u][:j]]
    total = float(sum(prefix[u][j] for u, j in take.items()))
    m = dict(meta or {})
    m.update({"selection": "kv_budget", "kv_layers": kv_layers, "budget": budget, "heads_per_group": heads_per_group,
              "n_fa": len(chosen), "score_sum": total, "layers": sorted({layer for layer, _ in chosen}),
              "min_per_layer": 0})
    return HeadMask.from_heads(sorted(chosen), n_layers, n_heads, n_kv_heads, m)


def _best_counts(prefix: list[np.ndarray], n_groups: int, k: int) -> dict[int, int]:
    """{group: heads} maximizing Σ prefix[group][heads] with Σ heads = k over at most ``n_groups`` groups, each used
    group ≥ 1 head (dynamic programming over the groups; ties: the earlier group, the fewer heads)."""
    U = len(prefix)
    best = np.full((n_groups + 1, k + 1), -np.inf)
    best[0, 0] = 0.0
    # choice[u][g, c]: heads group u took in the best state (g groups, c heads) after it (0: not used)
    choice = np.zeros((U, n_groups + 1, k + 1), dtype=np.int32)
    for u in range(U):
        new = best.copy()
        for j in range(1, min(len(prefix[u]) - 1, k) + 1):
            cand = best[:-1, : k + 1 - j] + prefix[u][j]
            better = cand > new[1:, j:]
            new[1:, j:] = np.where(better, cand, new[1:, j:])
            choice[u, 1:, j:] = np.where(better, j, choice[u, 1:, j:])
        best = new
    g = int(np.argmax(best[:, k]))
    if not np.isfinite(best[g, k]):  # pragma: no cover - check_kv_budget makes k fit
        raise HeadscopeInputError(f"{k} FA heads do not fit {n_groups} KV group(s)")
    take, c = {}, k
    for u in range(U - 1, -1, -1):
        j = int(choice[u, g, c])
        if j:
            take[u] = j
            g, c = g - 1, c - j
    return take


def layerwise_at(scores: np.ndarray, n_kv_heads: int, kv_layers: int, by: Literal["even", "score"] = "even",
                 meta: Optional[dict[str, Any]] = None) -> HeadMask:
    """The layer-wise arm: ``kv_layers`` whole FA layers, evenly spaced (``by="even"``) or the layers of the largest
    summed score (``by="score"``; NaN counts 0).

    Raises:
        HeadscopeInputError: ``kv_layers`` outside 1..n_layers, another ``by``.
    """
    from .selectors.layerwise import even_layers
    from .validate import check_choice

    s = np.asarray(scores, dtype=float)
    n_layers, n_heads = s.shape
    check_int("kv_layers", kv_layers, lo=1, hi=n_layers,
              fix=f"the KV budget counts whole layers' caches and the model has {n_layers} layers")
    check_choice("by", by, ("even", "score"))
    if by == "even":
        layers = even_layers(n_layers, kv_layers)
    else:
        total = np.nansum(s, axis=1)
        layers = sorted(int(x) for x in sorted(range(n_layers), key=lambda i: (-total[i], i))[:kv_layers])
    m = dict(meta or {})
    m.update({"selection": "layerwise", "by": by, "kv_layers": kv_layers, "layers": layers, "min_per_layer": 0,
              "n_fa": kv_layers * n_heads, "score_sum": float(np.nansum(s[layers]))})
    return HeadMask.from_heads([(layer, h) for layer in layers for h in range(n_heads)], n_layers, n_heads, n_kv_heads, m)


def arm_row(name: str, mask: HeadMask) -> dict[str, Any]:
    """One arm's line of ``kv_budget.json``: FA heads, KV share, KV groups kept, layers used, the summed score."""
    s = mask.summary()
    return {"arm": name, "n_fa": s["n_fa"], "fa_fraction": s["fa_fraction"], "kv_cache_fraction": s["kv_cache_fraction"],
            "kv_groups_kept": s["kv_groups_kept"], "layers": [i for i, hs in enumerate(mask.fa_heads) if hs],
            "fa_per_layer": {str(i): len(hs) for i, hs in enumerate(mask.fa_heads) if hs},
            "score_sum": mask.meta.get("score_sum")}
