#!/usr/bin/env bash
# The >= 50M-token conversion comparison and the component ablation on one host with 2 GPUs
# (issue 16), run from the repository root after the bundle's wheels are installed
# (benchmarks/README.md). Every step is resumable: run it again and finished pieces are skipped.
#
#   MODEL=/path/SmolLM2-135M-Instruct.Q4_1.gguf CONV_OUT=/data/conv bash experiments/gpu_conversion.sh
#
# Settings (environment): MASK (the HydraHead mask.json), TOKENS (per model, default 50e6), ABL_TOKENS (10e6), SAMPLE_S (seconds of
# teacher sampling per GPU, 150), SAMPLE_BATCH (2048), EVAL_N (100), EVAL_LENGTHS, DEV0 / DEV1 (the two
# devices, cuda:0 / cuda:1; CPU smoke test: DEV0=cpu DEV1=cpu with tiny settings), EXTRA_PLAN (more
# `conversion.py plan` options), SAMPLE_ARGS (more `conversion.py sample` options),
# SAMPLE_MAX_DOCS (documents per shard, "8192,10240" with SAMPLE_S=1000 to redraw the 2026-11-30 data; data/info.json
# records the counts and a SHA-256 of the documents to check), HELDOUT_DOCS (sampled documents held out for perplexity, 256), WARMUP ('' = no kernel warm-up run),
# JOBS0 / JOBS1 (the two queues, comma-separated job names; default: every planned job but allgdn, the main
# comparison first; set to '' to leave a queue out), JOBS2 / DEV2 (an optional third queue, on DEV0 unless DEV2 is
# set), EARLY_TEACHER=1 (the teacher's retrieval cells beside the sampling; packing waits for them too).
# One GPU: DEV1=cuda:0 (both queues on it; at most two training queues per GPU). Logs in $CONV_OUT/logs; the table via `conversion.py report`.
set -u
OUTD=${CONV_OUT:-/tmp/conv}
M=${MODEL:?set MODEL to the teacher (a .gguf path, HF directory or spec)}
PY=${PYTHON:-python3}
DEV0=${DEV0:-cuda:0}
DEV1=${DEV1:-cuda:1}
export PYTHONUNBUFFERED=1
mkdir -p "$OUTD/logs"
L="$OUTD/logs"
stamp() { echo "[$(date +%T)] $*" | tee -a "$L/steps.log"; }

if [ ! -f "$OUTD/settings.json" ]; then
  stamp plan
  # shellcheck disable=SC2086
  $PY experiments/conversion.py plan --out "$OUTD" --model "$M" \
    --mask "${MASK:-experiments/conversion-smollm2/masks/hydrahead.json}" \
    --tokens "${TOKENS:-50e6}" --ablation-tokens "${ABL_TOKENS:-10e6}" --eval-n "${EVAL_N:-100}" \
    ${EVAL_LENGTHS:+$EVAL_LENGTHS} ${EXTRA_PLAN:-} > "$L/plan.log" 2>&1 || { stamp "plan failed"; exit 1; }
fi

if [ ! -f "$OUTD/data/done" ]; then
  stamp "sample on $DEV0 and $DEV1 (${SAMPLE_S:-150} s each)"
  IFS=, read -r -a maxdocs <<< "${SAMPLE_MAX_DOCS:-10000000,10000000}"
  pids=()
  for k in 0 1; do
    dv=$DEV0; [ $k = 1 ] && dv=$DEV1
    [ -f "$OUTD/data/docs_$k.pt" ] || { $PY experiments/conversion.py sample --out "$OUTD" --shard $k --model "$M" \
      --device "$dv" --seconds "${SAMPLE_S:-150}" --batch "${SAMPLE_BATCH:-2048}" --cache-implementation static --max-docs "${maxdocs[$k]}" ${SAMPLE_ARGS:-} \
      > "$L/sample$k.log" 2>&1 & pids+=($!); }
  done
  # fla/tilelang kernels and the compiled step, built into the on-disk caches while the teacher samples; not
  # waited for (on 2026-11-30 it outlasted the sampling by ~5 min): the queues start when the data are packed
  [ -n "${WARMUP-1}" ] && $PY benchmarks/bench_train.py --out "$OUTD/logs/warmup.json" --shapes 64x512,16x2048 \
    --stages13 64x512 --variants hybrid_fast --variants13 hybrid_fast --ladder '' --steps 1 > "$L/warmup.log" 2>&1 &
  # the evaluation prompts, built once on the CPU while the GPUs sample
  $PY experiments/conversion.py pairs --out "$OUTD" --model "$M" > "$L/pairs.log" 2>&1 & pids+=($!)
  # EARLY_TEACHER=1: the teacher's retrieval cells need no sampled data; they run beside the sampling (its
  # perplexity follows in the queue that names "teacher")
  if [ -n "${EARLY_TEACHER:-}" ]; then
    $PY experiments/conversion.py queue --out "$OUTD" --model "$M" --device "$DEV1" --jobs teacher \
      >> "$L/teacher_early.log" 2>&1 & pids+=($!)
  fi
  wait "${pids[@]}"
  stamp pack
  $PY experiments/conversion.py pack --out "$OUTD" --model "$M" --heldout-docs "${HELDOUT_DOCS:-256}" > "$L/pack.log" 2>&1 || { stamp "pack failed"; exit 1; }
fi

stamp "queues"
# the main comparison first on both devices, then the teacher, then the ablation; a queue set to '' (e.g. JOBS1=)
# does not run, nor one whose jobs have all finished (eval.json: the queue would skip each of them)
J0=${JOBS0-hydrahead,layerwise3,abl0_base,abl2_gdn_rope}
J1=${JOBS1-layerwise,random,teacher,abl1_fa_nope,abl3_fa_gate}
unfinished() { local j; for j in ${1//,/ }; do [ -f "$OUTD/$j/eval.json" ] || return 0; done; return 1; }
unfinished "$J0" && $PY experiments/conversion.py queue --out "$OUTD" --model "$M" --device "$DEV0" \
  --jobs "$J0" >> "$L/queue0.log" 2>&1 &
unfinished "$J1" && $PY experiments/conversion.py queue --out "$OUTD" --model "$M" --device "$DEV1" \
  --jobs "$J1" >> "$L/queue1.log" 2>&1 &
# an optional third queue (DEV2); on one H200 three training queues ran out of memory once (2026-12-01): two per GPU
if unfinished "${JOBS2:-}"; then
  $PY experiments/conversion.py queue --out "$OUTD" --model "$M" --device "${DEV2:-$DEV0}" \
    --jobs "$JOBS2" >> "$L/queue2.log" 2>&1 &
fi
wait
$PY experiments/conversion.py report --out "$OUTD" > "$L/report.log" 2>&1
stamp done
