"""The one seam between a hybrid layer and its fast paths: which implementation computes a call.

The reference forward (``headscope/hybrid/layer.py``, the code a saved hybrid ships) asks :func:`fast_forward` first
when headscope is imported; None sends the call to the reference. The choices inside the fast paths come from the
model's :class:`~headscope.hybrid.inference.InferenceConfig` (``use_inference``), never from module state.

- training (gradients, no cache, no mask; prepared by ``headscope.train``): :mod:`.train_forward`;
- inference (no gradient, no mask, no cache or a ``HybridDecodeCache``): :mod:`.forward` — prefill
  (:mod:`.prefill`) and decode steps (:mod:`.decode`);
- a whole model's decode step into a ``HybridCache`` (``generate``, ``InferenceConfig.decode_graphs``):
  :func:`.model_step.model_forward`, asked by the hybrid causal LM's forward.

A layer whose ``o_proj`` carries a forward hook (knockout's ablation, the patching engine's edits of each head's
output before the output projection) runs the reference forward: the fast paths apply ``o_proj``'s weights
directly (input columns permuted, or fused into a kernel), so they would skip the hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor

from . import forward, train_forward
from .model_step import model_forward  # noqa: F401  (the model-level seam: modeling_hybrid's forward)

if TYPE_CHECKING:  # pragma: no cover
    from ..layer import HeadwiseHybridAttention


def fast_forward(layer: "HeadwiseHybridAttention", hidden_states: Tensor, position_embeddings: Optional[tuple],
                 attention_mask: Any, cache: Any, position_ids: Optional[Tensor], defer_out: bool = False,
                 projected: Optional[Tensor] = None) -> Any:
    """The layer's output [batch, time, hidden] from a fast path (or a ``DeferredOutput``, see
    :func:`.forward.forward`), or None where none applies (also when ``layer.o_proj`` carries hooks)."""
    if layer.o_proj._forward_pre_hooks or layer.o_proj._forward_hooks:  # only the module call runs them
        return None
    if (cache is None and attention_mask is None and projected is None and position_embeddings is not None
            and train_forward.fast_ready(layer, hidden_states)):
        return train_forward.fast_forward(layer, hidden_states, *position_embeddings, position_ids)
    if forward.applies(layer, hidden_states, attention_mask):
        return forward.forward(layer, hidden_states, position_embeddings, position_ids, cache, defer_out, projected)
    return None
