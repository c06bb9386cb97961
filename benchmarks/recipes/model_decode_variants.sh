#!/usr/bin/env bash
# Whole SmolLM2-shaped model: decode step per variant with the Triton kernels and compiled layer tails, B = 1/16 at 8K/32K (decode_step_ms_<variant>, ratio.decode_tok_s_* in model). The stored file's generate_* keys predate the corrected timing and are not usable (h200_hybrid_generate.json has them).
# Usage: bash benchmarks/recipes/model_decode_variants.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_hybrid_model_decode_variants.json
set -euo pipefail
OUT=${1:-/tmp/bench/model_decode_variants}
mkdir -p "$OUT"
python benchmarks/bench_hybrid.py --no-layer --model --model-lengths 32768 8192 --model-batches 16 1 \
  --model-cells 16x32768,1x32768,16x8192 --compile-tail --decode-variants --generate 128 --out "$OUT"
