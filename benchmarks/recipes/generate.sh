#!/usr/bin/env bash
# End-to-end greedy generate (graphed device-position steps vs eager) through the compiled tail: ms per new token of a 2n-token call's decode steps, CUDA events (StaticDecoder.last_timing), after a warm-up; ranked 7:1 mask, B = 16, 32K prompt. Needs fla on the host (fla-core's wheel alone, or both wheel sets: fla without tilelang's dependencies fails to import).
# Usage: bash benchmarks/recipes/generate.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_hybrid_generate.json (generate_ms_per_token_graph_compiled_tail)
set -euo pipefail
OUT=${1:-/tmp/bench/generate}
mkdir -p "$OUT"
python benchmarks/bench_hybrid.py --no-layer --model --generate-only --generate 64 --compile-tail \
  --model-lengths 32768 --model-batches 16 --model-cells 16x32768 --out "$OUT"
# both batches with every variant (generate_ms_per_token_*, generate_wall_ms_per_token_graph):
# python benchmarks/bench_hybrid.py --no-layer --model --generate-only --generate 64 --decode-variants --compile-tail \
#   --model-lengths 32768 --model-batches 1 16 --model-cells 1x32768,16x32768 --out "$OUT/variants"
