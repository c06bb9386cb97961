"""transformers' own ``generate``: a head-wise hybrid against its teacher, same arguments, ms per new token.

The issue-39 table: SmolLM2-135M-shaped models with random weights in bf16 on one GPU, the ranked 7:1 mask
(``experiments/conversion-smollm2-50m/masks/hydrahead.json``), greedy, batch 1 and 16, 8K and 32K prompts, under
two settings of transformers' ``generate``:

- ``default``: ``model.generate(ids, max_new_tokens=n, do_sample=False)`` (the teacher: a ``DynamicCache`` and eager
  steps; the hybrid: its growing ``HybridCache``, the lean prefill and eager lean decode steps);
- ``static``: the same with ``cache_implementation="static"`` (the teacher: a ``StaticCache`` and transformers'
  automatic ``torch.compile`` of the decode forward, CUDA graphs through ``mode="reduce-overhead"``; the hybrid: a
  static ``HybridCache`` whose decode steps replay one captured CUDA graph, ``StaticDecoder.step_replayed``).

``--family`` (issue 61; the table in ``benchmarks/family_configs.py``, shared with ``bench_train.py``,
``bench_first_call.py``): random weights of SmolLM2-135M, Qwen2.5-0.5B (q/k/v biases), Qwen3-0.6B, Mistral-7B's layer
shape (sliding window 4096) at ``--layers`` depth (default 8), Gemma 3 270M (18 layers, 5 sliding (window 512) : 1
full, head_dim 256) or Pythia-160M (GPT-NeoX: rotary on a quarter of each head, parallel residual); every family but
SmolLM2 with a random 7:1 mask (``mask_7to1``: one FA head per layer at least). ``--cells 1x8192,16x32768``: only these
batch x prompt cells (issue 61's acceptance cells) instead of every batch x length. A model that runs out of memory in
a cell leaves ``error`` there and the run goes on. Each result records the backend each role resolved to
(``backends``) beside the InferenceConfig.

ms per new token = (wall time of a call making 2N tokens − a call making N) / N, both after a warm-up call of the
same shape (compilation, capture and prefill cancel out), the minimum over ``--reps`` repetitions; every call is
forced to make all its tokens (``min_new_tokens``). ``first_call_ms``: the wall time of each model's first call of a
cell (N tokens: compile, capture and autotune of that shape in this process, the prefill included): in the first cell
the first ``generate`` of the process (the CUDA context and cuBLAS handle made before the clock; the compile caches on
disk as the machine has them, named in ``compile_caches``: ``bench_first_call.py`` starts from empty ones), in a later
cell the first call of a new shape (issue 61 item 5); ``*_peak_gib``: ``max_memory_allocated`` over a model's calls of the cell.
After the cells the hybrid's tokens are checked on a short prompt against its cache-free forward teacher-forced on
them, in the run's dtype and in fp32 (``check_tokens``, the settings measured). Writes one JSON with each cell, the ratio hybrid / teacher (< 1: the hybrid is faster), the
InferenceConfig and versions.

    python benchmarks/bench_generate.py --out benchmarks/results/h200_generate_api.json
    python benchmarks/bench_generate.py --family gemma3 --batches 1 --lengths 8192 --out gemma3_generate.json
    python benchmarks/bench_generate.py --family qwen3 --settings default --cells 1x8192,16x32768 --out qwen3.json
    python benchmarks/bench_generate.py --smoke [--family gemma3]   # CPU, tiny shape, < 1 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_configs import FAMILIES, chosen_backends, family_config, smoke_config  # noqa: E402

from headscope.hybrid import hybridize  # noqa: E402
from headscope.hybrid.inference import inference_config  # noqa: E402

SETTINGS = {"default": {}, "static": {"cache_implementation": "static"}}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def _gen(model, ids, n, setting):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, **SETTINGS[setting])


@torch.no_grad()
def ms_per_token(model, ids, n, setting, reps):
    """Minimum over ``reps`` of (wall ms of a 2n-token generate − an n-token one) / n, after one warm-up each."""
    dev = ids.device
    best = float("inf")
    walls = {}
    for k in (n, 2 * n):  # warm-up: compile / capture / autotune of this shape (the first call timed)
        _sync(dev)
        t = time.perf_counter()
        _gen(model, ids, k, setting)
        _sync(dev)
        walls.setdefault("first_call", (time.perf_counter() - t) * 1e3)
    for _ in range(reps):
        for k in (n, 2 * n):
            _sync(dev)
            t = time.perf_counter()
            out = _gen(model, ids, k, setting)
            _sync(dev)
            walls[k] = (time.perf_counter() - t) * 1e3
            assert out.shape[1] == ids.shape[1] + k, out.shape
        best = min(best, (walls[2 * n] - walls[n]) / n)
    return best, walls


@torch.no_grad()
def check_tokens(model, ids, n, settings=tuple(SETTINGS)):
    """The hybrid's generate (each setting) against its own cache-free forward, teacher-forced on what it generated.

    For every generated token the cache-free forward (``use_cache=False``, the reference path) is run on the
    generated sequence; a step *differs* when its argmax is not the generated token (teacher-forced, so one flip
    does not cascade into the later steps). ``max_margin`` is the largest (max logit − logit of the generated
    token) of the cache-free forward over all steps: 0 where every step agrees, and at a differing step the size
    of the near-tie it fell on (in logits). Returns ``{setting: {"steps": k, "differing": d, "max_margin": m}}`` for
    each of ``settings``.
    """
    T = ids.shape[1]
    res = {}
    for s in settings:
        gen = _gen(model, ids, n, s)
        logits = model(gen[:, :-1], use_cache=False).logits[:, T - 1:].float()  # [B, n, V]: predicts gen[:, T:]
        got = gen[:, T:]
        margin = logits.max(-1).values - logits.gather(-1, got[..., None])[..., 0]
        res[s] = {"steps": int(got.numel()), "differing": int((logits.argmax(-1) != got).sum()),
                  "max_margin": round(float(margin.max()), 5)}
    return res


def parse_cells(text: str) -> list[tuple[int, int]]:
    """``"1x8192,16x32768"`` -> [(1, 8192), (16, 32768)] (batch x prompt tokens).

    Raises:
        ValueError: an item that is not BxT with positive integers."""
    cells = []
    for item in (x for x in text.split(",") if x.strip()):
        b, sep, t = item.strip().partition("x")
        if not (sep and b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 0):
            raise ValueError(f"--cells item {item!r} is not BATCHxPROMPT, e.g. 1x8192,16x32768")
        cells.append((int(b), int(t)))
    return cells


def _peak_gib(dev: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None


def measure_cell(teacher, hybrid, ids, setting: str, args) -> dict:
    """One (setting, batch, prompt) cell: each model's ms per token, first call, walls and peak memory, the ratio; a
    model that runs out of memory leaves ``error`` in the cell (the other cells still run)."""
    dev = ids.device
    B, T = ids.shape
    cell = {"setting": setting, "batch": B, "prompt": T}
    for name, m in (("teacher", teacher), ("hybrid", hybrid)):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            ms, walls = ms_per_token(m, ids, args.new_tokens, setting, args.reps)
        except torch.OutOfMemoryError as e:
            cell.setdefault("error", {})[name] = f"OutOfMemoryError: {str(e).splitlines()[0][:300]}"
            cell[f"{name}_peak_gib"] = _peak_gib(dev)
            continue
        cell[f"{name}_ms_per_token"] = round(ms, 3)
        cell[f"{name}_first_call_ms"] = round(walls.pop("first_call"), 1)
        cell[f"{name}_wall_ms"] = {str(k): round(v, 1) for k, v in walls.items()}
        cell[f"{name}_peak_gib"] = _peak_gib(dev)
    if "error" not in cell:
        cell["hybrid_over_teacher"] = round(cell["hybrid_ms_per_token"] / cell["teacher_ms_per_token"], 3)
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--cells", default=None, help="BxT list instead of every batch x length, e.g. 1x8192,16x32768")
    ap.add_argument("--new-tokens", type=int, default=32, help="N: calls of N and 2N new tokens")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--mask", default="hydrahead", help="--family smollm2: hydrahead, random or a HeadMask JSON")
    ap.add_argument("--family", default="smollm2", choices=FAMILIES)
    ap.add_argument("--layers", type=int, default=8, help="--family mistral: decoder layers")
    ap.add_argument("--smoke", action="store_true", help="CPU, the family's tiny model, 64-token prompts")
    ap.add_argument("--out", default="h200_generate_api.json")
    args = ap.parse_args()
    try:
        cells = parse_cells(args.cells) if args.cells else None
    except ValueError as e:
        ap.error(str(e))
    if args.smoke:
        dev, dtype = torch.device("cpu"), torch.float32
        cfg, mask, what = smoke_config(args.family)
        args.batches, args.lengths, args.new_tokens, args.reps = [1, 2], [64], 4, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_generate.py times CUDA generate: run it on a GPU host, or --smoke on the CPU")
        dev, dtype = torch.device("cuda"), torch.bfloat16
        cfg, mask, what = family_config(args.family, args.layers, args.mask)
    cells = cells or [(B, T) for T in sorted(args.lengths) for B in args.batches]
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    hybrid = hybridize(teacher, mask).to(dev, dtype).eval()
    teacher = teacher.to(dev, dtype)
    g = torch.Generator().manual_seed(1)
    res = {"what": "transformers generate, ms per new token (2N - N tokens)/N, hybrid vs teacher, same arguments",
           "shape": what, "family": args.family,
           "mask": (args.mask if args.family == "smollm2" else "random 7:1") if not args.smoke else "tiny",
           "n_fa_heads": sum(len(h) for h in mask.fa_heads),
           "dtype": str(dtype), "new_tokens": args.new_tokens, "reps": args.reps,
           "settings": {s: SETTINGS[s] for s in args.settings},
           "inference_config": asdict(inference_config(hybrid)),
           "compile_caches": {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                                                             "TILELANG_CACHE_DIR")},
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(),
                        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()},
           "cells": []}
    short = torch.randint(1, cfg.vocab_size, (2, 48), generator=g).to(dev)
    if dev.type == "cuda":  # CUDA context and cuBLAS handle before the clock: neither model's first call pays them
        x = torch.ones(64, 64, device=dev, dtype=dtype)
        (x @ x).sum().item()
    for setting in args.settings:  # the timed cells first: the first cell's first calls are the process's first
        for B, T in cells:
            ids = torch.randint(1, cfg.vocab_size, (B, T), generator=g).to(dev)
            cell = measure_cell(teacher, hybrid, ids, setting, args)
            res["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1))  # saved as it goes
    res["backends"] = chosen_backends(hybrid)
    del teacher
    res["check_tokens"] = {str(dtype): check_tokens(hybrid, short, 8, args.settings)}
    if dtype != torch.float32:  # the same check in fp32: the near-ties of bf16 rounding gone, every step must agree
        del hybrid
        torch.manual_seed(0)
        hybrid32 = hybridize(AutoModelForCausalLM.from_config(cfg).eval(), mask).to(dev, torch.float32).eval()
        res["check_tokens"]["torch.float32"] = check_tokens(hybrid32, short, 8, args.settings)
        del hybrid32
    print("generate vs the cache-free forward, teacher-forced:", res["check_tokens"], "backends:", res["backends"],
          flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
