"""A conversion stage's result as a model folder of its own, and its training record.

``OUT/stage{k}/`` after stage k::

    config.json, model.safetensors, generation_config.json   save_pretrained: the hybrid's weights; the config
                                                              holds the mask and the hybrid options
                                                              (``headscope_hybrid``) and ``auto_map``
    modeling_hybrid.py, layer.py, ...                         the hybrid's modeling code (remote code)
    tokenizer.json, tokenizer_config.json, ...                the teacher's tokenizer
    mask.json                                                 the HeadMask
    training.json                                             the training record, written last: the
                                                              folder is complete when it exists
    log.csv, log.jsonl                                        one row per step

It loads with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` in a process
without headscope (docs/hybrid.md, "Saving and loading"), or with headscope's classes and fast backends through
``headscope.hybrid.load(folder)`` (or :func:`load_model_folder`).
"""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..errors import HeadscopeInputError, InputFileNotFoundError

RECORD = "training.json"


def is_model_folder(path: str | Path) -> bool:
    """True when ``path`` is a complete stage folder (``training.json`` written, weights and config there)."""
    p = Path(path)
    return (p / RECORD).is_file() and (p / "config.json").is_file()


def stage_finished(out: str | Path, stage: int, last_stage: int = 3) -> bool:
    """True when stage ``stage`` of the conversion folder ``out`` is finished: its ``stage{k}/`` folder is complete, or
    a later stage's is (earlier stage folders may be deleted once a later stage is done, to save disk; a conversion
    continued with ``--resume`` does not train them again)."""
    return any(is_model_folder(Path(out) / f"stage{k}") for k in range(stage, last_stage + 1))


def read_record(path: str | Path) -> dict[str, Any]:
    """``training.json`` of a stage folder.

    Raises:
        InputFileNotFoundError: no complete stage folder at ``path``.
    """
    p = Path(path)
    if not is_model_folder(p):
        raise InputFileNotFoundError(f"{p} is not a finished conversion stage (no {RECORD} / config.json)")
    return json.loads((p / RECORD).read_text())


def package_versions() -> dict[str, Optional[str]]:
    """Versions of Python and the packages a conversion's result depends on (None: not installed)."""
    out: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in ("headscope", "torch", "transformers", "safetensors", "flash-linear-attention", "triton", "flash-attn"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["torch"] = torch.__version__
    from ..runtime import __version__

    out["headscope"] = __version__
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def loss_curve(log_jsonl: Path) -> list[list[float]]:
    """[[step, tokens, loss], ...] of a stage's ``log.jsonl``, one row per step (a step replayed after
    a resume keeps its last value)."""
    rows: dict[int, list[float]] = {}
    if log_jsonl.is_file():
        for line in log_jsonl.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows[int(r["step"])] = [int(r["step"]), int(r["tokens"]), float(r["loss"])]
    return [rows[k] for k in sorted(rows)]


def save_model_folder(student: nn.Module, tokenizer: Any, mask: Any, folder: str | Path, record: dict[str, Any],
                      state_dict: Optional[dict[str, torch.Tensor]] = None) -> Path:
    """Write ``folder`` as a model of its own (see the module docstring): weights and modeling code
    (``save_pretrained``, safetensors), the tokenizer, ``mask.json``, then ``training.json`` last.

    ``state_dict``: the full weights when ``student`` is sharded (FSDP2); default its own.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RECORD).unlink(missing_ok=True)  # incomplete until written again below
    student.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)
    mask.to_json(folder / "mask.json")
    from ..runtime import atomic_write_text

    atomic_write_text(folder / RECORD, json.dumps(record, indent=2, default=str))
    return folder


def load_model_folder(folder: str | Path, device: Optional[torch.device | str] = None,
                      dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The hybrid student of a finished stage folder (headscope's own classes; weights fp32 unless ``dtype``).

    Raises:
        InputFileNotFoundError: no complete stage folder at ``folder``.
    """
    from transformers import AutoModelForCausalLM

    from ..hybrid import register_auto_classes, use_inference

    register_auto_classes()  # headscope's classes load the folder (no remote code)
    p = Path(folder)
    if not is_model_folder(p):
        raise InputFileNotFoundError(f"{p} is not a finished conversion stage (no {RECORD}): run that stage first")
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype or torch.float32)
    if not hasattr(model.config, "headscope_hybrid"):
        raise HeadscopeInputError(f"{p} holds no headscope hybrid (config.json has no headscope_hybrid)")
    use_inference(model)  # the fast backends the default InferenceConfig chooses
    return model.to(device) if device is not None else model
