"""Head-wise FA/GDN hybrid attention (HydraHead, SPEC.md §8)."""

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
from .gdn import fla_available, gated_delta_rule, gdn_chunked_torch, gdn_naive
from .kv import kv_cache_report, kv_cache_report_for
from .layer import HeadwiseHybridAttention

__all__ = [
    "HeadwiseHybridAttention",
    "HybridOptions",
    "HybridLlamaConfig",
    "HybridLlamaForCausalLM",
    "HybridQwen3Config",
    "HybridQwen3ForCausalLM",
    "fla_available",
    "gated_delta_rule",
    "gdn_chunked_torch",
    "gdn_naive",
    "head_output_rms",
    "hybrid_spec",
    "hybridize",
    "kv_cache_report",
    "kv_cache_report_for",
]
