#!/usr/bin/env bash
# Where a whole-model decode step's time goes: graph-replayed step, every kernel's µs per step (torch.profiler), by class, ranked (hydrahead, 30 KV groups kept) and random (34) 7:1 masks. No fla needed: the caches are filled at random. 'again:' repeats the defaults at the end of the run (the spread between two measurements of one setting).
# Usage: bash benchmarks/recipes/decode_step.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_decode_step_b16_t32768.json (and _twice: the same configuration in an earlier run, two measurements), h200_decode_step_b16_t65536.json, h200_decode_step_b1_t32768.json, h200_decode_step_b16_t8192.json
# Module switches in these commands (lean.X=..., static.X=..., splitk.X=...) reproduce the stored file at the commit
# that wrote it; today the variants are InferenceConfig fields (CHANGELOG.md maps them).
set -euo pipefail
OUT=${1:-/tmp/bench/decode_step}
mkdir -p "$OUT"
P="python benchmarks/profile_decode.py --masks hydrahead random"
$P --out "$OUT/b16_t32768" --batch 16 --length 32768 --reps 300 --variants defaults again:
$P --out "$OUT/b16_t65536" --batch 16 --length 65536 --reps 200 --variants defaults noends:static.COMPILE_ENDS=False
$P --out "$OUT/b1_t32768" --batch 1 --length 32768 --reps 300 --variants defaults noends:static.COMPILE_ENDS=False
$P --out "$OUT/b16_t8192" --batch 16 --length 8192 --reps 200 --variants defaults
