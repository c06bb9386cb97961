#!/usr/bin/env bash
# One attention layer, hybrid vs all-FA vs teacher: prefill 8K-128K (eager and graph-replayed), decode step, peak memory, cache. Needs fla-core + tilelang (wheels-a); the second call also flash-qla 0.1.3.
# Usage: bash benchmarks/recipes/layer.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: benchmarks/results/h200_hybrid_layer.json, h200_hybrid_layer_qwen3_flashqla.json
set -euo pipefail
OUT=${1:-/tmp/bench/layer}
mkdir -p "$OUT"
python benchmarks/bench_hybrid.py --out "$OUT/both" --no-before --graph-block 0 --shapes smollm2-135m qwen3-1.7b \
  --lengths 32768 16384 65536 131072 --graph-reps 100 --eager-reps 5 --budget-s 330
# the Qwen3-1.7B shape again with FlashQLA installed (head_dim 128 takes it by default, lean.FLASH_QLA)
python benchmarks/bench_hybrid.py --out "$OUT/qwen3_flashqla" --no-before --graph-block 0 --shapes qwen3-1.7b \
  --lengths 32768 16384 65536 131072 --graph-reps 100 --eager-reps 5 --budget-s 330
