#!/usr/bin/env bash
# Issue 62's measurements in parts that each fit one lent GPU session (30 device-minutes, one H100), on the package's
# commands through the study's driver (run.py: headscope convert / eval; headscope rank / mask directly).
#
# Usage (from the repository root): bash experiments/conversion-generalization/gpu_parts.sh OUT PART [PART ...]
#   OUT/work/    conversions (weights), eval folders with their prompt sets: lost with the machine
#   OUT/bring/   what comes back (< 16 MiB a file; no weights, no prompt sets): per teacher KEY (smollm2, gemma3) the
#                eval folder (cells with per-prompt outcomes, haystack, retention.csv), each conversion's recipe.json and
#                stageK/training.json, masks and rankings; docs/KEY_sS.tar.gz: seed S's sampled documents, packed as
#                soon as they are sampled. Written after every step and every minute, so a session cut short keeps
#                what finished.
#   STATE=DIR    (env, absolute path) the bring/ folders of earlier sessions, merged into one carried folder: restored
#                into OUT/work before a part runs, so a part resumes where it stopped (cells already scored are not
#                scored again; a student whose cells are all there is not converted; seed S's documents come from
#                STATE/docs/KEY_sS.tar.gz, so every arm of a seed trains on the same documents in every session).
# A converted model does not survive a session: a part that needs a student converts it again (headscope convert
# --deterministic, the same documents) and scores only its missing cells; every re-conversion's training.json is kept
# (training.N.json beside the latest) for the run-to-run comparison.
#
# Parts and minutes on one H100 (estimates from docs/conversion.md and docs/conversion-eval.md: a default conversion
# ~8 min alone, of which sampling the 12,288 documents ~5 (~7 with a second conversion beside it) and training ~3
# with the first step's ~2 min compile; ~4 min from carried documents; an eval cell with the 20-prompt generation
# check ~20 s at 1K-4K, ~10 s at 8K, ~15 s at 16K; 32K and 64K, not yet measured, scaled by attention FLOPs: teacher
# ~25 s and ~80 s a cell, a 7:1 student ~10 s and ~20 s; the prompt sets, built beside the conversion on 8 CPU
# workers: ~1 min for 8K-64K (measured on one core of the 2-core CPU: 0.03 / 0.15 / 0.6 s a prompt at 4K / 16K / 64K);
# every cell records its seconds, so the first run corrects these):
#   long_teacher        (a) the teacher, all four tasks at 8K/16K/32K/64K, n = 100                         ~13 min
#   long_s0, long_s1    (a) the default student (hydra-7to1, the package's defaults), seed S, the same 16 cells:
#                       convert (samples seed S's documents first if STATE has none: +5 min) + 16 cells       ~7 / ~12
#   budget_sS_R         (b) R in 3 7 15 31, seed S: head-wise R:1 vs layer-wise at the same KV share (headscope mask
#                       --kv-layers round(30/(R+1)) = 8/4/2/1 --budget R:1 on experiments/fused-smollm2/focus), each
#                       converted and scored on unseen single + multi-key at 1K-16K (10 cells; the teacher's too,
#                       once)                                                                      ~2 x (4 + 3) = ~14
#   levers_rank         (d) headscope rank --budget 7:1 --min-per-layer 1 on niah_single alone and fused over the
#                       four tasks (6 pairs of 512 tokens a task)                                              ~3
#   levers_sS_masks     (d) the two ranked masks (rank1-7to1, rank4-7to1), seed S: all four tasks at 1K-8K and
#                       multi-key at 16K/32K (18 cells each)                                      ~2 x (4 + 6) = ~20
#   levers_sS_s3tok     (d) the default student (its missing 1K-8K / multi-key cells) and s3tok2x: stage 3 with twice
#                       its tokens from the default's stages 1-2 (run.py --reuse-from both), the same 18 cells   ~17
#   gemma_rank          (c) Gemma 3 270M: headscope rank on niah_single + niah_multikey (6 pairs, 512 tokens,
#                       --budget 7:1), then headscope mask --kv-layers 3 --budget 7:1 (head-wise 9 FA heads in at
#                       most 3 layers vs 3 whole layers, evenly spaced: KV share 3/18)                         ~3
#   gemma_sS_head, gemma_sS_layer  (c) one arm, seed S: convert (Gemma's sampling of 12,288 documents not yet
#                       measured) + all four tasks at 1K-4K with the teacher's cells (12 each, once)   ~10-15 each
# Two parts may run side by side as two chains (tools/device/chain.sh, each its own SESSION_DIR/CODE_DIR, the same
# OUT): one samples a seed's documents at a time (the other waits for them), the teacher's cells are scored by one of
# them (a lock), both write OUT/bring. A sampler holds ~49 GiB on an H100 and a training stage ~32: put a part that
# samples (the first of a seed) beside one that only scores or ranks. An order that respects this, two chains a
# session: long_teacher | long_s0;  long_s1 | levers_rank gemma_rank;  budget_s0_R | budget_s1_R for R = 7, 3, 15, 31;
# levers_s0_masks | levers_s1_masks;  levers_s0_s3tok | levers_s1_s3tok;  gemma_s0_head | gemma_s0_layer;
# gemma_s1_head | gemma_s1_layer (the layer-wise part waits for the head-wise part's documents). A part cut off by the
# session's end is run again in the next one and goes on where it stopped.
#
# env: SMOL (smollm2-135m), GEMMA (/tmp/g/gemma3-270m.gguf: device_env.sh joins it; its mtime is set to a fixed date
#      so that the teacher's cells keep one fingerprint across sessions), TOKENS (12.5M), N (100), GEN_N (20),
#      WORKERS (8), LONG, BUDGET_LENGTHS, SUITE, MK_LONG, GEMMA_LENGTHS (the lengths above), RANKING
#      (experiments/fused-smollm2/focus), GEMMA_KV (3), RANK_SET (--pairs 6 --seq-len 512), CONVERT_ARGS, EVAL_ARGS,
#      RANK_ARGS (extra arguments, e.g. a CPU try's --device cpu ...), DEFAULT_MASK (the default student's mask instead of
#      records/masks/hydra-7to1.json), STATE, PYTHON (python), POLL (5 s), COLLECT_S (60 s),
#      DRY_RUN=1 (print the package's commands, run none).
set -euo pipefail
usage() { sed -n '2,3p' "$0" | sed 's/^# //'; }
[ $# -ge 2 ] || { usage >&2; exit 2; }
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
shift
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python}
W=$OUT/work
B=$OUT/bring
SMOL=${SMOL:-smollm2-135m}
GEMMA=${GEMMA:-/tmp/g/gemma3-270m.gguf}
TOKENS=${TOKENS:-12.5M}
ALL=niah_single,niah_multikey,niah_multivalue,variable_tracking
LONG=${LONG:-8K,16K,32K,64K}
BUDGET_LENGTHS=${BUDGET_LENGTHS:-1K,2K,4K,8K,16K}
SUITE=${SUITE:-1K,2K,4K,8K}
MK_LONG=${MK_LONG:-16K,32K}
GEMMA_LENGTHS=${GEMMA_LENGTHS:-1K,2K,4K}
RANKING=${RANKING:-$HERE/../fused-smollm2/focus}
GEMMA_KV=${GEMMA_KV:-3}
POLL=${POLL:-5}
read -r -a RANK_SET <<< "${RANK_SET:---pairs 6 --seq-len 512}"
read -r -a CONVERT_X <<< "${CONVERT_ARGS:-}"
read -r -a EVAL_X <<< "${EVAL_ARGS:-}"
read -r -a RANK_X <<< "${RANK_ARGS:-}"
DEF=()  # the default student's mask: the study's committed hydra-7to1 (DEFAULT_MASK: another, e.g. a tiny model's)
[ -z "${DEFAULT_MASK:-}" ] || DEF=(--mask "$DEFAULT_MASK")
# one setting for every eval of a folder: a cell is skipped only when stored with the same settings, so the teacher's
# cells are scored once for every part; generation checked at every length (the agreement column)
EVAL_SET=(--n "${N:-100}" --gen-n "${GEN_N:-20}" --gen-max-len 65536 --batch-tokens 32768 --workers "${WORKERS:-8}"
          --no-progress)
DRY=${DRY_RUN:-}

log() { echo "[gpu_parts $(date +%H:%M:%S)] $*"; }
x() { echo "+ $*"; [ -n "$DRY" ] || "$@"; }                       # a package command (printed, then run)
hs() { x "$PY" -m headscope.cli "$@"; }
teacher_of() { if [ "$1" = gemma3 ]; then echo "$GEMMA"; else echo "$SMOL"; fi; }
# the driver for one teacher: run.py with its run folder and the study's token budget
D() { local key=$1; shift; x "$PY" "$HERE/run.py" "$1" --out "$W/$key" --tokens "$TOKENS" --model "$(teacher_of "$key")" "${@:2}"; }
sess() { "$PY" "$HERE/sessions.py" "$@"; }
collect() { [ -n "$DRY" ] || sess collect "$W/$1" "$B/$1" "${@:2}"; }  # KEY [--eval-only]

prepare() {  # KEY: the work folder with what STATE holds (eval cells, haystack, masks, rankings, stage records)
  mkdir -p "$W/$1" "$B/$1" "$B/docs"
  if [ -n "${STATE:-}" ] && [ -d "$STATE/$1" ]; then sess restore "$STATE/$1" "$W/$1" --records-to "$B/$1"; fi
  if [ "$1" = gemma3 ] && [ -f "$GEMMA" ] && [ -z "$DRY" ]; then touch -d "2026-01-01 00:00:00 UTC" "$GEMMA"; fi
}

locked() {  # FILE CMD...: CMD under an exclusive lock (the teacher's cells: one part scores them)
  local f=$1; shift
  if [ -n "$DRY" ] || ! command -v flock > /dev/null; then "$@"; else (flock 9 && "$@") 9> "$f"; fi
}

teacher_cells() {  # KEY TASKS LENGTHS: the teacher's cells (headscope eval skips those stored with these settings)
  locked "$W/$1/.teacher.lock" hs eval "$(teacher_of "$1")" --name teacher --out "$W/$1/eval" --tasks "$2" \
    --lengths "$3" "${EVAL_SET[@]}" "${EVAL_X[@]}"
  collect "$1" --eval-only
}

docs_pack() { local p=$B/docs/$1_s$2.tar.gz; [ -f "$p" ] || p=${STATE:-/nonexistent}/docs/$1_s$2.tar.gz; echo "$p"; }

docs_in() {  # KEY SEED RUN_DIR: seed S's documents from a pack into the conversion folder -> 0, or 1 (none yet)
  local p
  p=$(docs_pack "$1" "$2")
  [ -f "$p" ] || return 1
  if ! ls "$3"/data/docs/shard_*.pt > /dev/null 2>&1; then
    mkdir -p "$3/data/docs" && tar -xzf "$p" -C "$3/data/docs" && log "documents of $1 seed $2 from $p"
  fi
}

docs_out() {  # KEY SEED RUN_DIR: pack the sampled shards into bring/docs (atomic) unless B or STATE has them
  local p=$B/docs/$1_s$2.tar.gz
  if [ ! -f "$(docs_pack "$1" "$2")" ] && ls "$3"/data/docs/shard_*.pt > /dev/null 2>&1; then
    (cd "$3/data/docs" && tar -czf "$p.tmp" shard_*.pt) && mv "$p.tmp" "$p" && log "packed $p ($(du -h "$p" | cut -f1))"
  fi
  touch "$W/.docs_$1_s$2"
}

convert() {  # KEY SEED RUN_DIR DRIVER_ARGS...: headscope convert (through run.py) on seed S's shared documents
  local key=$1 seed=$2 rd=$3 pid
  shift 3
  [ -f "$rd/stage3/training.json" ] && { log "$rd converted in this session"; return 0; }
  if [ -n "$DRY" ]; then D "$key" convert --seed "$seed" "$@" -- "${CONVERT_X[@]}"; return 0; fi
  mkdir -p "$rd"
  while ! docs_in "$key" "$seed" "$rd" && [ ! -e "$W/.docs_${key}_s$seed" ] && [ ! -e "$rd/data/stage1_rows.json" ]; do
    if mkdir "$W/.sampling" 2> /dev/null; then  # this part samples the documents; the others wait for its pack
      echo $$ > "$W/.sampling/pid"
      D "$key" convert --seed "$seed" "$@" -- "${CONVERT_X[@]}" & pid=$!
      while kill -0 $pid 2> /dev/null && [ ! -f "$rd/data/stage1_rows.json" ]; do sleep "$POLL"; done
      [ -f "$rd/data/stage1_rows.json" ] && docs_out "$key" "$seed" "$rd"
      rm -rf "$W/.sampling"
      wait $pid
      return
    fi
    p=$(cat "$W/.sampling/pid" 2> /dev/null || true)  # a lock left by a part that died
    if [ -n "$p" ] && ! kill -0 "$p" 2> /dev/null; then rm -rf "$W/.sampling"; else sleep "$POLL"; fi
  done
  D "$key" convert --seed "$seed" "$@" -- "${CONVERT_X[@]}"
  [ -f "$rd/data/stage1_rows.json" ] && docs_out "$key" "$seed" "$rd"
  return 0
}

todo() {  # KEY LABEL SEED TASKS LENGTH: the student's tasks without a cell at LENGTH
  sess missing "$W/$1/eval" "$2" "$3" "$TOKENS" "$4" "$5"
}

needs() {  # KEY SEED "TASKS@L1+L2 ..." DRIVER_ARGS...: whether the student lacks a cell (always, in a dry run)
  local key=$1 seed=$2 want=$3 lab w L ls
  shift 3
  [ -z "$DRY" ] || return 0
  lab=$("$PY" "$HERE/run.py" dir --out "$W/$key" --tokens "$TOKENS" --seed "$seed" "$@" | cut -f2)
  for w in $want; do
    ls=${w#*@}
    for L in ${ls//+/ }; do [ -z "$(todo "$key" "$lab" "$seed" "${w%@*}" "$L")" ] || return 0; done
  done
  log "$lab seed $seed: every cell is there"
  return 1
}

fresh() {  # "TASKS@L1+L2": whether the block has a (task, length) that no earlier block of this student() asked for
  # (marking its cells in student's `asked`); blocks overlap only where a tiny try sets two of the lengths alike
  local tasks=${1%@*} ls=${1#*@} t L old=1
  for L in ${ls//+/ }; do for t in ${tasks//,/ }; do [ -n "${asked[$t@$L]+x}" ] || old=0; asked[$t@$L]=1; done; done
  return $old
}

student() {  # KEY SEED "TASKS@L1+L2 ..." DRIVER_ARGS...: convert if a cell is missing, then score the missing cells
  local key=$1 seed=$2 want=$3 rd lab tpid="" w L m p ls t k
  local -A asked=()
  shift 3
  read -r rd lab < <("$PY" "$HERE/run.py" dir --out "$W/$key" --tokens "$TOKENS" --seed "$seed" "$@" | tr '\t' ' ')
  needs "$key" "$seed" "$want" "$@" || return 0
  log "$lab seed $seed: convert and score its missing cells"
  for w in $want; do  # the teacher's cells and every prompt set, beside the conversion (the GPU's idle while it builds)
    ls=${w#*@}
    fresh "$w" || continue
    if [ -n "$DRY" ]; then
      teacher_cells "$key" "${w%@*}" "${ls//+/,}"
    else
      teacher_cells "$key" "${w%@*}" "${ls//+/,}" & tpid="$tpid $!"
    fi
  done
  convert "$key" "$seed" "$rd" "$@"
  collect "$key"
  for p in $tpid; do wait "$p"; done
  # one headscope eval per set of missing tasks, over every length that misses exactly those (one model load each;
  # the collector below returns each cell within a minute of its being scored)
  local -A lens=() scored=()
  local sets=()
  for w in $want; do
    ls=${w#*@}
    for L in ${ls//+/ }; do
      if [ -n "$DRY" ]; then m=${w%@*}; else m=$(todo "$key" "$lab" "$seed" "${w%@*}" "$L"); fi
      k=""  # without the tasks an earlier block scores at this length
      for t in ${m//,/ }; do [ -n "${scored[$t@$L]+x}" ] || k=${k:+$k,}$t; scored[$t@$L]=1; done
      m=$k
      [ -z "$m" ] && continue
      if [ -z "${lens[$m]+x}" ]; then sets+=("$m"); lens[$m]=$L; else lens[$m]="${lens[$m]},$L"; fi
    done
  done
  for m in "${sets[@]}"; do
    D "$key" eval --seed "$seed" --lengths "${lens[$m]}" "$@" -- --tasks "$m" "${EVAL_SET[@]}" "${EVAL_X[@]}"
    collect "$key"
  done
}

want() { echo "$1@${2//,/+}"; }  # TASKS LENGTHS -> one word "TASKS@L1+L2+..." (a cell block of student())

# rankings and masks: made once, under a lock (two parts side by side may both need them), kept in OUT/bring
kv_masks() {  # RANKING KV_LAYERS BUDGET OUT: head-wise and layer-wise masks at the same KV share (headscope mask)
  [ -f "$4/headwise.json" ] || hs mask "$1" --kv-layers "$2" --budget "$3" --layerwise even --out "$4"
}

budget_masks() {  # R: LA:FA = R:1 within round(layers / (R + 1)) layers' KV cache
  locked "$W/smollm2/.masks.lock" kv_masks "$RANKING" "$(sess kv-layers "$RANKING" "$1")" "$1:1" \
    "$W/smollm2/masks/kv_$1to1"
}

rank_once() {  # KEY NAME TASKS...: headscope rank -> W/KEY/rank/NAME (mask.json at 7:1, >= 1 FA head per layer)
  local key=$1 name=$2 t args=()
  shift 2
  for t in "$@"; do args+=(--task "$t"); done
  [ -f "$W/$key/rank/$name/ranking.json" ] || hs rank --model "$(teacher_of "$key")" "${args[@]}" "${RANK_SET[@]}" \
    --budget 7:1 --min-per-layer 1 --out "$W/$key/rank/$name" "${RANK_X[@]}"
}

ranked() { locked "$W/$1/.rank.lock" rank_once "$@"; collect "$1"; }

gemma_rank() {
  ranked gemma3 fused2 niah_single niah_multikey
  locked "$W/gemma3/.masks.lock" kv_masks "$W/gemma3/rank/fused2" "$GEMMA_KV" 7:1 "$W/gemma3/masks/kv_L$GEMMA_KV"
  collect gemma3
}

part() {
  local p=$1 s R
  log "part $p"
  case $p in
    long_teacher) prepare smollm2; teacher_cells smollm2 "$ALL" "$LONG" ;;
    long_s[0-9]*) s=${p#long_s}; prepare smollm2; student smollm2 "$s" "$(want "$ALL" "$LONG")" "${DEF[@]}" ;;
    budget_s[0-9]*_[0-9]*)
      s=${p#budget_s}; R=${s#*_}; s=${s%_*}
      prepare smollm2; budget_masks "$R"; collect smollm2
      student smollm2 "$s" "$(want niah_single,niah_multikey "$BUDGET_LENGTHS")" --name "headwise-${R}to1" \
        --mask "$W/smollm2/masks/kv_${R}to1/headwise.json"
      student smollm2 "$s" "$(want niah_single,niah_multikey "$BUDGET_LENGTHS")" --name "layerwise-${R}to1" \
        --mask "$W/smollm2/masks/kv_${R}to1/layerwise.json" ;;
    levers_rank) prepare smollm2; ranked smollm2 single niah_single; ranked smollm2 fused4 ${ALL//,/ } ;;
    levers_s[0-9]*_masks)
      s=${p#levers_s}; s=${s%_masks}
      prepare smollm2; ranked smollm2 single niah_single; ranked smollm2 fused4 ${ALL//,/ }
      student smollm2 "$s" "$(want "$ALL" "$SUITE") $(want niah_multikey "$MK_LONG")" --name rank1-7to1 \
        --mask "$W/smollm2/rank/single/mask.json"
      student smollm2 "$s" "$(want "$ALL" "$SUITE") $(want niah_multikey "$MK_LONG")" --name rank4-7to1 \
        --mask "$W/smollm2/rank/fused4/mask.json" ;;
    levers_s[0-9]*_s3tok)
      s=${p#levers_s}; s=${s%_s3tok}
      prepare smollm2
      local rd cells
      cells="$(want "$ALL" "$SUITE") $(want niah_multikey "$MK_LONG")"
      student smollm2 "$s" "$cells" "${DEF[@]}"
      rd=$("$PY" "$HERE/run.py" dir --out "$W/smollm2" --tokens "$TOKENS" --seed "$s" | cut -f1)
      # the lever starts from the default's stages 1-2: convert the default here if the lever has cells to score
      if [ -z "$DRY" ] && [ ! -f "$rd/stage2/training.json" ] \
         && needs smollm2 "$s" "$cells" --lever s3tok2x --reuse-from both "${DEF[@]}"; then
        convert smollm2 "$s" "$rd" "${DEF[@]}"
      fi
      student smollm2 "$s" "$cells" --lever s3tok2x --reuse-from both "${DEF[@]}" ;;
    gemma_rank) prepare gemma3; gemma_rank ;;
    gemma_s[0-9]*_head|gemma_s[0-9]*_layer)
      s=${p#gemma_s}; local arm=${s#*_}; s=${s%_*}
      prepare gemma3
      [ -f "$W/gemma3/masks/kv_L$GEMMA_KV/headwise.json" ] || gemma_rank
      student gemma3 "$s" "$(want "$ALL" "$GEMMA_LENGTHS")" --name "gemma-${arm}wise-kv$GEMMA_KV" \
        --mask "$W/gemma3/masks/kv_L$GEMMA_KV/${arm}wise.json" ;;
    *) echo "unknown part $p; parts: long_teacher long_sS budget_sS_R levers_rank levers_sS_masks levers_sS_s3tok" \
         "gemma_rank gemma_sS_head gemma_sS_layer (S a seed, R in 3 7 15 31)" >&2; exit 2 ;;
  esac
  log "part $p done"
}

collector() {  # the eval folders into OUT/bring every COLLECT_S seconds while the parts run
  while sleep "${COLLECT_S:-60}"; do
    for k in smollm2 gemma3; do [ ! -d "$W/$k/eval" ] || sess collect "$W/$k" "$B/$k" --eval-only > /dev/null 2>&1 || true; done
  done
}
# (its output to /dev/null: a sleep left after the kill must not hold the caller's pipe open)
if [ -z "$DRY" ]; then collector > /dev/null 2>&1 & CPID=$!; trap 'kill $CPID 2> /dev/null || true' EXIT; fi
for p in "$@"; do part "$p"; done
