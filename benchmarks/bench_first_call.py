"""The first ``generate`` of a shape: a head-wise hybrid's compile / capture cost against its teacher's (issue 61 item 5).

Per cell (batch B, prompt T; ``max_new_tokens`` N, greedy, defaults of ``generate``), each in fresh processes so
that nothing is compiled before the clock starts:

- ``cold``: the teacher's first call, the hybrid's first call (everything compiled, tuned and captured now) and its
  second call of the same shape (other tokens): first − second is the first-call overhead;
- ``warm_up``: ``headscope.hybrid.warm_up(model, B, T + N, prompt_lens=[T])`` timed, then the first real call;
- ``cached``: a new process whose ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` hold what ``cold`` compiled
  (the cross-process reuse torch allows): its first call.

SmolLM2-135M shape, random weights, bf16, the ranked 7:1 mask (as ``bench_generate.py``). Writes one JSON: the cells,
the hybrid's ``InferenceConfig``, versions, the cache directory.

    python benchmarks/bench_first_call.py --out benchmarks/results/h100_first_call.json
    python benchmarks/bench_first_call.py --smoke --out /tmp/first_call.json      # CPU, tiny shape
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

HERE = Path(__file__).resolve().parent


def _child(mode: str, B: int, T: int, n: int, smoke: bool, mask_name: str) -> dict:
    """One measurement in this (fresh) process -> seconds per timed call."""
    import platform
    from dataclasses import asdict

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(HERE))
    from bench_hybrid_model import hybrid_mask, smollm2_config

    from headscope.hybrid import hybridize, inference_config, warm_up
    from headscope.masks import HeadMask

    if smoke:
        dev, dtype = torch.device("cpu"), torch.float32
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096)
        cfg._attn_implementation = "sdpa"
        mask = HeadMask(4, 4, 2, ((0,), (1,), (2, 3), (0,)))
    else:
        dev, dtype = torch.device("cuda"), torch.bfloat16
        cfg, mask = smollm2_config(), hybrid_mask(mask_name)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(cfg).eval()
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
    return out


def _run(mode: str, B: int, T: int, a: argparse.Namespace, cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    cmd = [sys.executable, __file__, "--child", mode, "--batch", str(B), "--prompt", str(T), "--new-tokens",
           str(a.new_tokens), "--mask", a.mask] + (["--smoke"] if a.smoke else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode:
        raise SystemExit(f"{mode} B={B} T={T} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--mask", default="hydrahead")
    ap.add_argument("--cache-dir", default=None, help="compile caches (default: a new temporary directory per cell)")
    ap.add_argument("--smoke", action="store_true", help="CPU, 4-layer tiny shape, 64-token prompts")
    ap.add_argument("--out", default="first_call.json")
    ap.add_argument("--child", choices=["cold", "warm_up", "cached"], help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.batch, a.prompt, a.new_tokens, a.smoke, a.mask)))
        return
    if a.smoke:
        a.batches, a.lengths, a.new_tokens = [1], [64], 4
    res = {"what": "first generate of a shape (s): teacher vs hybrid cold, after warm_up, with the compile caches kept",
           "shape": "tiny (smoke)" if a.smoke else "SmolLM2-135M (30 x 9 heads, 3 KV, d 64), random weights, bf16",
           "mask": "tiny" if a.smoke else a.mask, "new_tokens": a.new_tokens, "cells": []}
    for T in a.lengths:
        for B in a.batches:
            cache = Path(a.cache_dir) / f"B{B}_T{T}" if a.cache_dir else Path(tempfile.mkdtemp(prefix="first_call_"))
            cell = {"batch": B, "prompt": T, "cache_dir": str(cache)}
            for mode in ("cold", "cached", "warm_up"):  # cached right after cold: the caches it filled
                got = _run(mode, B, T, a, cache)
                res.setdefault("inference_config", got.pop("inference_config"))
                res.setdefault("versions", got.pop("versions"))
                cell.update(got)
            cell["hybrid_first_call_overhead_s"] = round(cell["hybrid_first_s"] - cell["hybrid_second_s"], 3)
            cell["teacher_first_call_overhead_s"] = round(cell["teacher_first_s"] - cell["teacher_second_s"], 3)
            res["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            Path(a.out).write_text(json.dumps(res, indent=1))  # saved as it goes
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
