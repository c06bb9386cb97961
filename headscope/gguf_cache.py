"""The packaged GGUF models de-quantized once into plain model folders in headscope's cache.

transformers reads a GGUF file by parsing its metadata (for SmolLM2-135M a 49,152-entry vocabulary, three
times: config, tokenizer, weights) and de-quantizing every tensor: about 20 s per load of SmolLM2-135M on a
2-core CPU, 8 s for its tokenizer alone. The first load of a packaged model (``"smollm2-135m"``,
``"gemma3-270m"``: GGUF files that installed packages ship) writes what transformers made of it into
``cache_dir()/gguf/<stem>-<key>/``:

* ``tokenizer/``: the tokenizer's files (``tokenizer.json``, its config and chat template);
* ``model/``: ``config.json`` and ``model.safetensors`` (float32, as de-quantized: 0.5 GB for SmolLM2-135M).

Later loads read these folders (about 0.3 s) and give the same weights bit for bit and the same token ids;
the tokenizer's and the config's ``name_or_path`` stay the GGUF's folder, as a direct load gives. ``key`` hashes
the GGUF's resolved path, size and modification time and the transformers version, so a reinstalled package or
another converter writes a new folder. Each folder is written beside its place and renamed into it, so a crash or
two processes loading at once never leave half a folder; where the cache cannot be written (read-only, full),
the GGUF is read directly, as without the cache. Reading the folders runs no code (JSON and safetensors).
A ``.gguf`` path given by the user is read directly each time (no copy of an arbitrary model is written).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from .model_specs import cache_dir


def gguf_folder(gguf: str | os.PathLike) -> Path:
    """Where the converted folders of a GGUF file live: ``cache_dir()/gguf/<stem>-<16 hex of its key>``."""
    import transformers

    p = Path(gguf).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}".encode()).hexdigest()
    return cache_dir() / "gguf" / f"{p.stem}-{key[:16]}"


def _written(target: Path, write: Callable[[Path], None]) -> Path:
    """``target`` after ``write(tmp)`` filled a temporary folder beside it and it was renamed into place (a folder
    another process renamed there first is kept, ours removed)."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _origin(obj: Any, gguf: Path) -> Any:
    """``obj`` (a tokenizer or a model) named as a direct load of ``gguf`` names it (its folder, the path as the caller
    gave it, not resolved: a venv behind a symbolic link keeps its own name, the cache key is the resolved file's)."""
    if hasattr(obj, "config"):
        obj.config.name_or_path = str(gguf.parent)
    else:
        obj.name_or_path = str(gguf.parent)
    return obj


def cached_tokenizer(gguf: str | os.PathLike) -> Any:
    """The tokenizer of a GGUF file, from its converted folder (written on the first call).

    Raises:
        OSError: the GGUF cannot be read.
    """
    from transformers import AutoTokenizer

    g = Path(gguf).resolve()

    def write(tmp: Path) -> None:
        AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name).save_pretrained(tmp)

    try:
        folder = _written(gguf_folder(g) / "tokenizer", write)
    except OSError:  # the cache cannot be written (read-only, full): the GGUF read directly
        return AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    return _origin(AutoTokenizer.from_pretrained(folder), Path(gguf))  # as given: a direct load's name


def cached_model(gguf: str | os.PathLike, **from_pretrained: Any) -> Any:
    """The causal LM of a GGUF file, from its converted float32 folder (written on the first call), loaded with
    ``from_pretrained``'s keywords (``dtype``, ``device_map``).

    Raises:
        OSError: the GGUF cannot be read.
    """
    import torch
    from transformers import AutoModelForCausalLM

    g = Path(gguf).resolve()

    def write(tmp: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32)
        model.hf_quantizer = None  # de-quantized on load: plain float32 weights, saved as they are
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)

    try:
        folder = _written(gguf_folder(g) / "model", write)
    except OSError:  # the cache cannot be written (read-only, full): the GGUF read directly
        return AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, **from_pretrained)
    return _origin(AutoModelForCausalLM.from_pretrained(folder, **from_pretrained), Path(gguf))
