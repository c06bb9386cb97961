"""Other ways to pick heads and layers, under one interface (issue 9; SPEC.md §11).

``select(model, method, **settings) -> Ranking``: every selector returns the same
:class:`~headscope.scores.Ranking` as :func:`headscope.rank` — ``.scores`` one row per
(layer, head) with ``layer, head, kv_group, score, rank`` (plus the selector's own columns), and
``.mask(budget, min_per_layer)`` a :class:`~headscope.masks.HeadMask`.

Methods (one file each, one line each in :data:`SELECTORS`): ``causal`` (HydraHead: ``select(model,
"causal", **kw)`` *is* ``headscope.rank(model, **kw)``, one code path), ``retrieval_score`` (Wu et al. 2024),
``duo_gates`` (DuoAttention-style gates), ``flashmorph_gates`` (FlashMorph-style layer gates),
``rope_dependence`` (HwH RPD / RFIS), ``random``, ``uniform_per_layer``, ``layerwise``.

Adding a selector: a new file ``headscope/selectors/<name>.py`` with ``def select_<name>(model: LoadedModel,
**settings) -> Ranking`` (build the Ranking with :func:`headscope.selectors.base.make_ranking`) and one line
``"<name>": "<name>:select_<name>"`` in :data:`SELECTORS`. ``select`` then checks its settings against the
function's signature (``Literal`` choices included) before the model loads.
"""

from __future__ import annotations

from typing import Any

from ..errors import HeadscopeInputError
from ..models import load_model
from ..plugin_registry import Registry
from ..validate import check_choice, check_int, check_real, is_int

#: method name -> "module:function" (imported on first use)
SELECTORS = Registry(__name__, {
    "causal": "causal:select_causal",
    "retrieval_score": "retrieval_score:select_retrieval_score",
    "duo_gates": "duo_gates:select_duo_gates",
    "flashmorph_gates": "flashmorph_gates:select_flashmorph_gates",
    "rope_dependence": "rope_dependence:select_rope_dependence",
    "random": "rand:select_random",
    "uniform_per_layer": "uniform_per_layer:select_uniform_per_layer",
    "layerwise": "layerwise:select_layerwise",
})

_OTHER = {"retrieval_scores": "retrieval_score", "fa_layers": "flashmorph_gates"}


def check_select_args(model: Any, method: Any, settings: dict[str, Any]) -> None:
    """:func:`headscope.selectors.select`: the method, its settings and the model spec.

    Raises:
        HeadscopeInputError: unknown method, a setting the selector does not take (the message lists
            the accepted ones), a value outside a ``Literal`` choice or a bad count / depth / length.
    """
    import inspect
    import typing

    from ..models import check_model

    if method not in SELECTORS:
        raise HeadscopeInputError(f"unknown selector {method!r}; available: {', '.join(SELECTORS)}")
    fn = SELECTORS[method]
    params = inspect.signature(fn).parameters
    if method == "causal":
        import headscope.api as api

        ok = [k for k in inspect.signature(api.rank).parameters if k != "model"]
        bad = [k for k in settings if k not in ok]
        if bad:
            raise HeadscopeInputError(f"selector 'causal' does not take {bad}; its settings are {ok}")
        # the values: headscope.rank checks them before it loads the model (its config, then the call)
    elif not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        bad = [k for k in settings if k not in params or k == "model"]
        if bad:
            ok = [k for k in params if k != "model"]
            raise HeadscopeInputError(f"selector {method!r} does not take {bad}; its settings are {ok}")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    for k, v in settings.items():
        if typing.get_origin(hints.get(k)) is typing.Literal:
            check_choice(k, v, typing.get_args(hints[k]))
    for k in ("n_prompts", "steps", "n_bands"):
        if k in settings:
            check_int(k, settings[k], lo=1)
    if "seq_lens" in settings:
        for L in [settings["seq_lens"]] if is_int(settings["seq_lens"]) else list(settings["seq_lens"]):
            check_int("seq_lens", L, lo=16)
    if "depths" in settings:
        ds = settings["depths"]
        for d in [ds] if isinstance(ds, (int, float)) else list(ds):
            check_real("depths", d, 0.0, 1.0, fix="depths are fractions of the prompt")
    if method != "causal":  # headscope.rank checks the model itself, before it loads
        check_model(model)


def select(model: Any, method: str, **settings: Any) -> Any:
    """Rank every head of ``model`` with the named selector.

    Args:
        model: a model spec (see :func:`headscope.load_model`) or a LoadedModel.
        method: one of :data:`SELECTORS`.
        **settings: the selector's keyword arguments (see ``SELECTORS[method]``'s docstring); for
            ``causal`` those of :func:`headscope.rank` (progress bar off unless asked).

    Returns:
        Ranking (rank 1 = the head that most deserves full attention).

    Raises (before the model loads; HeadscopeInputError is a ValueError):
        HeadscopeInputError: unknown method, a setting the selector does not take (the message lists
            the accepted ones), a value outside the selector's choices, a bad count, length or
            depth; for ``causal`` every check of :func:`headscope.rank`.
        ModelSpecError: a model spec that cannot be loaded (missing file, uncached hub id).
    """
    check_select_args(model, method, settings)  # before the model loads
    fn = SELECTORS[method]
    if method == "causal":  # headscope.rank itself: it loads the model with its own device / dtype
        return fn(model, **settings)
    return fn(load_model(model), **settings)


def __getattr__(name: str) -> Any:
    # the selector functions by name (select_random, ...), retrieval_scores and fa_layers, imported on use
    for key, entry in SELECTORS.entries.items():
        if entry.endswith(":" + name):
            return SELECTORS[key]
    if name in _OTHER:
        import importlib

        return getattr(importlib.import_module(f".{_OTHER[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["select", "SELECTORS", "retrieval_scores", "fa_layers"] + [e.split(":")[1] for e in SELECTORS.entries.values()]
