"""Architecture adapters: a transformers model -> :class:`~headscope.arch.parts.Arch`.

One function per layout. Each reads what the model varies from its config and modules (per-layer
``layer_types``, ``no_rope_layers``, sliding windows, soft-capping, multipliers, partial rotary,
parallel blocks) and never fills in a default that the model does not state. Whatever an adapter
gets wrong is caught by the engine's build-time self-check against the model's own forward
(:meth:`~headscope.patching.engine.Engine.self_check`).

Layouts:

* ``llama_like``: ``model.model.layers[i].self_attn.{q,k,v,o}_proj`` with ``input_layernorm`` /
  ``post_attention_layernorm`` — Llama, SmolLM2/3, Mistral, Qwen2, Qwen3, Granite, Phi-3 (fused
  ``qkv_proj``), Gemma 2/3 (sandwich norms), OLMo 2 (post-norms, whole-projection QK-norm);
* ``gpt2``: ``transformer.h[i]`` with ``Conv1D`` ``c_attn`` / ``c_proj``, learned positions;
* ``gpt_neox``: ``gpt_neox.layers[i].attention.query_key_value`` (per-head interleaved q|k|v),
  partial rotary, parallel residual.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from .parts import Arch, LayerParts, Proj, Rope, unwrap, weight_view
from .rope_state import fresh_rope


def _linear(m: nn.Module) -> Proj:
    m = unwrap(m)
    return Proj(m.weight, getattr(m, "bias", None), m)


def _rows(p: Proj, lo: int, hi: int, module: nn.Module | None = None) -> Proj:
    """Output rows lo..hi of a projection (a view of the detached weight: it shares the storage, so
    in-place weight edits are seen, and builds no autograd node that a later backward would free)."""
    w, b = p.weight, p.bias
    key = f"rows{lo}:{hi}"
    return Proj(weight_view(w, key, lambda t: t[lo:hi]),
                None if b is None else weight_view(b, key, lambda t: t[lo:hi]), module)


def _conv1d(m: nn.Module) -> Proj:
    """A GPT-2 ``Conv1D`` (y = x @ W + b with W [in, out]) as an [out, in] projection (a transposed view)."""
    m = unwrap(m)
    return Proj(weight_view(m.weight, "t", lambda t: t.t()), m.bias, m)


def _rope_fn(rotary: nn.Module, per_kind: bool) -> Callable[[str, Tensor, Tensor], tuple[Tensor, Tensor]]:
    """cos/sin [S, rotary_dim] for ``positions`` from the model's own rotary module (its bases,
    scaling type and attention factor included); ``per_kind``: the module takes the layer type
    (Gemma 3: one base per layer type). A dynamic RoPE table is the one a freshly built module computes
    for these positions, whatever ran before (:func:`~headscope.arch.rope_state.fresh_rope`)."""
    rotary = unwrap(rotary)

    def rope(kind: str, positions: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        dev = next(iter(rotary.buffers())).device
        args = (like.to(dev) if like.device != dev else like, positions[None].to(dev))
        with fresh_rope(rotary):
            cos, sin = rotary(*args, kind) if per_kind else rotary(*args)
        return cos[0].to(like.device, like.dtype), sin[0].to(like.device, like.dtype)

    return rope


# families whose model builds a sliding-window mask for every ``layer_types[i] == "sliding_attention"``
# layer from ``config.sliding_window``, whatever the attention module's ``sliding_window`` attribute says
# (SmolLM3 leaves that None when ``use_sliding_window`` is False, and still slides through the mask)
_MASK_BY_LAYER_TYPE = ("smollm3", "qwen2", "qwen3")


# families whose attention passes ``attn_logit_softcapping`` to the attention function (soft-capped logits)
_ATTN_SOFTCAP = ("gemma2",)


def _window(cfg: Any, attn: nn.Module, i: int, mtype: str) -> int | None:
    """The layer's sliding window as the model applies it: the mask the family builds for the layer's
    type where it builds it from the config, else the module attribute, else the config. The engine checks
    it against the masks the model passes to each layer (:meth:`~headscope.patching.engine.Engine.self_check`)."""
    types = getattr(cfg, "layer_types", None)
    if mtype in _MASK_BY_LAYER_TYPE and types:
        w = getattr(cfg, "sliding_window", None) if types[i] == "sliding_attention" else None
    elif hasattr(attn, "sliding_window"):
        w = attn.sliding_window
    elif mtype == "mistral":  # Mistral passes config.sliding_window to every layer
        w = getattr(cfg, "sliding_window", None)
    else:
        types = getattr(cfg, "layer_types", None)
        w = cfg.sliding_window if types and types[i] == "sliding_attention" else None
    return int(w) if w else None


def llama_like(hf: nn.Module) -> Arch:
    cfg = hf.config
    mtype = getattr(cfg, "model_type", "")
    inner = hf.model
    gemma = mtype in ("gemma", "gemma2", "gemma3_text", "gemma3")
    per_kind = mtype in ("gemma3_text", "gemma3")
    no_rope = getattr(cfg, "no_rope_layers", None)  # SmolLM3: 1 = RoPE, 0 = NoPE
    types = getattr(cfg, "layer_types", None)
    layers = []
    for i, blk in enumerate(inner.layers):
        blk = unwrap(blk)
        a = unwrap(blk.self_attn)
        if hasattr(a, "qkv_proj"):  # Phi-3: one fused projection, [q | k | v] along the output
            fused = _linear(a.qkv_proj)
            dq = cfg.num_attention_heads * a.head_dim
            dk = cfg.num_key_value_heads * a.head_dim
            q, k, v = _rows(fused, 0, dq), _rows(fused, dq, dq + dk), _rows(fused, dq + dk, dq + 2 * dk)
        else:
            q, k, v = _linear(a.q_proj), _linear(a.k_proj), _linear(a.v_proj)
        use_rope = not (no_rope is not None and not no_rope[i]) and bool(getattr(a, "use_rope", True))
        kind = types[i] if (per_kind and types) else "default"
        if mtype == "olmo2":  # post-norms only; QK-norm over the whole projection
            ln1, ln2 = None, None
            post_attn, post_mlp = unwrap(blk.post_attention_layernorm), unwrap(blk.post_feedforward_layernorm)
        elif gemma and hasattr(blk, "pre_feedforward_layernorm"):  # sandwich norms (Gemma 2/3)
            ln1, ln2 = unwrap(blk.input_layernorm), unwrap(blk.pre_feedforward_layernorm)
            post_attn, post_mlp = unwrap(blk.post_attention_layernorm), unwrap(blk.post_feedforward_layernorm)
        else:
            ln1, ln2 = unwrap(blk.input_layernorm), unwrap(blk.post_attention_layernorm)
            post_attn = post_mlp = None
        layers.append(LayerParts(
            q=q, k=k, v=v, o=_linear(a.o_proj), ln1=ln1, ln2=ln2, mlp=unwrap(blk.mlp),
            scaling=float(getattr(a, "scaling", a.head_dim ** -0.5)),
            rope=Rope(kind) if use_rope else None,
            q_norm=unwrap(getattr(a, "q_norm", None)), k_norm=unwrap(getattr(a, "k_norm", None)),
            qk_norm_per_head=mtype != "olmo2",
            window=_window(cfg, a, i, mtype),
            # Gemma 3's attention keeps config.attn_logit_softcapping as an attribute but never applies it
            softcap=(getattr(a, "attn_logit_softcapping", None) or None) if mtype in _ATTN_SOFTCAP else None,
            post_attn_norm=post_attn, post_mlp_norm=post_mlp,
            residual_multiplier=float(getattr(cfg, "residual_multiplier", 1.0)) if mtype == "granite" else 1.0,
            device=q.weight.device,
        ))
    embed_mod = unwrap(inner.embed_tokens)
    emb_mult = float(getattr(cfg, "embedding_multiplier", 1.0)) if mtype == "granite" else 1.0

    def embed(ids: Tensor, positions: Tensor) -> Tensor:
        h = embed_mod(ids)
        return h * emb_mult if emb_mult != 1.0 else h

    return Arch(
        family=mtype, layers=layers, embed=embed, final_norm=unwrap(inner.norm), lm_head=_linear(hf.lm_head),
        rope_tables=_rope_fn(inner.rotary_emb, per_kind) if hasattr(inner, "rotary_emb") else None,
        logit_divisor=float(getattr(cfg, "logits_scaling", 1.0)) if mtype == "granite" else 1.0,
        final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
        notes={"layer_types": list(types) if types else None,
               "no_rope_layers": list(no_rope) if no_rope is not None else None},
    )


def gpt2(hf: nn.Module) -> Arch:
    cfg = hf.config
    tr = hf.transformer
    d = cfg.hidden_size
    layers = []
    for blk in tr.h:
        blk = unwrap(blk)
        a = unwrap(blk.attn)
        if getattr(a, "reorder_and_upcast_attn", False):
            raise NotImplementedError("GPT-2 with reorder_and_upcast_attn: use the generic (bridge) path")
        fused = _conv1d(a.c_attn)
        q, k, v = (_rows(fused, j * d, (j + 1) * d) for j in range(3))
        layers.append(LayerParts(
            q=q, k=k, v=v, o=_conv1d(a.c_proj), ln1=unwrap(blk.ln_1), ln2=unwrap(blk.ln_2), mlp=unwrap(blk.mlp),
            scaling=float(a.scaling), device=fused.weight.device,
        ))
    wte, wpe = unwrap(tr.wte), unwrap(tr.wpe)

    def embed(ids: Tensor, positions: Tensor) -> Tensor:
        return wte(ids) + wpe(positions.to(ids.device))[None]

    return Arch(family="gpt2", layers=layers, embed=embed, final_norm=unwrap(tr.ln_f), lm_head=_linear(hf.lm_head))


def gpt_neox(hf: nn.Module) -> Arch:
    cfg = hf.config
    inner = hf.gpt_neox
    H = cfg.num_attention_heads
    layers = []
    for blk in inner.layers:
        blk = unwrap(blk)
        a = unwrap(blk.attention)
        fused = _linear(a.query_key_value)
        dh = a.head_size
        # output features are [head, (q | k | v), d_head]: gather each part's rows (a copy)
        idx = torch.arange(H * 3 * dh, device=fused.weight.device).view(H, 3, dh)
        parts = []
        for j in range(3):
            rows = idx[:, j].reshape(-1)
            # a copy (made once per weight version): GPT-NeoX engines must be rebuilt after the weights change
            key = f"neox{j}@{fused.weight._version}"
            parts.append(Proj(weight_view(fused.weight, key, lambda t, r=rows: t[r]),
                              None if fused.bias is None else weight_view(fused.bias, key, lambda t, r=rows: t[r])))
        layers.append(LayerParts(
            q=parts[0], k=parts[1], v=parts[2], o=_linear(a.dense), ln1=unwrap(blk.input_layernorm),
            ln2=unwrap(blk.post_attention_layernorm), mlp=unwrap(blk.mlp), scaling=float(a.scaling),
            rope=Rope("default"), parallel=bool(cfg.use_parallel_residual), device=fused.weight.device,
        ))
    emb = unwrap(inner.embed_in)
    return Arch(family="gpt_neox", layers=layers, embed=lambda ids, pos: emb(ids),
                final_norm=unwrap(inner.final_layer_norm), lm_head=_linear(hf.lm_head),
                rope_tables=_rope_fn(inner.rotary_emb, False))


LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "granite", "phi3", "gemma", "gemma2", "gemma3_text",
              "olmo2")
ADAPTERS: dict[str, Callable[[nn.Module], Arch]] = {
    **{t: llama_like for t in LLAMA_LIKE},
    "gpt2": gpt2,
    "gpt_neox": gpt_neox,
}
