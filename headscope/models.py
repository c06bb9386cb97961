"""Model loading: a model spec -> a hooked model, its tokenizer and its head geometry (:class:`LoadedModel`).

What a spec may name and its geometry read without loading are in :mod:`headscope.model_specs` (re-exported
here); a GGUF file is de-quantized once into a model folder in headscope's cache (:mod:`headscope.gguf_cache`).
The loaded transformers model is wrapped by TransformerLens 4's ``TransformerBridge`` for hooks
(``blocks.{l}.attn.hook_z`` etc.). The patching engine reads the same modules directly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from .arch import unwrap
from .errors import HeadscopeInputError, InputTypeError, SettingError
from .gguf_cache import cached_model, cached_tokenizer
from .model_specs import (  # noqa: F401  (re-exported: headscope.models is where users look for them)
    DEFAULT_MODEL,
    GEMMA3_GGUF,
    Geometry,
    ModelSpecError,
    cache_dir,
    cached_hub_config,
    config_geometry,
    default_gguf_path,
    gemma3_gguf_path,
    geometry_of,
    gguf_geometry,
    join_chunks,
    missing_path,
    packaged,
    resolve_spec,
)
from .validate import check_choice


@dataclass
class LoadedModel:
    """A model ready for patching: the transformers model, the tokenizer and the geometry.

    ``.bridge`` is the TransformerLens ``TransformerBridge`` around the same model, booted on first
    use (it wraps the model's modules in place, adding hook points such as
    ``blocks.{l}.attn.hook_z``). The patching engine needs only ``.hf_model``, so headscope's
    sweeps also run where TransformerLens is not installed.
    """

    hf_model: Any
    tokenizer: Any
    geometry: Geometry
    spec: str
    name: str
    device: torch.device
    dtype: torch.dtype
    info: dict[str, Any] = field(default_factory=dict)
    hub_name: str | None = None
    _bridge: Any = field(default=None, repr=False)

    @property
    def bridge(self) -> Any:
        """The TransformerBridge (TransformerLens 4) wrapping ``hf_model``; booted on first access."""
        if self._bridge is None:
            from transformer_lens.model_bridge import TransformerBridge

            self._bridge = TransformerBridge.boot_transformers(
                self.hub_name or f"headscope/{self.name}",
                hf_model=self.hf_model,
                tokenizer=self.tokenizer,
                device=self.device,
                dtype=self.dtype,
            )
            try:  # before any weight processing can fold them away (knockout's zero ablation needs them)
                self.info["value_bias"] = value_bias(self._bridge, self.geometry.n_heads)
            except AttributeError:  # a bridge without per-block b_V / W_V
                self.info["value_bias"] = None
        return self._bridge

    def provenance(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "model_spec": self.spec,
            "geometry": self.geometry.to_dict(),
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
        }




def check_model(spec: Any, name: str = "model") -> Geometry | None:
    """Resolve a model spec without loading it -> its Geometry (None where the config is unreadable).

    Raises:
        ModelSpecError (a HeadscopeInputError): unknown spec, missing GGUF / directory / config.json,
            a hub id that is not in the local Hugging Face cache.
        InputTypeError: ``spec`` is neither a spec string, a path nor a LoadedModel.
    """
    if isinstance(spec, LoadedModel):
        return spec.geometry
    if not isinstance(spec, (str, os.PathLike)):
        raise InputTypeError(f"{name} must be a model spec (name, directory, .gguf path, hub id) or a LoadedModel, "
                             f"not {type(spec).__name__}")
    path, kw, _ = resolve_spec(spec)
    if "gguf_file" in kw:
        return gguf_geometry(Path(path) / kw["gguf_file"])
    if kw.get("local_files_only"):
        cfg = cached_hub_config(path)
        if cfg is None:
            raise not_cached(spec)
        return config_geometry(cfg)
    return config_geometry(Path(path) / "config.json")


def not_cached(spec: Any) -> ModelSpecError:
    """The error for a spec read as a hub id that the local cache lacks; where its first part is a local folder it
    was a path with a typo: the path's error (:func:`headscope.model_specs.missing_path`)."""
    p = Path(str(spec)).expanduser()
    if p.parent.is_dir() and str(p.parent) not in ("", "."):
        return ModelSpecError(missing_path(p))
    return ModelSpecError(
        f"{str(spec)!r} is no local directory and not in the local Hugging Face cache (headscope never downloads): "
        "check the path, download the hub id yourself (huggingface-cli download ...), or pass a .gguf path"
    )


def is_hybrid(spec: Any) -> bool:
    """Whether a model spec names a saved head-wise hybrid (a converted model folder, or a cached hub id of one):
    its ``config.json`` holds the ``headscope_hybrid`` entry (mask, options, layer specs) that
    :func:`headscope.hybridize` writes. Reads the config only; False for GGUF files and unknown specs.
    A :class:`LoadedModel` is a hybrid when its model's config has the entry."""
    if isinstance(spec, LoadedModel):
        return bool(getattr(spec.hf_model.config, "headscope_hybrid", None))
    try:
        path, kw, _ = resolve_spec(spec)
    except HeadscopeInputError:
        return False
    if "gguf_file" in kw:
        return False
    cfg = cached_hub_config(path) if kw.get("local_files_only") else Path(path) / "config.json"
    try:
        return bool(cfg) and bool(json.loads(Path(cfg).read_text()).get("headscope_hybrid"))
    except (OSError, ValueError, AttributeError):
        return False


def _load_kwargs(spec: str | os.PathLike) -> tuple[str, dict[str, Any], str]:
    """(path, from_pretrained keywords, name) of a spec, transformers' logging quieted; a saved hybrid's model types
    registered (it then loads with headscope's classes, without remote code)."""
    from transformers.utils import logging as hf_logging

    path, kw, name = resolve_spec(spec)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if is_hybrid(spec):
        from .hybrid import register_auto_classes

        register_auto_classes()  # headscope's classes load the folder without remote code
        kw = {**kw, "trust_remote_code": False}
    return path, kw, name


def load_tokenizer(spec: str | os.PathLike = DEFAULT_MODEL) -> Any:
    """The tokenizer of a model spec alone (no weights; a GGUF's read from its metadata, a packaged model's from
    its converted folder in the cache: :mod:`headscope.gguf_cache`).

    Raises:
        ModelSpecError: the spec cannot be resolved locally, or its tokenizer cannot be read.
    """
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path, kw, _ = _load_kwargs(spec)
    try:
        if packaged(spec):
            return cached_tokenizer(Path(path) / kw["gguf_file"])
        return AutoTokenizer.from_pretrained(path, **kw)
    except OSError as e:
        raise ModelSpecError(f"could not load the tokenizer of {spec!r}: {e}") from e


def load_hf(
    spec: str | os.PathLike = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    device_map: str | dict[str, Any] | None = None,
) -> tuple[Any, Any, str]:
    """Load a plain transformers causal LM and its tokenizer (no hooks) -> (model, tokenizer, name).

    ``device_map`` ("auto", "balanced", "sequential" or a {module name: device} dict; needs
    accelerate) spreads the layers over the visible devices, for models that do not fit one GPU;
    ``device`` is then ignored. A packaged model (``"smollm2-135m"``, ``"gemma3-270m"``) is read from its folder
    in the cache, written on its first load (:mod:`headscope.gguf_cache`: the same weights and token ids, ~0.3 s
    instead of ~20 s for SmolLM2-135M on a 2-core CPU).

    Raises:
        ModelSpecError: the spec cannot be resolved locally (message says what to pass instead).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, kw, name = _load_kwargs(spec)
    hybrid = is_hybrid(spec)
    placed = {} if device_map is None else {"device_map": device_map}
    try:
        if packaged(spec):
            gguf = Path(path) / kw["gguf_file"]
            tok, model = cached_tokenizer(gguf), cached_model(gguf, dtype=dtype, **placed)
        else:
            tok = AutoTokenizer.from_pretrained(path, **kw)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw, **placed)
    except OSError as e:
        if kw.get("local_files_only"):
            raise not_cached(spec) from e
        raise ModelSpecError(f"could not load {spec!r}: {e}") from e
    model.eval()
    if hybrid:
        from .hybrid import use_inference

        use_inference(model)  # the hybrid's fast backends (docs/hybrid.md)
    if device_map is None:
        dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model.to(dev)
    return model, tok, name


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device_map(device_map: Any, devices: int = 1, name: str = "device_map") -> None:
    """A known device-map name or a {module: device} dict, accelerate installed, one process.

    Raises:
        HeadscopeInputError: an unknown name, with ``devices`` > 1, or accelerate missing.
    """
    if device_map is None:
        return
    if devices > 1:
        raise HeadscopeInputError(
            "--device-map spreads one model over the GPUs; --devices shards the sweep: use one of them"
        )
    if isinstance(device_map, str):
        check_choice(name, device_map, DEVICE_MAPS, "or pass a {module name: device} dict")
    elif not isinstance(device_map, dict):
        raise SettingError(name, f"{{setting}}={device_map!r}: use one of {DEVICE_MAPS} or a {{module: device}} dict")
    if importlib.util.find_spec("accelerate") is None:
        raise SettingError(name, "{setting} needs accelerate: pip install 'headscope[scale]' (or accelerate)")



def dispatch(hf_model: Any, device_map: str | dict[str, Any], max_memory: dict[Any, Any] | None = None) -> dict[str, Any]:
    """Spread an in-memory transformers model over devices (accelerate), in place -> the device map used.

    Args:
        device_map: a {module name: device} dict, or "auto"/"balanced" (decoder layers balanced over
            the visible GPUs; CPU when there is none), "balanced_low_0", "sequential".
        max_memory: per-device budgets for the string forms ({0: "40GiB", 1: "40GiB"}).

    Raises:
        ValueError: an unknown device-map name. ImportError: accelerate is not installed.
    """
    try:
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.utils import get_balanced_memory
    except ImportError as e:  # pragma: no cover
        raise ImportError("device_map needs accelerate: pip install 'headscope[scale]' (or accelerate)") from e
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAPS:
            raise ValueError(f"device_map={device_map!r}: use one of {DEVICE_MAPS} or a {{module: device}} dict")
        no_split = list(getattr(hf_model, "_no_split_modules", None) or [])
        if not torch.cuda.is_available():
            device_map = {"": "cpu"}
        else:
            if max_memory is None and device_map != "sequential":
                max_memory = get_balanced_memory(
                    hf_model, dtype=next(hf_model.parameters()).dtype, no_split_module_classes=no_split,
                    low_zero=device_map == "balanced_low_0",
                )
            device_map = infer_auto_device_map(hf_model, max_memory=max_memory, no_split_module_classes=no_split)
    dispatch_model(hf_model, device_map=device_map)
    for name, dev in device_map.items():  # make sure every module's weights sit on its device
        if dev != "disk":
            (hf_model.get_submodule(name) if name else hf_model).to(f"cuda:{dev}" if isinstance(dev, int) else dev)
    hf_model.hf_device_map = dict(device_map)
    return dict(device_map)


def _eager_if_softcapped(hf_model: Any) -> None:
    """Attention logit soft-capping (Gemma 2) is computed only by transformers' eager attention: the
    GPU image's transformers 5.17 ran SDPA and silently dropped the cap (the fast engine's self-check
    then refused Gemma 2 there with a 0.32 relative difference at layer 0; eager passed at 1.1e-6), and
    5.24 raises. Switch such a model to eager attention, with a warning."""
    cfg = hf_model.config
    impl = getattr(cfg, "_attn_implementation", None)
    if getattr(cfg, "attn_logit_softcapping", None) and impl not in (None, "eager"):
        warnings.warn(
            f"{type(hf_model).__name__} soft-caps attention logits, which only eager attention computes; "
            f"switching attn_implementation from {impl!r} to 'eager' (load it with attn_implementation='eager' "
            "to silence this)",
            stacklevel=3,
        )
        try:
            hf_model.set_attn_implementation("eager")
        except (AttributeError, ValueError):  # older transformers, or a config the setter refuses
            cfg._attn_implementation = "eager"


def wrap(
    hf_model: Any, tokenizer: Any, name: str = "model", spec: str | None = None, hub_name: str | None = None
) -> LoadedModel:
    """Wrap an already loaded transformers causal LM (and its tokenizer) into a LoadedModel.

    Use this for models built in memory (tests, custom checkpoints). The tokenizer is required:
    without it the bridge would try to fetch one from the hub.
    """
    if tokenizer is None:
        raise ValueError("wrap() needs the model's tokenizer (the bridge would otherwise ask the hub for one)")
    hf_model.eval()
    try:
        param = next(hf_model.parameters())
    except StopIteration as e:  # pragma: no cover
        raise ValueError("model has no parameters") from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(hf_model.config, "architectures", None):
        # a model built from a config has no architectures entry; the bridge picks its adapter from it
        hf_model.config.architectures = [type(hf_model).__name__]
    _eager_if_softcapped(hf_model)
    geom = geometry_of(hf_model.config)
    return LoadedModel(
        hf_model=hf_model,
        tokenizer=tokenizer,
        geometry=geom,
        spec=spec or name,
        name=name,
        device=param.device,
        dtype=param.dtype,
        info={"architecture": type(hf_model).__name__},
        hub_name=hub_name,
    )


def random_family(name: str, tokenizer: Any, seed: int | None = None,
                  shape: tuple[int, int, int, int] | None = None) -> LoadedModel:
    """A :class:`LoadedModel` of family ``name`` with random weights; ``shape`` =
    (layers, d_model, query heads, KV heads), default tiny.

    Raises:
        KeyError: an unknown family (see :data:`headscope.arch.random_models.FAMILIES`).
    """
    from .arch.random_models import FAMILIES, SEEDS, _families

    builders = FAMILIES if shape is None else _families(*shape)
    s = SEEDS.get(name, 0) if seed is None else seed
    return wrap(builders[name](len(tokenizer), s), tokenizer, name=f"random-{name}")


def load_model(
    spec: str | os.PathLike | LoadedModel = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    device_map: str | dict[str, Any] | None = None,
) -> LoadedModel:
    """Load a model for patching.

    Args:
        spec: ``"smollm2-135m"`` (default), ``"gemma3-270m"``, a ``.gguf`` path, a local HF directory, or a cached hub
            id. A :class:`LoadedModel` is returned unchanged.
        device: ``"cpu"``, ``"cuda"``, ... (default: CUDA when available).
        dtype: ``torch.float32`` (default) or ``torch.bfloat16``.
        device_map: spread the layers over devices (see :func:`load_hf`; a model that does not fit
            one GPU); a given :class:`LoadedModel` is dispatched in place (:func:`dispatch`).

    Returns:
        LoadedModel with ``.bridge`` (TransformerBridge), ``.tokenizer`` and ``.geometry``.

    Raises:
        ModelSpecError: unknown spec, missing file, or a hub id that is not cached locally.
    """
    if isinstance(spec, LoadedModel):
        if device_map is None or getattr(spec.hf_model, "hf_device_map", None) is not None:
            return spec  # already placed
        dispatch(spec.hf_model, device_map)
        return wrap(spec.hf_model, spec.tokenizer, name=spec.name, spec=spec.spec, hub_name=spec.hub_name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    hf_model, tok, name = load_hf(spec, device=device, dtype=dtype, device_map=device_map)
    hub_name = {"SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "gemma-3-270m": "google/gemma-3-270m"}.get(name)
    return wrap(hf_model, tok, name=name, spec=str(spec), hub_name=hub_name)


# ---- value biases ------------------------------------------------------------------------------
@torch.no_grad()
def value_bias(bridge: Any, n_heads: int) -> dict[int, Float[Tensor, "hd"]]:
    """Per layer, the constant part of hook_z (flattened over heads) in a TransformerBridge's
    current weights.

    Attention weights sum to 1, so head h's hook_z is (a part that depends on the input) + c[h] at
    every position, with c = b_V + β·W_V: the value bias (under GQA, the head's KV group's) plus the
    value projection of the attention norm's bias β (LayerNorm; none for RMSNorm). Read from the
    bridge's ``blocks[l].attn.b_V`` / ``W_V`` (TransformerLens 4.3), which are the weights that run
    also where weight processing leaves the transformers modules behind (GPT-2's fused c_attn).
    Units: activations of hook_z; tensors on the CPU, float32.

    Raises:
        AttributeError: a bridge without per-block ``attn.b_V`` / ``attn.W_V``.
    """
    out: dict[int, Tensor] = {}
    for layer, blk in enumerate(bridge.blocks):
        b_v = blk.attn.b_V
        w_v = blk.attn.W_V  # [n_kv or n_heads, d_model, d_head]
        c = torch.zeros(w_v.shape[0], w_v.shape[-1], dtype=torch.float64) if b_v is None else b_v.detach().double().cpu()
        beta = getattr(unwrap(getattr(blk, "ln1", None)), "bias", None)
        if isinstance(beta, Tensor):
            c = c + torch.einsum("m,nmd->nd", beta.detach().double().cpu(), w_v.detach().double().cpu())
        out[layer] = c.float().repeat_interleave(n_heads // c.shape[0], 0).flatten()
    return out
