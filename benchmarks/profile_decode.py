"""Where a whole-model decode step's time goes: the GPU kernels of one CUDA-graph-replayed step of the
SmolLM2-135M-shaped teacher and its 7:1 hybrid (``bench_hybrid_model.py``'s models, random weights), through
:class:`headscope.hybrid.inference.decoder.StaticDecoder`.

The caches are filled with random K/V and GDN states and set to ``T`` tokens (a decode step's time does not
depend on the cached values), so no prefill runs and no GDN prefill kernel (fla) is needed. Per model and
setting: the graph-replayed step (ms, CUDA events) and, from ``torch.profiler`` over replays of the same graph,
every kernel's µs per step, grouped into classes (GEMM, split-K attention, GDN step, compiled elementwise,
copies, other), their sum and the kernel count per step. ``sum_kernel_us`` below the step's time is idle time
between kernels (launch latency inside the graph).

    python benchmarks/profile_decode.py --out DIR [--batch 16 --length 32768 --tail-modes default max-autotune-no-cudagraphs]
        [--variants defaults compiled_tail:tail_kernel=False]
    python benchmarks/profile_decode.py --out DIR --shape qwen3-1.7b --layers 28 --masks random   # head_dim 128

``--shape qwen3-1.7b``: a Qwen3-1.7B-shaped model (Qwen3 attention with QK-norm, hidden 2048, 16 query heads,
8 KV heads, head_dim 128, MLP 6144, vocabulary 151,936; random weights) instead of SmolLM2's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hybrid_model import MASKS, hybrid_mask, smollm2_config  # noqa: E402
from bench_timing import parse_variant as _parse_variant, time_ms, variant_config  # noqa: E402

from headscope.hybrid import hybridize  # noqa: E402
from headscope.hybrid.inference.decoder import StaticDecoder  # noqa: E402
from headscope.masks import HeadMask  # noqa: E402

# kernel classes by name (the GDN step and FA prep kernels were named _step / _prep, class "other", in the
# 2026-12-01 result files; one_launch: step.py's FA prep + split-K partials + GDN step, from the fifth session;
# tail: tail_step.py's layer tail, from the sixth)
CLASSES = (("one_launch", ("_one_launch",)), ("tail", ("_tail",)), ("mlp", ("_mlp_partials", "_mlp_finish")), ("splitk", ("_partial", "_combine")),
           ("gdn_step", ("_gdn_decode_step",)), ("fa_prep", ("_fa_decode_prep",)),
           ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "cublas", "splitKreduce")),
           ("compiled", ("triton_",)), ("copy", ("copy", "index", "fill", "elementwise")))


def model_config(shape: str, layers: int):
    """(config, model class) of the profiled model: ``"smollm2-135m"`` (Llama) or ``"qwen3-1.7b"`` (Qwen3)."""
    if shape == "smollm2-135m":
        from transformers import LlamaForCausalLM

        return smollm2_config(layers), LlamaForCausalLM
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                      rope_theta=1000000.0, max_position_embeddings=1 << 17, rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    return cfg, Qwen3ForCausalLM


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k.lower() in low for k in keys):
            return cls
    return "other"


def fill(dec: StaticDecoder, T: int, seed: int = 0) -> None:
    """Random cache contents at T tokens (K/V ~ N(0, 1), GDN states ~ N(0, 0.01))."""
    g = torch.Generator(device=dec.caches[0].k.device if dec.caches[0].k is not None else "cuda").manual_seed(seed)
    for c in dec.caches:
        for t in (c.k, c.v):
            if t is not None:
                t.normal_(generator=g)
        if c.S is not None:
            c.S.normal_(std=0.01, generator=g)
    dec._set_length(T)


def profile_replay(dec: StaticDecoder, n: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile

    dec.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            dec.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us and e.count:
            rows.append({"kernel": e.key[:140], "class": kernel_class(e.key), "calls_per_step": e.count / n,
                         "us_per_step": us / n})
    rows.sort(key=lambda r: -r["us_per_step"])
    by = {}
    for r in rows:
        c = by.setdefault(r["class"], {"us_per_step": 0.0, "calls_per_step": 0.0})
        c["us_per_step"] += r["us_per_step"]
        c["calls_per_step"] += r["calls_per_step"]
    return {"kernels": rows[:60], "by_class": by, "sum_kernel_us": sum(r["us_per_step"] for r in rows),
            "kernels_per_step": sum(r["calls_per_step"] for r in rows)}


def parse_variant(variant: str, ap: argparse.ArgumentParser) -> tuple:
    """bench_timing.parse_variant, a bad item a usage error."""
    try:
        return _parse_variant(variant)
    except ValueError as e:
        ap.error(str(e))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--shape", default="smollm2-135m", choices=("smollm2-135m", "qwen3-1.7b"))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--masks", nargs="+", default=["hydrahead"],
                    help=f"the hybrids' FA heads, each one of {MASKS} or a HeadMask JSON file (bench_hybrid_model.hybrid_mask); "
                         "the first is 'hybrid', the others 'hybrid_<name>'")
    ap.add_argument("--tail-modes", nargs="+", default=["default"],
                    help="torch.compile modes of the compiled layer tail to compare ('none': eager tail)")
    ap.add_argument("--variants", nargs="+", default=["defaults"],
                    help="settings to compare, each NAME or NAME:field=value,... of InferenceConfig; 'defaults' = the "
                         "library's; e.g. compiled_tail:tail_kernel=False (values: ints, True/False/None, or strings)")
    args = ap.parse_args()
    H, KV = (9, 3) if args.shape == "smollm2-135m" else (16, 8)
    for m in args.masks:
        try:
            hybrid_mask(m, args.layers, H, KV)
        except ValueError as e:
            ap.error(str(e))
    parsed = {v: parse_variant(v, ap) for v in args.variants}
    if not torch.cuda.is_available():
        sys.exit("profile_decode.py needs a CUDA device")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    cfg, cls = model_config(args.shape, args.layers)
    torch.manual_seed(0)
    teacher = cls(cfg).to(dt).eval()
    with torch.no_grad():
        for p in teacher.parameters():
            p.normal_(std=0.02)
    L = args.layers
    masks = {m: hybrid_mask(m, L, H, KV) for m in args.masks}
    models = {"teacher": hybridize(teacher, HeadMask(L, H, KV, (tuple(range(H)),) * L), fusion="none").to(dev, dt).eval()}
    for i, (m, hm) in enumerate(masks.items()):
        name = "hybrid" if i == 0 else f"hybrid_{Path(m).stem}"
        name = name if name not in models else f"{name}_{i}"  # two mask files of one name
        models[name] = hybridize(teacher, hm).to(dev, dt).eval()
    res = {"shape": args.shape, "batch": args.batch, "length": args.length, "layers": L, "torch": torch.__version__,
           "masks": {m: {"kv_groups_kept": sum(len(g) for g in hm.kv_groups()), "n_fa": hm.n_fa} for m, hm in masks.items()},
           "device": torch.cuda.get_device_name(), "cells": {}}
    B, T = args.batch, args.length
    ids = torch.randint(0, cfg.vocab_size, (B, 1), device=dev)
    t0 = time.perf_counter()
    cells = [(mode, v) for mode in args.tail_modes for v in args.variants]
    for mode, variant in cells:
        vname, changes = parsed[variant]
        config = variant_config({"tail_mode": None if mode in ("default", "none") else mode, **changes})
        tag = mode if vname == "defaults" else f"{mode}+{vname}"
        for name, model in models.items():
            dec = StaticDecoder(model, B, T + 1, compile_tail=mode != "none", config=config)
            fill(dec, T)
            dec.capture(ids)
            ms = time_ms(dec.replay, dev, args.reps)
            prof = profile_replay(dec)
            cell = {"step_ms": ms, "per_layer_us": ms * 1e3 / L,
                    "settings": changes, "config": asdict(config), **prof}
            res["cells"][f"{name}/{tag}"] = cell
            print(f"{name:8s} tail={tag:28s} step {ms:.3f} ms ({ms * 1e3 / L:.1f} us/layer), kernels "
                  f"{prof['sum_kernel_us']:.0f} us in {prof['kernels_per_step']:.0f} launches | "
                  + " ".join(f"{k} {v['us_per_step'] / L:.1f}us/{v['calls_per_step'] / L:.1f}" for k, v in
                             sorted(prof["by_class"].items())) + f" (per layer) | {time.perf_counter() - t0:.0f} s",
                  flush=True)
            del dec
            torch.cuda.empty_cache()
            (out_dir / "profile_decode.json").write_text(json.dumps(res, indent=1, default=str))
    for mode, variant in cells:
        tag = mode if variant.partition(":")[0] == "defaults" else f"{mode}+{variant.partition(':')[0]}"
        t = res["cells"][f"teacher/{tag}"]
        for name in models:
            if name == "teacher":
                continue
            h = res["cells"][f"{name}/{tag}"]
            h["speedup_vs_teacher"] = t["step_ms"] / h["step_ms"]
            print(f"{tag}: {name} speed-up {t['step_ms'] / h['step_ms']:.2f}x (teacher {t['step_ms']:.3f} ms, {name} "
                  f"{h['step_ms']:.3f} ms)")
    (out_dir / "profile_decode.json").write_text(json.dumps(res, indent=1, default=str))
    for mode, variant in cells[:1]:
        tag = mode if variant.partition(":")[0] == "defaults" else f"{mode}+{variant.partition(':')[0]}"
        t, h = res["cells"][f"teacher/{tag}"], res["cells"][f"hybrid/{tag}"]
        print(f"{tag}: top kernels of the hybrid step:")
        for r in h["kernels"][:25]:
            print(f"   {r['us_per_step']:8.1f} us {r['calls_per_step']:5.0f}x  {r['class']:9s} {r['kernel'][:100]}")
        print("  teacher:")
        for r in t["kernels"][:15]:
            print(f"   {r['us_per_step']:8.1f} us {r['calls_per_step']:5.0f}x  {r['class']:9s} {r['kernel'][:100]}")


if __name__ == "__main__":
    main()
