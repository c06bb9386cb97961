#!/usr/bin/env bash
# The conversion stages at Qwen3-1.7B shape on one GPU against the teacher's compiled dense step (issue 63 items 1, 5),
# each command under 10 minutes on one H100 / H200 (the first compiles from scratch: 4 minutes at the SmolLM2 shape), each
# writing its JSON after every step. Needs fla (the fast step on CUDA runs with it): `source tools/device/device_env.sh`.
# Usage: bash benchmarks/recipes/convert_scale.sh [OUT_DIR] [PART ...]   (run from the repository root on the GPU host;
#        PART: s2 s2_bf16t s3_8k s3_2k s1 check resume s2_accum llama8b_s1 llama8b_s1_fp32, default the first five; on the `device` tool give the
#        same lines to tools/device/chain.sh start)
# Memory (headscope plan-memory's model with the float32 teacher `headscope convert` holds; stage 3 parks the teacher in
# host memory since 2026-12-06, before that it stayed resident, +6.4 GiB): s2 51.7 GiB, s3_8k 42.9, s3_2k 42.9, s1 39.7 (two
# 32-row micro-batches; whole 64-row batches plan 60.7, and the plan was 0.83x of stage 1's measured peak at SmolLM2),
# check (4 x 512, no checkpointing) about 43 + 14 (two gradient copies) + logits, resume 8 x 512 about 45 (and a
# 21 GiB checkpoint on disk: 1.85B fp32 weights + AdamW's two moments), s2_accum 64.6 (16-row micro-batches),
# llama8b_s1 53.4 (bf16 teacher, stage 1 training only the new parameters: fits one H100), llama8b_s1_fp32 96.7
# (fp32 teacher, every parameter: H200 only). Stored results: <gpu>_convert_scale_qwen3_*.json. Measured on one H100 (docs/performance.md):
# s2_accum peaked at 73.0 GiB with its baseline at 60.7 (ran, 0.67x); s3_8k without checkpointing ran out of memory;
# --activation-checkpointing with the fast step failed on CUDA (s2, s3_8k, s3_2k need it). s2 and s2_accum
# also profile 2 steps per variant (--profile: the GPU's busy share and top kernels, for the MFU gap).
set -euo pipefail
OUT=${1:-/tmp/bench/convert_scale}
shift || true
PARTS=${*:-s2 s3_8k s3_2k s1 check}
mkdir -p "$OUT"
B="python benchmarks/bench_convert_scale.py --shape qwen3-1.7b --budget-s 480"
for part in $PARTS; do
  case $part in
    s2)        $B --stages 2 --activation-checkpointing --profile 2 --out "$OUT/convert_scale_qwen3_s2_ckpt.json" --log "$OUT/s2.log" ;;
    s2_bf16t)  $B --stages 2 --activation-checkpointing --teacher-dtype bf16 --profile 2 \
                 --out "$OUT/convert_scale_qwen3_s2_ckpt_bf16t.json" --log "$OUT/s2_bf16t.log" ;;
    s3_8k)     $B --stages 3 --rows 64,64,4 --seq-len 512,512,8192 --stage3-long '' --activation-checkpointing \
                 --out "$OUT/convert_scale_qwen3_s3_8k_ckpt.json" --log "$OUT/s3_8k.log" ;;
    s3_2k)     $B --stages 3 --stage3-long '' --activation-checkpointing --out "$OUT/convert_scale_qwen3_s3_2k_ckpt.json" \
                 --log "$OUT/s3_2k.log" ;;
    s1)        $B --stages 1 --grad-accum 2 --no-baseline --out "$OUT/convert_scale_qwen3_s1.json" --log "$OUT/s1.log" ;;
    check)     $B --stages '' --check --check-stages 2 --check-rows 4x512 --check-steps 3 \
                 --out "$OUT/convert_scale_qwen3_check.json" --log "$OUT/check.log" ;;  # a process of its own: after
                 # stage 1's case in the same process it ran out of memory (H100)
    resume)    $B --stages '' --resume-check 2 --resume-rows 8x512 --resume-steps 4 \
                 --out "$OUT/convert_scale_qwen3_resume.json" --log "$OUT/resume.log" ;;
    s2_accum)  $B --stages 2 --grad-accum 4 --profile 2 --out "$OUT/convert_scale_qwen3_s2_accum4.json" --log "$OUT/s2_accum.log" ;;
    llama8b_s1) python benchmarks/bench_convert_scale.py --shape llama-3.1-8b --budget-s 480 --stages 1 --rows 16,8,1 \
                 --grad-accum 2 --activation-checkpointing --teacher-dtype bf16 --new-params-only --no-baseline \
                 --out "$OUT/convert_scale_llama8b_s1.json" --log "$OUT/llama8b_s1.log" ;;
    llama8b_s1_fp32) python benchmarks/bench_convert_scale.py --shape llama-3.1-8b --budget-s 480 --stages 1 --rows 16,8,1 \
                 --activation-checkpointing --no-baseline --out "$OUT/convert_scale_llama8b_s1_fp32.json" \
                 --log "$OUT/llama8b_s1_fp32.log" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
