#!/usr/bin/env bash
# Decode-step settings compared in one run each (profile_decode.py --variants NAME:module.OPTION=VALUE). The stored files ran with the defaults of their time: the notes say where a file's 'defaults' differ from today's.
# Usage: bash benchmarks/recipes/decode_step_ablations.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_decode_step_ablation_*.json/.log, h200_decode_step_qwen3_b16_t32768.json
# Module switches in these commands (lean.X=..., static.X=..., splitk.X=...) reproduce the stored file at the commit
# that wrote it; today the variants are InferenceConfig fields (CHANGELOG.md maps them).
set -euo pipefail
OUT=${1:-/tmp/bench/decode_step_ablations}
mkdir -p "$OUT"
P="python benchmarks/profile_decode.py --batch 16 --length 32768"
# output fusion and prep overlap (..._fused_out_b16_t32768; ..._overlap_b16_t32768: the forced side stream)
$P --out "$OUT/fused_out" --reps 200 --masks hydrahead random --variants defaults before:lean.DECODE_FUSED_OUT=False,lean.DECODE_OVERLAP_PREP=False
# programmatic dependent launch (..._pdl_b16_t32768; the file ran with the three on by default: its 'before' is today's default)
$P --out "$OUT/pdl" --reps 200 --variants defaults pdl:splitk.PDL=True,static.TAIL_PDL=True cublas_pdl:splitk.PDL=True,static.TAIL_PDL=True,skinny.ENABLE=False
# the Qwen3-1.7B shape (head_dim 128) and its output fusion at d = 128 (h200_decode_step_qwen3_b16_t32768)
python benchmarks/profile_decode.py --out "$OUT/qwen3" --batch 16 --length 32768 --shape qwen3-1.7b --layers 28 --masks random --variants defaults wide:lean.FUSED_OUT_MAX_D=128
# one-launch step vs three launches, with and without PDL (..._one_launch_{b16_t32768,b16_t65536,b1_t32768}; also --batch 1, --length 65536)
$P --out "$OUT/one_launch" --reps 200 --variants defaults three:lean.DECODE_ONE_LAUNCH=False pdl:splitk.PDL=True,static.TAIL_PDL=True pdl3:splitk.PDL=True,static.TAIL_PDL=True,lean.DECODE_ONE_LAUNCH=False
# split-K launch settings with the one-launch step (..._splitk_settings; each setting as name:splitk.X=V)
$P --out "$OUT/splitk" --reps 100 --variants defaults w2:splitk.NUM_WARPS=2 bps8:splitk.BLOCKS_PER_SM=8
# two-launch MLP tail (..._mlp_kernel_{b16,b1}_t32768; the file had the MLP tail on by default: its 'mlpoff' is today's default)
$P --out "$OUT/mlp_kernel" --reps 200 --variants defaults mlp:static.MLP_KERNEL=True three:lean.DECODE_ONE_LAUNCH=False
# Inductor max-autotune for the tail (..._max_autotune)
$P --out "$OUT/max_autotune" --reps 200 --tail-modes default max-autotune-no-cudagraphs
# one-launch layer tail vs the nine launches it replaces (..._tail_kernel_{b16_t32768,b16_t65536,b1_t32768}; also --length 65536 --reps 200, --batch 1)
$P --out "$OUT/tail_kernel" --reps 300 --variants defaults off:static.TAIL_KERNEL=False
# the tail kernel's settings; its development, one file per version (..._tail_{first_version,pipelined,project,pieces}: their 'tk' variants, the tail off by default then)
$P --out "$OUT/tail_settings" --reps 300 --variants defaults tk2:tail_step.NUM_WARPS=2 noproj:static.TAIL_PROJECT_NEXT=False
# compiled ends and dropped variants (..._compiled_ends_b16_t32768; ..._ends_early: tail_step.EARLY_PRODUCTS on by default, dropped;
# ..._preload: tail_step.PRELOAD, dropped)
$P --out "$OUT/compiled_ends" --reps 300 --variants defaults noends:static.COMPILE_ENDS=False bps3:splitk.BLOCKS_PER_SM=3 bps5:splitk.BLOCKS_PER_SM=5 st4:splitk.NUM_STAGES=4 again:
# split-K combination in the one launch (step.COMBINE) vs the tail's first phase (..._launch_combine; run before
# step.LAUNCH_COMBINE_MAX_G, every row combined in the launch)
$P --out "$OUT/launch_combine" --reps 300 --variants defaults tail:lean.DECODE_DEFER_COMBINE=True again:
# not run yet: which launch slows the all-FA teacher under PDL
# $P --out "$OUT/pdl_skip" --reps 200 --variants defaults pdl:splitk.PDL=True,static.TAIL_PDL=True \
#   nopartial:splitk.PDL=True,static.TAIL_PDL=True,splitk.PDL_SKIP=partial nocombine:splitk.PDL=True,static.TAIL_PDL=True,splitk.PDL_SKIP=combine \
#   noprep:splitk.PDL=True,static.TAIL_PDL=True,splitk.PDL_SKIP=prep notail:splitk.PDL=True
