#!/usr/bin/env bash
# Commands on a lent GPU machine that goes back when idle (the lead's `device` tool: 10 minutes a call, the machine
# returned 30 s after a call ends and after 30 minutes held), run detached so that they outlive one call and polled by
# short calls. On a GPU machine of your own, run the commands in sequence instead (benchmarks/recipes/).
# From the repository root on the GPU machine, after `source tools/device/device_env.sh` in the calls that carry wheels:
#   bash tools/device/chain.sh start "COMMAND" ["COMMAND" ...]
#       copy the code (headscope/, experiments/, benchmarks/, tools/, tests/) to CODE_DIR (every call sends the working tree
#       again; a command importing from it while it was copied failed, H200, 2026-12-03) and run each COMMAND there in
#       turn with bash, in a new process session: a failing command up to TRIES times, the chain stopped at one that
#       still fails (later commands need its output); "wait FILE" instead of a command waits up to CHAIN_WAIT_S s for
#       FILE and stops the chain if it does not come. The commands see OUT_DIR (their results' folder) and
#       PYTHONPATH=/tmp/site:CODE_DIR. Status lines: SESSION_DIR/status; output: SESSION_DIR/log. Restores the Triton
#       autotune results KERNEL_CACHE (a `poll`'s autotune.tar.gz) and the compile caches COMPILE_CACHE (`caches`).
#   bash tools/device/chain.sh poll RETURN [WAIT_S [PATTERN]]
#       wait up to WAIT_S s (default 0) until PATTERN (grep -E, default "chain done") is in the status, print the status
#       and the log's end, and copy into RETURN (on the GPU machine RETURN=$OUT, the folder that comes back): OUT_DIR
#       as out.tar.gz.partNN (gzip tar in parts of <= 15 MiB, without weights and checkpoints: *.safetensors, *.pt,
#       *.bin, checkpoint/, and the PACK_EXCLUDE patterns), the autotune results (autotune.tar.gz), status and log.
#       On the working machine: cat RETURN/out.tar.gz.part* | tar -xzf - -C runs/DIR
#   bash tools/device/chain.sh caches RETURN [MAX_MIB]
#       the compile caches (TileLang, Inductor, Triton) as <= 15 MiB gzip parts in RETURN/compile_cache (smallest
#       first, MAX_MIB compressed in all, default 45, and no more files in RETURN than RETURN_FILES, default 8: the
#       device tool returns at most 8 files a call, so run it in a call of its own); carry that folder as
#       COMPILE_CACHE (default runs/state/compile_cache) in a later session's `start`, which restores them
# Several chains may run at once (two trainings on one GPU): give each its own SESSION_DIR and CODE_DIR.
# env: OUT_DIR (/tmp/out), SESSION_DIR (/tmp/hs_chain), CODE_DIR (/tmp/hs_code), TRIES (3), CHAIN_WAIT_S (1200),
#      CHAIN_POLL_S (seconds between two looks for a waited file or a polled status, 5), CHAIN_RETRY_S (pause before
#      a retry, 2),
#      PACK_EXCLUDE (more tar --exclude patterns, space-separated), TRITON_CACHE_DIR (/tmp/hs_triton), KERNEL_CACHE,
#      TORCHINDUCTOR_CACHE_DIR (/tmp/torchinductor_USER), TILELANG_CACHE_DIR (~/.tilelang/cache), COMPILE_CACHE
set -uo pipefail
out=${OUT_DIR:-/tmp/out}
sd=${SESSION_DIR:-/tmp/hs_chain}
code=${CODE_DIR:-/tmp/hs_code}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/hs_triton}
inductor_dir=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}
tilelang_dir=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
usage() {
  echo "usage: bash $0 start \"COMMAND\" ... | poll RETURN [WAIT_S [PATTERN]] | caches RETURN [MAX_MIB]"
  echo "  on the GPU machine, from the repository root (see the comments at the top)"
}
if [ $# -lt 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then usage; [ $# -ge 1 ]; exit $?; fi
cmd=$1
shift
case $cmd in
  start)
    [ $# -ge 1 ] || { echo "start needs at least one COMMAND, e.g. \"python -m headscope.cli --help\"" >&2; exit 2; }
    mkdir -p "$sd" "$out"
    if [ -f "$sd/chain.pid" ] && kill -0 "$(cat "$sd/chain.pid")" 2>/dev/null; then
      echo "a chain started earlier is still running (pid $(cat "$sd/chain.pid"); its status: $sd/status): poll it, or" \
        "start again once it has printed 'chain done', or give this chain its own SESSION_DIR and CODE_DIR" >&2
      exit 1
    fi
    rm -rf "$code" && mkdir -p "$code"
    for d in headscope experiments benchmarks tools tests; do [ -d "$repo/$d" ] && cp -r "$repo/$d" "$code/"; done
    [ -f "$repo/pyproject.toml" ] && cp "$repo/pyproject.toml" "$code/"  # pytest's markers and settings, for tests run by a chain
    kc=${KERNEL_CACHE:-}
    if [ -n "$kc" ] && [ -f "$kc" ]; then
      mkdir -p "$TRITON_CACHE_DIR" && tar -xzf "$kc" -C "$TRITON_CACHE_DIR" \
        && echo "autotune results restored: $(tar -tzf "$kc" | grep -c 'autotune.json$') kernel(s)"
    fi
    cc=${COMPILE_CACHE:-$repo/runs/state/compile_cache}
    if [ -f "$cc/manifest.txt" ]; then
      while read -r name sha dir; do
        cat "$cc/$name.tar.gz.part"* > "$sd/$name.tar.gz" \
          && [ "$(sha256sum "$sd/$name.tar.gz" | cut -d' ' -f1)" = "$sha" ] \
          && mkdir -p "$dir" && tar -C "$dir" -xzf "$sd/$name.tar.gz" \
          && echo "compile cache restored: $name into $dir" || echo "compile cache $name NOT restored (parts missing or changed)"
        rm -f "$sd/$name.tar.gz"
      done < "$cc/manifest.txt"
    fi
    printf '%s\n' "$@" > "$sd/commands"
    export OUT_DIR=$out SESSION_DIR=$sd CODE_DIR=$code
    setsid nohup bash "$code/tools/device/chain.sh" _chain >> "$sd/log" 2>&1 < /dev/null &
    echo $! > "$sd/chain.pid"
    echo "started $# command(s), results in OUT_DIR=$out; poll with: bash $0 poll RETURN [WAIT_S [PATTERN]]"
    ;;
  _chain)
    cd "$code" || exit 1
    export PYTHONPATH="/tmp/site:$code" PYTHONUNBUFFERED=1 HEADSCOPE_CACHE=${HEADSCOPE_CACHE:-/tmp/hs_cache}
    t0=$(date +%s)
    st() { echo "$(( $(date +%s) - t0 )) s: $*" >> "$sd/status"; }
    while IFS= read -r line; do
      if [[ $line == wait\ * ]]; then
        f=${line#wait }
        for _ in $(seq $(( ${CHAIN_WAIT_S:-1200} / ${CHAIN_POLL_S:-5} ))); do [ -e "$f" ] && break; sleep "${CHAIN_POLL_S:-5}"; done
        if [ -e "$f" ]; then st "$line: here"; continue; fi
        st "$line: not here after ${CHAIN_WAIT_S:-1200} s"
        st "chain stopped: $f did not come; later commands not run"
        break
      fi
      k=0; ok=0
      while [ $k -lt "${TRIES:-3}" ]; do
        k=$((k + 1))
        bash -c "$line" < /dev/null; rc=$?
        st "$line: rc=$rc (try $k)"
        [ $rc = 0 ] && { ok=1; break; }
        sleep "${CHAIN_RETRY_S:-2}"
      done
      [ $ok = 1 ] || { st "chain stopped: $line did not finish; later commands not run"; break; }
    done < "$sd/commands"
    st "chain done"
    ;;
  poll)
    ret=${1:?poll RETURN [WAIT_S [PATTERN]]}
    mkdir -p "$sd" "$ret"
    wait_s=${2:-0}
    pat=${3:-chain done}
    for _ in $(seq $(( wait_s / ${CHAIN_POLL_S:-5} ))); do grep -qE "$pat" "$sd/status" 2>/dev/null && break; sleep "${CHAIN_POLL_S:-5}"; done
    cat "$sd/status" 2>/dev/null; echo "--- log (end)"; tail -n 15 "$sd/log" 2>/dev/null | tr '\r' '\n' | tail -n 15
    if [ -d "$out" ]; then
      ex=(--exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='checkpoint')
      for p in ${PACK_EXCLUDE:-}; do ex+=(--exclude="$p"); done
      rm -f "$ret"/out.tar.gz.part*
      tar -C "$out" "${ex[@]}" -czf - . | split -b 15m -d -a 2 - "$ret/out.tar.gz.part"
      echo "OUT_DIR packed: $(ls "$ret"/out.tar.gz.part* | wc -l) part(s), $(cat "$ret"/out.tar.gz.part* | wc -c) bytes, $(cat "$ret"/out.tar.gz.part* | tar -tzf - | grep -vc '/$') files"
    fi
    if [ -d "$TRITON_CACHE_DIR" ]; then
      (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | LC_ALL=C sort > "$sd/autotune.list" \
        && [ -s "$sd/autotune.list" ] && tar -czf "$ret/autotune.tar.gz" -T "$sd/autotune.list" \
        && echo "autotune results: $(wc -l < "$sd/autotune.list") kernel(s) in $ret/autotune.tar.gz")
    fi
    cp "$sd/status" "$sd/log" "$ret/" 2>/dev/null
    true
    ;;
  caches)
    ret=${1:?caches RETURN [MAX_MIB]}
    max=$(( ${2:-45} * 1048576 ))
    nfiles=${RETURN_FILES:-8}
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
