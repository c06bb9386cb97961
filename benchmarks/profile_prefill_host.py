"""Where an eager prefill of one attention layer spends its *host* time (CUDA only).

An eager hybrid layer's prefill below ~32K tokens is bound by the host (README, "Known issues"): the GPU
waits while Python, the compiled glue's guards and the kernels' launchers run. For each shape, length and
layer (the all-FA layer and the hybrid) this prints, in one run:

- ``gpu ms``: the eager call's time between CUDA events (host-bound calls show their host time here);
- ``graph ms``: the same call replayed from a CUDA graph (no host time: the GPU's own time);
- ``host ms``: wall time until the call *returns* (the GPU synchronised before each call; a call that is
  not host-bound returns before its kernels finish, one that is returns after);
- with ``--cprofile``: cProfile of ``--reps`` calls, the functions with the most own and cumulative time;
- with ``--torch-profile``: torch.profiler's CPU-side operators by self CPU time.

    python benchmarks/profile_prefill_host.py --out DIR --shapes smollm2-135m --lengths 16384 32768 --cprofile
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from bench_hybrid import SHAPES, layers
from bench_timing import configured, cuda_device, graphed_ms, parse_variant, time_ms, variant_config


def _host_ms(call, reps: int) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[len(ts) // 2]


def _cprofile(call, reps: int, top: int) -> dict:
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        call()
    pr.disable()
    torch.cuda.synchronize()
    out = {}
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).strip_dirs().sort_stats(key).print_stats(top)
        out[key] = s.getvalue()
    return out


def _torch_profile(call, reps: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m"], choices=sorted(SHAPES))
    ap.add_argument("--lengths", nargs="+", type=int, default=[16384, 32768])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--variants", nargs="+", default=["defaults"],
                    help="InferenceConfig fields per variant, e.g. blocks:gdn_block_tokens=4096 (bench_timing)")
    a = ap.parse_args(argv)
    try:
        parsed = {v: parse_variant(v) for v in a.variants}
    except ValueError as e:
        ap.error(str(e))
    dev, dtype = cuda_device("profile_prefill_host.py"), torch.bfloat16
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    t_all = time.time()
    for shape in a.shapes:
        mods, cfg = layers(shape, dev, dtype, "fla")
        del mods["teacher"]
        rope = LlamaRotaryEmbedding(cfg).to(dev)
        for T in a.lengths:
            x = torch.randn(1, T, cfg.hidden_size, device=dev, dtype=dtype)
            pe = rope(x, torch.arange(T, device=dev)[None])
            for variant in a.variants:
                vname, changes = parsed[variant]
                config = variant_config(changes)
                with configured(mods.values(), config):
                    for name, mod in mods.items():
                        call = lambda: mod(x, position_embeddings=pe)[0]  # noqa: E731
                        r = {"shape": shape, "T": T, "variant": vname, "layer": name, "config": asdict(config)}
                        r["gpu_ms"] = time_ms(call, dev, a.reps, warmup=2)
                        r["host_ms"] = _host_ms(call, a.reps)
                        r["graph_ms"] = graphed_ms(call, dev, a.reps)
                        torch.cuda.empty_cache()
                        line = (f"{shape:14s} {T:7d} {vname:12s} {name:6s} | gpu ms {r['gpu_ms']:8.3f} | host ms "
                                f"{r['host_ms']:8.3f} | graph ms {r['graph_ms']:8.3f}")
                        print(line, flush=True)
                        if a.cprofile:
                            r["cprofile"] = _cprofile(call, a.reps, a.top)
                            print(r["cprofile"]["tottime"], flush=True)
                        if a.torch_profile:
                            r["torch_profile"] = _torch_profile(call, a.reps, a.top)
                            print(r["torch_profile"], flush=True)
                        res["rows"].append(r)
                        (out_dir / "profile_prefill_host.json").write_text(json.dumps(res, indent=1))
    print(f"wall {time.time() - t_all:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
