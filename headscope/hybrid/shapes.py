"""Shape annotations for the hybrid modules: jaxtyping's ``Float`` / ``Int`` when it is installed.

The hybrid's modeling files are copied beside saved weights and run as transformers remote code in
processes that may not have jaxtyping. The annotations are never evaluated at run time (every module
uses ``from __future__ import annotations``), so without jaxtyping a stand-in is enough: it maps
``Float[Tensor, "batch time"]`` to ``Tensor``. transformers' import check skips imports inside ``try``.
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
