"""A transformers decoder layer after its attention: the residual adds, norms and MLP of each block form the hybrid's
fast paths run by hand (Llama's, Gemma 3's sandwich norms, GPT-NeoX's parallel or sequential residual), in
transformers' order of additions. Used by the captured decode (``hybrid/inference/decoder.py``) and the fast training
step's body (``train/fast_body.py``)."""

from __future__ import annotations

from typing import Any

from jaxtyping import Float
from torch import Tensor


def after_attention(layer: Any, h: Float[Tensor, "*rows hidden"],
                    a: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows hidden"]:
    """The layer's output from its input ``h`` (the residual stream) and its attention output ``a`` (after o_proj):
    Llama's h + a, then + MLP(norm(·)); Gemma 3's with the post-attention / pre- and post-feedforward norms;
    GPT-NeoX's parallel residual MLP(norm(h)) + a + h (``use_parallel_residual``; its sequential form is Llama's).
    Eval mode (no dropout)."""
    if hasattr(layer, "pre_feedforward_layernorm"):
        h = h + layer.post_attention_layernorm(a)
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
    if getattr(layer, "use_parallel_residual", False):
        return layer.mlp(layer.post_attention_layernorm(h)) + a + h
    h = h + a
    return h + layer.mlp(layer.post_attention_layernorm(h))
