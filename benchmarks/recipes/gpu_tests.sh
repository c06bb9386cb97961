#!/usr/bin/env bash
# GPU tests of the hybrid's kernels and graphs (lean path, fla kernels, the Triton decode kernels, graphed decoding, eager GDN graphs; they skip without CUDA).
# Usage: bash benchmarks/recipes/gpu_tests.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_gpu_tests.log
set -euo pipefail
OUT=${1:-/tmp/bench/gpu_tests}
mkdir -p "$OUT"
# issue 61's Gemma 3 / Mistral fixes first: the one-launch decode step at head_dim 256 in fp32 and bf16 (it asked
# 282,688 B of shared memory), FlashQLA's prefill at 4 GDN heads next to fla's at 3 and 27 (FlashQLA's cumsum does
# not compile at odd counts), the layer tail at Mistral-7B's sizes in fp32 (it asked 305,152 B)
python -m pytest -q -rA "tests/test_step.py::test_one_launch_at_gemma3_head_dim_256" \
  "tests/test_hybrid_gdn.py::test_flash_qla_prefill_matches_reference_bf16" \
  "tests/test_tail_step.py::test_kernel_in_fp32_at_the_mistral_shape" 2>&1 | tee "$OUT/issue61_fixes.log" || true
python -m pytest -q tests/test_tail_step.py tests/test_step.py tests/test_splitk.py tests/test_gdn_step.py \
  tests/test_fa_step.py tests/test_hybrid_graphs.py tests/test_hybrid_lean.py tests/test_hybrid_gdn.py tests/test_eager_graphs.py \
  tests/test_hybrid_family_backends.py tests/test_fast_train_gpu.py tests/test_train.py 2>&1 | tee "$OUT/gpu_tests.log"
