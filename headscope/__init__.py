"""headscope: find the attention heads that carry long-range retrieval, by causal intervention.

Public API: :func:`load_model`, :func:`rank`, :class:`Ranking`, :class:`HeadMask`, :func:`hybridize`,
:func:`ablate`. Bad arguments raise :class:`HeadscopeInputError` (a ValueError) before any work.
"""

__version__ = "0.1.0"

from .errors import HeadscopeInputError  # noqa: E402
from .masks import HeadMask  # noqa: E402
from .models import LoadedModel, load_model  # noqa: E402
from .scores import Ranking  # noqa: E402
from .api import rank  # noqa: E402
from . import knockout, train  # noqa: E402
from .knockout import ablate, retrieval_accuracy  # noqa: E402
from .hybrid import HeadwiseHybridAttention, HybridOptions, hybridize, kv_cache_report  # noqa: E402

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
    "knockout",
    "train",
    "ablate",
    "retrieval_accuracy",
]
