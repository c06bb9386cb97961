"""Length-dependent rotary tables made independent of call history.

transformers' dynamic RoPE (``rope_type`` containing ``"dynamic"``, e.g. dynamic NTK) grows its
frequency table to the longest sequence it has seen and keeps it: a sequence of length n gets the
table of max(n, longest length seen before) (it returns to the original table only below the
original context). The table a pair gets would then depend on which pairs ran before it.
:func:`fresh_rope` runs a block with every such module as freshly built (original table, original
length), so a pass of n tokens gets the table a fresh model computes for n tokens, and restores the
module's own state afterwards. LongRoPE (``"longrope"``) picks its short or long factors from the
call's own length alone (transformers ``longrope_frequency_update``) and needs nothing here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

_MISSING = object()


def _dynamic_prefixes(m: nn.Module) -> list[str]:
    """Attribute prefixes ("" or "<layer_type>_") of ``m``'s dynamic RoPE tables."""
    rt = getattr(m, "rope_type", None)
    if not hasattr(m, "original_max_seq_len"):
        return []
    if isinstance(rt, str):
        return [""] if "dynamic" in rt and hasattr(m, "original_inv_freq") else []
    if isinstance(rt, dict):  # one table per layer type (Gemma 3)
        return [f"{k}_" for k, v in rt.items() if "dynamic" in str(v) and hasattr(m, f"{k}_original_inv_freq")]
    return []


@contextmanager
def fresh_rope(module: nn.Module) -> Iterator[None]:
    """Every dynamic-RoPE rotary module in ``module`` (itself included) runs the block as freshly built.

    The state changed (``inv_freq``, ``max_seq_len_cached``, ``attention_scaling``, per layer type
    where the module keeps one table per type) is put back when the block ends, also on an error.
    """
    saved = []
    for m in module.modules():
        for p in _dynamic_prefixes(m):
            names = (f"{p}max_seq_len_cached", "attention_scaling")
            saved.append((m, p, getattr(m, f"{p}inv_freq"), {n: getattr(m, n, _MISSING) for n in names}))
            m.register_buffer(f"{p}inv_freq", getattr(m, f"{p}original_inv_freq"), persistent=False)
            setattr(m, f"{p}max_seq_len_cached", m.original_max_seq_len)
    try:
        yield
    finally:
        for m, p, inv, attrs in reversed(saved):
            m.register_buffer(f"{p}inv_freq", inv, persistent=False)
            for n, v in attrs.items():
                if v is _MISSING:
                    if hasattr(m, n):
                        delattr(m, n)
                else:
                    setattr(m, n, v)
