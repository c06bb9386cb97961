"""``headscope generate``: text from any model headscope loads, through transformers' ``generate``.

:func:`check_generate_args` checks the arguments (nothing loaded) into a frozen :class:`GenerateConfig`;
:func:`generate_text` runs ``model.generate`` on one prompt and times it. On a converted hybrid, ``generate`` goes
through the model's own forward, which takes the hybrid's fast path where the device has one (CUDA: the inference
forward and the decode kernels of ``headscope.hybrid.inference``, chosen by the model itself; the CPU runs the
reference PyTorch layer); nothing here selects a path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .errors import HeadscopeInputError


@dataclass(frozen=True)
class GenerateConfig:
    """How to generate (checked by :func:`check_generate_args`).

    Attributes:
        max_new_tokens: tokens to generate at most (generation stops earlier at the end-of-sequence token).
        temperature: 0 = greedy decoding; > 0 = sampling at this temperature.
        top_p: nucleus sampling mass (1.0 = off); only with temperature > 0.
        seed: torch seed set before sampling.
        chat: wrap the prompt in the tokenizer's chat template (a user turn) before generating.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False


def check_generate_args(model: str, prompt: Optional[str], file: Optional[str | Path], max_new_tokens: int,
                        temperature: float, top_p: float, seed: int, device: Optional[str], dtype: str,
                        chat: bool = False) -> GenerateConfig:
    """Every argument of ``headscope generate`` checked before a model loads -> the :class:`GenerateConfig`.

    Raises:
        HeadscopeInputError (a ValueError): both a prompt and ``file``; a missing file; max_new_tokens < 1;
            temperature < 0; top_p outside (0, 1]; an unknown dtype or device; a model spec it cannot load.
    """
    from .models import check_model
    from .validate import check_choice, check_device, check_file, check_int, check_real

    if prompt is not None and file is not None:
        raise HeadscopeInputError("give the prompt as an argument or with --file, not both")
    if file is not None:
        check_file(file, "--file", "pass a UTF-8 text file with the prompt")
    check_int("--max-new-tokens", max_new_tokens, lo=1)
    check_real("--temperature", temperature, lo=0.0)
    check_real("--top-p", top_p, lo=0.0, hi=1.0, lo_open=True)
    check_int("--seed", seed, lo=0)
    check_choice("--dtype", dtype, ("auto", "float32", "bfloat16", "float16"))
    check_device(device, "--device")
    check_model(model, "MODEL")
    return GenerateConfig(max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p), seed=seed,
                          chat=chat)


def resolve_dtype(dtype: str, device: Optional[str], cuda_available: bool) -> str:
    """The weights' dtype ``generate`` loads the model in: ``"auto"`` is bfloat16 on a CUDA device (the dtype the
    hybrid's fast paths are measured in, docs/performance.md) and float32 elsewhere; any other value is kept.

    ``device`` None means CUDA when ``cuda_available``, as the model loader decides."""
    if dtype != "auto":
        return dtype
    on_cuda = device.startswith("cuda") if device else cuda_available
    return "bfloat16" if on_cuda else "float32"


def prompt_ids(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """The prompt's token ids: the tokenizer's own special tokens (BOS where it adds one), or with ``chat`` the chat
    template of one user turn with the assistant's turn opened.

    Raises:
        HeadscopeInputError (a ValueError): an empty prompt; ``chat`` with a tokenizer without a chat template.
    """
    if not prompt:
        raise HeadscopeInputError("the prompt is empty: pass it as an argument, with --file or on stdin")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise HeadscopeInputError("--chat: this model's tokenizer has no chat template; leave --chat out")
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return list(tokenizer(prompt)["input_ids"])


def generate_text(model: Any, tokenizer: Any, prompt: str, cfg: GenerateConfig) -> dict[str, Any]:
    """Generate from ``prompt`` with ``model.generate`` (greedy at temperature 0, else sampling with ``top_p``).

    Returns:
        {"text": the new text (special tokens skipped), "ids": the new token ids, "prompt_tokens", "new_tokens",
        "stop": why it stopped (:func:`stop_reason`), "seconds": wall time of ``generate`` (prefill and decode; CUDA synchronized), "tokens_per_s": new tokens /
        seconds}.
    """
    import torch

    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids(tokenizer, prompt, cfg.chat)], device=dev)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kw: dict[str, Any] = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if cfg.temperature > 0:
        kw = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
    torch.manual_seed(cfg.seed)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
                             pad_token_id=pad, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t0
    new = out[0, ids.shape[1]:].tolist()
    return {"text": tokenizer.decode(new, skip_special_tokens=True), "ids": new, "prompt_tokens": int(ids.shape[1]),
            "new_tokens": len(new), "stop": stop_reason(new, eos_ids(model, tokenizer), cfg.max_new_tokens),
            "seconds": dt, "tokens_per_s": len(new) / dt if dt > 0 else float("inf")}


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The token ids ``generate`` stops at: the model's generation config's ``eos_token_id`` (an id or a list), and
    the tokenizer's."""
    ids: set[int] = set()
    for v in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        ids.update(int(i) for i in (v if isinstance(v, (list, tuple)) else [v]) if i is not None)
    return ids


def stop_reason(new: list[int], eos: set[int], max_new_tokens: int) -> str:
    """Why generation stopped: ``"eos"`` (the last new token is an end-of-sequence token), ``"max_new_tokens"`` (the
    limit reached), else ``"other"`` (a stopping criterion of the model's generation config)."""
    if new and new[-1] in eos:
        return "eos"
    return "max_new_tokens" if len(new) >= max_new_tokens else "other"


_STOPS = {"eos": "stopped at the end-of-sequence token", "max_new_tokens": "--max-new-tokens reached",
          "other": "stopped by the model's generation config"}


def summary(res: dict[str, Any], device: Any, dtype: str) -> str:
    """The line ``headscope generate`` prints on stderr: new tokens, why generation stopped, prompt tokens, speed,
    e.g. ``1 new token (stopped at the end-of-sequence token) after 37 prompt tokens in 0.12 s: ...``."""
    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    return (f"{count(res['new_tokens'], 'new token')} ({_STOPS[res['stop']]}) after "
            f"{count(res['prompt_tokens'], 'prompt token')} in {res['seconds']:.2f} s: {res['tokens_per_s']:.1f} "
            f"tokens/s ({device}, {dtype})")
