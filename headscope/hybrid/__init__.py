"""Head-wise FA/GDN hybrid attention (HydraHead, SPEC.md §8)."""

from .attn import fa_attention, flash_attn_available
from .config import HybridOptions
from .convert import (
    HybridLlamaConfig,
    HybridLlamaForCausalLM,
    HybridQwen3Config,
    HybridQwen3ForCausalLM,
    head_output_rms,
    hybrid_spec,
    hybridize,
)
from .gdn import fla_available, gated_delta_rule, gdn_chunked_torch, gdn_naive, gdn_recurrent_torch
from .kv import kv_cache_report, kv_cache_report_for
from .layer import HeadwiseHybridAttention, HybridDecodeCache

__all__ = [
    "HeadwiseHybridAttention",
    "HybridDecodeCache",
    "HybridOptions",
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
    "kv_cache_report",
    "kv_cache_report_for",
]
