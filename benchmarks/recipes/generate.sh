#!/usr/bin/env bash
# End-to-end greedy generate through transformers' model.generate (decode steps replayed from a CUDA graph vs eager steps; --compile-tail: also a static cache, compiled tails): ms per new token = (wall of a 2n-token call - an n-token one) / n, each after a warm-up call; ranked 7:1 mask, B = 16, 32K prompt. The stored file predates this timing (CUDA events around StaticDecoder.generate's steps, removed); bench_generate.py is the issue-39 table. Needs fla on the host (fla-core's wheel alone, or both wheel sets: fla without tilelang's dependencies fails to import).
# Usage: bash benchmarks/recipes/generate.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_hybrid_generate.json (generate_ms_per_token_graph_compiled_tail)
set -euo pipefail
OUT=${1:-/tmp/bench/generate}
mkdir -p "$OUT"
python benchmarks/bench_hybrid.py --no-layer --model --generate-only --generate 64 --compile-tail \
  --model-lengths 32768 --model-batches 16 --model-cells 16x32768 --out "$OUT"
# both batches with every variant (generate_ms_per_token_*):
# python benchmarks/bench_hybrid.py --no-layer --model --generate-only --generate 64 --decode-variants --compile-tail \
#   --model-lengths 32768 --model-batches 1 16 --model-cells 1x32768,16x32768 --out "$OUT/variants"
