#!/usr/bin/env bash
# Issue 61's per-family table (docs/performance.md): for SmolLM2, Qwen2 (biases), Qwen3-0.6B, Mistral-7B's layer shape
# (8 layers), Gemma 3 270M and Pythia-160M (GPT-NeoX), random weights of each family's config (benchmarks/family_configs.py)
# with a 7:1 mask, bf16, one GPU: `generate` with defaults hybrid / teacher ms per token at B1·8K and B16·32K and each
# model's first call (gen_F), the stage-2 training step against the teacher's compiled dense step (train_F), and on the
# real checkpoints the greedy tokens of the fast and reference paths (greedy_smollm2, greedy_gemma3). One JSON (+ log)
# per part in OUT_DIR; `python benchmarks/families_table.py OUT_DIR` prints the table.
# Usage: bash benchmarks/recipes/families.sh OUT_DIR PART ...   (repository root on the GPU host, after
#        `source tools/device/device_env.sh`: fla and tilelang are needed; on the `device` tool give the parts to
#        tools/device/chain.sh start, a few per command)
# PART (minutes on one H100, estimated from the stored runs: process start + building the models on the CPU 0.5-1,
#       compile and capture of the first calls, the teacher's B16·32K prefill 5-8 s a call at the larger families;
#       the training step's first compile: the dense teacher's torch.compile 80-190 s, the hybrid's fast step
#       45-230 s cold, h200_train_ratio_api.json and h100_convert_scale_qwen3_*.json):
#   gen_smollm2 2.5   gen_qwen2 2.5   gen_qwen3 4   gen_mistral 4.5   gen_gemma3 3   gen_gpt-neox 2.5   (all: 19)
#   train_smollm2 5.5 train_qwen2 4.5 train_qwen3 5.5 train_mistral 6.5 train_gemma3 4.5 train_gpt-neox 4 (all: 30.5)
#   greedy_smollm2 1.5 (needs the SmolLM2 GGUF: .gpu/m1..m3 carried)
#   greedy_gemma3 2    (needs /tmp/g/gemma3-270m.gguf: .gpu/g1..g6 carried, make_carry.sh --gemma; or GEMMA3_GGUF)
#   first_F (optional, item 5's cross-process figures: bench_first_call.py cold, cached, warm_up at B1·8K) 2-4 each
# Order (the whole table is ~53 minutes of parts: two or three lent sessions of 30 device-minutes, ~25 of them for
# a chain once the wheels are in):
#   session 1: gen_smollm2 gen_qwen2 gen_gpt-neox gen_gemma3 gen_qwen3 gen_mistral, then greedy_smollm2 and
#              greedy_gemma3 once their GGUFs have come (chain.sh "wait FILE" lines)            ~22.5 min
#   session 2: train_mistral train_gemma3 train_qwen2 train_qwen3 (the families made fast)      ~21 min
#   session 3: train_smollm2 train_gpt-neox, then first_F where time is left                  ~9.5 min + 2-4 each
# First calls (gen_F): the process's first generate with the compile caches on disk as earlier parts left them (the
# chain's TRITON_CACHE_DIR, Inductor's /tmp/torchinductor_USER, TileLang's ~/.tilelang/cache); first_F's cold mode
# starts from empty caches.
# The table reads whatever files are there; a part not run shows as "not measured". Each part prints its wall seconds
# ("== PART: rc=..., N s"): replace these estimates with them.
# Memory (H100, 80 GB): gen_qwen3's teacher at B16·32K holds a 60 GiB DynamicCache (28 layers x 8 KV heads x 128 x
# 524,288 tokens, bf16); Mistral's and Gemma 3's teachers at B16·32K go through transformers' sliding-window mask in
# SDPA (16 x 32K x 32K); a model that runs out of memory in a cell is recorded as such and the part goes on. Training
# shapes: family_configs.TRAIN_SHAPE (64 x 512; 16 x 512 for the Qwen vocabularies, Gemma 3 and Mistral).
# env: PART_TIMEOUT_S (600: a part that hangs is killed, its JSON kept as far as written), GEMMA3_GGUF, PYTHON.
set -uo pipefail
OUT=${1:?OUT_DIR}
shift
[ $# -ge 1 ] || { echo "give at least one PART (see the header of $0)" >&2; exit 2; }
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
PY=${PYTHON:-python}
T=${PART_TIMEOUT_S:-600}
FAMILIES="smollm2 qwen2 qwen3 mistral gemma3 gpt-neox"
for part in "$@"; do  # every part checked before any runs
  case $part in
    gen_*|train_*|first_*)
      [[ " $FAMILIES " == *" ${part#*_} "* ]] || { echo "unknown family in $part (one of: $FAMILIES)" >&2; exit 2; } ;;
    greedy_smollm2|greedy_gemma3) ;;
    *) echo "unknown part $part (see the header of $0)" >&2; exit 2 ;;
  esac
done
failed=()
for part in "$@"; do
  fam=${part#*_}
  case $part in
    gen_*)   cmd=("$PY" benchmarks/bench_generate.py --family "$fam" --settings default --cells 1x8192,16x32768 --reps 1
                  --out "$OUT/generate_$fam.json") ;;
    train_*) cmd=("$PY" benchmarks/bench_train.py --family "$fam" --out "$OUT/train_$fam.json") ;;
    first_*) cmd=("$PY" benchmarks/bench_first_call.py --family "$fam" --batches 1 --lengths 8192
                  --cache-dir "/tmp/first_call_$fam" --out "$OUT/first_call_$fam.json") ;;
    greedy_smollm2) cmd=("$PY" benchmarks/gpu_greedy_real.py --model smollm2-135m --out "$OUT/greedy_smollm2.json") ;;
    greedy_gemma3)  cmd=("$PY" benchmarks/gpu_greedy_real.py --model "${GEMMA3_GGUF:-/tmp/g/gemma3-270m.gguf}"
                         --out "$OUT/greedy_gemma3.json") ;;
  esac
  echo "== $part: ${cmd[*]}"
  start=$(date +%s)
  timeout "$T" "${cmd[@]}" > "$OUT/$part.log" 2>&1
  rc=$?
  echo "== $part: rc=$rc, $(( $(date +%s) - start )) s"
  tail -n 3 "$OUT/$part.log"
  [ $rc = 0 ] || failed+=("$part")
done
[ ${#failed[@]} = 0 ] || { echo "failed parts: ${failed[*]}"; exit 1; }
