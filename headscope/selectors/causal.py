"""``causal``: the HydraHead ranking itself — ``select(model, "causal", **kw)`` is :func:`headscope.rank`
(receivers; senders and fusion where it offers them), one code path."""

from __future__ import annotations

from typing import Any

from ..scores import Ranking


def select_causal(model: Any, **settings: Any) -> Ranking:
    """``headscope.rank(model, **settings)`` (progress bar off unless asked); see its docstring.

    ``model``: a spec or a LoadedModel, as :func:`headscope.rank` takes it. Every keyword is passed
    through unchanged; the provenance gains ``selector="causal"``.

    Raises:
        TypeError: a keyword that :func:`headscope.rank` does not accept; otherwise as :func:`headscope.rank`.
    """
    from ..api import rank

    settings.setdefault("progress", False)
    r = rank(model, **settings)
    r.provenance["selector"] = "causal"
    return r
