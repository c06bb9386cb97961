"""What ``headscope convert --deterministic`` costs and whether it holds: a tiny conversion (all three stages of
``convert_model`` on a random 4-layer Llama, the tests' 2,048-token tokenizer, seeded corpus text) run ``--reps`` times
with and without the setting, alternating, in one process; per run the training seconds (the stages'
``training.json``), the wall time and the final weights; then whether the runs of each kind are bit-equal (largest
absolute weight difference and equal loss curves) and the StepPlan's ``nondeterministic`` parts.

    python benchmarks/bench_deterministic.py --out /tmp/det_cpu.json                 # CPU, one thread
    python benchmarks/bench_deterministic.py --device cuda --out /tmp/det_cuda.json  # the GPU path: compile, CUDA graph, fla

The speed of the real shape's step on a GPU is ``bench_train.py``'s ``hybrid_fast_det`` variant (docs/conversion.md,
"Deterministic training").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from headscope.masks import HeadMask
from headscope.train import ConvertRecipe, convert_model
from headscope.train.model_folder import load_model_folder

ROOT = Path(__file__).resolve().parents[1]


def tokenizer():
    spec = importlib.util.spec_from_file_location("small_vocab", ROOT / "tests" / "small_vocab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tok = mod.small_tokenizer()
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


def corpus(n_docs: int = 120, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = "the a farmer painter sailor walked looked talked harbour garden square barn road morning rain care".split()
    return "\n\n".join(" ".join(" ".join(rng.choice(words) for _ in range(9)) + "." for _ in range(12)) for _ in range(n_docs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=4, help="runs of each kind")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads on a CPU")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = tokenizer()
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg._attn_implementation = "sdpa"
    teacher = LlamaForCausalLM(cfg).to(a.device).eval()
    mask = HeadMask(4, 4, 2, ((1,), (0, 3), (2,), (1,)))
    work = Path(tempfile.mkdtemp(prefix="bench_det_"))
    (work / "corpus.txt").write_text(corpus())
    recipe = ConvertRecipe(seq_len=128, long_len=256, batch_size=4, batch_long=2, corpus=str(work / "corpus.txt"),
                           stage_tokens=(8 * 4 * 128, 16 * 4 * 128, 8 * 2 * 256), ckpt_every=0)
    runs: dict[str, list] = {"deterministic": [], "off": []}
    for rep in range(a.reps):
        for det in ((False, True) if rep % 2 == 0 else (True, False)):
            kind = "deterministic" if det else "off"
            out = work / f"{kind}{rep}"
            t0 = time.perf_counter()
            convert_model(teacher, tok, mask, out, recipe=recipe, progress=False, train_options={"deterministic": det})
            wall = time.perf_counter() - t0
            recs = [json.loads((out / f"stage{k}" / "training.json").read_text()) for k in (1, 2, 3)]
            runs[kind].append({"wall_s": wall, "train_s": sum(r["seconds"] for r in recs),
                               "curves": [r["loss_curve"]["rows"] for r in recs],
                               "nondeterministic": recs[-1]["step_plan"]["nondeterministic"],
                               "weights": load_model_folder(out / "stage3").state_dict()})
            print(kind, rep, f"{wall:.2f} s wall, {runs[kind][-1]['train_s']:.2f} s training", flush=True)
    report = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "threads": a.threads, "reps": a.reps,
              "steps": [recipe.steps(k) for k in (1, 2, 3)]}
    for kind, rs in runs.items():
        w0 = rs[0]["weights"]
        report[kind] = {
            "median_train_s": statistics.median(r["train_s"] for r in rs),
            "median_wall_s": statistics.median(r["wall_s"] for r in rs),
            "train_s": [round(r["train_s"], 3) for r in rs],
            "max_abs_weight_diff_to_first": max(float((r["weights"][n].float() - w0[n].float()).abs().max())
                                                for r in rs[1:] for n in w0) if len(rs) > 1 else None,
            "loss_curves_equal": all(r["curves"] == rs[0]["curves"] for r in rs[1:]),
            "nondeterministic": rs[0]["nondeterministic"]}
    report["train_s_ratio"] = report["deterministic"]["median_train_s"] / report["off"]["median_train_s"]
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items()}, indent=1))


if __name__ == "__main__":
    main()
