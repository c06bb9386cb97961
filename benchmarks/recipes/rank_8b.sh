#!/usr/bin/env bash
# Exact receiver IE of all 1,024 heads of a Llama-3.1-8B-shaped model (random weights, bf16) at 8K tokens on one GPU,
# beside the one-hook-per-head sweep and the screen; pieces run as separate calls, then merged.
# Usage: bash benchmarks/recipes/rank_8b.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: benchmarks/results/h200_rank_8b.json
set -euo pipefail
OUT=${1:-/tmp/bench/rank_8b}
mkdir -p "$OUT"/a "$OUT"/b "$OUT"/c
PYTHONPATH=. python benchmarks/gpu_rank_8b.py --piece engine --pair-idx 0,1 --out-dir "$OUT/a"
PYTHONPATH=. python benchmarks/gpu_rank_8b.py --piece engine,sweep --pair-idx 2,3,4,5 --out-dir "$OUT/b"
PYTHONPATH=. python benchmarks/gpu_rank_8b.py --piece screen --out-dir "$OUT/c"
python benchmarks/gpu_rank_8b.py --merge "$OUT"/a/*.json "$OUT"/b/*.json "$OUT"/c/*.json --out "$OUT/h200_rank_8b.json"
