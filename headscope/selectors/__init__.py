"""Other ways to pick heads and layers, under one interface (issue 9; SPEC.md §11).

``select(model, method, **settings) -> Ranking``: every selector returns the same
:class:`~headscope.scores.Ranking` as :func:`headscope.rank` — ``.scores`` one row per
(layer, head) with ``layer, head, kv_group, score, rank`` (plus the selector's own columns), and
``.mask(budget, min_per_layer)`` a :class:`~headscope.masks.HeadMask`.

Methods (one file each): ``causal`` (HydraHead, :func:`headscope.rank`), ``retrieval_score``
(Wu et al. 2024), ``duo_gates`` (DuoAttention-style gates), ``flashmorph_gates`` (FlashMorph-style
layer gates), ``rope_dependence`` (HwH RPD / RFIS), ``random``, ``uniform_per_layer``, ``layerwise``.
"""

from __future__ import annotations

from typing import Any, Callable

from ..models import LoadedModel, load_model
from ..scores import Ranking
from .causal import select_causal
from .duo_gates import select_duo_gates
from .flashmorph_gates import fa_layers, select_flashmorph_gates
from .layerwise import select_layerwise
from .rand import select_random
from .retrieval_score import retrieval_scores, select_retrieval_score
from .rope_dependence import select_rope_dependence
from .uniform_per_layer import select_uniform_per_layer

SELECTORS: dict[str, Callable[..., Ranking]] = {
    "causal": select_causal,
    "retrieval_score": select_retrieval_score,
    "duo_gates": select_duo_gates,
    "flashmorph_gates": select_flashmorph_gates,
    "rope_dependence": select_rope_dependence,
    "random": select_random,
    "uniform_per_layer": select_uniform_per_layer,
    "layerwise": select_layerwise,
}


def select(model: str | LoadedModel, method: str, **settings: Any) -> Ranking:
    """Rank every head of ``model`` with the named selector.

    Args:
        model: a model spec (see :func:`headscope.load_model`) or a LoadedModel.
        method: one of :data:`SELECTORS`.
        **settings: the selector's keyword arguments (see ``SELECTORS[method]``'s docstring).

    Returns:
        Ranking (rank 1 = the head that most deserves full attention).

    Raises (before the model loads; HeadscopeInputError is a ValueError):
        HeadscopeInputError: unknown method, a setting the selector does not take (the message
            lists the accepted ones), a value outside the selector's choices, a bad count, length or
            depth; for ``causal`` every check of :func:`headscope.rank`.
        ModelSpecError: a model spec that cannot be loaded (missing file, uncached hub id).
    """
    from ..checks import check_select_args

    check_select_args(model, method, settings)  # before the model loads
    fn = SELECTORS[method]
    return fn(load_model(model), **settings)


__all__ = ["select", "SELECTORS", "retrieval_scores", "fa_layers"] + [f.__name__ for f in SELECTORS.values()]
