"""headscope: find the attention heads that carry long-range retrieval, by causal intervention.

Public API: :func:`load_model`, :func:`rank`, :class:`Ranking`, :class:`HeadMask`, :func:`hybridize`,
:func:`ablate`. Bad arguments raise :class:`HeadscopeInputError` (a ValueError) before any work.

``import headscope`` is cheap: it loads only the version and the error types. Every other public name
(and every subpackage: ``headscope.train``, ``headscope.hybrid``, ...) is imported on first use
(PEP 562 module ``__getattr__``), so a ranking never loads the training, FSDP or hybrid code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import HeadscopeInputError
from .runtime import __version__

#: public name -> the module that defines it (imported on first access)
_LAZY = {
    "HeadMask": "masks",
    "LoadedModel": "models",
    "Ranking": "scores",
    "rank": "api",
    "RankConfig": "rank_config",
    "ScreenConfig": "rank_config",
    "FusionConfig": "rank_config",
    "Readout": "readout",
    "ablate": "analysis.knockout",
    "retrieval_accuracy": "analysis.knockout",
    "hybridize": "hybrid",
    "HeadwiseHybridAttention": "hybrid",
    "HybridOptions": "hybrid",
    "kv_cache_report": "hybrid",
}
_SUBMODULES = (
    "analysis", "api", "arch", "cli", "distributed", "errors", "evaluation", "generation", "hybrid", "masks", "model_specs",
    "models", "patching", "plots", "plugin_registry", "rank_config", "readout", "runtime", "scores", "selectors", "tasks", "train",
    "validate",
)


def load_model(*args: Any, **kwargs: Any) -> Any:
    """:func:`headscope.models.load_model` (spec -> LoadedModel; imported on the first call). A plain
    function here, so that replacing ``headscope.models.load_model`` (tests, tools) is seen by callers."""
    from . import models

    return models.load_model(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'headscope' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


if TYPE_CHECKING:  # for type checkers and IDEs: the names the lazy loader provides
    from . import analysis, hybrid, train  # noqa: F401
    from .api import rank  # noqa: F401
    from .rank_config import FusionConfig, RankConfig, ScreenConfig  # noqa: F401
    from .hybrid import HeadwiseHybridAttention, HybridOptions, hybridize, kv_cache_report  # noqa: F401
    from .analysis.knockout import ablate, retrieval_accuracy  # noqa: F401
    from .masks import HeadMask  # noqa: F401
    from .models import LoadedModel, load_model  # noqa: F401
    from .readout import Readout  # noqa: F401
    from .scores import Ranking  # noqa: F401

__all__ = [
    "__version__",
    "HeadscopeInputError",
    "load_model",
    "LoadedModel",
    "rank",
    "Ranking",
    "HeadMask",
    "hybridize",
    "HeadwiseHybridAttention",
    "HybridOptions",
    "kv_cache_report",
    "analysis",
    "train",
    "ablate",
    "retrieval_accuracy",
    "Readout",
    "RankConfig",
    "ScreenConfig",
    "FusionConfig",
]
