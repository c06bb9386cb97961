"""Data-parallel training step on 2 CPU processes (gloo): PyTorch's DistributedDataParallel against the
hand-written replicated mode (flat-bucket gradient sums after the backward), same run, same settings.

Both modes run headscope's trainer with the fast step on every rank (CPU: fused LM head + loss chunks,
the hybrid layers' training path, no compile, no graph), the same student, the same rows and global
batch; they differ only in how the gradients reach every rank (DDP: buckets all-reduced while the
backward runs, losses normalized by the global batch's counts; replicate: local losses, gradients
weighted and summed in flat buckets after the backward). The modes alternate (``--rounds`` rounds of
each), every round from the same initial weights; a round's first ``--warmup`` steps are not timed.
tokens/s = global batch · row length / median seconds per step (rank 0's ``seconds`` column: the whole
step, reduction and AdamW included); ``ddp_over_replicate`` compares the medians of every timed step of
each mode, ``ddp_over_replicate_per_round`` each DDP round with the replicate round just before it.

    python benchmarks/bench_data_parallel.py --out benchmarks/results/cpu_gloo_ddp_vs_replicate.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _models(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    from headscope.hybrid import hybridize
    from headscope.masks import HeadMask

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d, intermediate_size=2 * args.d,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                      max_position_embeddings=4096)
    teacher = LlamaForCausalLM(cfg).eval()
    mask = HeadMask(args.layers, args.heads, args.heads // 2, tuple((i % args.heads,) for i in range(args.layers)))
    torch.manual_seed(1)
    student = hybridize(teacher, mask)
    return teacher, student, mask


def _worker(args_dict: dict, out_dir: str) -> dict:
    from headscope.hybrid import hybridize
    from headscope.train import TokenRows, TrainConfig, Trainer
    from headscope.train.parallel import world_info

    args = argparse.Namespace(**args_dict)
    rank, world = world_info()
    teacher, student0, mask = _models(args)
    start = {k: v.clone() for k, v in student0.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    n_rows = args.batch * (args.warmup + args.steps)
    ids = torch.randint(0, args.vocab, (n_rows, args.seq), generator=g)
    rows = TokenRows(ids, torch.ones_like(ids, dtype=torch.bool))
    res: dict = {"rank": rank, "world": world, "runs": []}
    modes = [m for _ in range(args.rounds) for m in ("replicate", "ddp")]
    for i, mode in enumerate(modes):
        student = hybridize(teacher, mask)
        student.load_state_dict(start)
        cfg = TrainConfig(stage=args.stage, tokens=n_rows * args.seq, batch_size=args.batch, lr=1e-3, warmup=0.0,
                          progress=False, ckpt_on_exit=False, seed=0, fast=True, data_parallel=mode)
        tr = Trainer(student, teacher if args.stage in (1, 2) else None, rows, cfg, Path(out_dir) / f"{i}_{mode}")
        t0 = time.perf_counter()
        log = [tr.train_step() for _ in range(args.warmup + args.steps)]
        wall = time.perf_counter() - t0
        secs = [r["seconds"] for r in log[args.warmup:]]
        med = statistics.median(secs)
        res["runs"].append({"mode": tr.plan.data_parallel, "round": i // 2, "step_s_median": med, "step_s": secs,
                            "tokens_per_s": args.batch * args.seq / med, "wall_s": wall,
                            "losses": [r["loss"] for r in log], "grad_norms": [r["grad_norm"] for r in log]})
        tr.step_fn.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows per step, split over the ranks)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from headscope.runtime import launch

    with tempfile.TemporaryDirectory() as tmp:
        res = launch(_worker, 2, (vars(args), tmp), device="cpu")
    by, steps = {}, {}
    for r in res["runs"]:
        by.setdefault(r["mode"], []).append(r["tokens_per_s"])
        steps.setdefault(r["mode"], []).extend(r["step_s"])
    pooled = {m: args.batch * args.seq / statistics.median(v) for m, v in steps.items()}
    paired = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(res["runs"][::2], res["runs"][1::2])]
    first = {m: next(r for r in res["runs"] if r["mode"] == m) for m in by}
    loss_rel = max(abs(a - b) / abs(a) for a, b in zip(first["replicate"]["losses"], first["ddp"]["losses"]))
    summary = {
        "settings": {**vars(args), "devices": 2, "backend": "gloo", "threads_per_rank": 1,
                     "torch": torch.__version__, "model": f"Llama {args.layers} layers x {args.d} wide, {args.heads} heads "
                     f"({args.heads // 2} KV), vocab {args.vocab}; hybrid with 1 FA head per layer"},
        "tokens_per_s": {m: v for m, v in by.items()},
        "tokens_per_s_mean": {m: statistics.mean(v) for m, v in by.items()},
        "tokens_per_s_pooled_median": pooled,
        "ddp_over_replicate": pooled["ddp"] / pooled["replicate"],
        "ddp_over_replicate_per_round": paired,
        "loss_max_rel_diff": loss_rel,
        "runs": res["runs"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("tokens_per_s_pooled_median", "ddp_over_replicate",
                                              "ddp_over_replicate_per_round", "loss_max_rel_diff")}))


if __name__ == "__main__":
    main()
