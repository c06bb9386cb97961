#!/usr/bin/env bash
# Prefill replayed from a CUDA graph (both layers; the hybrid also with 8K-token GDN blocks) and the whole model's graphed prefill, random mask; measured before the graphed prefill's quarter-token GDN blocks.
# Usage: bash benchmarks/recipes/model_graphed_prefill.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_hybrid_model_graphed_prefill.json (prefill_graph_* keys, model)
set -euo pipefail
OUT=${1:-/tmp/bench/model_graphed_prefill}
mkdir -p "$OUT"
python benchmarks/bench_hybrid.py --no-before --shapes qwen3-1.7b smollm2-135m --lengths 8192 16384 32768 65536 \
  --graph-reps 100 --eager-reps 10 --budget-s 140 --model --model-lengths 8192 16384 32768 \
  --model-cells 1x8192,1x16384,1x32768,16x8192,16x32768 --mask random --out "$OUT"
