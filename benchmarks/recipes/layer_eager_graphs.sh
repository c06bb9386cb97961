#!/usr/bin/env bash
# The eager prefill's GDN heads in graph-replayed blocks (lean.EAGER_GDN_GRAPHS): eager speed-up and peak (the larger of the first call's and a later call's, plus the graphs' held memory: prefill_peak_bytes_first_call, _steady, eager_graph_held_bytes); host vs GPU time of an eager layer call. fla-core alone.
# Usage: bash benchmarks/recipes/layer_eager_graphs.sh [OUT_DIR]   (run from the repository root on the GPU host)
# Stored result: h200_hybrid_layer_eager_graphs.json (the Qwen3 shape's 64K/128K cells: h200_hybrid_layer_eager_graphs_qwen3_64k_128k.json, a run one fix earlier: same kernels and timings, outputs wrong, first-call peaks), h200_prefill_host.json, h200_prefill_host_cprofile.json
# Module switches in these commands (lean.X=..., static.X=..., splitk.X=...) reproduce the stored file at the commit
# that wrote it; today the variants are InferenceConfig fields (CHANGELOG.md maps them).
set -euo pipefail
OUT=${1:-/tmp/bench/layer_eager_graphs}
mkdir -p "$OUT"
python benchmarks/bench_hybrid.py --out "$OUT/layer" --no-before --graph-block 0 --shapes smollm2-135m qwen3-1.7b \
  --lengths 32768 16384 65536 131072 --graph-reps 100 --eager-reps 5 --budget-s 330
python benchmarks/profile_prefill_host.py --out "$OUT/host" --shapes smollm2-135m qwen3-1.7b --lengths 16384 32768 \
  --variants defaults off:lean.EAGER_GDN_GRAPHS=False
# the Python functions with the most host time
python benchmarks/profile_prefill_host.py --out "$OUT/host_cprofile" --shapes smollm2-135m qwen3-1.7b --lengths 16384 32768 \
  --variants defaults off:lean.EAGER_GDN_GRAPHS=False --cprofile
