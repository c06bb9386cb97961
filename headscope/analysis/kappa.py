"""κ_h^(c), a head's retrieval focus on the evidence span (SPEC.md §6): a model run, so it lives beside
the patching code, not in :mod:`headscope.scores` (which only combines numbers)."""

from __future__ import annotations

from typing import Any

from jaxtyping import Float
from torch import Tensor

from ..errors import HeadscopeInputError


def retrieval_focus(model: Any, pairs: Any) -> Float[Tensor, "layer head"]:
    """κ (SPEC.md §6 default): each head's retrieval focus on the evidence span.

    Per pair, the mean attention probability a head puts on ``pair.evidence`` from the
    answer-reading positions (clean prompt ⊕ a⁺[:-1], read as in eq. 9), divided by the span's share
    of the context visible from the first read position; averaged over pairs, divided by its
    maximum over heads and clipped to [0, 1].

    Raises:
        ValueError: no pairs; HeadscopeInputError: no head attends to the evidence at all (κ undefined).
    """
    from ..patching.engine import Engine
    from ..patching.receivers import check_pairs, sequences

    check_pairs(model, pairs)
    eng = Engine(model)
    acc = None
    for p in pairs:
        seq, _, read = sequences(p)
        s, e = p.evidence
        share = (e - s) / (read[0] + 1)
        ratio = eng.attention_mass(seq, read, (s, e)) / share
        acc = ratio if acc is None else acc + ratio
    kappa = acc / len(pairs)
    top = float(kappa.max())
    if not top > 0:
        raise HeadscopeInputError("no head puts attention on the evidence span; κ is undefined (use kappa='one')")
    return (kappa / top).clamp(0.0, 1.0).float()
