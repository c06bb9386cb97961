#!/usr/bin/env bash
# GDN block size vs prefill time and peak memory, graphed, both fla paths (lean.GDN_LOW_MEMORY on/off). fla-core alone.
# Usage: bash benchmarks/recipes/block_sweep.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_hybrid_block_sweep.json (key block_sweep)
# Module switches in these commands (lean.X=..., static.X=..., splitk.X=...) reproduce the stored file at the commit
# that wrote it; today the variants are InferenceConfig fields (CHANGELOG.md maps them).
set -euo pipefail
OUT=${1:-/tmp/bench/block_sweep}
mkdir -p "$OUT"
python benchmarks/bench_hybrid.py --no-layer --block-sweep --sweep-graphed --shapes smollm2-135m qwen3-1.7b \
  --sweep-lengths 16384 32768 65536 131072 --sweep-blocks 2048 4096 8192 16384 32768 65536 \
  --sweep-variants defaults onecall:lean.GDN_LOW_MEMORY=False --out "$OUT"
