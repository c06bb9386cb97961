"""Raw-op ceiling of one layer's decode step: the attention ops alone, all-FA vs the 7:1 head-wise hybrid.

The decode counterpart of the prefill raw-op table in ``shared/gpu/README.md``: one query token per sequence over a
cache of T tokens, no projections, no glue, each op on its own (CUDA-graph replays, mean of ``--reps``):

- all-FA: PyTorch SDPA (``enable_gqa``) of every query head over every KV group; also headscope's split-K
  kernels (``splitk.decode_attention``: partials + combination) over the same cache;
- hybrid: the same two over the FA heads' KV groups only (SmolLM2: 1 query head over 1 group; Qwen3-1.7B shape: 2
  heads over 1 group), plus flash-linear-attention's ``fused_recurrent_gated_delta_rule`` for one token of the GDN
  heads (q/k L2-norm in the kernel, fp32 state read and written) — separately launched, as a library user would.

The ratio all-FA / hybrid of these raw ops is the ceiling that issue 17 measures the layer against; the layer's own
decode step (``bench_hybrid.py``) adds the projections, the glue and the output fusion, the same for both layers.

    python benchmarks/bench_decode_raw.py --out DIR [--lengths 32768 131072] [--batch 1] [--reps 300]

Writes ``DIR/bench_decode_raw.json``. Needs a CUDA device and fla.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_timing import cuda_device, graphed_ms  # noqa: E402

from headscope.hybrid.inference import DEFAULT  # noqa: E402
from headscope.hybrid.inference.kernels import splitk  # noqa: E402

# name: (q heads, KV groups, head_dim, the hybrid's FA query heads, the KV groups they read)
SHAPES = {"smollm2-135m": (9, 3, 64, 1, 1), "qwen3-1.7b": (16, 8, 128, 2, 1)}


def bench(shape: str, T: int, B: int, dev: torch.device, reps: int) -> dict:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    h, kv, d, nf, kf = SHAPES[shape]
    ng = h - nf
    dt = torch.bfloat16
    torch.manual_seed(0)
    scale = d ** -0.5
    q = torch.randn(B, h, 1, d, device=dev, dtype=dt)
    K = torch.randn(B, kv, T, d, device=dev, dtype=dt)
    V = torch.randn(B, kv, T, d, device=dev, dtype=dt)
    Kf, Vf = K[:, :kf].contiguous(), V[:, :kf].contiguous()
    qf = q[:, :nf].contiguous()
    qg, kg, vg = (torch.randn(B, 1, ng, d, device=dev, dtype=dt) for _ in range(3))
    g = -torch.rand(B, 1, ng, device=dev, dtype=torch.float32)
    beta = torch.rand(B, 1, ng, device=dev, dtype=dt)
    S = torch.randn(B, ng, d, d, device=dev, dtype=torch.float32) * 0.01

    def sdpa_fa():
        return F.scaled_dot_product_attention(q, K, V, scale=scale, enable_gqa=True)

    def sdpa_hy():
        return F.scaled_dot_product_attention(qf, Kf, Vf, scale=scale, enable_gqa=True)

    def splitk_fa():
        return splitk.decode_attention(q[:, :, 0], K, V, None, scale)

    def splitk_hy():
        return splitk.decode_attention(qf[:, :, 0], Kf, Vf, None, scale)

    def gdn():
        # one token of every GDN head; the state is read and the final state written (as a decode step must)
        return fused_recurrent_gated_delta_rule(qg, kg, vg, g=g, beta=beta, scale=scale, initial_state=S,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)

    r = {"shape": shape, "T": T, "batch": B, "cache_MB_fa": 2 * K.numel() * 2 / 2**20,
         "cache_MB_hybrid": 2 * Kf.numel() * 2 / 2**20, "gdn_state_MB": S.numel() * 4 / 2**20}
    ms = {name: graphed_ms(fn, dev, reps) for name, fn in
          (("sdpa_fa", sdpa_fa), ("sdpa_hybrid", sdpa_hy), ("splitk_fa", splitk_fa), ("splitk_hybrid", splitk_hy),
           ("gdn_fla", gdn))}
    # both of the hybrid's ops in one graph, one after the other (what the separate launches cost together)
    ms["sdpa_hybrid+gdn_fla"] = graphed_ms(lambda: (sdpa_hy(), gdn()), dev, reps)
    ms["splitk_hybrid+gdn_fla"] = graphed_ms(lambda: (splitk_hy(), gdn()), dev, reps)
    r["us"] = {k: v * 1e3 for k, v in ms.items()}
    r["ratio_sdpa"] = ms["sdpa_fa"] / ms["sdpa_hybrid+gdn_fla"]
    r["ratio_splitk"] = ms["splitk_fa"] / ms["splitk_hybrid+gdn_fla"]
    r["ratio_best"] = min(ms["sdpa_fa"], ms["splitk_fa"]) / min(ms["sdpa_hybrid+gdn_fla"], ms["splitk_hybrid+gdn_fla"])
    ref = splitk.decode_attention_torch(q[:, :, 0], K, V, None, scale)
    r["parity_splitk_vs_torch"] = float((splitk_fa().float() - ref.float()).abs().max())
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args(argv)
    dev = cuda_device("bench_decode_raw.py")
    t0 = time.perf_counter()
    rows = []
    for shape in a.shapes:
        for T in a.lengths:
            r = bench(shape, T, a.batch, dev, a.reps)
            rows.append(r)
            u = r["us"]
            print(f"{shape:13s} B={a.batch} T={T:6d} | SDPA fa {u['sdpa_fa']:6.1f} hybrid {u['sdpa_hybrid']:6.1f} "
                  f"+ gdn {u['gdn_fla']:5.1f} = {u['sdpa_hybrid+gdn_fla']:6.1f} us x{r['ratio_sdpa']:.2f} | split-K fa "
                  f"{u['splitk_fa']:6.1f} hybrid {u['splitk_hybrid']:6.1f} (+gdn {u['splitk_hybrid+gdn_fla']:6.1f}) "
                  f"x{r['ratio_splitk']:.2f} | best x{r['ratio_best']:.2f}", flush=True)
            torch.cuda.empty_cache()
    import fla

    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "fla": fla.__version__,
            "dtype": "bfloat16", "splitk": splitk.launch_defaults(), "wall_s": time.perf_counter() - t0,
            "config": asdict(DEFAULT)}  # the kernels are called directly: the library's defaults, for the record
    (a.out / "bench_decode_raw.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wall {meta['wall_s']:.1f} s; wrote {a.out / 'bench_decode_raw.json'}")


if __name__ == "__main__":
    main()
