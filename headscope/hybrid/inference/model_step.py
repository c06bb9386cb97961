"""The fast path of a whole hybrid model's forward: a decode step into a :class:`~headscope.hybrid.HybridCache`.

A hybrid causal LM (``modeling_hybrid``) asks :func:`model_forward` (through ``dispatch.py``) before its own forward
when headscope is imported. It computes one call: a decode step (one new token per sequence) into a HybridCache after
an unpadded prefill, replayed from one CUDA graph of the whole step (``StaticDecoder.step_replayed``: embedding,
every layer through the lean decode path, final norm and LM head) — the graph-captured step's speed through
transformers' own ``generate``. A static cache (``generate(..., cache_implementation="static")``) gets compiled layer
tails and the tail kernel (a first-use compile); a growing one (``generate``'s default) eager tails (capture only),
recaptured if a layer's cache grows; ``InferenceConfig.decode_graphs`` chooses which. Every other call (prefill,
padding, gradients, autocast, hooks, outputs other than logits, layers with the short convolution) returns None and
runs the model's own forward, whose attention layers take the lean path where it applies (``forward.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import inference_config
from .decoder import StaticDecoder

_OUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# keyword arguments a decode step may carry that the replayed step computes itself (positions from the cache)
_IGNORED = {"use_cache", "cache", "past_key_values", "position_ids", "cache_position", "logits_to_keep",
            "return_dict", "attention_mask"}


def _decoder_layers_plain(model: Any) -> bool:
    """Whether the model's layers are what ``StaticDecoder`` computes: Llama-form decoder layers (input norm →
    attention → residual → post-attention norm → MLP → residual) whose attention is a plain hybrid layer without the
    short convolution (the device-position step runs on the lean path only, which has none)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return False
    return all(getattr(getattr(l, "self_attn", None), "plain", False) and l.self_attn.gdn_conv is None
               and all(hasattr(l, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp"))
               and not hasattr(l, "pre_feedforward_layernorm") for l in layers)


def _user_hooks(m: Any) -> bool:
    """Whether module ``m`` has a forward hook other than the hybrid's own (the base model's cache swap)."""
    hooks = (m._forward_hooks or m._forward_pre_hooks) and (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
    return any(not getattr(h, "headscope_own", False) for h in hooks or ())


def model_forward(model: Any, input_ids: Optional[Tensor], cache: Any, kwargs: dict) -> Optional[Any]:
    """The model's output for this call from the replayed decode step, or None where it does not apply.

    Args:
        model: a hybrid causal LM.
        input_ids: [batch, time] token ids (or None).
        cache: the call's :class:`~headscope.hybrid.HybridCache`.
        kwargs: the call's other keyword arguments (``attention_mask``, ``use_cache``, ...).

    Returns:
        ``CausalLMOutputWithPast(logits=[batch, 1, vocab], cache)`` (logits copied out of the graph's buffer), or
        None: the model's own forward computes the call.
    """
    n = cache.get_seq_length()
    if n == 0:  # a prefill: remember whether it was padded (a decode step of a padded batch needs its mask)
        mask = kwargs.get("attention_mask")
        cache.headscope_unpadded = mask is None or bool(mask.all())
        return None
    if not getattr(cache, "headscope_unpadded", False):
        return None
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1 or torch.is_grad_enabled():
        return None
    if torch.is_autocast_enabled(input_ids.device.type):  # the lean path (and so the replayed step) runs without it
        return None
    if any(v is not None and v is not False for k, v in kwargs.items() if k not in _IGNORED):
        return None  # inputs_embeds, labels, output_attentions / hidden_states, ...: the model's own forward
    cfg = inference_config(model)
    where = cfg.fast_path
    if where == "never" or (where == "cuda" and input_ids.device.type != "cuda"):
        return None
    if cfg.decode_graphs == "never" or (cfg.decode_graphs == "static" and not cache.static):
        return None
    if model.training or any(_user_hooks(m) for m in model.modules()):
        return None
    dec = getattr(cache, "headscope_decoder", None)
    caches = cache.decode_caches
    if dec is None or any(a is not b for a, b in zip(dec.caches, caches)):  # new, or a layer's cache grew
        if any(c is None for c in caches) or not _decoder_layers_plain(model):
            return None
        if len({c.max_len for c in caches}) != 1:
            return None
        dec = StaticDecoder(model, input_ids.shape[0], caches[0].max_len,
                            compile_tail=input_ids.is_cuda and cache.static, config=cfg, caches=caches)
        cache.headscope_decoder = dec
    logits = dec.step_replayed(input_ids).clone()
    return CausalLMOutputWithPast(logits=logits, **{_OUT_CACHE_FIELD: cache})
