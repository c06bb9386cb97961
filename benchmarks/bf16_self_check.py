"""The engine's self-check in bfloat16 at growing prompt lengths: the largest relative difference of the old comparison
along the engine's own residual stream (:func:`~headscope.patching.reference_check.compare`, what 16-bit models were checked
with before: the two forwards' rounding accumulates over depth and length) and of the teacher-forced one
(:func:`~headscope.patching.reference_check.compare_teacher_forced`, each layer from the model's own input to it), both against
the tolerance 8·eps, and the patched-row check (:func:`~headscope.patching.reference_check.check_patches`, one row, the
prompt's cached prefix up to its first differing token). Prompts: one ``niah_single`` pair per length (what
``headscope rank`` ranks).

    PYTHONPATH=. .venv/bin/python benchmarks/bf16_self_check.py --device cpu --lengths 128 256 512 1024
    PYTHONPATH=. .venv/bin/python benchmarks/bf16_self_check.py --device cuda --lengths 1024 4096 8192

Prints one line per length: tokens, old (accumulated) worst and the first part it refuses, new (teacher-forced)
worst, patched-row difference, tolerance, seconds.
"""

from __future__ import annotations

import argparse
import time

import torch

from headscope.models import load_model
from headscope.patching import reference_check as chk
from headscope.patching.engine import Engine, EngineMismatch
from headscope.patching.pass_plan import Plan
from headscope.patching.receivers import sequences
from headscope.tasks import make_pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    a = ap.parse_args()
    lm = load_model(a.model, device=a.device, dtype=getattr(torch, a.dtype))
    eng = Engine(lm, check=False)
    tol = chk.tolerance(eng.dtype)
    print(f"{a.model} in {a.dtype} on {a.device}: {eng.g.n_layers} layers, tolerance {tol:.3g}")
    for L in a.lengths:
        t0 = time.perf_counter()
        pair = make_pairs("niah_single", lm.tokenizer, n_pairs=1, seq_len=L, depth=0.5, seed=0)[0]
        clean, corr, read = sequences(pair)
        T = int(clean.numel())
        ref = chk.model_reference(eng, clean)
        new = chk.compare_teacher_forced(eng, clean, ref, range(T), tol=float("inf"))
        res = eng.forward(Plan(read=list(range(T)), ids=clean, keep=True))
        old = chk.compare(eng, res.cache, res.out[0], ref, range(T), tol=float("inf"))
        try:
            chk.compare(eng, res.cache, res.out[0], ref, range(T))
            first = "-"
        except EngineMismatch as e:
            first = str(e).split(": relative difference")[0].split("own forward ")[-1]
        del ref, res
        base, src = eng.run(clean, read), eng.run(corr, read)
        start = int((clean != corr).nonzero()[0])
        patched = chk.check_patches(eng, clean, base, src, start, read, tol=float("inf"))
        print(f"T={T}: old (accumulated) {old:.4f} [{first}], new (teacher-forced) {new:.4f}, patched row "
              f"{patched:.4f}, tolerance {tol:.4f}; {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
