"""KV-cache accounting of a head-wise hybrid against its teacher (SPEC.md §8).

A KV group keeps its cache if any of its query heads is FA (GQA: query head h belongs to group
h // (n_heads / n_kv_heads)). Per token and layer the teacher stores K and V for every KV head:
2 · n_kv · d_head · bytes. The hybrid stores them only for kept groups, plus a fixed, length-independent
GDN state per GDN head: d_head × d_head matrix (fp32 by default, as fla keeps it) and, with a short
convolution of kernel K, the last K − 1 inputs of its q/k/v channels (3 · d_head each).
"""

from __future__ import annotations

from typing import Any, Optional

from ..masks import HeadMask


def kv_cache_report(
    mask: HeadMask,
    head_dim: int,
    seq_len: int,
    batch: int = 1,
    kv_bytes: int = 2,
    state_bytes: int = 4,
    conv_kernel: int = 0,
) -> dict[str, Any]:
    """Bytes of the attention cache of the hybrid and of the teacher (all-FA) at ``seq_len`` tokens of ``batch``
    sequences (``head_dim`` channels per head; ``kv_bytes`` per K/V element, ``state_bytes`` per GDN state element,
    ``conv_kernel`` the short convolution's size, 0 = none).

    Returns:
        dict with ``teacher_bytes_per_token``, ``hybrid_bytes_per_token`` (KV of kept groups), ``gdn_state_bytes``
        (fixed), ``teacher_bytes``, ``hybrid_bytes`` (= per token · len · batch + state · batch), ``ratio`` (hybrid /
        teacher), ``kv_groups_kept``, ``n_gdn_heads``. Raises ValueError: non-positive sizes.
    """
    if head_dim < 1 or seq_len < 0 or batch < 1 or kv_bytes < 1 or state_bytes < 1 or conv_kernel < 0:
        raise ValueError("head_dim, batch and byte sizes must be positive; seq_len and conv_kernel >= 0")
    kept = sum(len(g) for g in mask.kv_groups())
    n_gdn = mask.n_total - mask.n_fa
    teacher_tok = 2 * mask.n_layers * mask.n_kv_heads * head_dim * kv_bytes
    hybrid_tok = 2 * kept * head_dim * kv_bytes
    state = n_gdn * head_dim * head_dim * state_bytes
    if conv_kernel:
        state += n_gdn * 3 * head_dim * (conv_kernel - 1) * kv_bytes
    teacher = teacher_tok * seq_len * batch
    hybrid = hybrid_tok * seq_len * batch + state * batch
    return {
        "seq_len": seq_len,
        "batch": batch,
        "kv_groups_kept": kept,
        "kv_groups_total": mask.n_layers * mask.n_kv_heads,
        "n_gdn_heads": n_gdn,
        "teacher_bytes_per_token": teacher_tok,
        "hybrid_bytes_per_token": hybrid_tok,
        "gdn_state_bytes": state,
        "teacher_bytes": teacher,
        "hybrid_bytes": hybrid,
        "ratio": hybrid / teacher if teacher else float("nan"),
    }


def kv_cache_report_for(model: Any, seq_len: int, mask: Optional[HeadMask] = None, **kw: Any) -> dict[str, Any]:
    """:func:`kv_cache_report` for a hybrid model (mask and options read from its config), or a teacher
    model with an explicit ``mask``."""
    from .convert import hybrid_spec

    cfg = model.config
    if mask is None:
        mask, opts = hybrid_spec(model)
        kw.setdefault("conv_kernel", opts.gdn_conv)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return kv_cache_report(mask, head_dim, seq_len, **kw)
