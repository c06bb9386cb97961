"""Where a hybrid layer's one-launch decode step (``hybrid/step.py``) spends its time, the kernel alone.

The whole-model step (``profile_decode.py``) shows the hybrid's one launch reading its cache at a lower rate than the
all-FA teacher's (SmolLM2 shape, B = 16, 32K: 37.7 µs for 134 MB against 95.5 µs for 403 MB). This times
:func:`~headscope.hybrid.inference.kernels.one_launch.hybrid_decode_step` on its own, replayed from a CUDA graph, at one layer of the ranked
7:1 SmolLM2 mask (one FA query head over one KV group, 8 GDN heads, head_dim 64, RoPE, the per-head output norm) and
takes it apart:

- ``default``: the library's settings; ``combine_kernel`` / ``no_combine``: the split-K combination in a second
  launch / not at all (the partials only: what the combination costs);
- ``fa_only``: no GDN heads (its own split count), ``fa_only_ns``: no GDN heads at the default's split count (what
  the GDN programs cost); ``gdn_only``: ``gdn_step.gdn_decode_step`` alone (its own launch);
- ``ns<N>``: the default with N splits per row;
- ``teacher``: the all-FA layer's step (9 query heads over 3 KV groups, no GDN heads), for its read rate;
- ``read_ref``: ``torch.sum`` over the FA cache (K and V, fp32 accumulation): a plain read of the same bytes.

Each row: µs per launch (mean of ``--reps`` graph replays), and the FA cache bytes read per µs (TB/s).

    python benchmarks/bench_one_launch.py --out DIR [--batch 16 1] [--length 32768] [--reps 300]

Writes ``DIR/bench_one_launch.json``. Needs a CUDA device (Triton); no fla.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_timing import cuda_device, graphed_ms  # noqa: E402

from headscope.hybrid.inference import DEFAULT  # noqa: E402
from headscope.hybrid.inference.kernels import gdn_step, one_launch as step, splitk  # noqa: E402


def _inputs(B: int, Hq: int, Hk: int, ng: int, d: int, L: int, dev: torch.device, g: torch.Generator,
            dt: torch.dtype = torch.bfloat16) -> dict:
    r = lambda *s: torch.randn(*s, generator=g).to(dev, dt)  # noqa: E731
    ang = torch.rand(B, d // 2, generator=g) * 6
    x = {"q": r(B, Hq, d), "k": r(B, Hk, d), "v": r(B, Hk, d), "kc": r(B, Hk, L, d), "vc": r(B, Hk, L, d),
         "cos": torch.cat([ang.cos()] * 2, -1).to(dev, dt), "sin": torch.cat([ang.sin()] * 2, -1).to(dev, dt),
         "gamma": (1 + 0.2 * torch.randn(Hq, d, generator=g)).to(dev), "len": torch.tensor([L], device=dev)}
    if ng:
        x["gdn"] = dict(q=r(B, ng, d), k=r(B, ng, d), v=r(B, ng, d), a=r(B, ng), b=r(B, ng),
                        S=(torch.randn(B, ng, d, d, generator=g) * 0.3).to(dev), A_neg=(-torch.rand(ng, generator=g)).to(dev),
                        dt_bias=torch.randn(ng, generator=g).to(dev), scale=d ** -0.5,
                        gamma=(1 + 0.2 * torch.randn(ng, d, generator=g)).to(dev))
    return x


def _call(x: dict, gdn: bool = True, **kw):
    return lambda: step.hybrid_decode_step(x["q"], x["k"], x["v"], x["kc"], x["vc"], x["len"], x["q"].shape[-1] ** -0.5,
                                           cos=x["cos"], sin=x["sin"], gamma=x["gamma"],
                                           gdn=x.get("gdn") if gdn else None, **kw)


def bench(B: int, L: int, dev: torch.device, reps: int, splits: list[int], smoke: bool = False) -> dict:
    """The cells at batch B and length L; ``smoke``: CPU through Triton's interpreter in fp32, each cell run once and
    its output checked against the default's (no timing)."""
    g = torch.Generator().manual_seed(0)
    d, ng = (32, 3) if smoke else (64, 8)
    dt = torch.float32 if smoke else torch.bfloat16
    x = _inputs(B, 1, 1, ng, d, L, dev, g, dt)
    cache_bytes = 2 * x["kc"].numel() * 2
    gm = x["gdn"]
    NGP = B * ng  # one program per (sequence, head) with the fused norm
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    ns_default = splitk.n_splits_for(B, L, sms=sms, reserved=NGP)
    cells = {"default": _call(x), "combine_kernel": _call(x, combine="kernel"), "no_combine": _call(x, combine=False),
             "fa_only": _call(x, gdn=False), "fa_only_ns": _call(x, gdn=False, n_splits=ns_default),
             "gdn_only": lambda: gdn_step.gdn_decode_step(**gm)}
    for n in splits:
        cells[f"ns{n}"] = _call(x, n_splits=n)
    if smoke:  # every cell runs and agrees with the default (the same token's attention; GDN state advanced each call)
        ref = cells["default"]()[0].clone()
        for name, fn in cells.items():
            o = fn()
            if name != "gdn_only" and name != "no_combine":
                assert (o[0] - ref).abs().max() < 1e-4, name
        return {"batch": B, "length": L, "smoke": "ok", "cells": list(cells)}
    us = {}
    for name, fn in cells.items():
        us[name] = graphed_ms(fn, dev, reps) * 1e3
    kc, vc = x["kc"], x["vc"]
    us["read_ref"] = 1e3 * graphed_ms(lambda: (kc.sum(dtype=torch.float32), vc.sum(dtype=torch.float32)), dev, reps)
    del x, cells
    t = _inputs(B, 9, 3, 0, d, L, dev, g)
    us["teacher"] = 1e3 * graphed_ms(_call(t), dev, reps)
    teacher_bytes = 2 * t["kc"].numel() * 2
    tk, tv = t["kc"], t["vc"]
    us["teacher_read_ref"] = 1e3 * graphed_ms(lambda: (tk.sum(dtype=torch.float32), tv.sum(dtype=torch.float32)), dev, reps)
    del t
    torch.cuda.empty_cache()
    rate = {k: (teacher_bytes if k.startswith("teacher") else cache_bytes) / (v * 1e-6) / 1e12
            for k, v in us.items() if k != "gdn_only"}
    return {"batch": B, "length": L, "cache_MB": cache_bytes / 2**20, "teacher_cache_MB": teacher_bytes / 2**20,
            "n_splits_default": ns_default, "gdn_programs": NGP, "us": us, "TB_per_s": rate}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, fp32, tiny sizes: checks the script")
    ap.add_argument("--splits", type=int, nargs="+", default=[16, 20, 30, 33, 40, 50],
                    help="split counts per row to time beside the default (B = 16; B = 1 times them x 4)")
    a = ap.parse_args(argv)
    if a.smoke:
        for B in (3, 1):
            print(bench(B, 96, torch.device("cpu"), 1, [2, 5], smoke=True), flush=True)
        return
    dev = cuda_device("bench_one_launch.py")
    t0 = time.perf_counter()
    rows = []
    for B in a.batch:
        splits = a.splits if B >= 16 else [min(n * 4, splitk.MAX_SPLITS) for n in a.splits]
        r = bench(B, a.length, dev, a.reps, splits)
        rows.append(r)
        print(f"B={B} T={a.length} cache {r['cache_MB']:.0f} MB, default {r['n_splits_default']} splits + "
              f"{r['gdn_programs']} GDN programs", flush=True)
        for k, v in r["us"].items():
            tb = r["TB_per_s"].get(k)
            print(f"  {k:16s} {v:8.2f} us" + (f"  {tb:5.2f} TB/s" if tb else ""), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "splitk": splitk.launch_defaults(),
            "step": {"LAUNCH_COMBINE_MAX_G": step.LAUNCH_COMBINE_MAX_G},
            "config": asdict(DEFAULT),  # the kernels are called directly: the library's defaults, for the record
            "wall_s": time.perf_counter() - t0}
    (a.out / "bench_one_launch.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wall {meta['wall_s']:.1f} s; wrote {a.out / 'bench_one_launch.json'}")


if __name__ == "__main__":
    main()
