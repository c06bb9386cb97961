#!/usr/bin/env bash
# The screen (screen_auto, certified top 10) of the 8B-shaped ranking at 8K tokens, its time, verified heads and
# recall@10 against the exact IE, added to the stored benchmarks/results/h200_rank_8b.json.
# The stored result keeps no per-head IE, so the exact engine reruns the same seeded model and pairs beside the
# screen (~380 s + ~60 s on an H200, at 125/105/86/64/42/18 s per pair): two calls of < 9 min each.
# Usage (repository root):
#   bash benchmarks/recipes/rank_8b_screen.sh a OUT_DIR    # GPU host: engine pairs 0-3 (~6.7 min)
#   bash benchmarks/recipes/rank_8b_screen.sh b OUT_DIR    # GPU host: engine pairs 4, 5 + the screen (<= 9 min)
#   bash benchmarks/recipes/rank_8b_screen.sh merge A_DIR B_DIR [STORED]   # here: into the stored result
#   bash benchmarks/recipes/rank_8b_screen.sh short OUT_DIR   # GPU host, one call: engine + screen of pairs 4, 5 only
#   bash benchmarks/recipes/rank_8b_screen.sh merge-short OUT_DIR [STORED]
# env: PYTHON (default python), TOKENIZER (default .gpu/smol_tokenizer).
# The tokenizer must be the stored run's (.gpu/smol_tokenizer, or TOKENIZER=DIR): merge refuses pieces whose
# configuration or pair lengths differ from the stored result's.
set -euo pipefail
step=${1:?a, b or merge}
TOK=${TOKENIZER:-.gpu/smol_tokenizer}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}."
PY=${PYTHON:-python}
case "$step" in
  a) "$PY" benchmarks/gpu_rank_8b.py --piece engine --pair-idx 0,1,2,3 --tokenizer "$TOK" --out-dir "${2:?OUT_DIR}" ;;
  b) "$PY" benchmarks/gpu_rank_8b.py --piece engine,screen --pair-idx 4,5 --tokenizer "$TOK" --out-dir "${2:?OUT_DIR}" ;;
  # one call: the screen on the two deepest pairs (~60 s of exact engine) -- recall@10 over those pairs
  short) "$PY" benchmarks/gpu_rank_8b.py --piece engine,screen --pair-idx 4,5 --screen-own-pairs --tokenizer "$TOK" \
           --out-dir "${2:?OUT_DIR}" ;;
  merge-short) "$PY" benchmarks/gpu_rank_8b.py --merge "${2:?B_DIR}"/rank8b_engine-screen_4-5.json \
           --merge-into "${3:-benchmarks/results/h200_rank_8b.json}" ;;
  merge) "$PY" benchmarks/gpu_rank_8b.py --merge "${2:?A_DIR}"/rank8b_engine_0-1-2-3.json \
           "${3:?B_DIR}"/rank8b_engine-screen_4-5.json --merge-into "${4:-benchmarks/results/h200_rank_8b.json}" ;;
  *) echo "unknown step $step: a, b or merge" >&2; exit 2 ;;
esac
