"""Scale-out on 2 GPUs: sharded receiver sweep, FSDP2 stage-2 distillation, device_map placement.

    python benchmarks/scale_out.py --out OUT --gguf /tmp/m/smol.gguf [--gdn-kernel auto|torch|fla]
    python benchmarks/scale_out.py --out /tmp/smoke --smoke          # CPU, gloo, tiny models

Parts (each in try/except; OUT/scale_out.json is rewritten after each part):

a. exact receiver IE of a Qwen3-1.7B-shaped random model (28 layers, 16 query / 8 KV heads, d_head
   128, d_model 2048, ffn 6144) for --pairs pairs at --seq-len tokens (bf16): one GPU vs two GPUs
   sharded through ``headscope.rank(shard=...)`` (NCCL); seconds, throughput ratio, max |diff| of the
   merged table against the one-GPU table.
b. stage-2 distillation (global KL): SmolLM2-135M from --gguf (else a small random Llama) as teacher, a
   7:1 hybrid student from a mask of random scores, --stage1-steps of stage 1 first; then --steps steps
   of stage 2 on one GPU (bf16 autocast; and fp32, the bf16-noise control) and on two GPUs (FSDP2, bf16),
   the same global batch and rows; loss curves, relative loss differences (2 GPUs vs 1, fp32 vs bf16),
   tokens/s; then --tp-steps at a global batch of --tp-batch-size on one and two GPUs (throughput).
   The same two runs on two GPUs with DistributedDataParallel (``TrainConfig.data_parallel = "ddp"``:
   the one-GPU fast step on every rank, gradients averaged over ranks by DDP) go to
   ``b_stage2.ddp``: its loss curve against one GPU, tokens/s, and at the throughput batch
   (default 64 x 512) one GPU's fast step vs two GPUs, ``ddp_throughput_ratio`` (a number).
c. the Qwen3-shaped model spread over two GPUs (``device_map="balanced"``): one pair, exact
   receiver IE against the one-GPU result, peak memory per GPU against the one-GPU peak.

Files: OUT/scale_out.json (everything), OUT/sweep.csv, OUT/loss_curves.csv, OUT/device_map.csv.
"""

from __future__ import annotations

import os

# NVLink multicast stays off, for this process and every child (spawned children inherit os.environ)
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ helpers
def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def plain_copy(model):
    """The same weights in a model without the GGUF quantization marker, so it can be saved and reloaded
    by the spawned ranks (transformers refuses ``save_pretrained`` on a GGUF-loaded model)."""
    import copy

    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg.__dict__.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(cfg, torch_dtype=next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict())
    return plain.to(next(model.parameters()).device).eval()


def qwen3_shaped(tok, dtype, device, smoke: bool, seed: int = 0):
    """The Qwen3-1.7B-shaped random model (tiny in smoke mode), built on ``device`` with ``seed``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from headscope.models import wrap

    if smoke:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    else:
        shape = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128)
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), max_position_embeddings=40960, tie_word_embeddings=True, **shape)
    with torch.device(device):
        hf = Qwen3ForCausalLM(cfg).to(dtype).eval()
    return wrap(hf, tok, name="qwen3-1.7b-shape-random" if not smoke else "qwen3-tiny-random")


def checksum(lm) -> float:
    return float(sum(p.float().sum().item() for p in list(lm.hf_model.parameters())[:6]))


def init_rank(rank: int, world: int, rendezvous: str, use_cuda: bool) -> str:
    dev = f"cuda:{rank}" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    return dev


def fresh(*dirs: Path) -> None:
    """Remove results of an earlier run (a stale store would be resumed and skew the timings)."""
    import shutil

    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def rendezvous_file(out: Path, tag: str) -> str:
    p = out / f".rdv-{tag}-{os.getpid()}"
    if p.exists():
        p.unlink()
    return str(p)


def nan_max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    both = ~(torch.isnan(a) | torch.isnan(b))
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return math.inf
    return float((a[both] - b[both]).abs().max()) if both.any() else 0.0


# ------------------------------------------------------------------------------- a: sweep throughput
def _sweep_worker(rank, world, rdv, use_cuda, tok, pairs, dtype, smoke, out_dir, result):
    import headscope
    from headscope.patching import receiver_patching

    dev = init_rank(rank, world, rdv, use_cuda)
    try:
        t_build = time.perf_counter()
        lm = qwen3_shaped(tok, dtype, dev, smoke)
        bs = lm.geometry.n_heads
        receiver_patching(lm, pairs[:1], min_gap=0.0, heads=[(0, 0)], progress=False, batch_size=bs)  # warm-up
        sync(dev)
        build = time.perf_counter() - t_build
        dist.barrier()
        t = time.perf_counter()
        r = headscope.rank(lm, pairs=pairs, min_gap=0.0, out_dir=out_dir, shard=(rank, world), batch_size=bs, progress=False)
        sync(dev)
        mine = time.perf_counter() - t
        dist.barrier()
        sweep = time.perf_counter() - t
        secs = [torch.zeros(1, device=dev) for _ in range(world)]
        dist.all_gather(secs, torch.tensor([mine], device=dev))
        if rank == 0:
            torch.save({"ie": r.ie, "seconds": sweep, "rank_seconds": [float(s) for s in secs], "build_seconds": build,
                        "checksum": checksum(lm)}, result)
    finally:
        dist.destroy_process_group()


def part_a(args, tok, out: Path, res: dict) -> None:
    import headscope
    from headscope.patching import receiver_patching
    from headscope.tasks import niah_single

    use_cuda = not args.smoke
    dev = "cuda:0" if use_cuda else "cpu"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    fresh(out / "a_one_gpu", out / "a_two_gpu")
    pairs = niah_single(tok, n_pairs=args.pairs, seq_len=args.seq_len, depth=0.5, seed=0)
    r = res.setdefault("a_sweep", {"pairs": len(pairs), "seq_len": args.seq_len, "lengths": [p.length for p in pairs],
                                   "dtype": str(dtype).replace("torch.", "")})
    # one GPU
    lm = qwen3_shaped(tok, dtype, dev, args.smoke)
    bs = lm.geometry.n_heads  # the same batch shapes in every run: bitwise-comparable results
    receiver_patching(lm, pairs[:1], min_gap=0.0, heads=[(0, 0)], progress=False, batch_size=bs)
    sync(dev)
    t = time.perf_counter()
    one = headscope.rank(lm, pairs=pairs, min_gap=0.0, out_dir=out / "a_one_gpu", batch_size=bs, progress=False)
    sync(dev)
    r["one_gpu_seconds"] = round(time.perf_counter() - t, 2)
    r["one_gpu_checksum"] = checksum(lm)
    log(f"a: 1 device: {len(pairs)} pairs in {r['one_gpu_seconds']} s")
    del lm
    if use_cuda:
        torch.cuda.empty_cache()
    # two GPUs, sharded through the existing distributed path
    result = out / "a_two_gpu_result.pt"
    t = time.perf_counter()
    torch.multiprocessing.spawn(
        _sweep_worker, args=(2, rendezvous_file(out, "a"), use_cuda, tok, pairs, dtype, args.smoke,
                             str(out / "a_two_gpu"), str(result)), nprocs=2, join=True)
    wall = time.perf_counter() - t
    two = torch.load(result, weights_only=False)
    r["two_gpu_seconds"] = round(two["seconds"], 2)
    r["two_gpu_rank_seconds"] = [round(s, 2) for s in two["rank_seconds"]]
    r["two_gpu_wall_seconds_incl_spawn_and_build"] = round(wall, 2)
    r["throughput_ratio"] = round(r["one_gpu_seconds"] / two["seconds"], 3)
    r["same_weights"] = two["checksum"] == r["one_gpu_checksum"]
    r["max_abs_diff_ie"] = nan_max_abs_diff(one.ie, two["ie"])
    r["identical"] = r["max_abs_diff_ie"] == 0.0
    log(f"a: 2 devices: {r['two_gpu_seconds']} s (ranks {r['two_gpu_rank_seconds']}, wall with spawn {r['two_gpu_wall_seconds_incl_spawn_and_build']} s); "
        f"ratio {r['throughput_ratio']}x, max|diff| {r['max_abs_diff_ie']}")
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["devices", "seconds", "pairs", "seq_len", "throughput_ratio", "max_abs_diff_ie"])
        w.writerow([1, r["one_gpu_seconds"], len(pairs), args.seq_len, 1.0, 0.0])
        w.writerow([2, r["two_gpu_seconds"], len(pairs), args.seq_len, r["throughput_ratio"], r["max_abs_diff_ie"]])


# ------------------------------------------------------------------------------ b: FSDP2 stage 2
def _train(student, teacher, rows, cfg, out_dir):
    from headscope.train import Trainer

    tr = Trainer(student, teacher, rows, cfg, out_dir)
    summary = tr.run()
    return summary, [json.loads(x) for x in (Path(out_dir) / "log.jsonl").read_text().splitlines()] if tr.rank == 0 else None


def _student(teacher, mask, kernel, state, dev):
    from headscope.hybrid import hybridize

    student = hybridize(teacher, mask, gdn_kernel=kernel)
    student.load_state_dict(torch.load(state, map_location=dev))
    return student


def _train_worker(rank, world, rdv, use_cuda, teacher_dir, mask, kernel, state, rows, jobs, result):
    """One rank: load the teacher once, then for each (config, out_dir) job train a fresh student from
    ``state`` (FSDP2-sharded or replicated by the Trainer, as ``config.data_parallel`` says). Rank 0
    writes [{summary, log}] per finished job to ``result``."""
    from headscope.models import load_hf

    dev = init_rank(rank, world, rdv, use_cuda)
    try:
        teacher = load_hf(teacher_dir, device=dev)[0]
        done = []
        for cfg, out_dir in jobs:
            summary, rows_log = _train(_student(teacher, mask, kernel, state, dev), teacher, rows, cfg, out_dir)
            done.append({"summary": summary, "log": rows_log})
            if rank == 0:  # after each job: a later job's failure keeps the earlier results
                Path(result).write_text(json.dumps(done))
    finally:
        dist.destroy_process_group()


def _tps(lg, tokens_per_step, skip):
    """tokens/s over the steps after the first ``skip`` (kernel compilation, allocator warm-up)."""
    secs = sum(x["seconds"] for x in lg[skip:])
    return round((len(lg) - skip) * tokens_per_step / secs, 1)


def _rel(a, b):
    return [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)]


def part_b(args, tok, out: Path, res: dict) -> None:
    """Stage 2 on one GPU (bf16 autocast, and fp32 as the bf16-noise control) and on two GPUs (FSDP2,
    bf16), the same rows, global batch and start (a student after a short stage 1); then throughput at a
    larger global batch on one and two GPUs."""
    import numpy as np

    from headscope.hybrid import hybridize
    from headscope.hybrid.gdn_kernels import fla_available
    from headscope.masks import HeadMask, parse_budget
    from headscope.models import load_hf
    from headscope.train import TrainConfig, retrieval_rows

    use_cuda = not args.smoke
    dev = "cuda:0" if use_cuda else "cpu"
    dirs = {k: out / f"b_{k}" for k in ("stage1", "one_bf16", "one_fp32", "two_bf16", "tp_one", "tp_two", "two_rep_bf16",
                                        "tp_two_rep")}
    fresh(*dirs.values())
    if args.gguf and not args.smoke:
        teacher = plain_copy(load_hf(args.gguf, device=dev)[0])  # GGUF-loaded models refuse save_pretrained
        name = str(args.gguf)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2) \
            if args.smoke else dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                    num_key_value_heads=3)
        teacher = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), max_position_embeddings=8192, **small)).to(dev).eval()
        name = "random-llama"
    teacher_dir = out / "b_teacher"
    teacher.save_pretrained(teacher_dir)
    tok.save_pretrained(teacher_dir)
    cfg_m = teacher.config
    kernel = args.gdn_kernel
    if kernel == "auto":
        kernel = "fla" if (use_cuda and fla_available()) else "torch"
    rng = np.random.default_rng(0)
    n_layers, n_heads = cfg_m.num_hidden_layers, cfg_m.num_attention_heads
    budget = max(parse_budget("7:1", n_layers * n_heads), n_layers)  # 7:1, at least one FA head per layer
    mask = HeadMask.select(rng.random((n_layers, n_heads)), budget, cfg_m.num_key_value_heads, min_per_layer=1)
    if args.smoke:
        seq, batch, steps, s1_steps, tp_batch, tp_steps = 96, 4, 4, 2, 8, 3
    else:
        seq, batch, steps = args.train_seq_len, args.batch_size, args.steps
        s1_steps, tp_batch, tp_steps = args.stage1_steps, args.tp_batch_size, args.tp_steps
    n_rows = max(batch * 4, tp_batch, 32)
    rows = retrieval_rows(tok, n_rows, seq, seed=0, lengths=[seq])  # real filler text + needles, no download
    student = hybridize(teacher, mask, gdn_kernel=kernel, calibration_ids=rows.ids[:8].to(dev))
    # a short stage 1 (layer-wise alignment) first, so stage 2 starts where it starts in a conversion
    common = dict(lr=3e-4, warmup=0.05, progress=False, ckpt_on_exit=False, save_student=False, seed=0)
    s1 = TrainConfig(stage=1, tokens=s1_steps * batch * seq, batch_size=batch, **{**common, "lr": 1e-3})
    s1_summary, _ = _train(student, teacher, rows, s1, dirs["stage1"])
    state = out / "b_student_init.pt"
    torch.save(student.state_dict(), state)
    del student
    cfg = TrainConfig(stage=2, tokens=steps * batch * seq, batch_size=batch, **common)
    cfg32 = TrainConfig(stage=2, tokens=steps * batch * seq, batch_size=batch, bf16=False, **common)
    cfg_tp = TrainConfig(stage=2, tokens=tp_steps * tp_batch * seq, batch_size=tp_batch, **common)
    r = res.setdefault("b_stage2", {"model": name, "gdn_kernel": kernel, "mask": mask.summary(), "steps": steps,
                                    "global_batch": batch, "seq_len": seq, "tokens_per_step": batch * seq,
                                    "stage1_steps_before": s1_steps, "stage1_final_loss": s1_summary["final_loss"],
                                    "rows": "retrieval_rows (filler text + needles)", "bf16_autocast": use_cuda})
    log(f"b: {name}, 7:1 hybrid ({mask.summary()['n_fa']} FA heads), gdn kernel {kernel}, stage 1 {s1_steps} steps, "
        f"stage 2 {steps} steps x {batch} x {seq}; throughput {tp_steps} steps x {tp_batch} x {seq}")
    # one GPU: bf16 (the reference), fp32 (how far bf16 rounding alone moves the curve), throughput
    t1 = load_hf(str(teacher_dir), device=dev)[0]
    runs = {}
    for key, c in (("one_bf16", cfg), ("one_fp32", cfg32), ("tp_one", cfg_tp)):
        runs[key] = _train(_student(t1, mask, kernel, state, dev), t1, rows, c, dirs[key])
        log(f"b: {key} {runs[key][0]['seconds']} s, loss {runs[key][1][0]['loss']:.4f} -> {runs[key][1][-1]['loss']:.4f}")
    del t1
    if use_cuda:
        torch.cuda.empty_cache()
    # two GPUs: FSDP2 (the curve run, then the throughput run), then the same two with DDP, in one spawn
    fsdp, rep = {"data_parallel": "fsdp"}, {"data_parallel": "ddp"}
    result = out / "b_two_gpu_result.json"
    result.unlink(missing_ok=True)
    t = time.perf_counter()
    spawn_error = None
    try:
        torch.multiprocessing.spawn(
            _train_worker, args=(2, rendezvous_file(out, "b"), use_cuda, str(teacher_dir), mask, kernel, str(state), rows,
                                 [(replace(cfg, **fsdp), str(dirs["two_bf16"])), (replace(cfg_tp, **fsdp), str(dirs["tp_two"])),
                                  (replace(cfg, **rep), str(dirs["two_rep_bf16"])),
                                  (replace(cfg_tp, **rep), str(dirs["tp_two_rep"]))], str(result)),
            nprocs=2, join=True)
    except Exception as e:  # the DDP runs come last: keep the FSDP2 results if they finished
        traceback.print_exc()
        spawn_error = f"{type(e).__name__}: {e}"
    wall2 = time.perf_counter() - t
    done = json.loads(result.read_text()) if result.exists() else []
    if len(done) < 2:
        raise RuntimeError(f"two-GPU runs failed: {spawn_error}")
    two, tp_two = done[:2]
    l1 = [x["loss"] for x in runs["one_bf16"][1]]
    l32 = [x["loss"] for x in runs["one_fp32"][1]]
    l2 = [x["loss"] for x in two["log"]]
    d2, d32 = _rel(l1, l2), _rel(l1, l32)
    skip = min(5, steps - 1)
    tskip = min(5, tp_steps - 1)
    last = max(1, min(10, steps // 5))
    r.update({
        "one_gpu_seconds": runs["one_bf16"][0]["seconds"], "two_gpu_seconds": two["summary"]["seconds"],
        "two_gpu_wall_incl_spawn_and_both_runs": round(wall2, 2),
        "one_gpu_tokens_per_s": _tps(runs["one_bf16"][1], batch * seq, skip),
        "two_gpu_tokens_per_s": _tps(two["log"], batch * seq, skip),
        "first_loss": [l1[0], l2[0], l32[0]], "last_loss": [l1[-1], l2[-1], l32[-1]],
        f"mean_loss_last_{last}_steps": [float(np.mean(x[-last:])) for x in (l1, l2, l32)],
        "rel_loss_diff_2gpu_vs_1gpu": {"max": max(d2), "mean": float(np.mean(d2)), "median": float(np.median(d2))},
        "rel_loss_diff_fp32_vs_bf16_1gpu": {"max": max(d32), "mean": float(np.mean(d32)), "median": float(np.median(d32))},
        "within_bf16_noise": bool(np.mean(d2) <= np.mean(d32) and max(d2) <= max(d32)),
        "throughput": {"global_batch": tp_batch, "steps": tp_steps, "skip_first": tskip,
                       "one_gpu_tokens_per_s": _tps(runs["tp_one"][1], tp_batch * seq, tskip),
                       "two_gpu_tokens_per_s": _tps(tp_two["log"], tp_batch * seq, tskip)},
    })
    r["speedup_tokens_per_s"] = round(r["two_gpu_tokens_per_s"] / r["one_gpu_tokens_per_s"], 3)
    tp = r["throughput"]
    tp["speedup"] = round(tp["two_gpu_tokens_per_s"] / tp["one_gpu_tokens_per_s"], 3)
    r["fsdp_modes"] = [two["summary"].get("data_parallel"), tp_two["summary"].get("data_parallel")]
    rep_log = done[2]["log"] if len(done) > 2 else None
    if len(done) == 4:
        rep_two, rep_tp = done[2:]
        lr2 = [x["loss"] for x in rep_log]
        dr = _rel(l1, lr2)
        rr = {
            "modes": [rep_two["summary"].get("data_parallel"), rep_tp["summary"].get("data_parallel")],
            "fast_step": {"one_gpu": runs["tp_one"][0].get("fast_step"), "two_gpu": rep_tp["summary"].get("fast_step")},
            "two_gpu_seconds": rep_two["summary"]["seconds"],
            "two_gpu_tokens_per_s": _tps(rep_log, batch * seq, skip),
            "first_loss": lr2[0], "last_loss": lr2[-1],
            "rel_loss_diff_2gpu_vs_1gpu": {"max": max(dr), "mean": float(np.mean(dr)), "median": float(np.median(dr))},
            "within_bf16_noise": bool(np.mean(dr) <= np.mean(d32) and max(dr) <= max(d32)),
            "throughput": {"global_batch": tp_batch, "seq_len": seq, "steps": tp_steps, "skip_first": tskip,
                           "one_gpu_fast_step_tokens_per_s": tp["one_gpu_tokens_per_s"],
                           "two_gpu_tokens_per_s": _tps(rep_tp["log"], tp_batch * seq, tskip),
                           "two_gpu_seconds_per_step": round(float(np.mean([x["seconds"] for x in rep_tp["log"][tskip:]])), 4)},
        }
        rr["speedup_tokens_per_s"] = round(rr["two_gpu_tokens_per_s"] / r["one_gpu_tokens_per_s"], 3)
        rr["throughput"]["ratio"] = round(rr["throughput"]["two_gpu_tokens_per_s"] / tp["one_gpu_tokens_per_s"], 3)
        r["ddp"] = rr
        r["ddp_throughput_ratio"] = rr["throughput"]["ratio"]
    else:
        r["ddp_error"] = spawn_error or f"only {len(done)} of 4 two-GPU runs finished"
    with open(out / "loss_curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss_1gpu_bf16", "loss_2gpu_bf16", "loss_1gpu_fp32", "grad_norm_1gpu", "grad_norm_2gpu",
                    "seconds_1gpu", "seconds_2gpu", "loss_2gpu_ddp_bf16", "seconds_2gpu_ddp"])
        for i, (a, b, c) in enumerate(zip(runs["one_bf16"][1], two["log"], runs["one_fp32"][1])):
            e = rep_log[i] if rep_log is not None and i < len(rep_log) else {}
            w.writerow([a["step"], a["loss"], b["loss"], c["loss"], a["grad_norm"], b["grad_norm"], a["seconds"], b["seconds"],
                        e.get("loss"), e.get("seconds")])
    log(f"b: loss {l1[0]:.4f} -> {l1[-1]:.4f} (1 device) / {l2[0]:.4f} -> {l2[-1]:.4f} (2 devices) / fp32 {l32[-1]:.4f}; "
        f"rel diff 2 vs 1 mean {np.mean(d2):.2e} max {max(d2):.2e}, fp32 vs bf16 mean {np.mean(d32):.2e} max {max(d32):.2e}; "
        f"tokens/s {r['one_gpu_tokens_per_s']} vs {r['two_gpu_tokens_per_s']} ({r['speedup_tokens_per_s']}x); "
        f"batch {tp_batch}: {tp['one_gpu_tokens_per_s']} vs {tp['two_gpu_tokens_per_s']} ({tp['speedup']}x)")
    if "ddp" in r:
        rr = r["ddp"]
        log(f"b: DDP fast step on 2 devices: loss {rr['first_loss']:.4f} -> {rr['last_loss']:.4f}, rel diff vs 1 "
            f"device max {rr['rel_loss_diff_2gpu_vs_1gpu']['max']:.2e}; tokens/s {rr['two_gpu_tokens_per_s']} "
            f"({rr['speedup_tokens_per_s']}x); batch {tp_batch} x {seq}: 1 device fast step "
            f"{rr['throughput']['one_gpu_fast_step_tokens_per_s']} vs 2 devices {rr['throughput']['two_gpu_tokens_per_s']} "
            f"({rr['throughput']['ratio']}x)")
    else:
        log(f"b: DDP runs FAILED: {r['ddp_error']}")


# ------------------------------------------------------------------------------ c: device_map
def part_c(args, tok, out: Path, res: dict) -> None:
    from headscope.models import dispatch, wrap
    from headscope.patching import receiver_patching
    from headscope.tasks import niah_single

    use_cuda = not args.smoke
    dev = "cuda:0" if use_cuda else "cpu"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    pairs = niah_single(tok, n_pairs=1, seq_len=args.seq_len, depth=0.5, seed=0)
    r = res.setdefault("c_device_map", {"pairs": 1, "seq_len": args.seq_len})
    lm = qwen3_shaped(tok, dtype, dev, args.smoke)
    bs = lm.geometry.n_heads

    def peaks():
        return [round(torch.cuda.max_memory_allocated(i) / 2**30, 3) for i in range(torch.cuda.device_count())] if use_cuda else None

    def reset():
        if use_cuda:
            for i in range(torch.cuda.device_count()):
                torch.cuda.synchronize(i)
                torch.cuda.reset_peak_memory_stats(i)

    receiver_patching(lm, pairs, min_gap=0.0, heads=[(0, 0)], progress=False, batch_size=bs)  # warm-up
    reset()
    t = time.perf_counter()
    one = receiver_patching(lm, pairs, min_gap=0.0, progress=False, batch_size=bs)
    sync(dev)
    r["one_gpu_seconds"] = round(time.perf_counter() - t, 2)
    r["one_gpu_peak_gib"] = peaks()
    log(f"c: 1 device: {r['one_gpu_seconds']} s, peak GiB {r['one_gpu_peak_gib']}")
    del lm
    if use_cuda:
        torch.cuda.empty_cache()
    lm = qwen3_shaped(tok, dtype, dev, args.smoke)
    dmap = dispatch(lm.hf_model, "balanced")
    lm = wrap(lm.hf_model, tok, name=lm.name)
    layer_dev = {}
    for k, v in dmap.items():
        layer_dev.setdefault(str(v), []).append(k)
    r["placement"] = {d: len(v) for d, v in layer_dev.items()}
    r["device_map"] = {k: str(v) for k, v in dmap.items()}
    if use_cuda:
        torch.cuda.empty_cache()
    receiver_patching(lm, pairs, min_gap=0.0, heads=[(0, 0)], progress=False, batch_size=bs)
    reset()
    t = time.perf_counter()
    two = receiver_patching(lm, pairs, min_gap=0.0, progress=False, batch_size=bs)
    for i in range(torch.cuda.device_count() if use_cuda else 0):
        torch.cuda.synchronize(i)
    r["split_seconds"] = round(time.perf_counter() - t, 2)
    r["split_peak_gib"] = peaks()
    r["max_abs_diff_patched"] = float((one.patched - two.patched).abs().max())
    r["max_abs_diff_ie"] = nan_max_abs_diff(one.ie, two.ie)
    with open(out / "device_map.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["placement", "seconds", "peak_gib_per_gpu", "max_abs_diff_ie"])
        w.writerow(["one_gpu", r["one_gpu_seconds"], r["one_gpu_peak_gib"], 0.0])
        w.writerow(["balanced_2gpu", r["split_seconds"], r["split_peak_gib"], r["max_abs_diff_ie"]])
    log(f"c: split {r['placement']}: {r['split_seconds']} s, peak GiB {r['split_peak_gib']}, max|diff| IE {r['max_abs_diff_ie']}")


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--gguf", default=None, help="SmolLM2-135M GGUF (tokenizer, and the part-b teacher)")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny models: exercise every code path")
    ap.add_argument("--parts", default="abc", help="which parts to run (subset of 'abc')")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16, help="part b: global batch (rows)")
    ap.add_argument("--train-seq-len", type=int, default=512, help="part b: row length")
    ap.add_argument("--stage1-steps", type=int, default=30, help="part b: stage-1 steps before stage 2")
    ap.add_argument("--tp-batch-size", type=int, default=64, help="part b: global batch of the throughput runs")
    ap.add_argument("--tp-steps", type=int, default=20, help="part b: steps of the throughput runs")
    ap.add_argument("--gdn-kernel", default="auto", choices=["auto", "torch", "fla"],
                    help="part b: GDN kernel of the student (auto = fla when importable on CUDA, else torch)")
    args = ap.parse_args()
    if args.smoke:
        args.pairs, args.seq_len = min(args.pairs, 2), min(args.seq_len, 128)
        torch.set_num_threads(1)  # like each rank: tiny matmuls, no OpenMP spinning on a shared CPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    from headscope.model_specs import default_gguf_path

    g = Path(args.gguf) if args.gguf else default_gguf_path()
    tok = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if not args.smoke and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()} (use --smoke on CPU)")
    res: dict = {
        "torch": torch.__version__, "smoke": args.smoke,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if not args.smoke else ["cpu"],
        "env": {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")},
    }
    path = out / "scale_out.json"
    for part, fn in (("a", part_a), ("b", part_b), ("c", part_c)):
        if part not in args.parts:
            continue
        t = time.perf_counter()
        log(f"part {part} ...")
        try:
            fn(args, tok, out, res)
        except Exception as e:  # keep the other parts' results
            traceback.print_exc()
            res[f"{part}_error"] = f"{type(e).__name__}: {e}"
            log(f"part {part} FAILED: {e}")
        res[f"{part}_part_seconds"] = round(time.perf_counter() - t, 1)
        path.write_text(json.dumps(res, indent=1, default=str))
    log("summary:")
    for k, v in res.items():
        if isinstance(v, dict) and k not in ("env",):
            short = {kk: vv for kk, vv in v.items() if kk not in ("device_map", "lengths", "mask")}
            print(f"  {k}: {json.dumps(short, default=str)}", flush=True)
        elif k.endswith("error"):
            print(f"  {k}: {v}", flush=True)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
