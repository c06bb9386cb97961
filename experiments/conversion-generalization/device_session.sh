#!/usr/bin/env bash
# The study's pieces on the lent GPU machine (the `device` tool), detached so that they outlive one call's 10 minutes,
# polled by short calls (the machine goes back 30 s after a call ends, and after 30 minutes held). On a GPU machine of
# your own, run the pieces in sequence instead (the study's README).
# On the working machine, before the session (needs the repository's git history):
#   bash experiments/conversion-generalization/device_session.sh export-docs DIR [SEED [REF]]
#       write seed SEED's (default 0) document pack from git into DIR (e.g. runs/state/seed0-docs), checked against the
#       pack's manifest; carry DIR. The pack is the folder seedSEED-docs/ at REF's root or in REF's
#       experiments/conversion-generalization/state/ (REF: a commit, e.g. the one that added the pack to main and whose
#       successor removed it, so that it stays in main's history without riding in every call's tree; default: the
#       branch study-state, or origin/study-state in a clone)
# From the repository root on the GPU machine, after `source benchmarks/device_env.sh` in the calls that carry wheels:
#   bash experiments/conversion-generalization/device_session.sh docs PACK_DIR
#       unpack a carried state pack (e.g. a seed's documents from export-docs) into OUT, before `start`, so that
#       --piece data rebuilds the rows from them instead of sampling again (checked against the seed's info.json)
#   bash experiments/conversion-generalization/device_session.sh start "ARGS" ["ARGS" ...]
#       restore the committed state/ into OUT (the first start on a machine only; files already there are kept), copy
#       the code to a private folder, and run `run.py ARGS` for each string in turn in a new process session: a failing
#       piece up to 3 tries, a piece that ends "partial" resumed, the chain stopped at a piece that does not finish;
#       "wait FILE" instead of ARGS waits (up to CHAIN_WAIT_S s, default 1200) for FILE and stops the chain if it
#       does not come. Status lines: /tmp/hs_session/status; output:
#       /tmp/hs_session/log
#   bash experiments/conversion-generalization/device_session.sh return-docs RETURN SEED
#       pack seed SEED's documents (OUT/seedSEED/data/shards and info.json, ~10 MiB for 12,288) into RETURN/seedSEED-docs,
#       as soon as the data piece has sampled them, in a call of its own: a machine lost later then costs the trainings,
#       not the 280 s of sampling, and the seed's further arms train on the same documents in a later session
#   bash experiments/conversion-generalization/device_session.sh poll RETURN [WAIT_S [PATTERN]]
#       wait up to WAIT_S seconds (default 0) until PATTERN (grep -E) is in the status, print the status and the log's
#       end, pack OUT's state (no document shards, no suite: both are elsewhere) into RETURN/state and copy the status
#       and the log to RETURN (on the GPU machine RETURN=$OUT, the folder that comes back); commit what comes back
#   bash experiments/conversion-generalization/device_session.sh caches RETURN [MAX_MIB]
#       the compile caches (TileLang, Inductor, Triton) as <= 15 MiB gzip parts in RETURN/compile_cache (smallest
#       first, MAX_MIB compressed in all, default 45, and no more files in RETURN than RETURN_FILES, default 8: the
#       device tool returns at most 8 files a call, so run it in a call of its own, not after `poll`, which returns 5);
#       keep them in runs/state/compile_cache, carry that folder in a call before the next session's `start`, which
#       restores them (checked against their SHA-256)
# Why a private copy of the code: every call sends the working tree again, and a piece that imported from it while it
# was being copied failed (`No module named 'headscope.validate'`, H200, 2026-12-03).
# Kernel autotuning between sessions: on a fresh machine the first training step took 341 s (compiling and
# benchmarking every autotune config of fla's Triton kernels; 18 s once they were tuned). Triton keeps each tuning
# result as TRITON_CACHE_DIR/<hash>/<kernel>.autotune.json (fla sets cache_results); `poll` returns those small files
# as RETURN/autotune.tar.gz, committed as state/kernel_cache/autotune.tar.gz, and `start` restores them, so the next
# session compiles one config per kernel instead of all (the hash covers Triton, the GPU target and the kernel source).
# env: OUT_DIR (default /tmp/gen), SESSION_DIR (default /tmp/hs_session), CODE_DIR (default /tmp/hs_code),
#      TRITON_CACHE_DIR (default /tmp/hs_triton), KERNEL_CACHE (default state/kernel_cache/autotune.tar.gz),
#      TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_USER), TILELANG_CACHE_DIR (default ~/.tilelang/cache),
#      COMPILE_CACHE (default runs/state/compile_cache: `caches`'s parts, restored by `start`),
#      RUN (default: python CODE_DIR/experiments/conversion-generalization/run.py --out OUT_DIR --model smollm2-135m
#      --device cuda --budget-s PIECE_BUDGET_S), PIECE_BUDGET_S (default 1700: a piece's deadline), TRIES (default 3:
#      tries of a failing piece), RESUMES (default 5: reruns of a piece that ended "partial"),
#      CHAIN_WAIT_S (default 1200: how long a "wait FILE" piece waits)
set -uo pipefail
out=${OUT_DIR:-/tmp/gen}
sd=${SESSION_DIR:-/tmp/hs_session}
code=${CODE_DIR:-/tmp/hs_code}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/hs_triton}
inductor_dir=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}
tilelang_dir=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
usage() {
  echo "usage: bash $0 export-docs DIR [SEED [REF]] | docs PACK_DIR | start \"RUN.PY ARGS\" ... | return-docs RETURN SEED |"
  echo "       poll RETURN [WAIT_S [PATTERN]] | caches RETURN [MAX_MIB]"
  echo "  export-docs on the working machine; docs, start and poll on the GPU machine (see the comments at the top)"
}
if [ $# -lt 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then usage; [ $# -ge 1 ]; exit $?; fi
cmd=$1
shift
case $cmd in
  export-docs)
    dest=${1:?export-docs DIR [SEED [REF]]}
    seed=${2:-0}
    if [ -n "${3:-}" ]; then
      ref=$(git -C "$repo" rev-parse -q --verify "$3^{commit}") \
        || { echo "no commit $3 in $repo's history: pass the commit that added seed$seed-docs/ (state/README.md lists them)" >&2; exit 1; }
    else
      ref=$(git -C "$repo" rev-parse -q --verify study-state || git -C "$repo" rev-parse -q --verify origin/study-state) \
        || { echo "no branch study-state here: git fetch origin study-state:study-state, or pass the commit that holds the pack as REF" >&2; exit 1; }
    fi
    loc=
    for cand in "seed$seed-docs" "experiments/conversion-generalization/state/seed$seed-docs"; do
      git -C "$repo" cat-file -e "$ref:$cand/state.manifest.json" 2>/dev/null && { loc=$cand; break; }
    done
    [ -n "$loc" ] || { echo "no seed$seed-docs/ at $ref (its root or experiments/conversion-generalization/state/): sample the seed's documents on the GPU first" >&2; exit 1; }
    mkdir -p "$dest"
    git -C "$repo" show "$ref:$loc/state.manifest.json" > "$dest/state.manifest.json" \
      || { rm -f "$dest/state.manifest.json"; exit 1; }
    python3 -c "import json, sys; [print(p['name'], p['sha256']) for p in json.load(open(sys.argv[1]))['parts']]" \
      "$dest/state.manifest.json" > "$dest/.parts" || exit 1
    while read -r name want; do
      git -C "$repo" show "$ref:$loc/$name" > "$dest/$name" || { rm -f "$dest/$name"; exit 1; }
      have=$(sha256sum "$dest/$name" | cut -d' ' -f1)
      [ "$want" = "$have" ] || { echo "$name's SHA-256 $have is not the manifest's $want" >&2; exit 1; }
    done < "$dest/.parts"
    rm -f "$dest/.parts"
    echo "seed $seed's documents in $dest (from $ref, checked); carry it, then on the GPU machine: bash $0 docs $dest"
    ;;
  docs)
    pack=${1:?docs PACK_DIR}
    mkdir -p "$sd"
    PYTHONPATH="/tmp/site:$repo${PYTHONPATH:+:$PYTHONPATH}" python "$here/run.py" --out "$out" --piece unpack \
      --unpack-from "$pack"
    ;;
  start)
    [ $# -ge 1 ] || { echo "start needs at least one ARGS string, e.g. \"--piece suite\"" >&2; exit 2; }
    mkdir -p "$sd"
    if [ -f "$sd/chain.pid" ] && kill -0 "$(cat "$sd/chain.pid")" 2>/dev/null; then
      echo "a session started earlier is still running (pid $(cat "$sd/chain.pid"); its status: $sd/status): poll it, or" \
        "start again once it has printed 'session done'" >&2
      exit 1
    fi
    # the committed state goes into OUT once per machine: a later start must not bring back what pieces have moved
    # since (--retrain moves an arm's records and cells to earlier_training_N; restoring them again made train
    # refuse and eval skip the new student's cells, H200, 2026-12-03)
    mkdir -p "$out"
    if [ -f "$out/.state_restored" ]; then
      echo "OUT=$out already holds the committed state (restored by an earlier start): not restored again"
    else
      cp -rn "$here/state/." "$out/" && rm -f "$out/README.md" && date -u > "$out/.state_restored"
      echo "committed state restored into OUT=$out"
    fi
    rm -rf "$code" && mkdir -p "$code" && cp -r "$repo/headscope" "$repo/experiments" "$repo/benchmarks" "$code/"
    kc=${KERNEL_CACHE:-$here/state/kernel_cache/autotune.tar.gz}
    if [ -f "$kc" ]; then
      mkdir -p "$TRITON_CACHE_DIR" && tar -xzf "$kc" -C "$TRITON_CACHE_DIR" && echo "autotune results restored: $(tar -tzf "$kc" | grep -c 'autotune.json$') kernel(s)"
    fi
    cc=${COMPILE_CACHE:-$repo/runs/state/compile_cache}  # from `caches` in an earlier session, carried in
    if [ -f "$cc/manifest.txt" ]; then
      while read -r name sha dir; do
        cat "$cc/$name.tar.gz.part"* > "$sd/$name.tar.gz" \
          && [ "$(sha256sum "$sd/$name.tar.gz" | cut -d' ' -f1)" = "$sha" ] \
          && mkdir -p "$dir" && tar -C "$dir" -xzf "$sd/$name.tar.gz" \
          && echo "compile cache restored: $name into $dir" || echo "compile cache $name NOT restored (parts missing or changed)"
        rm -f "$sd/$name.tar.gz"
      done < "$cc/manifest.txt"
    fi
    printf '%s\n' "$@" > "$sd/pieces"
    export OUT_DIR=$out SESSION_DIR=$sd CODE_DIR=$code
    setsid nohup bash "$code/experiments/conversion-generalization/device_session.sh" _chain >> "$sd/log" 2>&1 < /dev/null &
    echo $! > "$sd/chain.pid"
    echo "started $# piece(s) in OUT=$out; poll with: bash $0 poll RETURN [WAIT_S [PATTERN]]"
    ;;
  _chain)
    cd "$code" || exit 1
    export PYTHONPATH="/tmp/site:$code" PYTHONUNBUFFERED=1 HEADSCOPE_CACHE=${HEADSCOPE_CACHE:-/tmp/hs_cache}
    # a detached piece is not bound by one call's 10 minutes: its deadline is the 30-minute hold (PIECE_BUDGET_S)
    run=${RUN:-python $code/experiments/conversion-generalization/run.py --out $out --model smollm2-135m --device cuda --budget-s ${PIECE_BUDGET_S:-1700}}
    t0=$(date +%s)
    st() { echo "$(( $(date +%s) - t0 )) s: $*" >> "$sd/status"; }
    while IFS= read -r args; do
      if [[ $args == wait\ * ]]; then
        # the later pieces need FILE: a wait that times out stops the chain (a piece run without it would only fail,
        # or train on what is not there)
        f=${args#wait }
        for _ in $(seq $(( ${CHAIN_WAIT_S:-1200} / 5 ))); do [ -e "$f" ] && break; sleep 5; done
        if [ -e "$f" ]; then st "$args: here"; continue; fi
        st "$args: not here after ${CHAIN_WAIT_S:-1200} s"
        st "chain stopped: $f did not come; later pieces not run"
        break
      fi
      # a failing piece is tried again (TRIES in all); a piece that ends "PIECE: partial: ..." (its deadline came) is
      # resumed (RESUMES times at most); the chain stops when a piece still fails or is still partial, since later
      # pieces need its output (an eval after an unfinished train would only fail)
      k=0; resumes=0; done_ok=0
      while [ $k -lt "${TRIES:-3}" ]; do
        k=$((k + 1))
        # shellcheck disable=SC2086
        $run $args 2>&1 | tee "$sd/piece.out"; rc=${PIPESTATUS[0]}
        if [ $rc = 0 ] && grep -qE '^[a-z]+: partial' "$sd/piece.out"; then
          st "$args: partial (resume $((resumes + 1)))"
          resumes=$((resumes + 1)); k=$((k - 1))
          [ $resumes -le "${RESUMES:-5}" ] && continue
          break
        fi
        st "$args: rc=$rc (try $k)"
        [ $rc = 0 ] && { done_ok=1; break; }
        sleep 2
      done
      [ $done_ok = 1 ] || { st "chain stopped: $args did not finish; later pieces not run"; break; }
    done < "$sd/pieces"
    st "session done"
    ;;
  return-docs)
    ret=${1:?return-docs RETURN SEED}
    seed=${2:?return-docs RETURN SEED}
    case $seed in *[!0-9]*) echo "SEED must be a number, not '$seed'" >&2; exit 2;; esac
    if [ ! -f "$out/seed$seed/data/done" ] || [ ! -f "$out/seed$seed/data/info.json" ]; then
      echo "seed $seed's documents are not all in $out yet (no seed$seed/data/done): return them once its data piece" \
        "has finished (its status line, or 'wait $out/seed$seed/data/done' in a chain)" >&2
      exit 1
    fi
    PYTHONPATH="/tmp/site:$repo${PYTHONPATH:+:$PYTHONPATH}" python "$here/run.py" --out "$out" --piece pack \
      --pack-to "$ret/seed$seed-docs" --pack-include "seed$seed/data/shards" "seed$seed/data/info.json" 2>&1 | tail -n 1
    [ -f "$ret/seed$seed-docs/state.manifest.json" ] || { echo "seed $seed's documents were not packed" >&2; exit 1; }
    echo "seed $seed's documents in $ret/seed$seed-docs: keep them on the working machine (state/README.md says where)"
    ;;
  poll)
    ret=${1:?poll RETURN [WAIT_S [PATTERN]]}
    mkdir -p "$sd"
    wait_s=${2:-0}
    pat=${3:-session done}
    for _ in $(seq $(( wait_s / 5 ))); do grep -qE "$pat" "$sd/status" 2>/dev/null && break; sleep 5; done
    cat "$sd/status" 2>/dev/null; echo "--- log (end)"; tail -n 15 "$sd/log" 2>/dev/null | tr '\r' '\n' | tail -n 15
    mkdir -p "$ret"
    if [ -f "$out/settings.json" ]; then
      PYTHONPATH="/tmp/site:$repo${PYTHONPATH:+:$PYTHONPATH}" python "$here/run.py" --out "$out" --piece pack \
        --pack-to "$ret/state" --pack-exclude 'seed*/data/shards/*' 'suite/*' 2>&1 | tail -n 1
    fi
    if [ -d "$TRITON_CACHE_DIR" ]; then
      (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | LC_ALL=C sort > "$sd/autotune.list" \
        && [ -s "$sd/autotune.list" ] && tar -czf "$ret/autotune.tar.gz" -T "$sd/autotune.list" \
        && echo "autotune results: $(wc -l < "$sd/autotune.list") kernel(s) in $ret/autotune.tar.gz; Triton cache $(du -sh . | cut -f1)")
    fi
    for c in "$inductor_dir" "$tilelang_dir"; do  # what `caches` would return
      [ -d "$c" ] && echo "cache $c: $(du -sh "$c" | cut -f1)"
    done
    cp "$sd/status" "$sd/log" "$ret/" 2>/dev/null
    true
    ;;
  caches)
    # the compile caches (TileLang, Inductor, Triton: what a fresh machine spends its first training step building)
    # as gzip parts of <= 15 MiB in RETURN/compile_cache, smallest first, up to MAX_MIB compressed in all
    ret=${1:?caches RETURN [MAX_MIB]}
    max=$(( ${2:-45} * 1048576 ))
    nfiles=${RETURN_FILES:-8}  # the device tool returns at most 8 files from OUT per call (all of OUT, not only these)
    mkdir -p "$sd" "$ret/compile_cache"
    : > "$ret/compile_cache/manifest.txt"
    used=0
    for spec in "tilelang=$tilelang_dir" "inductor=$inductor_dir" "triton=$TRITON_CACHE_DIR"; do
      name=${spec%%=*}; dir=${spec#*=}
      [ -d "$dir" ] || { echo "no $name cache ($dir)"; continue; }
      tar -C "$dir" -czf "$sd/$name.tar.gz" . || continue
      size=$(stat -c %s "$sd/$name.tar.gz")
      parts=$(( (size + 15728639) / 15728640 ))
      files=$(find "$ret" -type f | wc -l)
      if [ $(( files + parts )) -gt "$nfiles" ]; then
        echo "left out the $name cache: its $parts part(s) would make $(( files + parts )) files in $ret, more than the" \
             "$nfiles a call returns (run caches in a call of its own, without poll)"
      elif [ $(( used + size )) -le $max ]; then
        split -b 15m -d "$sd/$name.tar.gz" "$ret/compile_cache/$name.tar.gz.part"
        echo "$name $(sha256sum "$sd/$name.tar.gz" | cut -d' ' -f1) $dir" >> "$ret/compile_cache/manifest.txt"
        used=$(( used + size ))
        echo "returned the $name cache: $(( size / 1048576 )) MiB compressed ($(du -sh "$dir" | cut -f1) in $dir)"
      else
        echo "left out the $name cache: $(( size / 1048576 )) MiB compressed would pass ${2:-45} MiB in all"
      fi
      rm -f "$sd/$name.tar.gz"
    done
    ;;
  *)
    echo "unknown command $cmd" >&2; usage >&2; exit 2
    ;;
esac
