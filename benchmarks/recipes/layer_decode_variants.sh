#!/usr/bin/env bash
# Layer decode step per kernel variant (Triton GDN step, split-K FA decode, device-position steps), the Qwen3 shape also with FlashQLA and 2048-token graphed blocks at 8K-128K.
# Usage: bash benchmarks/recipes/layer_decode_variants.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_hybrid_layer_decode_variants_{qwen3,smollm2}.json (+ .log); with FlashQLA and the decode kernels of then: h200_hybrid_layer_decode_variants_flashqla_qwen3.json (+ _flashqla.log)
set -euo pipefail
OUT=${1:-/tmp/bench/layer_decode_variants}
mkdir -p "$OUT"
L="--lengths 32768 131072 65536 16384 8192 --graph-reps 100 --eager-reps 5 --decode-variants --profile-at 32768"
# the final decode kernels
python benchmarks/bench_hybrid.py --out "$OUT/qwen3" --no-before --shapes qwen3-1.7b $L --budget-s 160 --no-graph-prefill --graph-block 0
python benchmarks/bench_hybrid.py --out "$OUT/smollm2" --no-before --shapes smollm2-135m $L --budget-s 120 --no-graph-prefill --graph-block 0
# FlashQLA vs fla's chunk forward and 2048-token graphed blocks (prefill_*_flashqla, prefill_graph_*@block2048)
python benchmarks/bench_hybrid.py --out "$OUT/qwen3_flashqla" --no-before --shapes qwen3-1.7b $L --budget-s 190 --flash-qla --graph-block 2048
