"""The ``graph`` backend of the ``captured_decode`` role: a hybrid model's decode step into a
:class:`~headscope.hybrid.HybridCache` after an unpadded prefill, replayed from one CUDA graph of the whole step
(``StaticDecoder.step_replayed``); every other call returns None (the model's own forward). Details:
docs/hybrid.md, "How the kernels work: Captured decode".
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..modeling_hybrid import attention_name, decoder_layers
from . import forward
from .inference_config import inference_config
from .decoder import StaticDecoder

_OUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# keyword arguments a decode step may carry that the replayed step computes itself (positions from the cache)
_IGNORED = {"use_cache", "cache", "past_key_values", "position_ids", "cache_position", "logits_to_keep",
            "return_dict", "attention_mask"}


def _lean_layers(model: Any, x: Tensor) -> bool:
    """Whether every layer's decode role takes the lean backend for a call on x (what ``StaticDecoder`` runs)."""
    return all(forward.applies(getattr(l, attention_name(l)), x) for l in decoder_layers(model))


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
    if (input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1 or torch.is_grad_enabled()
            or torch.is_autocast_enabled(input_ids.device.type)):  # the lean path (so the replayed step): no autocast
        return None
    if any(v is not None and v is not False for k, v in kwargs.items() if k not in _IGNORED):
        return None  # inputs_embeds, labels, output_attentions / hidden_states, ...: the model's own forward
    cfg = inference_config(model)
    if (cfg.decode_graphs == "never" or (cfg.decode_graphs == "static" and not cache.static) or model.training
            or any(_user_hooks(m) for m in model.modules())):
        return None
    dec = getattr(cache, "headscope_decoder", None)
    caches = cache.decode_caches
    if dec is None or any(a is not b for a, b in zip(dec.caches, caches)):  # new, or a layer's cache grew
        h = torch.empty(input_ids.shape[0], 1, model.config.hidden_size, device=input_ids.device,
                        dtype=next(model.parameters()).dtype)
        if any(c is None for c in caches) or not _lean_layers(model, h):
            return None
        if len({c.max_len for c in caches}) != 1:
            return None
        dec = StaticDecoder(model, input_ids.shape[0], caches[0].max_len,
                            compile_tail=input_ids.is_cuda and cache.static, config=cfg, caches=caches)
        cache.headscope_decoder = dec
    logits = dec.step_replayed(input_ids).clone()
    return CausalLMOutputWithPast(logits=logits, **{_OUT_CACHE_FIELD: cache})
