"""transformers classes of the head-wise hybrid: one config and causal-LM class per teacher family.

Each subclasses the teacher's own transformers class (``HybridQwen2ForCausalLM`` is a ``Qwen2ForCausalLM``), so
everything outside attention is the teacher's code; only each decoder layer's attention module becomes a
:class:`HeadwiseHybridAttention` built from ``config.headscope_hybrid`` (``mask``: a HeadMask dict; ``options``:
HybridOptions; ``layers``: one LayerSpec dict per layer). The classes differ only in their bases
(:data:`FAMILY_BASES`), imported when a class is first asked for (module ``__getattr__``).

This module and its relative imports are the hybrid's remote code, the reference model only: ``save_pretrained``
copies them beside the weights with ``auto_map``, so a saved hybrid runs exactly with torch and transformers alone
(``AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)``). headscope's fast backends attach from the
installed package (``model.backends`` / ``layer.backends``: ``headscope.hybrid.load``, ``hybridize``,
``use_inference``). ``A_log`` and ``dt_bias`` stay fp32 when loaded in bf16/fp16 (``_keep_in_fp32_modules_strict``).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from typing import Any, Optional

from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel, StaticCache

from .cache import HybridCache
from .config import HybridOptions, LayerSpec
from .layer import HeadwiseHybridAttention

CONFIG_KEY = "headscope_hybrid"


def spec_fa_heads(config: Any) -> list[tuple[int, ...]]:
    """FA heads of every layer (one tuple of query-head indices per layer), read from ``config.headscope_hybrid["mask"]``.

    Raises:
        ValueError: no hybrid entry, or a mask that is not a HeadMask dict of this config's geometry.
    """
    spec = getattr(config, CONFIG_KEY, None)
    if not spec:
        raise ValueError(f"{type(config).__name__} has no '{CONFIG_KEY}' entry (mask and options); "
                         "create hybrids with headscope.hybridize(model, mask)")
    mask = spec["mask"]
    if str(mask.get("format", "")).split("/")[0] != "headscope.HeadMask":
        raise ValueError(f"config.{CONFIG_KEY}['mask'] is not a HeadMask dict (no 'format': 'headscope.HeadMask/1')")
    H = int(config.num_attention_heads)
    want = (int(config.num_hidden_layers), H, int(getattr(config, "num_key_value_heads", None) or H))
    got = (int(mask["n_layers"]), int(mask["n_heads"]), int(mask["n_kv_heads"]))
    if got != want:
        raise ValueError(f"the stored mask is for {got[0]} layers x {got[1]} heads ({got[2]} KV heads) but the config "
                         f"has {want[0]} x {want[1]} ({want[2]} KV heads)")
    return [tuple(int(h) for h in mask["fa_heads"].get(str(i), [])) for i in range(want[0])]


ATTENTION_NAMES = ("self_attn", "attention")  # the decoder layer's attention attribute (GPT-NeoX: attention)
KEEP_IN_FP32 = ["A_log", "dt_bias"]  # GDN decay parameters: never rounded to bf16 / fp16 on load


def decoder_layers(model: nn.Module) -> Any:
    """The decoder layers of a supported causal LM (``model.layers`` or ``gpt_neox.layers``)."""
    for inner in ("model", "gpt_neox"):
        body = getattr(model, inner, None)
        if body is not None and hasattr(body, "layers"):
            return body.layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def attention_name(layer: nn.Module) -> str:
    """The attribute of a decoder layer that holds its attention module."""
    for name in ATTENTION_NAMES:
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    raise ValueError(f"{type(layer).__name__} has none of the attention attributes {ATTENTION_NAMES}")


def layer_specs(config: Any) -> list[LayerSpec]:
    """One :class:`LayerSpec` per layer from ``config.headscope_hybrid["layers"]``; older saves without
    it (Llama / Qwen3 only) get ``attention_bias`` on all four projections and ``qk_norm``."""
    spec = getattr(config, CONFIG_KEY)
    stored = spec.get("layers")
    n = int(config.num_hidden_layers)
    if stored is not None:
        if len(stored) != n:
            raise ValueError(f"config.{CONFIG_KEY}['layers'] has {len(stored)} entries for {n} layers")
        return [LayerSpec.from_dict(d) for d in stored]
    bias = bool(getattr(config, "attention_bias", False))
    qk = "rms" if spec.get("qk_norm", False) else None
    return [LayerSpec(q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias, qk_norm=qk)] * n


def install_hybrid_attention(model: PreTrainedModel) -> None:
    """Replace every decoder layer's attention module by a :class:`HeadwiseHybridAttention` built from
    ``model.config.headscope_hybrid`` (device and dtype of the module it replaces; a ``qk_norm="teacher"`` layer keeps
    copies of its ``q_norm``/``k_norm``). Raises ValueError as :func:`spec_fa_heads` / :func:`layer_specs`."""
    cfg = model.config
    fa_heads, opts = spec_fa_heads(cfg), HybridOptions.from_dict(getattr(cfg, CONFIG_KEY)["options"])
    for i, (layer, spec) in enumerate(zip(decoder_layers(model), layer_specs(cfg))):
        name = attention_name(layer)
        old = getattr(layer, name)
        norms = (copy.deepcopy(old.q_norm), copy.deepcopy(old.k_norm)) if spec.qk_norm == "teacher" else None
        w = next(old.parameters())
        new = HeadwiseHybridAttention(cfg, i, fa_heads[i], opts, spec=spec, norms=norms)
        setattr(layer, name, new.to(device=w.device, dtype=w.dtype))


def hybrid_cache_for(model: PreTrainedModel, cache: Any, use_cache: bool, initial_len: int = 0) -> Any:
    """The cache a hybrid model's layers get in place of the one transformers made or was given: None with
    ``use_cache`` or an empty ``DynamicCache`` → a growing :class:`HybridCache` (first allocation ≥ ``initial_len``);
    an empty ``StaticCache`` → ``HybridCache(max_len=max(its length, initial_len), static=True)``; anything else as it is."""
    if cache is None:
        return HybridCache(model.config, initial_len=initial_len) if use_cache else None
    if type(cache) is DynamicCache and cache.get_seq_length() == 0:
        return HybridCache(model.config, initial_len=initial_len)
    if type(cache) is StaticCache and int(cache.get_seq_length()) == 0:
        return HybridCache(model.config, max_len=max(int(cache.get_max_length()), initial_len), static=True)
    return cache


def _base_model_cache_hook(module: Any, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """Forward pre-hook of a hybrid's base model (``model.model``): the causal LM's cache swap
    (:func:`hybrid_cache_for`) for a call of the base model alone. A cache passed positionally is left as it is."""
    key, use = _cache_kwarg(type(module)), kwargs.get("use_cache")
    cache = kwargs.get(key, kwargs.get("past_key_values"))
    new = None if len(args) > 1 else hybrid_cache_for(module, cache, module.config.use_cache if use is None else use)
    if new is cache or new is None:
        return None
    return args, {**{k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}, key: new}


_base_model_cache_hook.headscope_own = True  # not a user's hook: the fast model step may run beside it


def _cache_kwarg(model_base: type) -> str:
    """The name the teacher's forward gives its cache argument (``cache`` in newer transformers)."""
    return "cache" if "cache" in inspect.signature(model_base.forward).parameters else "past_key_values"


def _hybrid_classes(family: str, config_base: type, model_base: type) -> tuple[type, type]:
    """The (config, causal-LM) classes of the hybrid of ``model_base`` (model type ``headscope_hybrid_<family>``).

    Beside the attention layers, the class changes the teacher's ``forward`` and ``generate``: they give the layers a
    :class:`HybridCache` where transformers would make or pass an empty ``DynamicCache`` / ``StaticCache``
    (:func:`hybrid_cache_for`); with headscope's backends attached (``self.backends``) a decode step may be computed
    by its ``captured_decode`` backend."""
    key = _cache_kwarg(model_base)
    cfg_cls = type(f"Hybrid{family}Config", (config_base,), {
        "__module__": __name__, "model_type": f"headscope_hybrid_{family.lower()}",
        "__doc__": f"{config_base.__name__} of a head-wise hybrid; ``headscope_hybrid`` = mask, options, layers.",
    })

    def __init__(self: Any, config: Any) -> None:
        model_base.__init__(self, config)
        self.backends = None  # headscope's fast backends, attached by headscope.hybrid.use_inference
        install_hybrid_attention(self)
        self.base_model.register_forward_pre_hook(_base_model_cache_hook, with_kwargs=True)

    def forward(self: Any, input_ids: Optional[Tensor] = None, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.pop("cache", None)
        old = kwargs.pop("past_key_values", None)
        cache = cache if cache is not None else old
        use_cache = kwargs.get("use_cache")
        cache = hybrid_cache_for(self, cache, self.config.use_cache if use_cache is None else use_cache)
        if cache is not None:
            kwargs[key] = cache
        if self.backends is not None and isinstance(cache, HybridCache) and not args:  # headscope's captured decode
            out = self.backends(self, input_ids, cache, kwargs)
            if out is not None:
                return out
        return model_base.forward(self, input_ids, *args, **kwargs)

    def _prepare_cache_for_generation(self: Any, generation_config: Any, model_kwargs: dict, *args: Any,
                                      **kwargs: Any) -> Any:
        out = model_base._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)
        n = kwargs.get("max_cache_length", args[-1] if args and isinstance(args[-1], int) else 0)
        for name in ("cache", "past_key_values"):
            if model_kwargs.get(name) is not None:
                model_kwargs[name] = hybrid_cache_for(self, model_kwargs[name], True, initial_len=n)
        return out

    forward.__doc__ = model_base.forward.__doc__
    forward.__signature__ = inspect.signature(model_base.forward)  # generate reads it (logits_to_keep, ...)
    model_cls = type(f"Hybrid{family}ForCausalLM", (model_base,), {
        "__module__": __name__, "config_class": cfg_cls, "__init__": __init__, "forward": forward,
        "_prepare_cache_for_generation": _prepare_cache_for_generation,
        "_keep_in_fp32_modules_strict": KEEP_IN_FP32,
        "__doc__": f"{model_base.__name__} whose attention layers are HeadwiseHybridAttention.",
    })
    return cfg_cls, model_cls


# family -> (transformers config class, causal-LM class), imported on first use
FAMILY_BASES = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM"),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "Mistral": ("MistralConfig", "MistralForCausalLM"),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "GPTNeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
}
_built: dict[str, tuple[type, type]] = {}


def family_classes(family: str) -> tuple[type, type]:
    """(hybrid config class, hybrid causal-LM class) of a family of :data:`FAMILY_BASES`, built on first use; their
    ``save_pretrained`` writes ``auto_map`` and copies this module (and its relative imports) beside the weights."""
    if family not in _built:
        transformers = importlib.import_module("transformers")
        cfg_cls, model_cls = _hybrid_classes(family, *(getattr(transformers, n) for n in FAMILY_BASES[family]))
        cfg_cls.register_for_auto_class("AutoConfig")
        model_cls.register_for_auto_class("AutoModelForCausalLM")
        _built[family] = (cfg_cls, model_cls)
    return _built[family]


def __getattr__(name: str) -> type:
    """``Hybrid<Family>Config`` / ``Hybrid<Family>ForCausalLM`` (what ``auto_map`` names), built on first access."""
    for family in FAMILY_BASES:
        if name in (f"Hybrid{family}Config", f"Hybrid{family}ForCausalLM"):
            return family_classes(family)[name.endswith("ForCausalLM")]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
