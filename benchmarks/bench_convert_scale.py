"""The three conversion stages at a large shape (Qwen3-1.7B, Llama-3.1-8B) through the product's convert path,
against the teacher's own compiled dense training step in the same run (issue 63 items 1, 2 and 5).

The teacher is built here from a shape name (``--shape``; nothing is downloaded) with random weights rounded to
bf16 and held as ``headscope convert`` holds it: float32 by default, bf16 with ``--teacher-dtype bf16`` (the same
trainer setting as ``headscope convert --teacher-dtype``: ``TrainConfig.teacher_dtype``, recorded in the step plan;
the teacher's parameters cast, its rotary buffers kept in fp32). ``--new-params-only``: stage 1 trains only the
parameters the hybrid adds (``TrainConfig.new_params_only``, as ``headscope convert --new-params-only``). The student
is ``load_student(teacher, mask, dtype=float32, **ConvertRecipe().hybrid_options())`` (fp32 master weights whatever the
teacher's dtype; the hybrid `headscope convert` trains: FA heads NoPE with the log-length query scale and an output gate,
GDN heads with RoPE; γ calibrated on 8 rows) with an equal-budget 7:1 mask (``round(heads / 8)`` FA heads in every layer, spread over
the KV groups) or ``--mask mask.json`` (a ranking's). Rows are random tokens, all real.

**Hybrid stage** (``hybrid``): ``headscope.train.convert_stage`` (what ``headscope convert`` runs per stage) with a
:class:`~headscope.train.TrainConfig` of the given rows, ``--activation-checkpointing``, ``--grad-accum`` and the
product's defaults otherwise (the fast step where it applies: on CUDA with fla installed; torch.compile,
a CUDA graph and fused AdamW on CUDA), ``--warmup`` + ``--steps`` steps; the step time is the trainer's own per-step
``seconds`` (host-synced), the median over the timed steps. Peak memory: ``torch.cuda.max_memory_allocated`` since
the stage started (teacher and student weights included; on a CPU the process's ``ru_maxrss``).

**Baseline** (``baseline``, ``--no-baseline`` skips it): the teacher's architecture as a plain transformers model
(a float32 copy of the teacher's weights), its decoder ``torch.compile``-d whole, trained with the stage's loss on the
same rows, the same micro-batches and checkpointing (transformers' ``activation_checkpointing_enable``), bf16 autocast,
the LM head + loss in the same row chunks as the fast step (``headscope.train.fused_loss``), gradient clipping and
fused AdamW: stage 2 distils from the teacher (its compiled forward included: the dense roof of
``bench_train.py``), stages 1 and 3 train next-token cross-entropy (stage 1 has no dense counterpart: the
teacher's own LM step). ``ratio_tok_s`` = hybrid tokens/s ÷ baseline tokens/s.

**Counted FLOPs** (``flops``; :func:`counted_flops`), per token at row length T, from
:func:`headscope.train.fast.flops_per_token` (2 per weight of every linear map, LM head included; causal FA
2·2·(T/2)·d_head per FA head; a GDN head 2·(5·64·d + 3·d²)): stage 1 = teacher body forward (its LM head not
run) + 3 × the student's attention modules' forward; stage 2 = teacher forward + 3 × student forward; stage 3 =
3 × student forward; baseline = 3 × dense forward (+ the teacher forward in stage 2). The recomputation of
activation checkpointing is not counted (model FLOPs). MFU = FLOPs per step ÷ seconds per step ÷ 989.4 TFLOP/s
(H100 / H200 SXM dense bf16).

**Correctness at scale** (``--check``): for ``--check-steps`` batches of ``--check-rows``, from the same weights, the
fast step (compiled, no CUDA graph) against the plain step in bf16 and against the plain step in float32: loss and
gradient relative errors (‖g_a − g_b‖ / ‖g_b‖ over all trained parameters, and the worst parameter), then one AdamW
step on the fast step's gradients so the next batch sees moved weights.

**Where the step's time goes** (``--profile K``): K more steps of each variant after the timed ones, under
``torch.profiler``: wall ms per step, the device's busy ms per step (the sum of the operators' self device time) and
its share of the wall time, and the 25 operators with the most self device time (ms and calls per step). Profiled
steps are not in the timing.

**Resume at scale** (``--resume-check 2``): ``--resume-steps`` steps of ``--resume-rows`` uninterrupted (twice: the
kernels' run-to-run differences), and cut after half of them (exit checkpoint written, its size recorded) then resumed
in a new trainer; the final weights against the uninterrupted run's.

The JSON (``--out``) is rewritten after every timed step, every finished case and every checked batch, so a crash or
a cut loses nothing measured; progress goes to stdout (flushed) and ``--log``. Runnable detached
(``tools/device/chain.sh``).

    python benchmarks/bench_convert_scale.py --shape qwen3-1.7b --stages 2 --activation-checkpointing \\
        --out benchmarks/results/h100_convert_scale_qwen3_s2.json
    python benchmarks/bench_convert_scale.py --shape tiny --out /tmp/scale.json --check   # CPU, seconds
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

from headscope.train.recipe import ConvertRecipe

PEAK_BF16 = 989.4e12  # H100 / H200 SXM dense bf16 FLOP/s (datasheet)
# the student `headscope convert` trains (its recipe's hybrid options: FA heads NoPE with the log-length query scale,
# the FA output gate, RoPE on the GDN heads); the H100 figures of 2026-12-06 were of HybridOptions' defaults instead
STUDENT_OPTIONS = ConvertRecipe().hybrid_options()
STAGE_LR = {1: 1e-3, 2: 2e-4, 3: 1e-4}  # the recipe's
T0 = time.time()
_LOG: Optional[Path] = None

#: teacher shapes by name: (transformers config class, its fields)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-1.7b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)),
    "llama-3.1-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                                         rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "smollm2-135m": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    "tiny": ("Qwen3Config", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                 rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096)),
}


def log(msg: str) -> None:
    line = f"[{time.time() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    if _LOG is not None:
        with open(_LOG, "a") as f:
            f.write(line + "\n")


def teacher_config(shape: str) -> Any:
    """The transformers config of a shape in :data:`SHAPES` (SDPA attention)."""
    import transformers

    cls, kw = SHAPES[shape]
    cfg = getattr(transformers, cls)(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_teacher(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A random teacher of ``shape`` on ``device``: transformers' initialization, weights rounded to bf16 (as a bf16
    checkpoint holds them), kept in ``dtype``; frozen, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(teacher_config(shape), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    from headscope.train.step_plan import dtype_name
    from headscope.train.trainer import hold_teacher

    model = hold_teacher(model, dtype_name(dtype)).eval()  # parameters only: the rotary inv_freq stays fp32
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def equal_budget_mask(cfg: Any, ratio: int = 8) -> Any:
    """The equal-budget LA:FA = (ratio-1):1 mask: ``max(1, round(heads / ratio))`` FA heads in every layer, heads
    ``j · heads / n`` (so they fall in different KV groups where they can)."""
    from headscope.masks import HeadMask

    H, L = cfg.num_attention_heads, cfg.num_hidden_layers
    n = max(1, round(H / ratio))
    heads = [(layer, j * H // n) for layer in range(L) for j in range(n)]
    return HeadMask.from_heads(heads, L, H, cfg.num_key_value_heads, {"budget": f"{ratio - 1}:1 per layer (equal budget)"})


def counted_flops(stage: int, student: torch.nn.Module, teacher: torch.nn.Module, seq_len: int) -> dict[str, float]:
    """Counted FLOPs per token of a hybrid stage step (see the module docstring): ``teacher_forward``,
    ``student_train`` (forward + backward = 3 × forward) and ``total``."""
    from headscope.train.fast import flops_per_token

    s = flops_per_token(student, seq_len, backward=True, attention_only=stage == 1)["total"]
    t = 0.0
    if stage in (1, 2):
        t = flops_per_token(teacher, seq_len, backward=False)["total"]
        if stage == 1:  # stage 1 runs the teacher's decoder layers only
            t -= 2.0 * teacher.lm_head.weight.numel()
    return {"teacher_forward": t, "student_train": s, "total": s + t}


def baseline_flops(stage: int, teacher: torch.nn.Module, seq_len: int) -> dict[str, float]:
    """Counted FLOPs per token of the dense baseline step: 3 × the dense forward, + the teacher forward in stage 2."""
    from headscope.train.fast import flops_per_token

    d = flops_per_token(teacher, seq_len, backward=True)["total"]
    t = flops_per_token(teacher, seq_len, backward=False)["total"] if stage == 2 else 0.0
    return {"teacher_forward": t, "student_train": d, "total": d + t}


def random_rows(vocab: int, rows: int, seq_len: int, n_batches: int, seed: int) -> Any:
    from headscope.train import TokenRows

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows * n_batches, seq_len), generator=g)
    return TokenRows(ids, torch.ones_like(ids, dtype=torch.bool))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


def timing(step_s: list[float], tokens_per_step: int, flops_per_step: float) -> dict[str, Any]:
    """Median step time of the timed steps and what follows from it (tokens/s, MFU, TFLOP/s)."""
    if not step_s:
        return {"timed_steps": 0}
    sec = sorted(step_s)[len(step_s) // 2]
    return {"timed_steps": len(step_s), "ms_per_step": 1e3 * sec, "ms_min": 1e3 * min(step_s), "ms_max": 1e3 * max(step_s),
            "tokens_per_s": tokens_per_step / sec, "mfu": flops_per_step / sec / PEAK_BF16,
            "tflops": flops_per_step / sec / 1e12}


# CUPTI's own records, not kernels: seen on an H100 (2026-12-06) as 1.2 s per 1.3-s step, which made the busy share 1.94
PROFILER_MARKERS = ("Command Buffer Full", "Activity Buffer Request", "Lazy Function Loading")


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` ((start, end) in µs), in ms: time the device ran at least one kernel
    (kernels on concurrent streams counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def profile_summary(events, n_steps: int, wall_s: float, device_kernels: bool) -> dict[str, Any]:
    """Summary of ``n_steps`` profiled steps from ``torch.profiler``'s ``events()``: with ``device_kernels`` only the
    device's kernel records count (the operators that launched them, which ``key_averages`` also lists with their
    kernels' time, would count it twice; CUPTI's markers ``PROFILER_MARKERS`` are not kernels): ``busy_share`` =
    union of the kernels' intervals ÷ wall time, ``top`` = the 25 kernels of most summed time (ms per step); on the
    CPU the operators' self CPU time."""
    from torch.autograd import DeviceType

    per: dict[str, list[float]] = {}
    spans = []
    for e in events:
        on_device = e.device_type != DeviceType.CPU
        if on_device != device_kernels or e.name in PROFILER_MARKERS:
            continue
        t = (e.time_range.end - e.time_range.start) if device_kernels else e.self_cpu_time_total
        if t <= 0:
            continue
        spans.append((e.time_range.start, e.time_range.end))
        acc = per.setdefault(e.name[:120], [0.0, 0])
        acc[0] += t
        acc[1] += 1
    rows = sorted(({"name": k, "ms_per_step": v[0] / 1e3 / n_steps, "calls_per_step": v[1] / n_steps}
                   for k, v in per.items()), key=lambda r: -r["ms_per_step"])
    busy = (busy_ms(spans) if device_kernels else sum(r["ms_per_step"] for r in rows) * n_steps) / n_steps
    wall_ms = 1e3 * wall_s / n_steps
    return {"steps": n_steps, "wall_ms_per_step": wall_ms, "device_busy_ms_per_step": busy,
            "busy_share": busy / wall_ms if wall_ms > 0 else None,
            "time": "device kernels (union of intervals)" if device_kernels else "self CPU", "top": rows[:25]}


class StepProfile:
    """``--profile K``: K more steps after the timed ones under ``torch.profiler`` (CPU and CUDA activity); the
    summary (``profile_summary``) says how busy the GPU was (kernel time per step against the step's wall time) and
    which kernels took it (top 25, ms per step). Profiled steps are not in the timing."""

    def __init__(self, n_steps: int, dev: torch.device):
        self.n, self.dev, self.prof, self.t0 = n_steps, dev, None, 0.0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev.type == "cuda" else [])
        sync(self.dev)
        self.prof = profile(activities=acts)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        sync(self.dev)
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        return profile_summary(self.prof.events(), self.n, wall, device_kernels=self.dev.type == "cuda")


# ------------------------------------------------------------------------------------------ the hybrid stage
def run_hybrid(stage: int, teacher, student, mask, rows, B: int, T: int, args, dev, work: Path, report_case: dict,
               save) -> dict[str, Any]:
    """``--warmup`` + ``--steps`` steps of ``stage`` through ``convert_stage``; the case's ``hybrid`` entry is
    filled in (and saved) after every step."""
    from headscope.train import TrainConfig, convert_stage

    k = args.grad_accum
    n_run = args.warmup + args.steps
    prof = StepProfile(args.profile, dev) if args.profile else None
    cfg = TrainConfig(stage=stage, tokens=B * T * (n_run + args.profile), batch_size=B, lr=STAGE_LR[stage],
                      progress=False, ckpt_every=0, ckpt_on_exit=False, seed=0, grad_accum=k,
                      activation_checkpointing=args.activation_checkpointing, fast=False if args.plain_step else None,
                      compile=False if args.no_compile else None, loss_chunk=args.loss_chunk,
                      teacher_dtype=args.teacher_dtype, new_params_only=args.new_params_only and stage == 1)
    fl = counted_flops(stage, student, teacher, T)
    res: dict[str, Any] = {"status": "running", "steps": [], "flops_per_token": fl, "flops_per_step": fl["total"] * B * T}
    report_case["hybrid"] = res

    def on_step(tr, row):
        res["steps"].append({"step": row["step"], "seconds": row["seconds"], "loss": row["loss"],
                             "peak_gib": peak_gib(dev)})
        if "step_plan" not in res:
            res["step_plan"] = tr.plan.as_dict()
            res["trained_parameters"] = sum(p.numel() for _, p in tr.params)
        if tr.plan.fast:
            res["cuda_graph"] = tr.step_fn.graph is not None
            res["graph_error"] = tr.step_fn.graph_error
            res["graph_breaks"] = list(getattr(tr.step_fn, "graph_breaks", []))
        res.update(timing([s["seconds"] for s in res["steps"][args.warmup:n_run]], B * T, res["flops_per_step"]))
        log(f"  stage {stage} {B}x{T} step {row['step']}: {row['seconds'] * 1e3:.0f} ms, loss {row['loss']:.4g}, "
            f"peak {res['steps'][-1]['peak_gib']} GiB")
        if prof is not None and row["step"] == n_run:
            prof.start()
        elif prof is not None and row["step"] == n_run + args.profile:
            res["profile"] = prof.stop()
        save()

    free(dev)
    _, summ = convert_stage(teacher, None, mask, stage, work / f"s{stage}_{B}x{T}", config=cfg, rows=rows,
                            student=student, save_folder=False, on_step=on_step, record={})
    res.update({"status": "done", "warmup_s": [s["seconds"] for s in res["steps"][:args.warmup]],
                "peak_memory": summ.get("peak_memory"), "peak_gib_stage": (summ.get("peak_memory") or {}).get("bytes", 0) / 2**30,
                "step_plan": summ.get("step_plan")})
    return res


# ------------------------------------------------------------------------------------------ the dense baseline
def run_baseline(stage: int, teacher, rows, B: int, T: int, args, dev, res: dict, save) -> dict[str, Any]:
    """The teacher's compiled dense training step with the stage's loss (see the module docstring)."""
    from headscope.train.fused_loss import ce_chunk, kl_chunk, linear_ce_loss, linear_kl_loss
    from headscope.train.stages import loss_token_count

    free(dev)
    k = args.grad_accum
    cuda = dev.type == "cuda"
    dense = copy.deepcopy(teacher).float().train()
    for p in dense.parameters():
        p.requires_grad_(True)
    if args.activation_checkpointing:
        enable = getattr(dense, "activation_checkpointing_enable", None) or dense.gradient_checkpointing_enable  # older name
        enable({"use_reentrant": False})
    compile_on = not args.no_compile
    wrap = (lambda m: torch.compile(m)) if compile_on else (lambda m: m)
    body, t_body = wrap(dense.model), (wrap(teacher.model) if stage == 2 else None)
    kl_fn, ce_fn = (wrap(kl_chunk), wrap(ce_chunk))
    opt = torch.optim.AdamW(dense.parameters(), lr=STAGE_LR[stage], betas=(0.9, 0.95),
                            **({"fused": True} if cuda else {"foreach": False}))
    fl = baseline_flops(stage, teacher, T)
    res.update({"status": "running", "steps": [], "flops_per_token": fl, "flops_per_step": fl["total"] * B * T,
                "kind": "distillation from the teacher (KL)" if stage == 2 else "next-token cross-entropy",
                "compiled": compile_on, "grad_accum": k, "activation_checkpointing": args.activation_checkpointing})
    ac = torch.autocast(dev.type, dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    n_run = args.warmup + args.steps
    prof = StepProfile(args.profile, dev) if args.profile else None
    for i in range(n_run + args.profile):
        if prof is not None and i == n_run:
            prof.start()
        ids = rows.ids[i * B:(i + 1) * B].to(dev)
        mask = rows.mask[i * B:(i + 1) * B].to(dev)
        sync(dev)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        denom = loss_token_count(2 if stage == 2 else 3, mask).to(torch.float32)
        total = torch.zeros((), device=dev)
        for ids_k, mask_k in zip(ids.tensor_split(k), mask.tensor_split(k)):
            with ac:
                if stage == 2:
                    with torch.no_grad():
                        h_t = t_body(input_ids=ids_k, use_cache=False).last_hidden_state
                h = body(input_ids=ids_k, use_cache=False).last_hidden_state
                D = h.shape[-1]
                if stage == 2:
                    loss = linear_kl_loss(h.reshape(-1, D), dense.lm_head.weight, h_t.reshape(-1, D), teacher.lm_head.weight,
                                          mask_k.reshape(-1), denominator=denom, chunk_rows=args.loss_chunk, chunk_fn=kl_fn)
                else:
                    keep = torch.zeros_like(mask_k)
                    keep[:, :-1] = mask_k[:, 1:] & mask_k[:, :-1]
                    loss = linear_ce_loss(h.reshape(-1, D), dense.lm_head.weight, ids_k.roll(-1, dims=1).reshape(-1),
                                          keep.reshape(-1), denominator=denom, chunk_rows=args.loss_chunk, chunk_fn=ce_fn)
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
        opt.step()
        lv = float(total)  # host sync, as the trainer's step
        sync(dev)
        sec = time.perf_counter() - t0
        res["steps"].append({"step": i + 1, "seconds": sec, "loss": lv, "peak_gib": peak_gib(dev)})
        res.update(timing([s["seconds"] for s in res["steps"][args.warmup:n_run]], B * T, res["flops_per_step"]))
        log(f"  baseline stage {stage} {B}x{T} step {i + 1}: {sec * 1e3:.0f} ms, loss {lv:.4g}, peak {peak_gib(dev)} GiB")
        if prof is not None and i + 1 == n_run + args.profile:
            res["profile"] = prof.stop()
        save()
    res.update({"status": "done", "warmup_s": [s["seconds"] for s in res["steps"][:args.warmup]], "peak_gib": peak_gib(dev)})
    del dense, opt, body, t_body
    free(dev)
    return res


# ------------------------------------------------------------------------------------------ fast vs plain
def rel_err(a: list[torch.Tensor], b: list[torch.Tensor], names: list[str]) -> dict[str, Any]:
    """‖a − b‖ / ‖b‖ over all tensors together, and the worst tensor's own relative error (with its name)."""
    num = math.sqrt(sum(float((x.float() - y.float()).pow(2).sum()) for x, y in zip(a, b)))
    den = math.sqrt(sum(float(y.float().pow(2).sum()) for y in b))
    per = [float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)) for x, y in zip(a, b)]
    w = max(range(len(per)), key=per.__getitem__)
    return {"global": num / max(den, 1e-30), "worst": per[w], "worst_parameter": names[w],
            "median": sorted(per)[len(per) // 2]}


def check_fast_vs_plain(stage: int, teacher, student, rows, B: int, steps: int, args, dev, out: dict, save) -> None:
    """Item 5 of issue 63: the fast step's loss and gradients against the plain step (bf16 and float32), batch by
    batch from the same weights, AdamW moving the weights between batches (fast step's gradients)."""
    from headscope.train import trainable_parameters
    from headscope.train.fast import FastStep
    from headscope.train.step_plan import PlainStep

    cuda = dev.type == "cuda"
    tch = teacher if stage < 3 else None
    named = trainable_parameters(student, stage, args.new_params_only and stage == 1)
    names, ps = [n for n, _ in named], [p for _, p in named]
    opt = torch.optim.AdamW(ps, lr=STAGE_LR[stage], **({"fused": True} if cuda else {"foreach": False}))
    fast = FastStep(stage, student, tch, ps, bf16=cuda, compile=cuda and not args.no_compile, cuda_graph=False,
                    chunk_rows=args.loss_chunk)
    plain = PlainStep(stage, student, tch, ps, bf16=cuda)
    plain32 = PlainStep(stage, student, tch, ps, bf16=False)
    out.update({"stage": stage, "rows": B, "seq_len": rows.seq_len, "bf16": cuda, "batches": []})
    student.train()
    for i in range(steps):
        ids, mask = rows.ids[i * B:(i + 1) * B].to(dev), rows.mask[i * B:(i + 1) * B].to(dev)
        lf = fast(ids, mask)
        l_fast = float(lf[0])
        g_fast = [p.grad.detach().clone() for p in ps]
        fast.close()  # the hybrid layers' training backend back to the model's own for the plain steps
        l32 = float(plain32(ids, mask)[0])
        g32 = [p.grad.detach().clone() for p in ps]
        lp = float(plain(ids, mask)[0])
        gp = [p.grad.detach() for p in ps]
        row = {"batch": i + 1, "loss_fast": l_fast, "loss_plain_bf16": lp, "loss_plain_fp32": l32,
               "loss_rel_fast_vs_plain": abs(l_fast - lp) / max(abs(lp), 1e-30),
               "loss_rel_fast_vs_fp32": abs(l_fast - l32) / max(abs(l32), 1e-30),
               "loss_rel_plain_vs_fp32": abs(lp - l32) / max(abs(l32), 1e-30),
               "grad_fast_vs_plain": rel_err(g_fast, gp, names), "grad_fast_vs_fp32": rel_err(g_fast, g32, names),
               "grad_plain_vs_fp32": rel_err(gp, g32, names)}
        out["batches"].append(row)
        log(f"  check stage {stage} batch {i + 1}: loss fast {l_fast:.6g} plain {lp:.6g} fp32 {l32:.6g}; grad rel err "
            f"fast/plain {row['grad_fast_vs_plain']['global']:.3g}, fast/fp32 {row['grad_fast_vs_fp32']['global']:.3g}, "
            f"plain/fp32 {row['grad_plain_vs_fp32']['global']:.3g}")
        save()
        for p, g in zip(ps, g_fast):
            p.grad = g
        del g32, gp
        opt.step()
        for p in ps:
            p.grad = None
    plain.close()
    plain32.close()
    keys = ("grad_fast_vs_plain", "grad_fast_vs_fp32", "grad_plain_vs_fp32")
    out["max"] = {k: max(b[k]["global"] for b in out["batches"]) for k in keys}
    out["max"].update({k: max(b[k] for b in out["batches"]) for k in
                       ("loss_rel_fast_vs_plain", "loss_rel_fast_vs_fp32", "loss_rel_plain_vs_fp32")})
    del opt
    free(dev)


# ------------------------------------------------------------------------------------------ resume
def resume_check(stage: int, teacher, student, mask, rows, B: int, steps: int, cut: int, args, dev, work: Path,
                 out: dict, save) -> None:
    """Issue 63 item 5's other half: ``steps`` steps of ``stage`` through ``convert_stage`` uninterrupted (twice: run
    to run differences of the device's kernels), and stopped after ``cut`` steps (the exit checkpoint written, timed)
    then resumed from it in a new trainer; the final weights compared with the uninterrupted run's (largest absolute
    difference, relative to what training moved the weights, and how many tensors are bit for bit equal)."""
    from headscope.train import StopTraining, TrainConfig, convert_stage

    start = {k: v.detach().to("cpu", copy=True) for k, v in student.state_dict().items()}

    def cfg() -> Any:
        return TrainConfig(stage=stage, tokens=B * rows.seq_len * steps, batch_size=B, lr=STAGE_LR[stage], progress=False,
                           ckpt_every=0, seed=0, grad_accum=args.grad_accum, activation_checkpointing=args.activation_checkpointing,
                           fast=False if args.plain_step else None, compile=False if args.no_compile else None,
                           loss_chunk=args.loss_chunk, teacher_dtype=args.teacher_dtype,
                           new_params_only=args.new_params_only and stage == 1)

    def run(name: str, resume: bool = False, stop: Optional[int] = None) -> dict[str, Any]:
        if not resume:
            student.load_state_dict(start)
        losses: list[float] = []

        def on_step(tr, row):
            losses.append(row["loss"])
            if stop is not None and tr.step == stop:
                raise StopTraining

        t0 = time.time()
        _, summ = convert_stage(teacher, None, mask, stage, work / f"resume_{name}", config=cfg(), rows=rows,
                                student=student, save_folder=False, on_step=on_step, record={}, resume=resume)
        free(dev)
        return {"losses": losses, "steps": summ["steps"], "seconds": time.time() - t0}

    out.update({"stage": stage, "rows": B, "seq_len": rows.seq_len, "steps": steps, "cut_after": cut})
    a = run("a")
    ref = {k: v.detach().to("cpu", copy=True) for k, v in student.state_dict().items()}
    a2 = run("a2")
    again = {k: v.detach().to("cpu", copy=True) for k, v in student.state_dict().items()}
    b1 = run("b", stop=cut)
    ckpt = work / f"resume_b/stage{stage}/checkpoint"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.exists() else 0
    b2 = run("b", resume=True)
    got = {k: v.detach().to("cpu") for k, v in student.state_dict().items()}

    def compare(x: dict, y: dict) -> dict[str, Any]:
        moved = max(float((y[k].double() - start[k].double()).abs().max()) for k in y)
        diff = max(float((x[k].double() - y[k].double()).abs().max()) for k in y)
        return {"max_abs_diff": diff, "max_moved": moved, "diff_over_moved": diff / max(moved, 1e-30),
                "tensors_bitwise_equal": sum(bool(torch.equal(x[k], y[k])) for k in y), "tensors": len(y)}

    out.update({"uninterrupted": a, "uninterrupted_again": a2, "cut": b1, "resumed": b2, "checkpoint_bytes": size,
                "resumed_vs_uninterrupted": compare(got, ref), "run_to_run": compare(again, ref),
                "losses_equal": b1["losses"] + b2["losses"] == a["losses"]})
    log(f"  resume stage {stage}: resumed vs uninterrupted {out['resumed_vs_uninterrupted']}, run to run "
        f"{out['run_to_run']}, checkpoint {size / 2**30:.2f} GiB, cut run {b1['seconds']:.1f} s")
    save()
    student.load_state_dict(start)


# ------------------------------------------------------------------------------------------ main
def parse_cases(args) -> list[tuple[int, int, int]]:
    """(stage, rows, seq_len) per case from --stages, --rows, --seq-len and --stage3-long."""
    rows = [int(x) for x in args.rows.split(",")]
    lens = [int(x) for x in args.seq_len.split(",")]
    if len(rows) != 3 or len(lens) != 3:
        raise SystemExit("--rows and --seq-len take three values (stages 1, 2, 3)")
    cases = []
    for s in (int(x) for x in args.stages.split(",") if x):
        if s not in (1, 2, 3):
            raise SystemExit(f"--stages: {s} is not a stage")
        cases.append((s, rows[s - 1], lens[s - 1]))
        if s == 3 and args.stage3_long:
            b, t = (int(x) for x in args.stage3_long.lower().split("x"))
            cases.append((3, b, t))
    for s, b, t in cases:
        k = args.grad_accum
        if b % k:
            raise SystemExit(f"stage {s}: {b} rows do not split into --grad-accum {k} micro-batches")
    return cases


def versions() -> dict[str, Any]:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for mod in ("transformers", "triton", "fla"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - not installed
            out[mod] = None
    try:
        out["headscope_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                                 cwd=Path(__file__).resolve().parents[1], timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git
        out["headscope_commit"] = None
    return out


def planned_gib(shape_name: str, cfg: Any, stage: int, rows: int, seq_len: int, mask: Any, args) -> Optional[float]:
    """``headscope plan-memory``'s total for the case (rows = one micro-batch), GiB."""
    try:
        from headscope.train.memory_plan import KNOWN_SHAPES, MemoryOptions, ModelShape, plan_memory

        shape = KNOWN_SHAPES.get(shape_name) or ModelShape.from_config(cfg, name=shape_name)
        opts = MemoryOptions(activation_checkpointing=args.activation_checkpointing, teacher_dtype=args.teacher_dtype,
                             new_params_only=args.new_params_only, loss_chunk=args.loss_chunk,
                             fa_gate=STUDENT_OPTIONS["fa_gate"])  # the student of `headscope convert`'s recipe
        return plan_memory(shape, stage, rows, seq_len, fa=mask, options=opts).total / 2**30
    except Exception as e:  # noqa: BLE001 - the plan is context, not the measurement
        log(f"memory plan unavailable: {e}")
        return None


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    global _LOG
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file (rewritten as results come)")
    ap.add_argument("--log", default=None, help="also append the progress lines to this file")
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--stages", default="1,2,3", help="stages to time, e.g. 2 or 1,2,3 ('' with --check: only the check)")
    ap.add_argument("--rows", default="64,64,16", help="rows per step of stages 1, 2, 3 (the recipe's)")
    ap.add_argument("--seq-len", default="512,512,2048", help="row length of stages 1, 2, 3 (the recipe's)")
    ap.add_argument("--stage3-long", default="4x8192", help="a second stage-3 case ROWSxLEN ('' = none)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per case")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="K more steps per variant under torch.profiler, not timed: GPU busy share and the top operators")
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing (compile; the CUDA graph is captured in the 3rd)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--loss-chunk", type=int, default=4096, help="rows per LM-head chunk")
    ap.add_argument("--no-baseline", action="store_true", help="skip the dense baseline")
    ap.add_argument("--baseline-only", action="store_true", help="only the dense baseline of each case")
    ap.add_argument("--plain-step", action="store_true", help="the trainer's plain step instead of the fast one")
    ap.add_argument("--no-compile", action="store_true", help="no torch.compile (fast step and baseline)")
    ap.add_argument("--teacher-dtype", default="fp32", choices=("fp32", "bf16"),
                    help="the teacher's weights (TrainConfig.teacher_dtype, `headscope convert --teacher-dtype`); the "
                         "student is float32 either way")
    ap.add_argument("--new-params-only", action="store_true",
                    help="stage 1 trains only the parameters the hybrid adds (TrainConfig.new_params_only)")
    ap.add_argument("--mask", default=None, help="a HeadMask JSON (a ranking's) instead of the equal-budget 7:1 mask")
    ap.add_argument("--check", action="store_true", help="fast step vs plain step (loss, gradients; bf16 and fp32)")
    ap.add_argument("--check-stages", default="2", help="stages of the check")
    ap.add_argument("--check-rows", default="4x512", help="ROWSxLEN of the check's batches")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--resume-check", default="", help="stages whose kill-and-resume is checked, e.g. 2 ('' = none)")
    ap.add_argument("--resume-rows", default="8x512", help="ROWSxLEN of the resume check's steps")
    ap.add_argument("--resume-steps", type=int, default=4, help="steps of the resume check (cut after half of them)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this many seconds")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    args = ap.parse_args(argv)
    _LOG = Path(args.log) if args.log else None
    if args.grad_accum < 1:
        raise SystemExit("--grad-accum must be >= 1")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cases = parse_cases(args) if args.stages else []
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    from headscope.masks import HeadMask
    from headscope.train.pipeline import load_student

    cfg = teacher_config(args.shape)
    log(f"building the {args.shape} teacher ({args.teacher_dtype}) on {dev}")
    teacher = build_teacher(args.shape, dev, torch.float32 if args.teacher_dtype == "fp32" else torch.bfloat16)
    mask = HeadMask.from_json(args.mask) if args.mask else equal_budget_mask(cfg)
    calib = random_rows(cfg.vocab_size, 8, 128, 1, seed=7).ids.to(dev)
    t_build = time.time()
    student = load_student(teacher, mask, calibration_ids=calib, dtype=torch.float32, **STUDENT_OPTIONS)
    log(f"student built in {time.time() - t_build:.1f} s")
    report: dict[str, Any] = {
        "script": "benchmarks/bench_convert_scale.py", "argv": sys.argv[1:] if argv is None else list(argv),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "versions": versions(),
        "shape": {"name": args.shape, **{k: v for k, v in SHAPES[args.shape][1].items()},
                  "teacher_params": sum(p.numel() for p in teacher.parameters()),
                  "student_params": sum(p.numel() for p in student.parameters())},
        "teacher_dtype": args.teacher_dtype,
        "mask": {"source": args.mask or "equal budget 7:1", "n_fa": mask.n_fa, "fa_per_layer": [len(h) for h in mask.fa_heads]},
        "settings": {"activation_checkpointing": args.activation_checkpointing, "grad_accum": args.grad_accum,
                     "new_params_only": args.new_params_only,
                     "loss_chunk": args.loss_chunk, "warmup": args.warmup, "steps": args.steps,
                     "plain_step": args.plain_step, "compile": not args.no_compile},
        "peak_bf16_flops": PEAK_BF16,
        "flops_formula": ("per token at row length T (headscope.train.fast.flops_per_token): F(model) = 2·linear weights "
                          "(LM head included) + 2·2·(T/2)·d_head per FA head + 2·(5·64·d_head + 3·d_head²) per GDN head; "
                          "stage 1: F(teacher) − 2·V·D + 3·F(student attention modules); stage 2: F(teacher) + "
                          "3·F(student); stage 3: 3·F(student); baseline: 3·F(teacher) (+ F(teacher) in stage 2); "
                          "recomputation not counted; MFU = FLOPs/step ÷ s/step ÷ peak_bf16_flops"),
        "cases": {}, "check": {}, "resume": {}, "errors": {},
    }

    def save() -> None:
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        os.replace(tmp, out_path)

    save()
    work = Path(tempfile.mkdtemp(prefix="bench_convert_scale_"))
    for stage, B, T in cases:
        key = f"stage{stage}_{B}x{T}"
        if time.time() - T0 > args.budget_s:
            report["errors"][key] = "skipped: --budget-s reached"
            save()
            continue
        k = args.grad_accum
        case: dict[str, Any] = {"stage": stage, "rows": B, "seq_len": T, "tokens_per_step": B * T, "grad_accum": k,
                                "micro_rows": B // k, "activation_checkpointing": args.activation_checkpointing,
                                "planned_gib": planned_gib(args.shape, cfg, stage, B // k, T, mask, args)}
        report["cases"][key] = case
        rows = random_rows(cfg.vocab_size, B, T, args.warmup + args.steps + args.profile, seed=stage)
        log(f"{key}: {B} x {T}, grad_accum {k}, checkpointing {args.activation_checkpointing}, plan {case['planned_gib']} GiB")
        if not args.baseline_only:
            try:
                student.to(dev)
                h = run_hybrid(stage, teacher, student, mask, rows, B, T, args, dev, work, case, save)
                log(f"{key} hybrid: {h.get('tokens_per_s', 0) / 1e3:.1f}K tok/s, {h.get('ms_per_step', 0):.0f} ms/step, "
                    f"MFU {h.get('mfu', 0):.3f}, peak {h.get('peak_gib_stage', 0):.2f} GiB, graph {h.get('cuda_graph')}")
            except Exception as e:  # noqa: BLE001 - keep what was measured, go on with the next case
                case.setdefault("hybrid", {})["status"] = "failed"
                report["errors"][f"{key}/hybrid"] = f"{type(e).__name__}: {e}"
                log(f"{key} hybrid FAILED: {e}\n{traceback.format_exc()[-3000:]}")
            save()
        if not args.no_baseline:
            try:
                if dev.type == "cuda":
                    student.to("cpu")  # room for the dense copy, its gradients and AdamW states
                base: dict[str, Any] = {}
                case["baseline"] = base
                run_baseline(stage, teacher, rows, B, T, args, dev, base, save)
                log(f"{key} baseline: {base.get('tokens_per_s', 0) / 1e3:.1f}K tok/s, {base.get('ms_per_step', 0):.0f} "
                    f"ms/step, MFU {base.get('mfu', 0):.3f}, peak {base.get('peak_gib')} GiB")
            except Exception as e:  # noqa: BLE001
                case.setdefault("baseline", {})["status"] = "failed"
                report["errors"][f"{key}/baseline"] = f"{type(e).__name__}: {e}"
                log(f"{key} baseline FAILED: {e}\n{traceback.format_exc()[-3000:]}")
            finally:
                student.to(dev)
                free(dev)
        h, b = case.get("hybrid", {}), case.get("baseline", {})
        if h.get("tokens_per_s") and b.get("tokens_per_s"):
            case["ratio_tok_s"] = h["tokens_per_s"] / b["tokens_per_s"]
            log(f"{key}: hybrid / baseline = {case['ratio_tok_s']:.3f}")
        save()
    if args.check:
        cb, ct = (int(x) for x in args.check_rows.lower().split("x"))
        for s in (int(x) for x in args.check_stages.split(",") if x):
            key = f"stage{s}_{cb}x{ct}"
            if time.time() - T0 > args.budget_s:
                report["errors"][f"check/{key}"] = "skipped: --budget-s reached"
                continue
            entry: dict[str, Any] = {}
            report["check"][key] = entry
            try:
                student.to(dev)
                rows = random_rows(cfg.vocab_size, cb, ct, args.check_steps, seed=100 + s)
                check_fast_vs_plain(s, teacher, student, rows, cb, args.check_steps, args, dev, entry, save)
                log(f"check {key}: max {entry['max']}")
            except Exception as e:  # noqa: BLE001
                report["errors"][f"check/{key}"] = f"{type(e).__name__}: {e}"
                log(f"check {key} FAILED: {e}\n{traceback.format_exc()[-3000:]}")
            save()
    if args.resume_check:
        rb, rt = (int(x) for x in args.resume_rows.lower().split("x"))
        for s in (int(x) for x in args.resume_check.split(",") if x):
            key = f"stage{s}_{rb}x{rt}"
            if time.time() - T0 > args.budget_s:
                report["errors"][f"resume/{key}"] = "skipped: --budget-s reached"
                continue
            entry = {}
            report["resume"][key] = entry
            try:
                student.to(dev)
                rows = random_rows(cfg.vocab_size, rb, rt, args.resume_steps, seed=200 + s)
                resume_check(s, teacher, student, mask, rows, rb, args.resume_steps, max(1, args.resume_steps // 2), args,
                             dev, work, entry, save)
            except Exception as e:  # noqa: BLE001
                report["errors"][f"resume/{key}"] = f"{type(e).__name__}: {e}"
                log(f"resume {key} FAILED: {e}\n{traceback.format_exc()[-3000:]}")
            save()
    report["seconds"] = round(time.time() - T0, 1)
    save()
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    print("\n| case | variant | tok/s | ms/step | MFU | peak GiB | plan GiB |")
    print("|---|---|---|---|---|---|---|")
    for key, c in report["cases"].items():
        for v in ("hybrid", "baseline"):
            r = c.get(v) or {}
            if r.get("tokens_per_s"):
                pk = r.get("peak_gib_stage") or r.get("peak_gib")
                print(f"| {key} | {v} | {r['tokens_per_s'] / 1e3:.1f}K | {r['ms_per_step']:.0f} | {r['mfu']:.3f} | "
                      f"{pk if pk is None else round(pk, 2)} | {c['planned_gib'] if c['planned_gib'] is None else round(c['planned_gib'], 1)} |")
        if "ratio_tok_s" in c:
            print(f"| {key} | ratio | {c['ratio_tok_s']:.3f} | | | | |")
    print("errors", json.dumps(report["errors"])[:2000], flush=True)
    return report


if __name__ == "__main__":
    main()
