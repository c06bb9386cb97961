#!/usr/bin/env bash
# The lever session's plan (issue 40: the stage-2 data mix, stage-3 template diversity and the 5:1 budget, each beside
# the baseline trained on the same documents, 12.5M tokens, one new seed) as chains of device_session.sh, so that each
# call on the GPU machine (the `device` tool) is one short line. From the repository root on the GPU machine, in the
# set-up call that completes the model (trainings wait for the wheels) or later (state/README.md), each call starting
# with `source benchmarks/device_env.sh; `:
#   bash experiments/conversion-generalization/lever_session.sh start
#       the four chains: (1) the seed's documents, the baseline hydra-7to1, its cells; (2) the suite's prompt sets, the
#       levers' rows once the documents are in, the --s2-retrieval 0.25 arm, its cells; (3) the --s3-wordings 6 arm
#       once its rows are in and the baseline has trained, its cells; (4) hydra-5to1, its cells: beside the baseline
#       on a GPU of more than 100 GiB (H200), else after the s2 arm (at most two trainings on an H100's 80 GiB: two
#       took 47 GiB, 2026-12-05). Every training also waits for /tmp/wheels_done (touched by the call that carries
#       the last wheel). Cells: unseen formats up to 4K, single-needle first.
#   bash experiments/conversion-generalization/lever_session.sh lean
#       less device time: chain (1) and the 5:1 arm beside it, and the suite's prompt sets (no data levers)
#   bash experiments/conversion-generalization/lever_session.sh docs-back RETURN [WAIT_S]
#       wait up to WAIT_S (default 500) for the seed's documents, then return them (device_session.sh return-docs) into
#       RETURN/seedS-docs: the first long call of a session, so that a machine lost later keeps the documents
#   bash experiments/conversion-generalization/lever_session.sh poll RETURN [WAIT_S]
#       wait up to WAIT_S (default 300) until every started chain printed "session done", then device_session.sh poll
#       (the state, chain 1's status and log) and every other chain's status and log's end in RETURN/chains.log
# env: SEED (default 4), TOKENS (default 12.5M), GPU_MIB (default: nvidia-smi's memory.total of GPU 0), WHEELS_DONE
#      (default /tmp/wheels_done), and what device_session.sh reads (OUT_DIR, RUN, ...); chains 2-4 run with
#      SESSION_DIR and CODE_DIR suffixed 2-4 (default /tmp/hs_session2, /tmp/hs_code2, ...) and KERNEL_CACHE=/none
#      COMPILE_CACHE=/none (the first chain restores the caches)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
S=$here/device_session.sh
seed=${SEED:-4}
R="--seed $seed --tokens ${TOKENS:-12.5M}"
E="--eval-formats unseen --eval-max-len 4096 --eval-tasks-first niah_single"
out=${OUT_DIR:-/tmp/gen}
D=$out/seed$seed/data
tok=$(python3 -c "import sys; t=sys.argv[1].upper(); m={'K':1e3,'M':1e6,'G':1e9}; print(int(float(t[:-1])*m[t[-1]]) if t[-1] in m else int(t))" "${TOKENS:-12.5M}")
B=$out/seed$seed/hydra-7to1_t$tok/stage3/done.json
B2=$out/seed$seed/hydra-7to1+s2_retrieval=0.25_t$tok/stage3/done.json
W=${WHEELS_DONE:-/tmp/wheels_done}
sd=${SESSION_DIR:-/tmp/hs_session}
code=${CODE_DIR:-/tmp/hs_code}
chain() {  # chain N ARGS...: device_session.sh start in chain N's own session and code folders
  local n=$1; shift
  env SESSION_DIR=$sd$n CODE_DIR=$code$n KERNEL_CACHE=/none COMPILE_CACHE=/none bash "$S" start "$@"
}
export CHAIN_WAIT_S=${CHAIN_WAIT_S:-1500}
cmd=${1:-}
case $cmd in
  start|lean)
    mib=${GPU_MIB:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)}
    bash "$S" start "--piece data --seed $seed" "wait $W" "--piece train --arm hydra-7to1 $R" \
      "--piece eval --arm hydra-7to1 $R $E" || exit 1
    if [ "$cmd" = lean ]; then
      chain 2 "--piece suite --eval-max-len 4096" || exit 1
      chain 4 "wait $D/done" "wait $W" "--piece train --arm hydra-5to1 $R" "--piece eval --arm hydra-5to1 $R $E"
      exit $?
    fi
    w4=$B2
    [ "${mib:-0}" -gt 100000 ] 2>/dev/null && w4=$D/done
    echo "GPU memory ${mib:-unknown} MiB: the 5:1 arm waits for $w4"
    chain 2 "--piece suite --eval-max-len 4096" "wait $D/done" "--piece data --seed $seed --s2-retrieval 0.25 --s3-wordings 6" \
      "wait $W" "--piece train --arm hydra-7to1 $R --s2-retrieval 0.25" \
      "--piece eval --arm hydra-7to1 $R --s2-retrieval 0.25 $E" || exit 1
    chain 3 "wait $D/long_w6.pt" "wait $B" "wait $W" "--piece train --arm hydra-7to1 $R --s3-wordings 6" \
      "--piece eval --arm hydra-7to1 $R --s3-wordings 6 $E" || exit 1
    chain 4 "wait $w4" "wait $W" "--piece train --arm hydra-5to1 $R" "--piece eval --arm hydra-5to1 $R $E"
    ;;
  docs-back)
    ret=${2:?docs-back RETURN [WAIT_S]}
    for _ in $(seq $(( ${3:-500} / 5 ))); do [ -f "$D/done" ] && break; sleep 5; done
    bash "$S" return-docs "$ret" "$seed"
    ;;
  poll)
    ret=${2:?poll RETURN [WAIT_S]}
    for _ in $(seq $(( ${3:-300} / 5 ))); do
      n=0; all=0
      for d in "$sd" "${sd}2" "${sd}3" "${sd}4"; do
        [ -f "$d/status" ] || continue
        all=$((all + 1)); grep -q "session done" "$d/status" && n=$((n + 1))
      done
      [ "$all" -gt 0 ] && [ "$n" -eq "$all" ] && break
      sleep 5
    done
    bash "$S" poll "$ret" 0
    for i in 2 3 4; do
      [ -f "$sd$i/status" ] || continue
      echo "== chain $i"; cat "$sd$i/status"; echo "-- log"; tail -n 25 "$sd$i/log"
    done > "$ret/chains.log" 2>&1
    ;;
  *)
    sed -n '2,25p' "$0" >&2; exit 2
    ;;
esac
