#!/usr/bin/env bash
# Layer decode with the one-launch step (SmolLM2 shape, B = 1, 32K and 128K, all-FA and hybrid layer), its module options, the attention ops alone against the layer (raw-op ceiling), and the one-launch kernel taken apart.
# Usage: bash benchmarks/recipes/decode_kernels.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_hybrid_layer_decode_one_launch_smollm2.json, h200_hybrid_layer_decode_{combine,splitk_sweep}_smollm2.json, h200_decode_raw_ops.json, h200_one_launch_step.json, h200_one_launch_step_peel.json (their shared_gdn and peel cells: two variants timed and removed)
# Module switches in these commands (lean.X=..., static.X=..., splitk.X=...) reproduce the stored file at the commit
# that wrote it; today the variants are InferenceConfig fields (CHANGELOG.md maps them).
set -euo pipefail
OUT=${1:-/tmp/bench/decode_kernels}
mkdir -p "$OUT"
B="python benchmarks/bench_hybrid.py --no-before --no-graph-prefill --graph-block 0"
$B --out "$OUT/one_launch" --shapes smollm2-135m --lengths 32768 131072 --variants triton_splitk one_launch devpos_one_launch --graph-reps 200 --eager-reps 5
# module options per variant (smollm2-fa-part: the hybrid's FA part alone)
$B --out "$OUT/options" --shapes smollm2-135m smollm2-fa-part --lengths 32768 131072 \
  --variants one_launch one_launch:step.COMBINE=kernel one_launch:splitk.MIN_SPLIT=128 --profile-at 32768 --graph-reps 300 --eager-reps 5
# SDPA / split-K over the FA heads' KV groups + fla's fused recurrent GDN step, all-FA vs hybrid, B = 1
python benchmarks/bench_decode_raw.py --out "$OUT/raw" --lengths 8192 32768 65536 131072
# the one-launch kernel alone: combination, GDN programs, split counts, the teacher's layer (--smoke: Triton interpreter on CPU)
python benchmarks/bench_one_launch.py --out "$OUT/kernel" --batch 16 1 --splits 20 33 50
