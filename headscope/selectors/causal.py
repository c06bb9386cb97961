"""``causal``: the HydraHead ranking itself (receivers; senders and fusion where ``headscope.rank``
offers them), called through :func:`headscope.rank`'s public signature."""

from __future__ import annotations

import time
from typing import Any

from ..models import LoadedModel
from ..scores import Ranking


def select_causal(model: LoadedModel, **settings: Any) -> Ranking:
    """``headscope.rank(model, **settings)`` (progress bar off unless asked); see its docstring.

    Every keyword is passed through unchanged (``tasks``, ``n_pairs``, ``seq_len``, ``seed``, ``depth``,
    and on versions that have them ``senders``, ``weights``, ``kappa``...).

    Raises:
        TypeError: a keyword that this version of :func:`headscope.rank` does not accept.
    """
    from ..api import rank

    settings.setdefault("progress", False)
    t0 = time.time()
    r = rank(model, **settings)
    r.provenance["selector"] = "causal"
    r.provenance.setdefault("seconds", round(time.time() - t0, 2))
    return r
