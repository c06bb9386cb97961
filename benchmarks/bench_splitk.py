"""Split-K decode attention (``headscope.hybrid.inference.kernels.splitk``): a sweep of its launch settings against SDPA and the
bandwidth roof, at the decode shapes of the hybrid benchmarks.

One decode step's FA attention reads the whole K/V cache once, so its floor is ``bytes(K, V) / bandwidth``.
For each shape (batch, KV groups, query heads per group, cached slots, head_dim) this times, CUDA-graph
replayed (no launch gaps from the host):

- PyTorch SDPA over the same cache (``enable_gqa``; the all-FA layer's default decode) — the baseline;
- ``decode_attention`` with the library's defaults (``splitk.BLOCK``, ``NUM_WARPS``, ``NUM_STAGES``,
  ``BLOCKS_PER_SM``, ``MIN_SPLIT``);
- every setting of the grid (slots per tile × warps × pipelining stages × thread blocks per SM × fewest
  slots per split), each checked against the PyTorch reference (max |Δ|; a setting off by more than
  ``--tol`` is reported and never picked),

and reports µs, GB/s, the fraction of the roof (``--roof-tbs``, 4.8 TB/s for the H200's HBM3e), the
speed-up of the defaults and of the best setting over SDPA, and the best setting per shape and overall (the
one with the least total time over the shapes). Ratios come from one run.

    python benchmarks/bench_splitk.py --out DIR            # CUDA: DIR/bench_splitk.json
    python benchmarks/bench_hybrid.py --splitk-from DIR/bench_splitk.json ...   # time with its best_overall
    python benchmarks/bench_splitk.py --smoke --out DIR    # CPU (Triton's interpreter, tiny shapes, fp32):
                                                           # parity of every setting only; times are meaningless
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict
import os
import sys
import time
from pathlib import Path

# the interpreter must be chosen before triton is imported (CPU smoke runs)
if "--smoke" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

from headscope.hybrid.inference import DEFAULT
from headscope.hybrid.inference.kernels import splitk
from headscope.hybrid.inference.graphs import capture

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared timing (also when imported by path)
from bench_timing import time_ms  # noqa: E402

# name: (batch, kv_groups, q_heads_per_group, slots, head_dim) — the FA heads' decode in the hybrid
# benchmarks (7:1 masks keep 1 KV group per layer; SmolLM2 9q/3kv d64, Qwen3-1.7B 16q/8kv d128) and the
# all-FA layers they are compared with
SHAPES = {
    "smollm2_hybrid_b1_32k": (1, 1, 1, 32768, 64),
    "smollm2_hybrid_b1_128k": (1, 1, 1, 131072, 64),
    "smollm2_hybrid_b16_32k": (16, 1, 2, 32768, 64),
    "smollm2_allfa_b16_32k": (16, 3, 3, 32768, 64),
    "smollm2_allfa_b1_32k": (1, 3, 3, 32768, 64),
    "qwen3_hybrid_b1_32k": (1, 2, 1, 32768, 128),
    "qwen3_hybrid_b1_128k": (1, 2, 1, 131072, 128),
    "qwen3_allfa_b1_32k": (1, 8, 2, 32768, 128),
}
SMOKE_SHAPES = {"tiny_b2": (2, 2, 2, 300, 16), "tiny_b1": (1, 1, 3, 200, 32)}
GRID = {"block": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (2, 3, 4), "blocks_per_sm": (1, 2, 4, 8),
        "min_split": (128, 256, 512)}
SMOKE_GRID = {"block": (16, 32), "num_warps": (4,), "num_stages": (2,), "blocks_per_sm": (1, 8), "min_split": (16, 64)}


def _inputs(shape, dtype, dev, seed=0):
    B, Hk, G, L, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Hk * G, d, generator=g).to(dev, dtype)
    k = torch.randn(B, Hk, L, d, generator=g).to(dev, dtype)
    v = torch.randn(B, Hk, L, d, generator=g).to(dev, dtype)
    n = torch.tensor([L - 7], device=dev)  # a cache not quite full: the length is read from device memory
    return q, k, v, n


def _time_us(fn, dev, reps):
    """µs per call: one call captured in a CUDA graph, replayed ``reps`` times (CUDA); wall-clock on CPU."""
    if dev.type != "cuda":
        return time_ms(fn, dev, reps, warmup=0) * 1e3
    graph, _ = capture(fn, warmup=2, device=dev)
    return time_ms(graph.replay, dev, reps, warmup=1) * 1e3


def sweep(shapes: dict, grid: dict, dtype, dev, reps: int, roof_tbs: float, tol: float, on_shape=None) -> dict:
    """Every shape × setting: time, bandwidth, parity; SDPA and the defaults as baselines. Returns the
    results dict (also the JSON's body); ``on_shape(results so far)`` after each shape (saves a partial run)."""
    keys = list(grid)
    settings = [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))]
    out = {"shapes": {}, "settings": settings}
    for name, shape in shapes.items():
        B, Hk, G, L, d = shape
        q, k, v, n = _inputs(shape, dtype, dev)
        scale = d ** -0.5
        ref = splitk.decode_attention_torch(q, k, v, n, scale).float()
        nbytes = 2 * B * Hk * (L - 7) * d * k.element_size()
        row = {"shape": dict(zip(("batch", "kv_groups", "q_per_group", "slots", "head_dim"), shape)),
               "kv_bytes": nbytes, "roof_us": nbytes / (roof_tbs * 1e12) * 1e6}
        if dev.type == "cuda":
            mask = (torch.arange(L, device=dev) < n)[None, None, None]
            q4 = q[:, :, None]
            sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale,  # noqa: E731
                                                          enable_gqa=G > 1)
            row["sdpa_us"] = _time_us(sdpa, dev, reps)
            row["sdpa_err"] = (sdpa()[:, :, 0].float() - ref).abs().max().item()
        default = lambda: splitk.decode_attention(q, k, v, n, scale)  # noqa: E731
        row["default_us"] = _time_us(default, dev, reps)
        row["default_err"] = (default().float() - ref).abs().max().item()
        runs = []
        for s in settings:
            ns = splitk.n_splits_for(B * Hk, L, s["block"], sms=splitk._sm_count(dev), min_split=s["min_split"],
                                     blocks_per_sm=s["blocks_per_sm"])

            def call(s=s, ns=ns):
                return splitk.decode_attention(q, k, v, n, scale, n_splits=ns, block=s["block"],
                                               num_warps=s["num_warps"], num_stages=s["num_stages"])

            try:
                err = (call().float() - ref).abs().max().item()
                us = _time_us(call, dev, reps)
                runs.append({"n_splits": ns, "us": us, "err": err, "ok": err <= tol})
            except Exception as e:  # noqa: BLE001 - a setting the compiler refuses (e.g. shared memory)
                runs.append({"n_splits": ns, "error": f"{type(e).__name__}: {e}"[:300], "ok": False})
        row["runs"] = runs
        good = [i for i, r in enumerate(runs) if r["ok"]]
        if good:
            i = min(good, key=lambda j: runs[j]["us"])
            row["best"] = {**settings[i], **runs[i], "gbs": nbytes / runs[i]["us"] / 1e3,
                           "roof_fraction": row["roof_us"] / runs[i]["us"]}
            row["default_gbs"] = nbytes / row["default_us"] / 1e3
            row["best_vs_default"] = row["default_us"] / runs[i]["us"]
            if "sdpa_us" in row:
                row["default_vs_sdpa"] = row["sdpa_us"] / row["default_us"]
                row["best_vs_sdpa"] = row["sdpa_us"] / runs[i]["us"]
        row["bad_settings"] = [settings[i] | {"err": r.get("err"), "error": r.get("error")}
                               for i, r in enumerate(runs) if not r["ok"]]
        out["shapes"][name] = row
        b = row.get("best", {})
        print(f"{name:26s} roof {row['roof_us']:7.1f} us | sdpa {row.get('sdpa_us', float('nan')):7.1f} | default "
              f"{row['default_us']:7.1f} (err {row['default_err']:.1e}) | best {b.get('us', float('nan')):7.1f} "
              f"{ {k: b.get(k) for k in keys} } splits {b.get('n_splits')} | bad {len(row['bad_settings'])}",
              flush=True)
        if on_shape is not None:
            on_shape(out)
    # one setting for all shapes: the least total time over the shapes where every shape ran it correctly
    totals = []
    for i, s in enumerate(settings):
        rs = [row["runs"][i] for row in out["shapes"].values()]
        if all(r["ok"] for r in rs):
            totals.append((sum(r["us"] for r in rs), i))
    if totals:
        tot, i = min(totals)
        dflt = sum(row["default_us"] for row in out["shapes"].values())
        out["best_overall"] = {**settings[i], "total_us": tot, "default_total_us": dflt, "speedup_vs_default": dflt / tot}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output folder (bench_splitk.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU: Triton's interpreter, tiny shapes, fp32, parity only")
    ap.add_argument("--shapes", nargs="*", default=None, help=f"a subset of {list(SHAPES)}")
    ap.add_argument("--reps", type=int, default=200, help="graph replays per timing")
    ap.add_argument("--roof-tbs", type=float, default=4.8, help="HBM bandwidth in TB/s (H200: 4.8)")
    ap.add_argument("--tol", type=float, default=None, help="max |Δ| against the PyTorch reference (default: "
                    "2e-2 in bf16, 1e-4 in fp32)")
    a = ap.parse_args()
    if a.smoke:
        dev, dtype, shapes, grid, reps = torch.device("cpu"), torch.float32, SMOKE_SHAPES, SMOKE_GRID, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_splitk.py times CUDA kernels; on a machine without CUDA run it with --smoke (parity only)")
        dev, dtype, grid, reps = torch.device("cuda"), torch.bfloat16, GRID, a.reps
        shapes = {k: SHAPES[k] for k in (a.shapes or SHAPES)}
    tol = a.tol if a.tol is not None else (1e-4 if dtype == torch.float32 else 2e-2)
    t0 = time.time()
    import importlib.metadata as md

    head = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)",
            "dtype": str(dtype), "roof_tbs": a.roof_tbs, "tol": tol, "defaults": splitk.launch_defaults(),
            "versions": {m: md.version(m) for m in ("torch", "triton")},
            "config": asdict(DEFAULT)}  # the kernel is called directly: the library's defaults, for the record
    a.out.mkdir(parents=True, exist_ok=True)

    def write(body: dict, done: bool) -> None:  # after every shape: a stopped sweep keeps what it measured
        (a.out / "bench_splitk.json").write_text(json.dumps({**head, **body, "complete": done,
                                                             "wall_s": time.time() - t0}, indent=1))

    res = sweep(shapes, grid, dtype, dev, reps, a.roof_tbs, tol, on_shape=lambda body: write(body, False))
    write(res, True)
    res = json.loads((a.out / "bench_splitk.json").read_text())
    if "best_overall" in res:
        print("best overall:", json.dumps(res["best_overall"]))
    print(f"wall {res['wall_s']:.1f} s; wrote {a.out / 'bench_splitk.json'}")


if __name__ == "__main__":
    main()
