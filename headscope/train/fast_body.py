"""The decoder body that the fast training step (:class:`~headscope.train.fast.FastStep`) computes by hand: which
causal LMs it knows, one call per decoder layer (each compiled on its own), the per-layer RoPE tables and
sliding-window masks, and the teacher's per-layer attention input / output of stage 1.

Two body forms, both as transformers computes them without padding:

- **Llama's** (Llama, Qwen2, Qwen3, Mistral; Gemma 3 with its sandwich norms, scaled embedding and RoPE per layer
  type): ``model.model`` with ``embed_tokens``, ``rotary_emb``, ``layers`` (attention ``self_attn``), ``norm``;
- **GPT-NeoX's** (Pythia): ``model.gpt_neox`` with ``embed_in``, ``emb_dropout``, ``rotary_emb`` (partial rotary:
  cos / sin narrower than the head, ``rotary_pct``), ``layers`` (attention ``attention`` with the fused
  ``query_key_value``; LayerNorms with biases; the parallel residual ``h + attn(ln1(h)) + mlp(ln2(h))`` or the
  sequential one), ``final_layer_norm``; the untied LM head (``embed_out``, ``lm_head`` in transformers 5:
  :func:`output_head`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from ..arch.residual import after_attention

# model types whose body model_body computes, without "_" ("gpt_neox", a hybrid's "headscope_hybrid_gptneox")
BODIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gptneox")
NAMES = "Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 / GPT-NeoX"


def _layer_call(layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, pos: Tensor,
                mask: Optional[Tensor] = None) -> Tensor:
    out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin), use_cache=False)
    return out[0] if isinstance(out, tuple) else out


def _attn_call(attn: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    return attn(h, position_embeddings=(cos, sin), attention_mask=mask)[0]


def attention_of(layer: nn.Module) -> nn.Module:
    """A decoder layer's attention module (``self_attn``; GPT-NeoX: ``attention``)."""
    return layer.self_attn if hasattr(layer, "self_attn") else layer.attention


def _teacher_io(layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor,
                mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """One decoder layer of a body :data:`BODIES` names (eval mode: no dropout), returning (attention input,
    attention output, layer output), in transformers' order of additions."""
    hn = layer.input_layernorm(h)
    a = attention_of(layer)(hn, position_embeddings=(cos, sin), attention_mask=mask)[0]
    return hn, a, after_attention(layer, h, a)


def inner_model(model: nn.Module) -> nn.Module:
    """The causal LM's decoder stack (``model.model``; GPT-NeoX: ``model.gpt_neox``)."""
    return model.gpt_neox if hasattr(model, "gpt_neox") else model.model


def output_head(model: nn.Module) -> nn.Linear:
    """The LM head (``lm_head``; GPT-NeoX's untied ``embed_out`` before transformers 5)."""
    return model.get_output_embeddings()


def has_fast_body(model: nn.Module) -> bool:
    """True when ``model`` is a causal LM (or its hybrid) of a body :data:`BODIES` names with the parts the hand-written
    body uses (sliding windows: :func:`layer_masks`; Gemma 3's RoPE per layer type: :func:`layer_positions`; its
    scaled embedding is its embedding module's). Other families with the same attribute names are refused (the body
    would not be theirs), as is a final logit soft-cap (the chunked loss has none)."""
    cfg = getattr(model, "config", None)
    mtype = str(getattr(cfg, "model_type", "")).removeprefix("headscope_hybrid_").removesuffix("_text").replace("_", "")
    if mtype not in BODIES or getattr(cfg, "final_logit_softcapping", None) is not None:
        return False
    inner = getattr(model, "gpt_neox" if mtype == "gptneox" else "model", None)
    parts = ("embed_in", "final_layer_norm") if mtype == "gptneox" else ("embed_tokens", "norm")
    return (all(hasattr(inner, a) for a in ("rotary_emb", "layers", *parts))
            and isinstance(getattr(model, "get_output_embeddings", lambda: None)(), nn.Linear))


def decoder_parts_ok(model: nn.Module) -> bool:
    """Every decoder layer has what :func:`_teacher_io` uses (stage 1's teacher)."""
    return all(
        all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp"))
        and (hasattr(layer, "self_attn") or hasattr(layer, "attention"))
        for layer in inner_model(model).layers
    )


def _layer_types(cfg: Any) -> list[str]:
    """Each decoder layer's attention type: the config's ``layer_types``, else all sliding where it has a window."""
    kind = "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"
    return list(getattr(cfg, "layer_types", None) or [kind] * int(cfg.num_hidden_layers))


def layer_masks(model: nn.Module, T: int, device: torch.device) -> list[Optional[Bool[Tensor, "1 1 time time"]]]:
    """Per decoder layer, the causal sliding-window mask (key j visible to query i iff 0 ≤ i − j < w) that a dense
    sliding layer (Mistral; Gemma 3's sliding layers) needs for T > w tokens — SDPA applies no window of its own —
    else None. Hybrid layers apply their window themselves (:func:`mask_for`)."""
    cfg = model.config
    w = getattr(cfg, "sliding_window", None)
    mask = None
    if w is not None and T > w:
        i, j = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None]
        mask = ((j <= i) & (i - j < w))[None, None]
    return [mask if t == "sliding_attention" else None for t in _layer_types(cfg)]


def layer_positions(model: nn.Module, h: Tensor, pos: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per decoder layer, its rotary (cos, sin): the model's one table (GPT-NeoX: the rotary part of the head only),
    or Gemma 3's table of the layer's type."""
    rot, types = inner_model(model).rotary_emb, _layer_types(model.config)
    if "layer_type" not in inspect.signature(rot.forward).parameters:
        return [rot(h, pos)] * len(types)
    tables = {t: rot(h, pos, t) for t in set(types)}
    return [tables[t] for t in types]


def mask_for(attn: nn.Module, mask: Optional[Tensor]) -> tuple:
    """The extra argument of a layer / attention call: (mask,) for a dense layer under a window, else () (a hybrid
    layer keeps its window in its LayerSpec: no mask, so its fused training backend takes the call)."""
    return () if mask is None or hasattr(attn, "new_decode_cache") else (mask,)


def embed(model: nn.Module, ids: Int[Tensor, "batch time"]) -> Float[Tensor, "batch time hidden"]:
    """The decoder stack's input: the token embedding (Gemma 3's scaled by its module; GPT-NeoX's through its
    embedding dropout)."""
    inner = inner_model(model)
    if hasattr(inner, "embed_in"):
        return inner.emb_dropout(inner.embed_in(ids))
    return inner.embed_tokens(ids)


def model_body(
    model: nn.Module, ids: Int[Tensor, "batch time"], layer_fn: Callable = _layer_call
) -> Float[Tensor, "batch time hidden"]:
    """Final hidden states of a causal LM of a body :data:`BODIES` names (after the final norm): the same numbers as
    ``inner_model(model)(input_ids=ids, use_cache=False).last_hidden_state`` without padding, one
    ``layer_fn(layer, h, cos, sin, position_ids[, window mask])`` call per decoder layer."""
    inner = inner_model(model)
    h = embed(model, ids)
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    masks = layer_masks(model, ids.shape[1], ids.device)
    for layer, (cos, sin), mask in zip(inner.layers, layer_positions(model, h, pos), masks):
        h = layer_fn(layer, h, cos, sin, pos, *mask_for(attention_of(layer), mask))
    return (inner.final_layer_norm if hasattr(inner, "final_layer_norm") else inner.norm)(h)
