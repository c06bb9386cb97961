"""Convert a pretrained decoder-only model into a head-wise FA/GDN hybrid (SPEC.md §8), and load a saved one.

:func:`hybridize` reads the teacher through its architecture adapter (:func:`headscope.arch.adapt`), records what each
layer applies as a :class:`~headscope.hybrid.config.LayerSpec`, builds the hybrid class of the teacher's family
(:func:`~headscope.hybrid.modeling_hybrid.family_classes`), copies every weight outside attention and migrates
Q/K/V/O (:func:`migrate`); the teacher is not changed. Families: Llama (SmolLM2), Qwen2, Qwen3, Mistral, Gemma 3
text, GPT-NeoX; others are refused with what is missing (:func:`unsupported_reason`). :func:`load` loads a saved
hybrid with headscope's classes and attaches the fast backends (docs/hybrid.md, "Saving and loading").
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
from .modeling_hybrid import CONFIG_KEY, FAMILY_BASES, attention_name, decoder_layers, family_classes
from .layer import _HeadRMSNorm
from .inference.inference_config import DEFAULT, InferenceConfig, use_inference


def register_auto_classes() -> None:
    """Register the hybrid model types (``headscope_hybrid_llama``, ...) with transformers' ``AutoConfig`` and
    ``AutoModelForCausalLM``, so that ``AutoModelForCausalLM.from_pretrained(d)`` loads a saved hybrid with headscope's
    classes without ``trust_remote_code``. Explicit (done by :func:`load`): importing headscope changes nothing in
    transformers."""
    for family in FAMILY_BASES:
        cfg_cls, model_cls = family_classes(family)
        try:
            AutoConfig.register(cfg_cls.model_type, cfg_cls)
            AutoModelForCausalLM.register(cfg_cls, model_cls)
        except ValueError:  # already registered
            pass


def load(path: Union[str, Path], config: InferenceConfig = DEFAULT, **kwargs: Any) -> PreTrainedModel:
    """A saved hybrid (``save_pretrained``'s directory) with headscope's classes and fast backends: the model types
    registered (:func:`register_auto_classes`), ``AutoModelForCausalLM.from_pretrained(path, **kwargs)``, then
    :func:`~headscope.hybrid.use_inference` with ``config``. Kernels the saved options ask for that are not installed
    (fla, flash-attn) are replaced by PyTorch's, with a warning.

    Raises:
        HeadscopeInputError: ``config`` names a backend that does not apply to the model.
        OSError: as ``from_pretrained``.
    """
    register_auto_classes()
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    use_inference(model, config)
    return model


def family_of(model: nn.Module) -> Optional[str]:
    """The hybrid family (a key of :data:`~headscope.hybrid.modeling_hybrid.FAMILY_BASES`) of a transformers teacher,
    or None: the class must be transformers' own (not a subclass)."""
    name, mod = type(model).__name__, type(model).__module__
    return next((f for f, (_, m) in FAMILY_BASES.items() if m == name and mod.startswith("transformers.")), None)

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
    if getattr(getattr(model, "config", None), CONFIG_KEY, None):
        return "this model is already a head-wise hybrid; hybridize its teacher instead"
    if family_of(model) is not None:
        return None
    mtype = str(getattr(getattr(model, "config", None), "model_type", ""))
    why = _MISSING.get(mtype, "no architecture adapter and hybrid class for this family")
    return (f"hybridize supports {sorted(m for _, m in FAMILY_BASES.values())}; {type(model).__name__} "
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
    calibration_mask: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None,
    **options: Any,
) -> PreTrainedModel:
    """Convert a causal LM into a head-wise FA/GDN hybrid (SPEC.md §8, section 4.2).

    Args:
        model: a transformers ``LlamaForCausalLM`` (incl. SmolLM2), ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
            ``MistralForCausalLM``, ``Gemma3ForCausalLM`` or ``GPTNeoXForCausalLM``; not modified.
        mask: a :class:`~headscope.masks.HeadMask` (or its dict / JSON path): per layer the FA heads.
        min_per_layer: least FA heads per layer; default the mask's ``meta["min_per_layer"]``, else 0.
        calibration_ids, calibration_mask: a token batch (and its padding mask) on which γ_h is set to the teacher
            head's output RMS (:func:`head_output_rms`); without it γ_h = 1.
        **options: fields of :class:`HybridOptions`.

    Returns:
        A new hybrid (the teacher's device and mode, ``dtype`` or the teacher's; the default backends attached,
        ``use_inference``) whose ``config.headscope_hybrid`` holds the mask, options and layer specs. An FA head keeps
        its layer's sliding window, logit scale and soft-cap; GDN heads have none.

    Raises (checked first, :func:`check_hybridize_args`):
        InputTypeError: an unsupported family (what is missing named) or mask type.
        HeadscopeInputError: a mask of another geometry, a head twice, a layer below ``min_per_layer``, a bad option.
        ImportError: ``gdn_kernel="fla"`` without flash-linear-attention. NotImplementedError: a layer applies
        something the hybrid layer cannot reproduce (named).
    """
    from ..arch import adapt

    mask = check_hybridize_args(model, mask, min_per_layer, options)  # before any weight is copied
    cfg_cls, model_cls = family_classes(family_of(model))
    cfg = model.config
    H = cfg.num_attention_heads
    opts = HybridOptions.from_dict(options)
    if opts.gdn_kernel == "fla":
        from .gdn_kernels import _import_fla

        _import_fla()
    arch = adapt(model)
    names = [attention_name(t) for t in decoder_layers(model)]
    specs = _layer_specs(model, arch, names)
    ref = next(model.parameters())
    hybrid = model_cls(_hybrid_config(cfg, cfg_cls, mask, opts, specs))
    _copy_outside_attention(model, hybrid, names)
    hybrid.to(device=ref.device, dtype=dtype or ref.dtype)
    for parts, h_layer, name in zip(arch.layers, decoder_layers(hybrid), names):
        migrate(getattr(h_layer, name), parts.q, parts.k, parts.v, parts.o, parts.q_norm, parts.k_norm)
    if calibration_ids is not None and opts.fusion == "rmsnorm":
        rms = head_output_rms(model, calibration_ids, calibration_mask)
        for i, (layer, name) in enumerate(zip(decoder_layers(hybrid), names)):
            g = getattr(layer, name).gamma
            g.data.copy_(rms[i][:, None].expand_as(g))
    if getattr(model, "generation_config", None) is not None:
        hybrid.generation_config = model.generation_config
    hybrid.train(model.training)
    use_inference(hybrid)  # the fast backends the default InferenceConfig chooses
    return hybrid


def _layer_specs(model: Any, arch: Any, names: list[str]) -> list[LayerSpec]:
    """Each teacher layer's :class:`LayerSpec` (:func:`layer_spec`). Raises NotImplementedError naming the layer."""
    d_head = arch.layers[0].o.weight.shape[1] // model.config.num_attention_heads
    specs = []
    for i, (parts, t_layer, name) in enumerate(zip(arch.layers, decoder_layers(model), names)):
        try:
            specs.append(layer_spec(parts, getattr(t_layer, name), d_head))
        except NotImplementedError as e:
            raise NotImplementedError(f"{type(model).__name__} layer {i}: the hybrid layer cannot reproduce {e}") from e
    return specs


def _hybrid_config(cfg: Any, cfg_cls: type, mask: HeadMask, opts: HybridOptions, specs: list[LayerSpec]) -> Any:
    """The hybrid's config: the teacher's, with ``headscope_hybrid`` = mask, options, layer specs."""
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
    return new_cfg


def _copy_outside_attention(model: Any, hybrid: Any, names: list[str]) -> None:
    """Every weight but attention's, from the teacher. Raises RuntimeError when the two do not match."""
    att = tuple(f".{n}." for n in set(names))
    sd = {k: v for k, v in model.state_dict().items() if not any(a in k for a in att)}
    missing, unexpected = hybrid.load_state_dict(sd, strict=False)
    bad = [k for k in missing if not any(a in k for a in att)]
    if bad or unexpected:
        raise RuntimeError(f"weight migration failed: missing {bad[:5]}, unexpected {list(unexpected)[:5]}")


def hybrid_spec(model: PreTrainedModel) -> tuple[HeadMask, HybridOptions]:
    """(HeadMask, HybridOptions) stored in a hybrid model's config."""
    spec = getattr(model.config, CONFIG_KEY, None)
    if not spec:
        raise ValueError("not a headscope hybrid model (config has no 'headscope_hybrid')")
    return HeadMask.from_dict(spec["mask"]), HybridOptions.from_dict(spec["options"])


@torch.no_grad()
def migrate_from(layer: Any, teacher: nn.Module) -> None:
    """Copy Q/K/V/O (and q_norm/k_norm) into hybrid ``layer`` from a Llama-style transformers attention module
    (``q_proj``/``k_proj``/``v_proj``/``o_proj``) of the same geometry; see :func:`migrate`.

    Raises:
        ValueError: the teacher has no such projections, or not this layer's shapes.
    """
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(teacher, name):
            raise ValueError(f"teacher attention has no {name}; pass its projections to migrate()")
    migrate(layer, teacher.q_proj, teacher.k_proj, teacher.v_proj, teacher.o_proj, getattr(teacher, "q_norm", None),
            getattr(teacher, "k_norm", None))


def _put(layer: Any, dst: nn.Linear, w: Tensor, b: Optional[Tensor], name: str) -> None:
    if (dst.bias is None) != (b is None):
        raise ValueError(f"layer {layer.layer_idx}: {name} bias is {'missing' if b is None else 'unexpected'} "
                         f"in the teacher (spec {layer.spec})")
    dst.weight.copy_(w)
    if b is not None:
        dst.bias.copy_(b)


@torch.no_grad()
def migrate(layer: Any, q: Any, k: Any, v: Any, o: Any, q_norm: Optional[nn.Module] = None,
            k_norm: Optional[nn.Module] = None) -> None:
    """Copy the teacher's projections into hybrid ``layer``: each of q, k, v, o has ``weight`` [out, in] and
    ``bias`` [out] or None (an ``nn.Linear`` or an adapter's ``Proj``); q_norm/k_norm: its QK-norm modules.

    K/V of kept KV groups go to ``k_proj``/``v_proj``; each GDN head gets a copy of its KV group's K/V rows (MHA
    expansion, h → group h // (n_heads / n_kv_heads)).

    Raises:
        ValueError: shapes that are not this layer's, a bias the layer has and the teacher lacks (or the reverse),
            QK-norm on one side only.
    """
    d, rep = layer.head_dim, layer.n_heads // layer.n_kv_heads
    if tuple(q.weight.shape) != tuple(layer.q_proj.weight.shape) or k.weight.shape[0] != layer.n_kv_heads * d:
        raise ValueError(f"teacher attention shapes q {tuple(q.weight.shape)}, k {tuple(k.weight.shape)} do not match "
                         f"the hybrid layer ({layer.n_heads} heads, {layer.n_kv_heads} KV heads, head_dim {d})")

    def rows(p: Any, groups: Any) -> tuple[Tensor, Optional[Tensor]]:
        idx = torch.cat([torch.arange(g * d, (g + 1) * d) for g in groups]).to(p.weight.device)
        return p.weight[idx], (p.bias[idx] if p.bias is not None else None)

    _put(layer, layer.q_proj, q.weight, q.bias, "q")
    _put(layer, layer.o_proj, o.weight, o.bias, "o")
    if layer.kv_keep:
        _put(layer, layer.k_proj, *rows(k, layer.kv_keep), "k")
        _put(layer, layer.v_proj, *rows(v, layer.kv_keep), "v")
    if layer.gdn_heads:
        groups = [h // rep for h in layer.gdn_heads]
        _put(layer, layer.gdn_k_proj, *rows(k, groups), "k")
        _put(layer, layer.gdn_v_proj, *rows(v, groups), "v")
    if (layer.q_norm is None) != (q_norm is None):
        raise ValueError(f"layer {layer.layer_idx}: QK-norm in {'the teacher' if q_norm is not None else 'the hybrid'} "
                         "only; build the layer from the teacher's LayerSpec")
    if layer.q_norm is not None:
        layer.q_norm.load_state_dict(q_norm.state_dict())
        layer.k_norm.load_state_dict(k_norm.state_dict())
