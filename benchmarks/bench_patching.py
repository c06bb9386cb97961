"""Exact and screen-then-verify receiver patching vs TransformerLens' per-head sweep, in one process.

    python benchmarks/bench_patching.py [--seq-len 256] [--pairs 6] [--skip-tl]
    python benchmarks/bench_patching.py --family all [--shape 8,512,8,4] [--seq-len 256]

Part 1 (one niah_single pair, needle at depth 0.5): times
  * TransformerLens `get_act_patch_attn_head_out_all_pos` over all heads (one forward per head),
  * headscope exact mode (same IE to float error; batched, layer/prefix reuse),
  * headscope screen-then-verify, ``verify="auto"`` (AtP + bf16 probes of 4-layer blocks, refined best
    first into layers, KV groups and heads where AtP's sums miss, exact verification until the top 10 is
    certified by the stopping rule, a heuristic; see ``screen_auto``).
Part 2 (``--pairs`` pairs): exact vs screen-then-verify top-10 on the mean IE.
The engine's self-check (:mod:`headscope.patching.self_check`) runs once per (model, dtype, length): its seconds in
the warm-up (where it is paid) and in each timed run are printed (``self-check: ...``), with its share of the one-pair
screen (``check_share_screen``; the share a cold screen would pay, ``cold_check_share_screen``, is the warm-up's
checks over the one-pair screen's time).
The final line is `speedup_exact=X speedup_screen=Y max_abs_diff=Z recall_at_k=R check_share_screen=S
cold_check_share_screen=C`. Times are ratios against the TransformerLens sweep measured in the same run.

``--family F[,G...]|all``: for random models of every adapter family at one shape (``--shape``
layers,d_model,heads,kv_heads), one niah_single pair each: the TransformerLens sweep, headscope exact on the
fast path and on the generic bridge path, each family's speed-up and its ratio to the Llama family's
speed-up in the same run, and max |patched m - TransformerLens| per path (``--fp64``: also both against a
float64 copy of the model, the truth both round). Writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import os
import time

import pandas as pd
import torch

import headscope
from headscope.patching import receiver_patching
from headscope.patching.attribution import recall_at_k
from headscope.patching.screen import screen_then_verify
from headscope.patching.receivers import sequences
from headscope.readout import logit_diff
from headscope.tasks import niah_single


def tl_sweep(model, pair):
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    clean_seq, corr_seq, read = sequences(pair)
    b = model.bridge
    _, clean_cache = b.run_with_cache(clean_seq[None], names_filter=lambda n: n.endswith("attn.hook_z"))

    def metric(logits):
        return logit_diff(logits[0, read], pair.answer, pair.counter_answer)

    return get_act_patch_attn_head_out_all_pos(b, corr_seq[None], clean_cache, metric).double()


def fp64_reference(name: str, tok, shape: tuple[int, int, int, int], pairs) -> torch.Tensor:
    """Patched m of every head from a float64 copy of the family's random model (same seed), through the
    generic path: the float64 truth that the float32 TransformerLens sweep and the fast engine both
    approximate."""
    from headscope.arch.random_models import _families
    from headscope.models import wrap

    hf64 = _families(*shape)[name](len(tok), 0).double()
    m64 = wrap(hf64, tok, name=f"random-{name}-fp64")
    r = receiver_patching(m64, pairs, direction="denoising", min_gap=0.0, progress=False, path="generic")
    return r.patched[0]


def bench_families(names: list[str], shape: tuple[int, int, int, int], seq_len: int, out: str | None,
                   fp64: bool = False, repeats: int = 2) -> None:
    import json

    from headscope.arch.random_models import FAMILIES
    from headscope.models import random_family
    from headscope.model_specs import default_gguf_path

    from transformers import AutoTokenizer

    gg = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(gg.parent, gguf_file=gg.name)
    names = sorted(FAMILIES) if names == ["all"] else names
    if "llama" in names:  # the baseline first
        names = ["llama"] + [n for n in names if n != "llama"]
    pair = niah_single(tok, n_pairs=1, seq_len=seq_len, depth=0.5, seed=0)
    rows = []
    for name in names:
        model = random_family(name, tok, seed=0, shape=shape)
        receiver_patching(model, pair, direction="denoising", min_gap=0.0, progress=False, heads=[(0, 0)])  # warm-up
        _ = model.bridge
        tl_times, times = [], {"fast": [], "generic": []}
        for _rep in range(repeats):  # the minimum over repeats: the least noisy estimate on a shared host
            t = time.perf_counter()
            tl = tl_sweep(model, pair[0])
            tl_times.append(time.perf_counter() - t)
            for path in ("fast", "generic"):
                t = time.perf_counter()
                r = receiver_patching(model, pair, direction="denoising", min_gap=0.0, progress=False, path=path)
                times[path].append(time.perf_counter() - t)
                if path == "fast":
                    r_fast = r
                else:
                    r_gen = r
        tl_s = min(tl_times)
        res = {"fast": (min(times["fast"]), float((r_fast.patched[0] - tl).abs().max())),
               "generic": (min(times["generic"]), float((r_gen.patched[0] - tl).abs().max()))}
        rows.append(dict(family=name, tl_s=tl_s, fast_s=res["fast"][0], generic_s=res["generic"][0],
                         speedup_fast=tl_s / res["fast"][0], speedup_generic=tl_s / res["generic"][0],
                         max_diff_fast=res["fast"][1], max_diff_generic=res["generic"][1],
                         tl_times=tl_times, fast_times=times["fast"], generic_times=times["generic"]))
        if fp64:  # both against the float64 truth (is a fast-vs-sweep difference rounding, and whose?)
            ref = fp64_reference(name, tok, shape, pair)
            rows[-1]["max_diff_tl_fp64"] = float((tl - ref).abs().max())
            rows[-1]["max_diff_fast_fp64"] = float((r_fast.patched[0] - ref).abs().max())
        print(rows[-1], flush=True)
        del model
    table = pd.DataFrame(rows)
    if "llama" in set(table.family):
        base = float(table.loc[table.family == "llama", "speedup_fast"].iloc[0])
        table["fast_vs_llama"] = table["speedup_fast"] / base
    print(f"random models of shape layers,d_model,heads,kv = {shape}, niah_single {seq_len} tokens, "
          f"torch threads={torch.get_num_threads()}, load average {os.getloadavg()}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if out:
        with open(out, "w") as f:
            json.dump({"shape": shape, "seq_len": seq_len, "threads": torch.get_num_threads(), "repeats": repeats,
                       "loadavg": os.getloadavg(), "rows": table.to_dict(orient="records")}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--skip-tl", action="store_true", help="skip the TransformerLens sweep (no speedups)")
    ap.add_argument("--family", default=None, help="comma-separated adapter families, or all")
    ap.add_argument("--shape", default="8,512,8,4", help="--family: layers,d_model,heads,kv_heads")
    ap.add_argument("--out", default=None, help="--family: write the table as JSON here")
    ap.add_argument("--fp64", action="store_true",
                    help="--family: also compare the sweep and the fast engine with a float64 copy of each model")
    ap.add_argument("--repeats", type=int, default=2,
                    help="--family: time each of TL, fast and generic this many times (interleaved) and keep the minimum")
    args = ap.parse_args()
    if args.family:
        shape = tuple(int(x) for x in args.shape.split(","))
        bench_families(args.family.split(","), shape, args.seq_len, args.out, args.fp64, args.repeats)  # type: ignore[arg-type]
        return
    from headscope.patching.self_check import seconds_spent

    model = headscope.load_model(args.model, device="cpu")
    one = niah_single(model.tokenizer, n_pairs=1, seq_len=args.seq_len, depth=0.5, seed=0)
    rows = []
    checks: dict[str, float] = {}
    # warm-up (allocator, bridge boot, the self-checks at this length) outside the timings
    c0 = seconds_spent()
    receiver_patching(model, one, direction="denoising", min_gap=0.0, progress=False, heads=[(0, 0)])
    checks["warm-up"] = seconds_spent() - c0
    _ = model.bridge

    tl_s = float("nan")
    max_diff = float("nan")
    c0, t = seconds_spent(), time.perf_counter()
    exact = receiver_patching(model, one, direction="denoising", min_gap=0.0, progress=False)
    exact_s = time.perf_counter() - t
    checks["exact, 1 pair"] = seconds_spent() - c0
    rows.append(("headscope exact (denoising)", exact_s))
    if not args.skip_tl:
        t = time.perf_counter()
        tl = tl_sweep(model, one[0])
        tl_s = time.perf_counter() - t
        rows.append(("TransformerLens per-head sweep", tl_s))
        max_diff = float((exact.patched[0] - tl).abs().max())
    c0, t = seconds_spent(), time.perf_counter()
    scr1 = screen_then_verify(model, one, verify="auto", min_gap=0.0, progress=False)
    screen_s = time.perf_counter() - t
    checks["screen, 1 pair"] = seconds_spent() - c0
    rows.append(("headscope screen-then-verify", screen_s))
    print(f"screen, 1 pair: {scr1.details}")

    pairs = niah_single(model.tokenizer, n_pairs=args.pairs, seq_len=args.seq_len, depth=0.5, seed=1)
    c0, t = seconds_spent(), time.perf_counter()
    ex = receiver_patching(model, pairs, progress=False)
    ex6 = time.perf_counter() - t
    checks[f"exact, {args.pairs} pairs"] = seconds_spent() - c0
    c0, t = seconds_spent(), time.perf_counter()
    sc = screen_then_verify(model, pairs, verify="auto", progress=False)
    sc6 = time.perf_counter() - t
    checks[f"screen, {args.pairs} pairs"] = seconds_spent() - c0
    mean_ex = ex.ie[ex.used].mean(0).numpy()
    mean_sc = sc.ie[sc.exact.used].mean(0).numpy()
    rec = recall_at_k(mean_ex, mean_sc, 10)
    rows.append((f"exact, {args.pairs} pairs", ex6))
    rows.append((f"screen-then-verify, {args.pairs} pairs", sc6))
    table = pd.DataFrame(rows, columns=["run", "seconds"])
    if tl_s == tl_s:
        table["vs TL sweep (x faster, per pair)"] = [
            tl_s / (s if "pairs" not in r else s / args.pairs) for r, s in rows
        ]
    print(f"SmolLM2 niah_single, {args.seq_len} tokens, depth 0.5, torch threads={torch.get_num_threads()}")
    print(table.to_string(index=False))
    print(f"screen, {args.pairs} pairs: {sc.details}")
    print("self-check seconds (once per model, dtype and length; the warm-up pays it): "
          + ", ".join(f"{k} {v:.2f}" for k, v in checks.items()))
    share, cold = checks["screen, 1 pair"] / screen_s, checks["warm-up"] / screen_s
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    print(f"speedup_exact={tl_s / exact_s:.1f} speedup_screen={tl_s / screen_s:.1f} "
          f"max_abs_diff={max_diff:.2e} recall_at_k={rec:.2f} check_share_screen={share:.3f} "
          f"cold_check_share_screen={cold:.3f}")


if __name__ == "__main__":
    main()
