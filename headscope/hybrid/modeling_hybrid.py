"""transformers classes of the head-wise hybrid: config and causal-LM classes for the Llama and Qwen3 families.

This module and the modules it imports relatively (``layer``, ``fast``, ``rope``, ``attn``, ``gdn``, ``config``, ``shapes``)
are the hybrid's *remote code*: ``save_pretrained`` copies them beside the weights and writes
``auto_map`` into ``config.json`` (the classes are registered for ``AutoConfig`` and
``AutoModelForCausalLM`` below), so a saved hybrid loads in any process that has torch and
transformers::

    AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)   # headscope not needed

and, after ``import headscope`` (which registers the model types), without ``trust_remote_code``.
The modules therefore import nothing from headscope outside this folder and nothing beyond torch and
transformers at top level (jaxtyping, fla and flash-attn are optional).

The config stores the mask and the :class:`~headscope.hybrid.config.HybridOptions` under
``config.headscope_hybrid`` = {"mask": HeadMask dict, "options": options dict, "qk_norm": bool}.
When a saved model asks for a kernel that is not installed (``gdn_kernel="fla"`` without
flash-linear-attention, ``fa_kernel="flash_attn"`` without flash-attn) it is loaded with the PyTorch
path instead (a warning says so; ``config.headscope_hybrid`` keeps the saved choice).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from transformers import PreTrainedModel
from transformers.models.llama import LlamaConfig, LlamaForCausalLM
from transformers.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

from .attn import flash_attn_available
from .config import HybridOptions
from .gdn import fla_available
from .layer import HeadwiseHybridAttention

CONFIG_KEY = "headscope_hybrid"


def spec_fa_heads(config: Any) -> list[tuple[int, ...]]:
    """FA heads of every layer, read from ``config.headscope_hybrid["mask"]`` (a HeadMask dict).

    Returns:
        one tuple of query-head indices per layer (``num_hidden_layers`` tuples).

    Raises:
        ValueError: the config has no hybrid entry, or its mask is not a HeadMask dict for this
            config's geometry (layers, heads, KV heads).
    """
    spec = getattr(config, CONFIG_KEY, None)
    if not spec:
        raise ValueError(
            f"{type(config).__name__} has no '{CONFIG_KEY}' entry (mask and options); "
            "create hybrids with headscope.hybridize(model, mask)"
        )
    mask = spec["mask"]
    if str(mask.get("format", "")).split("/")[0] != "headscope.HeadMask":
        raise ValueError(f"config.{CONFIG_KEY}['mask'] is not a HeadMask dict (no 'format': 'headscope.HeadMask/1')")
    want = (int(config.num_hidden_layers), int(config.num_attention_heads), int(config.num_key_value_heads))
    got = (int(mask["n_layers"]), int(mask["n_heads"]), int(mask["n_kv_heads"]))
    if got != want:
        raise ValueError(
            f"the stored mask is for {got[0]} layers x {got[1]} heads ({got[2]} KV heads) but the config has "
            f"{want[0]} x {want[1]} ({want[2]} KV heads)"
        )
    return [tuple(int(h) for h in mask["fa_heads"].get(str(i), [])) for i in range(want[0])]


def runnable_options(options: HybridOptions) -> HybridOptions:
    """``options`` with kernels that are not installed replaced by the PyTorch ones (with a warning):
    ``gdn_kernel="fla"`` → ``"torch"`` without flash-linear-attention, ``fa_kernel="flash_attn"`` →
    ``"sdpa"`` without flash-attn. Other options are returned unchanged."""
    swap: dict[str, str] = {}
    if options.gdn_kernel == "fla" and not fla_available():
        swap["gdn_kernel"] = "torch"
    if options.fa_kernel == "flash_attn" and not flash_attn_available():
        swap["fa_kernel"] = "sdpa"
    if not swap:
        return options
    warnings.warn(
        "the saved hybrid asks for kernels that are not installed "
        + ", ".join(f"{k}={getattr(options, k)!r}" for k in swap)
        + "; using " + ", ".join(f"{k}={v!r}" for k, v in swap.items())
        + " (PyTorch). Install flash-linear-attention / flash-attn for the fast kernels.",
        stacklevel=3,
    )
    return dataclasses.replace(options, **swap)


def install_hybrid_attention(model: PreTrainedModel) -> None:
    """Replace every decoder layer's ``self_attn`` by a :class:`HeadwiseHybridAttention` built from
    ``model.config.headscope_hybrid`` (same device and dtype as the module it replaces; the weights are
    the layer's initial values until loaded or migrated).

    Raises:
        ValueError: as :func:`spec_fa_heads`, or an invalid stored option.
    """
    cfg = model.config
    fa_heads = spec_fa_heads(cfg)
    spec = getattr(cfg, CONFIG_KEY)
    opts = runnable_options(HybridOptions.from_dict(spec["options"]))
    qk_norm = bool(spec.get("qk_norm", False))
    for i, layer in enumerate(model.model.layers):
        old = layer.self_attn
        layer.self_attn = HeadwiseHybridAttention(cfg, i, fa_heads[i], opts, qk_norm=qk_norm).to(
            device=old.q_proj.weight.device, dtype=old.q_proj.weight.dtype
        )


class HybridLlamaConfig(LlamaConfig):
    """LlamaConfig of a head-wise hybrid; ``headscope_hybrid`` = {"mask", "options", "qk_norm"}."""

    model_type = "headscope_hybrid_llama"


class HybridQwen3Config(Qwen3Config):
    """Qwen3Config of a head-wise hybrid; ``headscope_hybrid`` = {"mask", "options", "qk_norm"}."""

    model_type = "headscope_hybrid_qwen3"


class HybridLlamaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose attention layers are :class:`HeadwiseHybridAttention`."""

    config_class = HybridLlamaConfig

    def __init__(self, config: HybridLlamaConfig):
        super().__init__(config)
        install_hybrid_attention(self)


class HybridQwen3ForCausalLM(Qwen3ForCausalLM):
    """Qwen3ForCausalLM whose attention layers are :class:`HeadwiseHybridAttention`."""

    config_class = HybridQwen3Config

    def __init__(self, config: HybridQwen3Config):
        super().__init__(config)
        install_hybrid_attention(self)


# save_pretrained writes auto_map and copies this module (and its relative imports) beside the weights
for _cfg_cls, _model_cls in ((HybridLlamaConfig, HybridLlamaForCausalLM), (HybridQwen3Config, HybridQwen3ForCausalLM)):
    _cfg_cls.register_for_auto_class("AutoConfig")
    _model_cls.register_for_auto_class("AutoModelForCausalLM")
