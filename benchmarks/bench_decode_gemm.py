"""Decode-step GEMMs and launch chaining: cuBLAS vs a skinny Triton GEMM, with and without programmatic dependent
launch (PDL, Hopper), CUDA-graph replayed.

A batch-16 decode step's projections are [16, K] × [K, N] products (SmolLM2: K = 576 / 1536, N = 576 … 3072);
cuBLAS takes ~3.9 µs for each on the H200 (``profile_decode.py``), far above its bytes (≤ 3.5 MB: ≤ 0.8 µs).
This measures, in one run, µs per call of each shape for cuBLAS (``F.linear``, the baseline) and for the skinny
kernel (``headscope.hybrid.skinny.linear_rows``) over a small grid of tiles, and µs per *layer-shaped chain* (RMSNorm → in-proj → o_proj → RMSNorm →
gate/up → SiLU·mul → down, 30 times in one graph) for: cuBLAS + Triton elementwise, all Triton, all Triton with
PDL (each kernel loads its weights, then ``gdc_wait``: the weight fetch overlaps the previous kernel's tail).

    python benchmarks/bench_decode_gemm.py --out DIR        # CUDA only

(``benchmarks/results/h200_bench_decode_gemm.{json,log}``: the log's first run timed the same kernel from this
script, before it moved into ``headscope/hybrid/skinny.py``; the JSON is the re-run through the library's kernel.)
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from headscope.hybrid import skinny, splitk
from headscope.hybrid.graphs import capture

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared timing
from bench_timing import time_ms  # noqa: E402

# (M, K, N): SmolLM2 decode at batch 16 — hybrid in-proj, teacher in-proj, o_proj, gate+up, down
SHAPES = {"in_hybrid": (16, 576, 1856), "in_teacher": (16, 576, 960), "o_proj": (16, 576, 576),
          "gate_up": (16, 576, 3072), "down": (16, 1536, 576)}
TILES = list(itertools.product((16, 32, 64), (64, 128, 256), (2, 4)))  # (BN, BK, warps)


def kernels():
    import triton
    import triton.language as tl
    gdc_wait, gdc_launch_dependents = splitk.gdc_ops()  # (None, None) in an older Triton: no PDL

    @triton.jit
    def rms(X, Wn, Y, N, sx, sy, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        wn = tl.load(Wn + c, mask=c < N, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        x = tl.load(X + r * sx + c, mask=c < N, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps) * wn
        tl.store(Y + r * sy + c, y.to(Y.dtype.element_ty), mask=c < N)

    @triton.jit
    def silu_mul(X, Y, N, sx, sy, BLOCK: tl.constexpr, PDL: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        g = tl.load(X + r * sx + c, mask=c < N, other=0.0).to(tl.float32)
        u = tl.load(X + r * sx + N + c, mask=c < N, other=0.0).to(tl.float32)
        tl.store(Y + r * sy + c, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=c < N)

    return triton, rms, silu_mul, gdc_wait is not None


def graph_us(fn, reps=200, per=1):
    """µs per ``per`` calls: ``fn`` captured once in a CUDA graph (``headscope.hybrid.graphs.capture``, 3 warm-up
    calls), replayed ``reps`` times (``bench_timing.time_ms``: CUDA events)."""
    graph, _ = capture(fn, warmup=3)
    return time_ms(graph.replay, torch.device("cuda"), reps, warmup=1) * 1e3 / per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--chain", type=int, default=30, help="calls (or layers) per graph")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_gemm.py needs a CUDA device (the kernels' times and PDL are GPU-only)")
    dev = torch.device("cuda")
    triton, rms, silu_mul, has_pdl = kernels()
    splitk.PDL = True  # pdl=True below launches with PDL (where the GPU and Triton have it)
    torch.manual_seed(0)
    R = a.chain
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "pdl": has_pdl, "shapes": {}, "chains": {}}

    def lin(x, W, b, y, cfg, pdl=False):
        skinny.linear_rows(x, W, b, out=y, tiles=cfg, pdl=pdl)

    for name, (M, K, N) in SHAPES.items():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, W)
        row = {"cublas_us": graph_us(lambda: [F.linear(x, W) for _ in range(R)], per=R), "tiles": {}}
        for cfg in TILES:
            try:
                lin(x, W, None, y, cfg)
                torch.cuda.synchronize()
                err = (y.float() - ref.float()).abs().max().item()
                us = graph_us(lambda: [lin(x, W, None, y, cfg) for _ in range(R)], per=R)
                row["tiles"][str(cfg)] = {"us": us, "max_abs": err}
            except Exception as e:  # noqa: BLE001
                row["tiles"][str(cfg)] = {"error": f"{type(e).__name__}: {e}"[:200]}
        ok = {k: v for k, v in row["tiles"].items() if "us" in v and v["max_abs"] < 0.05}
        best = min(ok, key=lambda k: ok[k]["us"]) if ok else None
        row["best"] = best
        if best and has_pdl:
            cfg = ast.literal_eval(best)
            try:
                row["best_pdl_us"] = graph_us(lambda: [lin(x, W, None, y, cfg, True) for _ in range(R)], per=R)
            except Exception as e:  # noqa: BLE001
                row["best_pdl_error"] = f"{type(e).__name__}: {e}"[:300]
        res["shapes"][name] = row
        print(name, (M, K, N), "cublas %.2f us" % row["cublas_us"], "best", best, ok.get(best), "pdl",
              row.get("best_pdl_us", row.get("best_pdl_error")), flush=True)

    # a layer-shaped chain, 30 layers: rms -> in -> o -> rms -> gate_up -> silu_mul -> down (+ residual ignored)
    H, I, NI = 576, 1536, SHAPES["in_hybrid"][2]
    Ws = {"in": torch.randn(NI, H, device=dev, dtype=torch.bfloat16) / 24, "o": torch.randn(H, H, device=dev,
          dtype=torch.bfloat16) / 24, "gu": torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) / 24,
          "down": torch.randn(H, I, device=dev, dtype=torch.bfloat16) / 40}
    wn = torch.ones(H, device=dev, dtype=torch.bfloat16)
    h = torch.randn(16, H, device=dev, dtype=torch.bfloat16)
    buf = {k: torch.empty(16, n, device=dev, dtype=torch.bfloat16) for k, n in
           (("n1", H), ("z", NI), ("o", H), ("n2", H), ("gu", 2 * I), ("a", I), ("h", H))}
    cfgs = {k: ast.literal_eval(res["shapes"][s]["best"]) if res["shapes"][s]["best"] else (32, 128, 4)
            for k, s in (("in", "in_hybrid"), ("o", "o_proj"), ("gu", "gate_up"), ("down", "down"))}

    def layer(mode):
        pdl = mode == "triton_pdl"
        kw = {"launch_pdl": True} if pdl else {}
        src = h
        for _ in range(R):
            rms[(16,)](src, wn, buf["n1"], H, src.stride(0), H, 1e-5, BLOCK=1024, PDL=pdl, **kw)
            if mode == "cublas":
                torch.mm(buf["n1"], Ws["in"].t(), out=buf["z"])
                torch.mm(buf["z"][:, :H], Ws["o"].t(), out=buf["o"])
            else:
                lin(buf["n1"], Ws["in"], None, buf["z"], cfgs["in"], pdl)
                lin(buf["z"][:, :H], Ws["o"], None, buf["o"], cfgs["o"], pdl)
            rms[(16,)](buf["o"], wn, buf["n2"], H, H, H, 1e-5, BLOCK=1024, PDL=pdl, **kw)
            if mode == "cublas":
                torch.mm(buf["n2"], Ws["gu"].t(), out=buf["gu"])
            else:
                lin(buf["n2"], Ws["gu"], None, buf["gu"], cfgs["gu"], pdl)
            silu_mul[(16,)](buf["gu"], buf["a"], I, 2 * I, I, BLOCK=2048, PDL=pdl, **kw)
            if mode == "cublas":
                torch.mm(buf["a"], Ws["down"].t(), out=buf["h"])
            else:
                lin(buf["a"], Ws["down"], None, buf["h"], cfgs["down"], pdl)
            src = buf["h"]

    outs = {}
    for mode in ("cublas", "triton") + (("triton_pdl",) if has_pdl else ()):
        try:
            us = graph_us(lambda: layer(mode), per=R)
            layer(mode)
            torch.cuda.synchronize()
            outs[mode] = buf["h"].float().clone()
            res["chains"][mode] = {"us_per_layer": us}
        except Exception as e:  # noqa: BLE001
            res["chains"][mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print("chain", mode, res["chains"][mode], flush=True)
    for m, o in outs.items():
        res["chains"][m]["max_abs_vs_cublas"] = (o - outs["cublas"]).abs().max().item()
    out = Path(a.out) / "bench_decode_gemm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["chains"], indent=1))


if __name__ == "__main__":
    main()
