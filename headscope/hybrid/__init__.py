"""Head-wise FA/GDN hybrid attention (HydraHead, SPEC.md §8).

Importing this package changes nothing outside it (no transformers registration, no fast path switched on): the fast
backends attach to a model through :func:`use_inference` (called by :func:`hybridize` and :func:`load`), chosen by
its :class:`InferenceConfig` from the registry :func:`backends` lists.
"""

from .backend_registry import backends
from .cache import HybridCache
from .config import HybridOptions, LayerSpec
from .convert import head_output_rms, hybrid_spec, hybridize, load, migrate, migrate_from, register_auto_classes
from .fa_kernels import fa_attention, flash_attn_available
from .gdn import gdn_chunked_torch
from .gdn_kernels import fla_available, gated_delta_rule, gdn_naive, gdn_recurrent_torch
from .kv import kv_cache_report, kv_cache_report_for
from .layer import HeadwiseHybridAttention, HybridDecodeCache
from .inference import InferenceConfig, inference_config, use_inference
from .inference.decoder import StaticDecoder
from .warmup import warm_up

_CLASSES = ("HybridLlamaConfig", "HybridLlamaForCausalLM", "HybridQwen3Config", "HybridQwen3ForCausalLM")


def __getattr__(name: str):  # the hybrid classes, built on first access (modeling_hybrid imports families lazily)
    if name in _CLASSES:
        from . import modeling_hybrid

        return getattr(modeling_hybrid, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HeadwiseHybridAttention", "HybridCache", "HybridDecodeCache", "HybridOptions", "InferenceConfig", "StaticDecoder",
    "LayerSpec", *_CLASSES, "backends", "fa_attention", "fla_available", "flash_attn_available", "gated_delta_rule",
    "gdn_chunked_torch", "gdn_naive", "gdn_recurrent_torch", "head_output_rms", "hybrid_spec", "hybridize",
    "inference_config", "kv_cache_report", "kv_cache_report_for", "load", "migrate", "migrate_from",
    "register_auto_classes", "use_inference", "warm_up",
]
