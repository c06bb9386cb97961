"""Shape annotations: jaxtyping's ``Float`` / ``Int`` when installed, else stand-ins mapping ``Float[Tensor, "..."]``
to ``Tensor`` (the saved modeling code runs where jaxtyping may be missing; annotations are never evaluated at run
time, and transformers' import check skips imports inside ``try``).
"""

from __future__ import annotations

from typing import Any

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


__all__ = ["Float", "Int"]
