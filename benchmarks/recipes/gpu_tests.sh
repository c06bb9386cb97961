#!/usr/bin/env bash
# GPU tests of the hybrid's kernels and graphs (lean path, fla kernels, the Triton decode kernels, graphed decoding, eager GDN graphs; they skip without CUDA).
# Usage: bash benchmarks/recipes/gpu_tests.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_gpu_tests.log
set -euo pipefail
OUT=${1:-/tmp/bench/gpu_tests}
mkdir -p "$OUT"
python -m pytest -q tests/test_tail_step.py tests/test_step.py tests/test_splitk.py tests/test_gdn_step.py \
  tests/test_fa_step.py tests/test_hybrid_graphs.py tests/test_hybrid_lean.py tests/test_hybrid_gdn.py tests/test_eager_graphs.py \
  tests/test_hybrid_family_backends.py tests/test_fast_train_gpu.py tests/test_train.py 2>&1 | tee "$OUT/gpu_tests.log"
