"""The first ``generate`` of a shape: a head-wise hybrid's compile / capture cost against its teacher's (issue 61 item 5).

Per cell (batch B, prompt T; ``max_new_tokens`` N, greedy, defaults of ``generate``), each in fresh processes so
that nothing is compiled before the clock starts:

- ``cold``: the teacher's first call, the hybrid's first call (everything compiled, tuned and captured now) and its
  second call of the same shape (other tokens): first − second is the first-call overhead;
- ``warm_up``: ``headscope.hybrid.warm_up(model, B, T + N, prompt_lens=[T])`` timed, then the first real call;
- ``cached``: a new process whose ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` / ``TILELANG_CACHE_DIR`` hold what
  ``cold`` compiled (the cross-process reuse torch allows): its first call.

On the GPU each process makes its CUDA context and cuBLAS handle before the clock starts (one small matmul), so the
teacher, which runs first, does not pay them for the hybrid.

``--modes`` picks among the three (default all, in the order cold, cached, warm_up). ``--family``: the model of
``benchmarks/family_configs.py`` (the table ``bench_generate.py`` and ``bench_train.py`` share; default SmolLM2-135M's
shape with the ranked 7:1 mask, the others with a random 7:1 mask), random weights, bf16. Writes one JSON: the cells,
the hybrid's ``InferenceConfig`` and the backend each role resolved to, versions, the cache directory.

    python benchmarks/bench_first_call.py --out benchmarks/results/h100_first_call.json
    python benchmarks/bench_first_call.py --family gemma3 --batches 1 --lengths 8192 --modes cold cached --out F.json
    python benchmarks/bench_first_call.py --smoke [--family gpt-neox] --out /tmp/first_call.json   # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_configs import FAMILIES, chosen_backends, family_config, smoke_config  # noqa: E402

HERE = Path(__file__).resolve().parent
MODES = ("cold", "cached", "warm_up")


def _child(mode: str, B: int, T: int, n: int, smoke: bool, mask_name: str, family: str = "smollm2",
           layers: int = 8) -> dict:
    """One measurement in this (fresh) process -> seconds per timed call."""
    import platform
    from dataclasses import asdict

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from headscope.hybrid import hybridize, inference_config, warm_up

    if smoke:
        dev, dtype = torch.device("cpu"), torch.float32
        cfg, mask, _ = smoke_config(family)
    else:
        dev, dtype = torch.device("cuda"), torch.bfloat16
        cfg, mask, _ = family_config(family, layers, mask_name)
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    hybrid = hybridize(teacher, mask).to(dev, dtype).eval()
    teacher = teacher.to(dev, dtype)
    g = torch.Generator().manual_seed(T + B)

    def timed(model, seed_shift=0):
        ids = torch.randint(1, cfg.vocab_size, (B, T), generator=g).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return round(time.perf_counter() - t, 3)

    if dev.type == "cuda":  # CUDA context and cuBLAS handle before the clock: neither model's first call pays them
        x = torch.ones(64, 64, device=dev, dtype=dtype)
        (x @ x).sum().item()
    out = {"inference_config": asdict(inference_config(hybrid)),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(),
                        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()}}
    if mode == "cold":
        out.update(teacher_first_s=timed(teacher), teacher_second_s=timed(teacher), hybrid_first_s=timed(hybrid),
                   hybrid_second_s=timed(hybrid))
    elif mode == "warm_up":
        t = time.perf_counter()
        warm_up(hybrid, B, T + n, prompt_lens=[T], new_tokens=min(n, 3) if n >= 2 else 2)
        out.update(warm_up_s=round(time.perf_counter() - t, 3), hybrid_first_after_warm_up_s=timed(hybrid))
    else:
        out.update(hybrid_first_cached_s=timed(hybrid))
    out["backends"] = chosen_backends(hybrid)  # after the clock: resolving them is part of a first call
    return out


def _run(mode: str, B: int, T: int, a: argparse.Namespace, cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "TILELANG_CACHE_DIR": str(cache / "tilelang")}
    cmd = [sys.executable, __file__, "--child", mode, "--batch", str(B), "--prompt", str(T), "--new-tokens",
           str(a.new_tokens), "--mask", a.mask, "--family", a.family, "--layers", str(a.layers)] + (
        ["--smoke"] if a.smoke else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode:
        raise SystemExit(f"{mode} B={B} T={T} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--mask", default="hydrahead", help="--family smollm2: hydrahead, random or a HeadMask JSON")
    ap.add_argument("--family", default="smollm2", choices=FAMILIES)
    ap.add_argument("--layers", type=int, default=8, help="--family mistral: decoder layers")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="cold (first and second call of each model), cached (a new process with cold's compile "
                         "caches), warm_up (warm_up() then the first call)")
    ap.add_argument("--cache-dir", default=None, help="compile caches (default: a new temporary directory per cell)")
    ap.add_argument("--smoke", action="store_true", help="CPU, 4-layer tiny shape, 64-token prompts")
    ap.add_argument("--out", default="first_call.json")
    ap.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.batch, a.prompt, a.new_tokens, a.smoke, a.mask, a.family, a.layers)))
        return
    if a.smoke:
        a.batches, a.lengths, a.new_tokens = [1], [64], 4
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench_first_call.py times CUDA generate: run it on a GPU host, or --smoke on the CPU")
    what = (smoke_config(a.family) if a.smoke else family_config(a.family, a.layers, a.mask))[2]
    res = {"what": "first generate of a shape (s): teacher vs hybrid cold, after warm_up, with the compile caches kept",
           "family": a.family, "shape": what + ("" if a.smoke else ", random weights, bf16"),
           "mask": "tiny" if a.smoke else (a.mask if a.family == "smollm2" else "random 7:1"),
           "new_tokens": a.new_tokens, "modes": a.modes, "cells": []}
    for T in a.lengths:
        for B in a.batches:
            cache = Path(a.cache_dir) / f"B{B}_T{T}" if a.cache_dir else Path(tempfile.mkdtemp(prefix="first_call_"))
            cell = {"batch": B, "prompt": T, "cache_dir": str(cache)}
            for mode in [m for m in MODES if m in a.modes]:  # cached right after cold: the caches it filled
                got = _run(mode, B, T, a, cache)
                for k in ("inference_config", "backends", "versions"):
                    res.setdefault(k, got.pop(k))
                cell.update(got)
            if "cold" in a.modes:
                cell["hybrid_first_call_overhead_s"] = round(cell["hybrid_first_s"] - cell["hybrid_second_s"], 3)
                cell["teacher_first_call_overhead_s"] = round(cell["teacher_first_s"] - cell["teacher_second_s"], 3)
            res["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            Path(a.out).write_text(json.dumps(res, indent=1))  # saved as it goes
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
