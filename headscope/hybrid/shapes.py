"""Shape annotations: jaxtyping's ``Float`` / ``Int`` when installed, else stand-ins mapping ``Float[Tensor, "..."]``
to ``Tensor`` (the saved modeling code runs where jaxtyping may be missing; annotations are never evaluated at run
time, and transformers' import check skips imports inside ``try``).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

try:
    from jaxtyping import Float, Int
except ImportError:  # remote code without jaxtyping

    class _Shaped:
        """``X[Tensor, "dims"]`` is ``Tensor`` (annotation stand-in)."""

        def __class_getitem__(cls, item: Any) -> Any:
            return item[0] if isinstance(item, tuple) else item

    class Float(_Shaped):  # type: ignore[no-redef]
        pass

    class Int(_Shaped):  # type: ignore[no-redef]
        pass


# the gated delta rule's operands (gdn.py, gdn_kernels.py): q and k, v, the per-token log decay g and β, the state
GdnQK, GdnV = Float[Tensor, "batch time head dk"], Float[Tensor, "batch time head dv"]
GdnGate, GdnState = Float[Tensor, "batch time head"], Float[Tensor, "batch head dk dv"]
GdnOut = tuple[GdnV, GdnState]  # (y, the final state)
__all__ = ["Float", "Int", "GdnQK", "GdnV", "GdnGate", "GdnState", "GdnOut"]
