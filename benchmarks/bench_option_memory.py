"""What ``headscope convert --new-params-only`` and ``--teacher-dtype bf16`` save, measured on a CPU against what
``headscope plan-memory`` says they save (docs/conversion.md, "Memory plan").

A random Llama (``--hidden`` wide, ``--layers`` layers, 16 heads in 8 KV groups of 64, the tests' 2,048-token
tokenizer; ~100M parameters at the defaults) is saved as a model folder; each variant converts it with the CLI
(``python -m headscope.cli convert``, one thread, seeded corpus text, 2 rows of 128 tokens, 2 steps a stage), stage 1
and stage 2 each in a process of its own, so that each stage's recorded peak (``training.json``'s ``peak_memory``:
the process's ``ru_maxrss`` on a CPU) is that stage's. The variants: the defaults, ``--new-params-only``,
``--teacher-dtype bf16``, both. What is compared: each variant's peak minus the defaults' peak, measured and planned
(``plan_memory`` at the same shape, mask, rows and options; the process's own baseline — Python, torch, the
tokenizer — cancels in the difference).

    python benchmarks/bench_option_memory.py --out benchmarks/results/cpu2_option_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_deterministic import corpus, tokenizer  # noqa: E402  (the same tiny tokenizer and corpus)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"defaults": [], "new_params_only": ["--new-params-only"], "teacher_bf16": ["--teacher-dtype", "bf16"],
            "both": ["--new-params-only", "--teacher-dtype", "bf16"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from headscope.masks import HeadMask
    from headscope.train.memory_plan import MemoryOptions, ModelShape, plan_memory

    work = Path(tempfile.mkdtemp(prefix="bench_optmem_"))
    tok = tokenizer()
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=int(2.75 * a.hidden),
                      num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=8, head_dim=a.hidden // 16,
                      max_position_embeddings=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(work / "teacher")
    tok.save_pretrained(work / "teacher")
    mask = HeadMask(a.layers, 16, 8, tuple((0, 8) for _ in range(a.layers)))  # 7:1, two KV groups a layer
    mask.to_json(work / "mask.json")
    (work / "corpus.txt").write_text(corpus(n_docs=60))
    shape = ModelShape.from_config(cfg, "bench")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    report: dict = {"script": "benchmarks/bench_option_memory.py", "argv": sys.argv[1:], "shape": shape.__dict__,
                    "teacher_params": shape.teacher_params(), "rows": "2 x 128", "steps_per_stage": 2, "variants": {}}
    for name, flags in VARIANTS.items():
        out = work / name
        v: dict = {"flags": flags}
        for stage in (1, 2):
            cmd = [sys.executable, "-m", "headscope.cli", "convert", "--model", str(work / "teacher"), "--mask",
                   str(work / "mask.json"), "--out", str(out), "--device", "cpu", "--corpus", str(work / "corpus.txt"),
                   "--seq-len", "128", "--long-len", "256", "--batch-size", "2", "--batch-long", "2",
                   "--stage-tokens", "512,512,1024", "--gdn-kernel", "torch", "--stage", str(stage)]
            cmd += [f for f in flags if stage == 1 or f != "--new-params-only"]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
            if p.returncode != 0:
                raise SystemExit(f"{name} stage {stage} failed:\n{p.stderr[-3000:]}")
            rec = json.loads((out / f"stage{stage}" / "training.json").read_text())
            opts = MemoryOptions(teacher_dtype="bf16" if "bf16" in flags else "fp32",
                                 new_params_only=stage == 1 and "--new-params-only" in flags)
            plan = plan_memory(shape, stage, 2, 128, fa=mask, options=opts)
            v[f"stage{stage}"] = {"peak_bytes": rec["peak_memory"]["bytes"], "peak_kind": rec["peak_memory"]["kind"],
                                  "plan": plan.as_dict(), "step_plan": rec["step_plan"], "wall_s": round(time.perf_counter() - t0, 1)}
            print(name, stage, rec["peak_memory"]["bytes"] / 2**20, "MiB", plan.total / 2**20, "MiB planned", flush=True)
        report["variants"][name] = v
    base = report["variants"]["defaults"]
    report["saved_vs_defaults_mib"] = {
        name: {f"stage{s}": {"measured": round((base[f"stage{s}"]["peak_bytes"] - v[f"stage{s}"]["peak_bytes"]) / 2**20, 1),
                             "planned": round((base[f"stage{s}"]["plan"]["total"] - v[f"stage{s}"]["plan"]["total"]) / 2**20, 1)}
               for s in (1, 2)}
        for name, v in report["variants"].items() if name != "defaults"}
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report["saved_vs_defaults_mib"], indent=1))


if __name__ == "__main__":
    main()
