#!/usr/bin/env bash
# `headscope rank` on a real model at ~8K-token prompts, timed, with its peak GPU memory: the CLI's outputs
# (scores.csv, mask.json, heatmap.html, ranking.json, ie.pt, its store) in RUN_DIR (default OUT_DIR/rank), and in
# OUT_DIR three files named after JSON_NAME's stem S: S.json (model, seq_len, pairs, pair lengths, seconds, peak GPU
# memory, versions, top 10, the CLI's printout), S_scores.csv and S_ranking.json (copies of the CLI's). On the GPU
# host pass RUN_DIR outside $OUT: only 8 files come back from a call.
# Usage (repository root):
#   bash benchmarks/recipes/rank_cli_8k.sh MODEL OUT_DIR [SEQ_LEN=8191] [PAIRS=6] [DEVICE=cuda] [DTYPE=bfloat16]
#     MODEL: a .gguf path (e.g. /tmp/m/smol.gguf; the tokenizer is read from it), 'smollm2-135m', 'gemma3-270m',
#     or a local HF directory. SEQ_LEN 8191: the longest SmolLM2's 8,192-token context takes (pairs of 8,184
#     tokens + the answer, as the 8B-shaped benchmark). Needle depths spread over 0.1..0.9, one per pair.
#   env: JSON_NAME (default h200_rank_cli_8k.json), RUN_DIR (default OUT_DIR/rank), MODE (exact | screen, default
#     exact), RANK_PATH (auto | fast | generic: --path, default auto), MIN_GAP (default: the CLI's 0.1), PYTHON
#     (default python).
# CPU check of the command line: bash benchmarks/recipes/rank_cli_8k.sh smollm2-135m /tmp/cli 512 1 cpu float32
# The CLI runs in this Python process through its console-script entry point (headscope.cli:app, what the
# `headscope` command calls), so the process's peak GPU memory (torch.cuda.max_memory_allocated) is the CLI's.
set -euo pipefail
MODEL=${1:?MODEL (.gguf path, spec or HF dir)}
OUT=${2:?OUT_DIR}
SEQ_LEN=${3:-8191}
PAIRS=${4:-6}
DEVICE=${5:-cuda}
DTYPE=${6:-bfloat16}
mkdir -p "$OUT"
PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}." "${PYTHON:-python}" - "$MODEL" "$OUT" "$SEQ_LEN" "$PAIRS" "$DEVICE" "$DTYPE" \
  "${JSON_NAME:-h200_rank_cli_8k.json}" "${MODE:-exact}" "${MIN_GAP:-}" "${RANK_PATH:-auto}" "${RUN_DIR:-$OUT/rank}" \
  <<'EOF'
import contextlib, io, json, platform, shutil, subprocess, sys, time
from pathlib import Path

model, out, seq_len, pairs, device, dtype, json_name, mode, min_gap, path, run_dir = sys.argv[1:12]
out, seq_len, pairs, run_dir = Path(out), int(seq_len), int(pairs), Path(run_dir)
stem = json_name.removesuffix(".json")
depths = [round(0.1 + 0.8 * i / max(pairs - 1, 1), 3) for i in range(pairs)] if pairs > 1 else [0.5]
args = ["rank", "--model", model, "--task", "niah_single", "--pairs", str(pairs), "--seq-len", str(seq_len),
        *[a for d in depths for a in ("--depth", str(d))], "--device", device, "--dtype", dtype, "--mode", mode,
        "--path", path,
        "--out", str(run_dir), "--top", "10"] + (["--min-gap", min_gap] if min_gap else [])
import torch
import transformers

import headscope
from headscope.cli import app


class Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
            st.flush()
        return len(s)


cuda = device.startswith("cuda")
print("headscope " + " ".join(args), flush=True)
t0 = time.perf_counter()
log = io.StringIO()
with contextlib.redirect_stdout(Tee(sys.stdout, log)):
    error = None
    try:
        app(args)  # typer exits through SystemExit
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # still write what was measured (ranking.json is saved before the report)
        import traceback

        rc, error = 1, traceback.format_exc()
        print(error, file=sys.stderr, flush=True)
seconds = time.perf_counter() - t0
res = {"command": "headscope " + " ".join(args), "exit_code": rc, "model": model, "seq_len": seq_len,
       "pairs_requested": pairs, "depths": depths, "device": device, "dtype": dtype, "mode": mode,
       "path_requested": path,
       "seconds": round(seconds, 2),
       "seconds_note": "wall time of the whole command in one process: model load, pairs, self-check, ranking, "
                       "mask, heatmap (ranking_seconds: the ranking itself, from ranking.json)",
       "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
       "peak_gpu_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2) if cuda else None}
res["printout"] = log.getvalue().splitlines()
if error:
    res["error"] = error.splitlines()[-1]
rj = run_dir / "ranking.json"
if rj.exists():
    prov = json.loads(rj.read_text())["provenance"]
    res.update(model_name=prov.get("model"), model_dtype=prov.get("dtype"), path=prov.get("path"),
               pairs=prov.get("n_pairs"), pair_lengths=prov.get("pair_lengths"),
               skipped_pairs=prov.get("skipped_pairs"), ranking_seconds=prov.get("seconds"),
               gaps=[round(a - b, 4) for a, b in zip(prov.get("m_clean", []), prov.get("m_corrupt", []))],
               screen=prov.get("screen"))
    import pandas as pd

    top = pd.read_csv(run_dir / "scores.csv").sort_values("rank").head(10)
    res["top10"] = [[int(r.layer), int(r.head), round(float(r.ie_recv), 4)] for r in top.itertuples()]
    shutil.copyfile(run_dir / "scores.csv", out / f"{stem}_scores.csv")
    shutil.copyfile(rj, out / f"{stem}_ranking.json")
v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
     "headscope": getattr(headscope, "__version__", "?")}
if cuda:
    v.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name())
with contextlib.suppress(Exception):
    v["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
res["versions"] = v
(out / f"{stem}.json").write_text(json.dumps(res, indent=1))
print(json.dumps({k: res[k] for k in res if k not in ("versions", "screen", "printout")}), flush=True)
sys.exit(rc)
EOF
