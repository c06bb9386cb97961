"""Convert a pretrained Llama-family model into a head-wise FA/GDN hybrid (SPEC.md §8).

:func:`hybridize` builds a new model of a registered hybrid class (``HybridLlamaForCausalLM`` or
``HybridQwen3ForCausalLM`` from :mod:`.modeling_hybrid`, subclasses of the transformers classes) whose
config stores the HeadMask and the :class:`HybridOptions` under ``config.headscope_hybrid``; every
layer's ``self_attn`` is a :class:`HeadwiseHybridAttention` with Q/K/V/O migrated from the teacher. The
teacher is not changed.

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
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.llama import LlamaForCausalLM
from transformers.models.qwen3 import Qwen3ForCausalLM

from ..errors import HeadscopeInputError, InputTypeError
from ..masks import HeadMask, as_mask, check_mask_layers
from ..validate import check_int
from .config import HybridOptions
from .modeling_hybrid import (
    CONFIG_KEY,
    HybridLlamaConfig,
    HybridLlamaForCausalLM,
    HybridQwen3Config,
    HybridQwen3ForCausalLM,
)

# teacher class -> (hybrid config class, hybrid model class, teacher has q_norm/k_norm)
_FAMILIES: dict[type, tuple[type, type, bool]] = {
    LlamaForCausalLM: (HybridLlamaConfig, HybridLlamaForCausalLM, False),
    Qwen3ForCausalLM: (HybridQwen3Config, HybridQwen3ForCausalLM, True),
}

for _cfg_cls, _model_cls, _ in _FAMILIES.values():
    try:
        AutoConfig.register(_cfg_cls.model_type, _cfg_cls)
        AutoModelForCausalLM.register(_cfg_cls, _model_cls)
    except ValueError:  # already registered (module reloaded)
        pass


def check_hybridize_args(model: Any, mask: Any, min_per_layer: Optional[int], options: dict[str, Any]) -> HeadMask:
    """:func:`hybridize`'s arguments, before any weight is copied -> the HeadMask.

    Raises:
        InputTypeError: ``model`` is not a supported family (or already a hybrid); ``mask`` of an
            unknown type.
        HeadscopeInputError: a mask of another geometry, a layer below ``min_per_layer``, an unknown
            or invalid hybrid option, a sliding-window model.
    """
    if not any(type(model) is k for k in _FAMILIES):
        if isinstance(model, (HybridLlamaForCausalLM, HybridQwen3ForCausalLM)):
            raise InputTypeError("this model is already a head-wise hybrid; hybridize its teacher instead")
        raise InputTypeError(
            f"hybridize supports {[c.__name__ for c in _FAMILIES]}, got {type(model).__name__}; "
            "load the model with AutoModelForCausalLM"
        )
    m = as_mask(mask)
    cfg = model.config
    m.check_geometry(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    mpl = int(m.meta.get("min_per_layer", 0) or 0) if min_per_layer is None else min_per_layer
    check_int("min_per_layer", mpl, lo=0)
    check_mask_layers(m, mpl)
    try:
        HybridOptions.from_dict(options)
    except (TypeError, ValueError) as e:
        raise HeadscopeInputError(str(e)) from e
    if getattr(cfg, "use_sliding_window", False):
        raise HeadscopeInputError("sliding-window attention layers are not supported; load the model without sliding window")
    return m


@torch.no_grad()
def head_output_rms(
    model: PreTrainedModel, input_ids: Int[Tensor, "batch time"], attention_mask: Optional[Tensor] = None
) -> Tensor:
    """Float[Tensor, "layer head"] — RMS of each teacher head's output O_{l,h} (the input of o_proj)
    over real tokens and channels of a calibration batch. Used to initialize γ_h (fusion, eq. 13–14)."""
    cfg = model.config
    H = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    rms = torch.zeros(cfg.num_hidden_layers, H)
    keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def hook(mod, args, i=i):
            z = args[0].float().view(*args[0].shape[:-1], H, d)[keep.to(args[0].device)]  # n, H, d
            rms[i] = z.pow(2).mean(dim=(0, 2)).sqrt().cpu()
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(hook))
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
    """Convert a Llama-family causal LM into a head-wise FA/GDN hybrid (SPEC.md §8, section 4.2).

    Args:
        model: a transformers ``LlamaForCausalLM`` (incl. SmolLM2) or ``Qwen3ForCausalLM``; not modified.
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
        ``config.headscope_hybrid`` holds the mask and options.

    Raises (checked first, :func:`check_hybridize_args`):
        InputTypeError (a TypeError and HeadscopeInputError): ``model`` is not a supported family,
            or ``mask`` is of an unknown type.
        HeadscopeInputError (a ValueError): the mask is for another geometry, lists a head twice, or
            leaves a layer with fewer than ``min_per_layer`` FA heads; an unknown or invalid option.
        ImportError: ``gdn_kernel="fla"`` without flash-linear-attention installed.
    """
    mask = check_hybridize_args(model, mask, min_per_layer, options)  # before any weight is copied
    cfg_cls, model_cls, qk_norm = _FAMILIES[type(model)]
    cfg = model.config
    opts = HybridOptions.from_dict(options)
    if opts.gdn_kernel == "fla":
        from .gdn import _import_fla

        _import_fla()

    d = cfg.to_dict()
    for k in ("model_type", "architectures", "transformers_version", "auto_map"):
        d.pop(k, None)
    d[CONFIG_KEY] = {"mask": mask.to_dict(), "options": opts.to_dict(), "qk_norm": qk_norm}
    new_cfg = cfg_cls(**d)
    new_cfg._attn_implementation = "sdpa"
    ref = model.model.layers[0].self_attn.q_proj.weight
    hybrid = model_cls(new_cfg)
    # everything but attention is the teacher's
    sd = {k: v for k, v in model.state_dict().items() if ".self_attn." not in k}
    missing, unexpected = hybrid.load_state_dict(sd, strict=False)
    bad = [k for k in missing if ".self_attn." not in k]
    if bad or unexpected:
        raise RuntimeError(f"weight migration failed: missing {bad[:5]}, unexpected {list(unexpected)[:5]}")
    hybrid.to(device=ref.device, dtype=ref.dtype)
    for t_layer, h_layer in zip(model.model.layers, hybrid.model.layers):
        h_layer.self_attn.migrate_from(t_layer.self_attn)
    if calibration_ids is not None and opts.fusion == "rmsnorm":
        rms = head_output_rms(model, calibration_ids, calibration_mask)
        for i, layer in enumerate(hybrid.model.layers):
            layer.self_attn.gamma.data.copy_(rms[i][:, None].expand_as(layer.self_attn.gamma))
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
