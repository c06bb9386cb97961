"""Convert a pretrained decoder-only model into a head-wise FA/GDN hybrid (SPEC.md §8).

:func:`hybridize` reads the teacher through its architecture adapter (:func:`headscope.arch.adapt`:
per layer the projections with their biases, QK-norm, RoPE or NoPE, the logit scale, the sliding
window, soft-capping) and records what each layer applies as a
:class:`~headscope.hybrid.config.LayerSpec`. It then builds the hybrid class of the teacher's family
(:data:`~headscope.hybrid.modeling_hybrid.FAMILIES`: a subclass of the teacher's transformers class whose
attention modules are :class:`HeadwiseHybridAttention`), copies every weight outside attention and
migrates Q/K/V/O from the adapter's parts. The config stores the HeadMask, the
:class:`HybridOptions` and the layer specs under ``config.headscope_hybrid``. The teacher is not changed.

Families: Llama (SmolLM2), Qwen2 (q/k/v biases), Qwen3 (QK-norm), Mistral (sliding window), Gemma 3
text (sliding and full layers with their own RoPE bases, Gemma's QK-norm and logit scale; embedding
scale, sandwich norms and final soft-cap stay the teacher's code) and GPT-NeoX (fused interleaved
q/k/v, partial rotary, parallel residual). Other families are refused with what is missing
(:func:`unsupported_reason`).

``save_pretrained`` writes the modeling code beside the weights (``auto_map`` in config.json), so the
result loads with ``AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)`` in any process
with torch and transformers, and without ``trust_remote_code`` once ``headscope.hybrid`` has been
imported (this module registers the model types with the auto classes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
from jaxtyping import Int
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from ..errors import HeadscopeInputError, InputTypeError
from ..masks import HeadMask, as_mask, check_mask_layers
from ..validate import check_int
from .config import HybridOptions, LayerSpec
from .modeling_hybrid import (
    CONFIG_KEY,
    FAMILIES,
    attention_name,
    decoder_layers,
)
from .layer import _HeadRMSNorm

HYBRID_CLASSES = tuple(m for _, m in FAMILIES.values())

for _cfg_cls, _model_cls in FAMILIES.values():
    try:
        AutoConfig.register(_cfg_cls.model_type, _cfg_cls)
        AutoModelForCausalLM.register(_cfg_cls, _model_cls)
    except ValueError:  # already registered (module reloaded)
        pass

# what the hybrid layer lacks for the other families the ranking engine adapts
_MISSING = {
    "gpt2": "learned absolute positions and GPT-2's Conv1D c_attn/c_proj attention call (no rotary embedding to give GDN heads)",
    "olmo2": "QK-norm over the whole projection (before the head split): a GDN head cannot keep its share of it",
    "smollm3": "an acceptance test for its NoPE layers and sliding layers (the layer spec expresses both; not verified)",
    "phi3": "an acceptance test for its fused qkv_proj and partial rotary (not verified)",
    "granite": "an acceptance test for its attention/residual/embedding multipliers (not verified)",
    "gemma": "an acceptance test (Gemma 1: not verified)",
    "gemma2": "an acceptance test for its attention soft-capping (the FA path applies it; not verified against the teacher)",
}


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """None when :func:`hybridize` converts ``model``; else what is missing, naming the family."""
    if isinstance(model, HYBRID_CLASSES):
        return "this model is already a head-wise hybrid; hybridize its teacher instead"
    if type(model) in FAMILIES:
        return None
    mtype = str(getattr(getattr(model, "config", None), "model_type", ""))
    why = _MISSING.get(mtype, "no architecture adapter and hybrid class for this family")
    return (f"hybridize supports {sorted(c.__name__ for c in FAMILIES)}; {type(model).__name__} "
            f"(model type {mtype!r}) lacks {why}; load a supported model with AutoModelForCausalLM")


def _same_norm(norm: nn.Module, d: int) -> bool:
    """Whether ``norm`` computes x / RMS(x) · w as :class:`_HeadRMSNorm` does (Qwen3), checked on a
    random input with the module's own weight (Gemma's fp32 · (1 + w) is not)."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if w is None or eps is None or tuple(w.shape) != (d,):
        return False
    ref = _HeadRMSNorm(d, float(eps)).to(device=w.device, dtype=w.dtype)
    ref.weight.data.copy_(w.detach())
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(0)).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        return bool(torch.equal(norm(x), ref(x)))


def layer_spec(parts: Any, teacher_attn: nn.Module, head_dim: int) -> LayerSpec:
    """The :class:`LayerSpec` of one teacher layer from its adapter parts (:class:`headscope.arch.LayerParts`).

    Raises:
        NotImplementedError: something the hybrid layer cannot reproduce (QK-norm over the whole
            projection, bidirectional attention, one of q_norm/k_norm only).
    """
    if (parts.q_norm is None) != (parts.k_norm is None):
        raise NotImplementedError("QK-norm on q or k only")
    if parts.q_norm is not None and not parts.qk_norm_per_head:
        raise NotImplementedError("QK-norm over the whole projection (OLMo 2)")
    if getattr(teacher_attn, "is_causal", True) is False:
        raise NotImplementedError("bidirectional attention (use_bidirectional_attention)")
    qk = None
    if parts.q_norm is not None:
        qk = "rms" if _same_norm(parts.q_norm, head_dim) and _same_norm(parts.k_norm, head_dim) else "teacher"
    return LayerSpec(
        q_bias=parts.q.bias is not None, k_bias=parts.k.bias is not None, v_bias=parts.v.bias is not None,
        o_bias=parts.o.bias is not None, qk_norm=qk, rope=parts.rope is not None, scaling=float(parts.scaling),
        window=int(parts.window) if parts.window else None,
        softcap=float(parts.softcap) if parts.softcap else None,
    )


def check_hybridize_args(model: Any, mask: Any, min_per_layer: Optional[int], options: dict[str, Any]) -> HeadMask:
    """:func:`hybridize`'s arguments, before any weight is copied -> the HeadMask.

    Raises:
        InputTypeError: ``model`` is not a supported family (or already a hybrid); ``mask`` of an
            unknown type.
        HeadscopeInputError: a mask of another geometry, a layer below ``min_per_layer``, an unknown
            or invalid hybrid option.
    """
    why = unsupported_reason(model)
    if why is not None:
        raise InputTypeError(why)
    m = as_mask(mask)
    cfg = model.config
    H = cfg.num_attention_heads
    m.check_geometry(cfg.num_hidden_layers, H, getattr(cfg, "num_key_value_heads", None) or H)
    mpl = int(m.meta.get("min_per_layer", 0) or 0) if min_per_layer is None else min_per_layer
    check_int("min_per_layer", mpl, lo=0)
    check_mask_layers(m, mpl)
    try:
        HybridOptions.from_dict(options)
    except (TypeError, ValueError) as e:
        raise HeadscopeInputError(str(e)) from e
    return m


@torch.no_grad()
def head_output_rms(
    model: PreTrainedModel, input_ids: Int[Tensor, "batch time"], attention_mask: Optional[Tensor] = None
) -> Tensor:
    """Float[Tensor, "layer head"] — RMS of each teacher head's output O_{l,h} (the input of the
    attention output projection, hook_z) over real tokens and channels of a calibration batch. Used to
    initialize γ_h (fusion, eq. 13–14)."""
    from ..arch import attention_out_module

    cfg = model.config
    H = cfg.num_attention_heads
    L = cfg.num_hidden_layers
    rms = torch.zeros(L, H)
    keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    hooks = []
    for i in range(L):
        def hook(mod, args, i=i):
            z = args[0].float()
            z = z.view(*z.shape[:-1], H, z.shape[-1] // H)[keep.to(z.device)]  # n, H, d
            rms[i] = z.pow(2).mean(dim=(0, 2)).sqrt().cpu()
        hooks.append(attention_out_module(model, i).register_forward_pre_hook(hook))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return rms


def hybridize(
    model: PreTrainedModel,
    mask: Union[HeadMask, dict, str, Path],
    *,
    min_per_layer: Optional[int] = None,
    calibration_ids: Optional[Int[Tensor, "batch time"]] = None,
    calibration_mask: Optional[Tensor] = None,
    **options: Any,
) -> PreTrainedModel:
    """Convert a causal LM into a head-wise FA/GDN hybrid (SPEC.md §8, section 4.2).

    Args:
        model: a transformers ``LlamaForCausalLM`` (incl. SmolLM2), ``Qwen2ForCausalLM``,
            ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Gemma3ForCausalLM`` or
            ``GPTNeoXForCausalLM``; not modified.
        mask: a :class:`~headscope.masks.HeadMask` (or its dict / JSON path): per layer the FA heads.
        min_per_layer: every layer must keep at least this many FA heads; default: the mask's
            ``meta["min_per_layer"]`` if present, else 0 (an all-GDN layer is allowed).
        calibration_ids: optional token batch; γ_h of every head is set to the teacher head's output RMS
            on it (:func:`head_output_rms`), so the fused outputs start at the teacher's scale. Without
            it γ_h = 1.
        calibration_mask: padding mask [batch, time] for ``calibration_ids``.
        **options: fields of :class:`HybridOptions` (fa_pos, nope_a, fa_gate, gdn_rope, gdn_conv,
            fusion, norm_eps, gdn_kernel, chunk_size, gdn_span).

    Returns:
        A new hybrid model (same device and dtype as ``model``, eval/train mode copied) whose
        ``config.headscope_hybrid`` holds the mask, options and per-layer specs. An FA head keeps its
        layer's sliding window, logit scale and soft-cap; GDN heads have none of them.

    Raises (checked first, :func:`check_hybridize_args`):
        InputTypeError (a TypeError and HeadscopeInputError): ``model`` is not a supported family
            (the message names what is missing), or ``mask`` is of an unknown type.
        HeadscopeInputError (a ValueError): the mask is for another geometry, lists a head twice, or
            leaves a layer with fewer than ``min_per_layer`` FA heads; an unknown or invalid option.
        ImportError: ``gdn_kernel="fla"`` without flash-linear-attention installed.
        NotImplementedError: a layer applies something the hybrid layer cannot reproduce (named).
    """
    from ..arch import adapt

    mask = check_hybridize_args(model, mask, min_per_layer, options)  # before any weight is copied
    cfg_cls, model_cls = FAMILIES[type(model)]
    cfg = model.config
    H = cfg.num_attention_heads
    opts = HybridOptions.from_dict(options)
    if opts.gdn_kernel == "fla":
        from .gdn import _import_fla

        _import_fla()
    arch = adapt(model)
    teacher_layers = list(decoder_layers(model))
    names = [attention_name(t) for t in teacher_layers]
    d_head = arch.layers[0].o.weight.shape[1] // H
    specs = []
    for i, (parts, t_layer, name) in enumerate(zip(arch.layers, teacher_layers, names)):
        try:
            specs.append(layer_spec(parts, getattr(t_layer, name), d_head))
        except NotImplementedError as e:
            raise NotImplementedError(f"{type(model).__name__} layer {i}: the hybrid layer cannot reproduce {e}") from e

    d = cfg.to_dict()
    for k in ("model_type", "architectures", "transformers_version", "auto_map"):
        d.pop(k, None)
    if (d.get("quantization_config") or {}).get("quant_method") == "gguf":  # de-quantized on load: plain weights
        d.pop("quantization_config")
    d[CONFIG_KEY] = {"mask": mask.to_dict(), "options": opts.to_dict(),
                     "qk_norm": any(s.qk_norm is not None for s in specs),
                     "layers": [s.to_dict() for s in specs], "family": str(cfg.model_type)}
    new_cfg = cfg_cls(**d)
    new_cfg._attn_implementation = "sdpa"
    ref = next(model.parameters())
    hybrid = model_cls(new_cfg)
    # everything but attention is the teacher's
    att = tuple(f".{n}." for n in set(names))
    sd = {k: v for k, v in model.state_dict().items() if not any(a in k for a in att)}
    missing, unexpected = hybrid.load_state_dict(sd, strict=False)
    bad = [k for k in missing if not any(a in k for a in att)]
    if bad or unexpected:
        raise RuntimeError(f"weight migration failed: missing {bad[:5]}, unexpected {list(unexpected)[:5]}")
    hybrid.to(device=ref.device, dtype=ref.dtype)
    for parts, h_layer, name in zip(arch.layers, decoder_layers(hybrid), names):
        getattr(h_layer, name).migrate(parts.q, parts.k, parts.v, parts.o, parts.q_norm, parts.k_norm)
    if calibration_ids is not None and opts.fusion == "rmsnorm":
        rms = head_output_rms(model, calibration_ids, calibration_mask)
        for i, (layer, name) in enumerate(zip(decoder_layers(hybrid), names)):
            g = getattr(layer, name).gamma
            g.data.copy_(rms[i][:, None].expand_as(g))
    if getattr(model, "generation_config", None) is not None:
        hybrid.generation_config = model.generation_config
    hybrid.train(model.training)
    return hybrid


def hybrid_spec(model: PreTrainedModel) -> tuple[HeadMask, HybridOptions]:
    """(HeadMask, HybridOptions) stored in a hybrid model's config."""
    spec = getattr(model.config, CONFIG_KEY, None)
    if not spec:
        raise ValueError("not a headscope hybrid model (config has no 'headscope_hybrid')")
    return HeadMask.from_dict(spec["mask"]), HybridOptions.from_dict(spec["options"])
