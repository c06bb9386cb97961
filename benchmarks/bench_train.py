"""Training-step speed: the head-wise hybrid student against a dense student of the same shape.

One run, one process, one GPU. Models: SmolLM2-135M's shape (30 layers, 576 wide, 9 query / 3 KV
heads of 64, MLP 1536, vocabulary 49,152, tied embeddings), random weights; the teacher in bf16, the
students with fp32 master weights under bf16 autocast. The hybrid is ``hybridize(teacher, mask)`` with
a 7:1 mask (34 FA heads, at least one per layer) drawn from random scores. Batches are random tokens,
all real. Steps (a "step" is one optimizer step on one batch, timed over ``--steps`` steps after
warm-up, with ``torch.cuda.synchronize`` around; tokens/s = batch · seq_len / seconds per step):

- ``dense_eager`` / ``dense_compiled``: the dense roof recipe: plain transformers Llama student,
  teacher logits without gradient, student logits, KL in 4,096-row chunks, fused AdamW; eager, and
  with ``torch.compile`` on both whole models (stage 2 only). The denominator of the acceptance ratio.
- ``dense_fast``: the dense student through headscope's trainer with the fast step
  (:class:`headscope.train.fast.FastStep`).
- ``hybrid_old``: the hybrid through the trainer's plain step (``TrainConfig(fast=False)``: full
  logits, per-parameter AdamW), as before this change.
- ``hybrid_fast_eager`` (fused LM head + loss, fused AdamW, the hybrid layers' fast path, no compile,
  no graph), ``hybrid_fast_compile`` (+ regional ``torch.compile``), ``hybrid_fast`` (+ a CUDA graph of
  forward + backward: the trainer's default on CUDA): the levers one at a time.
- ``hybrid_fast_det``: ``hybrid_fast`` with ``TrainConfig(deterministic=True)`` under
  :func:`headscope.train.determinism.deterministic_mode` (``headscope convert --deterministic``): its cost.

Each result holds tokens/s, seconds per step, MFU (model FLOPs / time / 989.4 TFLOP/s, the H100/H200
SXM dense bf16 datasheet rate; :func:`headscope.train.fast.flops_per_token`), peak memory
(``max_memory_allocated``), the per-step losses and, for fast variants, whether the CUDA graph was
captured. ``loss_agreement``: first-step losses of the fast and the old step from the same weights on
the same batch. ``ratios``: hybrid / dense step speed per shape and stage. The JSON is rewritten after
every variant.

``--family F`` (issue 61's per-family table; the models of ``benchmarks/family_configs.py``, which
``bench_generate.py`` and ``bench_first_call.py`` share: random weights of the family's config, its 7:1
mask): by default only what the acceptance asks — stage 2 at the family's ``TRAIN_SHAPE`` (64 x 512 where
it fits one 80 GB GPU, fewer rows for the large vocabularies and Mistral's layers), ``dense_compiled`` and
``hybrid_fast`` — with the students kept on the CPU between variants (each variant's peak memory is its
own); ``hybrid_fast`` records whether the trainer took the fast step (``fast_step``; where it did not,
``fast_unavailable`` says why) and the backend each role resolved to. ``--smoke --family F``: the
family's tiny model on the CPU, the dense roof compiled by Dynamo without Inductor.

    python benchmarks/bench_train.py --out benchmarks/results/h200_train.json
    python benchmarks/bench_train.py --family qwen3 --out train_qwen3.json
    python benchmarks/bench_train.py --smoke [--family gemma3] --out /tmp/bench_train_smoke.json   # CPU, tiny
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
from dataclasses import asdict
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_configs import FAMILIES, TRAIN_SHAPE, chosen_backends, family_config, geometry, smoke_config  # noqa: E402

from headscope.hybrid import hybridize, inference_config
from headscope.masks import HeadMask
from headscope.train import TokenRows, TrainConfig, Trainer
from headscope.train.determinism import deterministic_mode
from headscope.train.fast import flops_per_token
from headscope.train.stages import distillation_loss

PEAK_BF16 = 989.4e12
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def smollm2_config(smoke: bool) -> LlamaConfig:
    if smoke:
        kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)
    else:
        kw = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152)
    cfg = LlamaConfig(max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def reset_mem(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


def rows_for(vocab: int, batch: int, seq: int, n_batches: int, seed: int) -> TokenRows:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch * n_batches, seq), generator=g)
    return TokenRows(ids, torch.ones_like(ids, dtype=torch.bool))


# ------------------------------------------------------------------------------------ the dense roof
def roof_step(student, teacher, ids, mask, opt, chunk=4096):
    """The dense roof's step: teacher logits, student logits (bf16 autocast), KL in row chunks."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        with torch.no_grad():
            t = teacher(input_ids=ids, use_cache=False).logits
        s = student(input_ids=ids, use_cache=False).logits
    V = s.shape[-1]
    s, t, m = s.reshape(-1, V), t.reshape(-1, V), mask.reshape(-1)
    n = m.sum().clamp_min(1)
    loss = sum(distillation_loss(s[r:r + chunk, None], t[r:r + chunk, None], m[r:r + chunk, None], denominator=n)
               for r in range(0, s.shape[0], chunk))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def run_roof(name, student0, teacher, rows, batch, steps, warm, dev, compiled, backend="inductor"):
    student = copy.deepcopy(student0).to(dev)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4, **({"fused": True} if dev.type == "cuda" else {}))
    s_fn, t_fn = student, teacher
    if compiled:
        s_fn, t_fn = torch.compile(student, backend=backend), torch.compile(teacher, backend=backend)
    reset_mem(dev)
    losses, times = [], []
    for i in range(warm + steps):
        ids = rows.ids[i * batch:(i + 1) * batch].to(dev)
        mask = rows.mask[i * batch:(i + 1) * batch].to(dev)
        sync(dev)
        t0 = time.perf_counter()
        loss = roof_step(s_fn, t_fn, ids, mask, opt)
        losses.append(float(loss))
        sync(dev)
        times.append(time.perf_counter() - t0)
    res = {"losses": losses, "warmup_s": times[:warm], "step_times": times[warm:], "peak_gib": peak_gib(dev)}
    del student, opt, s_fn, t_fn
    return res


# ------------------------------------------------------------------------------------ trainer variants
def run_trainer(stage, student0, teacher, rows, batch, steps, warm, dev, out_dir, **cfg_kw):
    student = copy.deepcopy(student0).to(dev)
    cfg = TrainConfig(stage=stage, tokens=rows.ids.numel(), batch_size=batch, lr=1e-4, progress=False,
                      ckpt_on_exit=False, save_student=False, bf16=dev.type == "cuda", **cfg_kw)
    reset_mem(dev)
    tr = Trainer(student, teacher, rows, cfg, out_dir)
    losses, times = [], []
    with deterministic_mode(cfg.deterministic):  # as Trainer.run (the steps are called one by one here)
        for _ in range(warm + steps):
            sync(dev)
            t0 = time.perf_counter()
            row = tr.train_step()
            sync(dev)
            times.append(time.perf_counter() - t0)
            losses.append(row["loss"])
    fs = tr.step_fn if tr.plan.fast else None
    res = {"losses": losses, "warmup_s": times[:warm], "step_times": times[warm:], "peak_gib": peak_gib(dev),
           "cuda_graph": None if fs is None else fs.graph is not None,
           "graph_error": None if fs is None else fs.graph_error,
           "fast_step": tr.plan.fast, "fast_unavailable": tr.plan.fast_unavailable,
           "backends": chosen_backends(student)}
    tr.step_fn.close()
    del tr, student
    return res


def summarize(res, tokens_per_step, flops_per_step):
    st = np.array(res["step_times"])
    sec = float(np.median(st))
    res.update({"step_s": sec, "step_s_min": float(st.min()), "step_s_max": float(st.max()),
                "tok_s": tokens_per_step / sec, "mfu": flops_per_step / sec / PEAK_BF16 if flops_per_step else None,
                "tflops": flops_per_step / sec / 1e12 if flops_per_step else None})
    return res


def acceptance(report: dict) -> dict:
    """Per case: the fast hybrid step against the dense steps (tokens/s, MFU, peak memory, ratios)."""
    out = {}
    for key, r in report["results"].items():
        if "hybrid_fast" not in r:
            continue
        h = r["hybrid_fast"]
        row = {"hybrid_tok_s": h["tok_s"], "hybrid_mfu": h["mfu"], "hybrid_peak_gib": h["peak_gib"],
               "hybrid_cuda_graph": h.get("cuda_graph"), "hybrid_fast_step": h.get("fast_step"),
               "hybrid_fast_unavailable": h.get("fast_unavailable")}
        for den in ("dense_compiled", "dense_fast", "dense_eager"):
            if den in r:
                row.update({f"{den}_tok_s": r[den]["tok_s"], f"{den}_mfu": r[den]["mfu"],
                            f"{den}_peak_gib": r[den]["peak_gib"], f"ratio_vs_{den}": h["tok_s"] / r[den]["tok_s"]})
        if "hybrid_old" in r:
            row.update({"hybrid_old_tok_s": r["hybrid_old"]["tok_s"], "speedup_vs_old": h["tok_s"] / r["hybrid_old"]["tok_s"]})
        out[key] = row
    return out


# ------------------------------------------------------------------------------------ main
OLD_DEFAULTS = {"shapes": "64x512,16x2048", "stages13": "64x512",
                "variants": "dense_compiled,hybrid_fast,hybrid_old,dense_eager,dense_fast", "ladder": "64x512"}


def family_models(family: str, smoke: bool, gdn_kernel: str):
    """``--family``: (config, description, teacher, dense student, hybrid student, mask) from
    ``benchmarks/family_configs.py``, built on the CPU (fp32; the students stay there and each variant copies its own
    to the device, so a variant's peak memory is its own)."""
    cfg, mask, what = smoke_config(family) if smoke else family_config(family)
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    dense0 = AutoModelForCausalLM.from_config(cfg)  # another random draw
    return cfg, what, teacher, dense0, hybridize(teacher, mask, gdn_kernel=gdn_kernel), mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script)")
    ap.add_argument("--family", default=None, choices=FAMILIES,
                    help="a family of benchmarks/family_configs.py: by default only stage 2 at its TRAIN_SHAPE, "
                         "dense_compiled and hybrid_fast (without: SmolLM2-135M's shape and every variant)")
    ap.add_argument("--shapes", default=None, help=f"stage-2 batch x seq_len list (default {OLD_DEFAULTS['shapes']})")
    ap.add_argument("--stages13", default=None,
                    help=f"shape for stages 1 and 3 ('' = skip; default {OLD_DEFAULTS['stages13']})")
    ap.add_argument("--variants", default=None, help=f"stage-2 variants at every shape (default {OLD_DEFAULTS['variants']})")
    ap.add_argument("--variants13", default="hybrid_fast,dense_fast,hybrid_old", help="stage 1 and 3 variants")
    ap.add_argument("--ladder", default=None,
                    help=f"shape for the remaining levers (fast without graph / compile; default {OLD_DEFAULTS['ladder']})")
    ap.add_argument("--ladder-variants", default="hybrid_fast_compile,hybrid_fast_eager")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--gdn-kernel", default="auto")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip variants once this many seconds have passed")
    args = ap.parse_args()

    if args.family and not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_train.py --family times CUDA training steps: run it on a GPU host, or with --smoke on the CPU")
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    fam = {"shapes": "2x32" if args.smoke else TRAIN_SHAPE.get(args.family), "stages13": "", "ladder": "",
           "variants": "dense_compiled,hybrid_fast"}
    for k, v in (fam if args.family else OLD_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    compile_backend = "inductor"
    if args.smoke and args.family:  # the dense roof through Dynamo without Inductor (minutes on 2 CPU cores)
        args.steps, compile_backend = 2, "eager"
    elif args.smoke:
        args.shapes, args.stages13, args.ladder, args.steps = "2x32,1x64", "2x32", "2x32", 2
        args.variants = args.variants.replace("dense_compiled,", "")  # inductor on 2 CPU cores: minutes
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if args.family:
        cfg, what, teacher, dense0, hybrid0, mask = family_models(args.family, args.smoke, args.gdn_kernel)
        teacher = teacher.to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    else:
        cfg = smollm2_config(args.smoke)
        what = "SmolLM2-135M shape" if not args.smoke else "tiny (smoke)"
        torch.manual_seed(0)
        teacher = LlamaForCausalLM(cfg).to(dev).eval()
        dense0 = LlamaForCausalLM(cfg).to(dev)  # another random draw
        scores = np.random.default_rng(0).random((cfg.num_hidden_layers, cfg.num_attention_heads))
        mask = HeadMask.select(scores, "2:1" if args.smoke else "7:1", cfg.num_key_value_heads, min_per_layer=1)
        hybrid0 = hybridize(teacher, mask, gdn_kernel=args.gdn_kernel)
        teacher = teacher.to(torch.bfloat16) if dev.type == "cuda" else teacher
    for p in teacher.parameters():
        p.requires_grad_(False)
    vers = {"torch": torch.__version__}
    for mod in ("transformers", "triton", "fla", "tilelang"):
        try:
            vers[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            vers[mod] = None
    L, H, KV = geometry(cfg)
    report = {
        "family": args.family or "smollm2", "shape": what,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "versions": vers, "gdn_kernel": args.gdn_kernel, "steps_timed": args.steps,
        "inference_config": asdict(inference_config(hybrid0)),  # the fast inference paths' (training: train_forward)
        "model": {"layers": L, "hidden": cfg.hidden_size, "heads": H, "kv_heads": KV, "vocab": cfg.vocab_size,
                  "dense_params": sum(p.numel() for p in dense0.parameters()),
                  "hybrid_params": sum(p.numel() for p in hybrid0.parameters())},
        "mask": {"n_fa": mask.n_fa, "fa_per_layer": [len(h) for h in mask.fa_heads],
                 "kv_groups_per_layer": [len(g) for g in mask.kv_groups()]},
        "peak_bf16_flops": PEAK_BF16, "results": {}, "ratios": {}, "loss_agreement": {}, "errors": {},
    }

    def save():
        report["acceptance"] = acceptance(report)
        out_path.write_text(json.dumps(report, indent=1))

    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    jobs = []  # in order of priority: the run stops taking new ones at --budget-s
    for shape in [s for s in args.shapes.split(",") if s]:
        jobs += [(2, shape, v) for v in args.variants.split(",") if v]
    for stage in (1, 3):
        for shape in [s for s in args.stages13.split(",") if s]:
            jobs += [(stage, shape, v) for v in args.variants13.split(",") if v]
    for shape in [s for s in args.ladder.split(",") if s]:
        jobs += [(2, shape, v) for v in args.ladder_variants.split(",") if v]
    for k, (stage, shape, v) in enumerate(jobs):
        if time.time() - T0 > args.budget_s:
            report["errors"][f"stage{stage}_{shape}/{v}"] = "skipped: time budget"
            continue
        b, t = (int(x) for x in shape.split("x"))
        key = f"stage{stage}_{shape}"
        rows = rows_for(cfg.vocab_size, b, t, n_batches=args.steps + 4, seed=1)
        student0 = hybrid0 if v.startswith("hybrid") else dense0
        fl_s = flops_per_token(student0, t, backward=True, attention_only=stage == 1)["total"]
        fl_t = flops_per_token(teacher, t, backward=False)["total"] if stage in (1, 2) else 0.0
        flops_step = (fl_s + fl_t) * b * t
        log(f"{key} {v} ...")
        try:
            warm = 3
            if v in ("dense_eager", "dense_compiled"):
                if stage != 2:
                    continue
                res = run_roof(v, dense0, teacher, rows, b, args.steps, warm, dev, compiled=v == "dense_compiled",
                               backend=compile_backend)
            else:
                kw = {"hybrid_old": dict(fast=False),
                      "hybrid_fast_eager": dict(compile=False, cuda_graph=False),
                      "hybrid_fast_compile": dict(cuda_graph=False),
                      "hybrid_fast": {}, "hybrid_fast_det": dict(deterministic=True), "dense_fast": {}}[v]
                if args.smoke and v not in ("hybrid_old",):
                    kw.setdefault("compile", False)
                res = run_trainer(stage, student0, teacher, rows, b, args.steps, warm, dev, tmp / f"{key}_{v}", **kw)
            res = summarize(res, b * t, flops_step)
            res["flops_per_step"] = flops_step
            report["results"].setdefault(key, {})[v] = res
            log(f"{key} {v}: {res['tok_s'] / 1e3:.1f}K tok/s, {res['step_s'] * 1e3:.0f} ms/step, MFU {res['mfu']:.3f}, "
                f"peak {res['peak_gib']} GiB, loss {res['losses'][0]:.5g}, graph {res.get('cuda_graph')} "
                f"{res.get('graph_error') or ''}")
        except Exception as e:  # noqa: BLE001 - keep the other variants
            report["errors"][f"{key}/{v}"] = f"{type(e).__name__}: {e}"
            log(f"{key} {v} FAILED: {e}\n{traceback.format_exc()[-3000:]}")
        # ratios and loss agreement so far
        r = report["results"].get(key, {})
        rat = {}
        for num in ("hybrid_fast", "hybrid_fast_det", "hybrid_fast_compile", "hybrid_fast_eager", "hybrid_old", "dense_fast"):
            for den in ("dense_compiled", "dense_fast", "dense_eager"):
                if num in r and den in r and num != den:
                    rat[f"{num}/{den}"] = r[num]["tok_s"] / r[den]["tok_s"]
        if "hybrid_fast_det" in r and "hybrid_fast" in r:  # the deterministic setting's speed, same process
            rat["hybrid_fast_det/hybrid_fast"] = r["hybrid_fast_det"]["tok_s"] / r["hybrid_fast"]["tok_s"]
        report["ratios"][key] = rat
        if "hybrid_old" in r:
            la = {}
            for fv in ("hybrid_fast", "hybrid_fast_compile", "hybrid_fast_eager"):
                if fv in r:
                    a, o = r[fv]["losses"][0], r["hybrid_old"]["losses"][0]
                    la[fv] = {"fast_loss": a, "old_loss": o, "rel_diff": abs(a - o) / max(abs(o), 1e-30)}
            report["loss_agreement"][key] = la
        save()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # final table
    print("\n| case | variant | tok/s | ms/step | MFU | peak GiB | graph |")
    print("|---|---|---|---|---|---|---|")
    for key, r in report["results"].items():
        for v, res in r.items():
            pk = f"{res['peak_gib']:.1f}" if res["peak_gib"] is not None else "-"
            print(f"| {key} | {v} | {res['tok_s'] / 1e3:.1f}K | {res['step_s'] * 1e3:.0f} | {res['mfu']:.3f} | {pk} | "
                  f"{res.get('cuda_graph')} |")
    for key, rat in report["ratios"].items():
        print(key, {k: round(x, 3) for k, x in rat.items()})
    print("loss agreement", json.dumps(report["loss_agreement"]))
    print("errors", json.dumps(report["errors"])[:2000])
    save()


if __name__ == "__main__":
    sys.exit(main())
