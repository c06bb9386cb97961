"""Exact and screen-then-verify receiver patching vs TransformerLens' per-head sweep, in one process.

    python benchmarks/bench_patching.py [--seq-len 256] [--pairs 6] [--skip-tl]

Part 1 (one niah_single pair, needle at depth 0.5): times
  * TransformerLens `get_act_patch_attn_head_out_all_pos` over all heads (one forward per head),
  * headscope exact mode (same IE to float error; batched, layer/prefix reuse),
  * headscope screen-then-verify, ``verify="auto"`` (AtP + bf16 probes of 4-layer blocks, refined best
    first into layers, KV groups and heads where AtP's sums miss, exact verification until the top 10 is
    certified by the stopping rule, a heuristic; see ``screen_auto``).
Part 2 (``--pairs`` pairs): exact vs screen-then-verify top-10 on the mean IE.
The final line is `speedup_exact=X speedup_screen=Y max_abs_diff=Z recall_at_k=R`.
Times are ratios against the TransformerLens sweep measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import time

import pandas as pd
import torch

import headscope
from headscope.patching import receiver_patching
from headscope.patching.attribution import recall_at_k, screen_then_verify
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--skip-tl", action="store_true", help="skip the TransformerLens sweep (no speedups)")
    args = ap.parse_args()
    model = headscope.load_model(args.model, device="cpu")
    one = niah_single(model.tokenizer, n_pairs=1, seq_len=args.seq_len, depth=0.5, seed=0)
    rows = []
    # warm-up (allocator, bridge boot) outside the timings
    receiver_patching(model, one, direction="denoising", min_gap=0.0, progress=False, heads=[(0, 0)])
    _ = model.bridge

    tl_s = float("nan")
    max_diff = float("nan")
    t = time.perf_counter()
    exact = receiver_patching(model, one, direction="denoising", min_gap=0.0, progress=False)
    exact_s = time.perf_counter() - t
    rows.append(("headscope exact (denoising)", exact_s))
    if not args.skip_tl:
        t = time.perf_counter()
        tl = tl_sweep(model, one[0])
        tl_s = time.perf_counter() - t
        rows.append(("TransformerLens per-head sweep", tl_s))
        max_diff = float((exact.patched[0] - tl).abs().max())
    t = time.perf_counter()
    scr1 = screen_then_verify(model, one, verify="auto", min_gap=0.0, progress=False)
    screen_s = time.perf_counter() - t
    rows.append(("headscope screen-then-verify", screen_s))
    print(f"screen, 1 pair: {scr1.details}")

    pairs = niah_single(model.tokenizer, n_pairs=args.pairs, seq_len=args.seq_len, depth=0.5, seed=1)
    t = time.perf_counter()
    ex = receiver_patching(model, pairs, progress=False)
    ex6 = time.perf_counter() - t
    t = time.perf_counter()
    sc = screen_then_verify(model, pairs, verify="auto", progress=False)
    sc6 = time.perf_counter() - t
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
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    print(f"speedup_exact={tl_s / exact_s:.1f} speedup_screen={tl_s / screen_s:.1f} "
          f"max_abs_diff={max_diff:.2e} recall_at_k={rec:.2f}")


if __name__ == "__main__":
    main()
