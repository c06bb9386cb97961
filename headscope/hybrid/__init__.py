"""Head-wise FA/GDN hybrid attention (HydraHead, SPEC.md §8)."""

from .attn import fa_attention, flash_attn_available
from .config import HybridOptions, LayerSpec
from .convert import head_output_rms, hybrid_spec, hybridize
from .modeling_hybrid import HybridLlamaConfig, HybridLlamaForCausalLM, HybridQwen3Config, HybridQwen3ForCausalLM
from .gdn import fla_available, gated_delta_rule, gdn_chunked_torch, gdn_naive, gdn_recurrent_torch
from .cache import HybridCache
from .kv import kv_cache_report, kv_cache_report_for
from .layer import HeadwiseHybridAttention, HybridDecodeCache
from .inference import dispatch as _dispatch  # noqa: F401  (the layers' fast paths: inference/dispatch.py)
from .inference import InferenceConfig, inference_config, use_inference
from .inference.decoder import StaticDecoder

__all__ = [
    "HeadwiseHybridAttention",
    "HybridCache",
    "HybridDecodeCache",
    "HybridOptions",
    "InferenceConfig",
    "StaticDecoder",
    "LayerSpec",
    "HybridLlamaConfig",
    "HybridLlamaForCausalLM",
    "HybridQwen3Config",
    "HybridQwen3ForCausalLM",
    "fa_attention",
    "fla_available",
    "flash_attn_available",
    "gated_delta_rule",
    "gdn_chunked_torch",
    "gdn_naive",
    "gdn_recurrent_torch",
    "head_output_rms",
    "hybrid_spec",
    "hybridize",
    "inference_config",
    "kv_cache_report",
    "kv_cache_report_for",
    "use_inference",
]
