#!/usr/bin/env bash
# Issue 39 item 6, "nothing silently wrong in the hybrid model", on the GPU host: every GDN kernel path (fla chunk with its backward, fla's chunk forward one-call and staged, FlashQLA, fla's fused recurrent, headscope's Triton decode step and one-launch step, the PyTorch forms) against fp64 in bf16 (T = 200, weak and strong decay, measured errors printed); the decay parameters bitwise fp32 through a bf16 load of the saved remote code; every captured CUDA-graph path (GDN prefill blocks, StaticDecoder.capture, step_replayed (generate's decode steps), prefill_graphed) leaving the recurrent state of an eager run; greedy tokens of generate (default and static cache) / a cache-free loop, also in a fresh process without headscope. Skips print their reasons (-rs; a missing fla-core or flash-qla wheel is named). Needs fla-core (wheels-a) for the fla checks, flash-qla for the FlashQLA one.
# Usage: bash benchmarks/recipes/gpu_checks.sh [OUT_DIR] [PYTEST_ARGS...]   (repository root on the GPU host; default
#   $OUT). A whole run takes ~6-9 minutes (TileLang compiles each kernel once, ~16 s); to split it over two calls of
#   <= 10 minutes: ... OUT_DIR -k "fp64" (the kernel paths), then ... OUT_DIR -k "not fp64" (the rest); each part
#   writes its own log (the -k expression in its name).
# Stored result: h200_hybrid_gpu_checks_k_fp64.log + h200_hybrid_gpu_checks_k_not_fp64.log (the run in two calls)
set -euo pipefail
OUT=${1:-${OUT:-/tmp/bench/gpu_checks}}
shift || true
mkdir -p "$OUT"
tag=$(printf '%s' "$*" | tr -c 'A-Za-z0-9' '_')
python -m pytest -v -s -rs tests/test_hybrid_gpu_checks.py "$@" 2>&1 | tee "$OUT/h200_hybrid_gpu_checks${tag:+_$tag}.log"
