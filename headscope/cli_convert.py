"""The conversion commands of the CLI: ``headscope convert`` (the three-stage transfer, SPEC.md §9) and
``headscope plan-memory`` (per-device memory of its stages, computed without a model); ``headscope.cli`` registers
them on its app."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from .cli_errors import user_errors
from .errors import HeadscopeInputError


CONVERT_HELP = """Convert a model into a head-wise FA/GDN hybrid: the three-stage transfer (SPEC.md §9) with the
conversion study's recipe as the default; each stage ends in a model folder OUT/stage{k}/.

`headscope convert --model M --mask mask.json --out DIR` runs stages 1 (layer-wise alignment), 2
(global distillation) and 3 (long-context fine-tuning) in order; `--stage K` runs one. Each stage
writes DIR/stage{k}/, a model of its own (`AutoModelForCausalLM.from_pretrained(DIR/stage3,
trust_remote_code=True)`, no headscope needed): weights and modeling code, the tokenizer, mask.json,
the hybrid options in config.json, and training.json (tokens, seeds, SHA-256 of the rows, loss
curve, versions, seconds, peak memory, the whole configuration). `--resume` continues exactly where a
run stopped (mid-stage from its checkpoint, or the next stage).

The defaults are the recipe of experiments/conversion-generalization (SmolLM2-135M, 7:1 HydraHead
mask; accuracy on the unseen formats, single needle at 1K / 2K / 4K, 100 prompts a cell): 12.5M
tokens gave 0.98 / 0.97 / 0.92 where 50M gave 0.99 / 0.80 / 0.76 (seed 0; 0.97 / 0.95 / 0.90 retention
over five seeds); the stage-2 retrieval mix lifted seed 4 from 0.98 / 0.91 / 0.87 to 1.00 / 0.98 /
0.95 (McNemar p = 0.016 / 0.008 at 2K / 4K), both data levers (with six stage-3 wordings) to 1.00 /
0.99 / 0.97; FA heads with RoPE instead of NoPE fell to 0.56 at 4K against 0.76 (50M, p = 1.9e-6).
docs/conversion.md gives each default with its figure.

On a CPU use a small budget, e.g. `--tokens 10K --seq-len 128 --long-len 256 --batch-size 4
--batch-long 2 --docs 16 --doc-len 64` with `OMP_NUM_THREADS=1` in the environment (about 12 minutes' wall time on 2 cores; 23 without it on a busy machine). Every argument, the mask against the teacher's config, the
conversion folder (its recipe.json, finished stages, checkpoints) are checked before the teacher loads
(errors: one line, exit code 2). Data parallel: --devices N (or torchrun)."""


def _floats(name: str, value: str, n: int) -> tuple[float, ...]:
    """'1e-3,2e-4,1e-4' -> three floats. Raises HeadscopeInputError naming the option."""
    parts = [x.strip() for x in str(value).split(",")]
    try:
        out = tuple(float(x) for x in parts)
    except ValueError:
        raise HeadscopeInputError(f"{name} {value!r}: give {n} comma-separated numbers (stage 1, 2, 3)") from None
    if len(out) != n:
        raise HeadscopeInputError(f"{name} {value!r}: give {n} comma-separated numbers (stage 1, 2, 3), not {len(out)}")
    return out


def convert(
    model: str = typer.Option("smollm2-135m", help="teacher: 'smollm2-135m', 'gemma3-270m', a local HF directory, a .gguf path or a cached hub id"),
    mask: Path = typer.Option(..., help="mask.json (HeadMask) with the FA heads, e.g. from `headscope rank`"),
    out: Path = typer.Option(..., help="conversion folder: OUT/stage1..3/ (model folders), OUT/recipe.json, OUT/data/ (documents, rows)"),
    stage: Optional[int] = typer.Option(None, help="run only this stage (1, 2 or 3; stages 2-3 start from OUT/stage{k-1}/); default: all three"),
    tokens: str = typer.Option("12.5M", help="total token budget of the three stages (12.5M, 200K, 200000). 12.5M: unseen single-needle "
                                             "0.98/0.97/0.92 at 1K/2K/4K against 0.99/0.80/0.76 with 50M (the study, seed 0)"),
    shares: str = typer.Option("0.15,0.55,0.30", help="each stage's share of --tokens, rounded to whole steps (the study's split: "
                                                      "1.87M / 6.88M / 3.74M of 12.5M)"),
    stage_tokens: Optional[str] = typer.Option(None, help="three per-stage budgets instead of --tokens x --shares, e.g. 1.87M,6.88M,3.74M"),
    resume: bool = typer.Option(False, "--resume", help="continue OUT exactly where it stopped: finished stages are kept, a stage "
                                                      "continues from its checkpoint, the next one starts from the last folder"),
    seq_len: int = typer.Option(512, help="row length of stages 1-2, tokens (the study's)"),
    long_len: int = typer.Option(2048, help="row length of stage 3, tokens (the study's)"),
    batch_size: int = typer.Option(64, help="rows per step in stages 1-2 (the study's 64 x 512 on one GPU; use 4-8 on a CPU)"),
    batch_long: int = typer.Option(16, help="rows per step in stage 3 (the study's 16 x 2048 on one GPU; use 2-4 on a CPU)"),
    lr: str = typer.Option("1e-3,2e-4,1e-4", help="peak learning rate of stages 1, 2, 3 (the study's)"),
    docs: int = typer.Option(12288, help="documents sampled from the teacher (the study's 12,288 per seed)"),
    heldout_docs: int = typer.Option(256, help="of them held out of training (at most a quarter; OUT/data/heldout.pt)"),
    doc_len: int = typer.Option(512, help="new tokens per sampled document"),
    sample_batch: int = typer.Option(2048, help="documents per sampling shard (shard k: seed 10000 x seed + k; the documents depend on it)"),
    sample_dtype: str = typer.Option("auto", help="the teacher's precision while sampling: auto (bfloat16 on CUDA, as the study "
                                                   "sampled; float32 on a CPU), float32 or bfloat16"),
    corpus: Optional[Path] = typer.Option(None, help="a UTF-8 text file (documents separated by blank lines) instead of sampled text"),
    s2_retrieval: float = typer.Option(0.25, help="share of stage-2 rows that are retrieval rows of the train template family: lifted "
                                                  "seed 4's unseen single-needle from 0.98/0.91/0.87 to 1.00/0.98/0.95 (p = 0.016 / 0.008); 0 = off"),
    s2_wordings: int = typer.Option(3, help="train-family wordings per task in the stage-2 retrieval rows (the study's)"),
    s3_retrieval: float = typer.Option(0.25, help="share of stage-3 rows that are retrieval rows (the study's)"),
    s3_wordings: int = typer.Option(6, help="train-family wordings per task in the stage-3 retrieval rows: 6 with the stage-2 mix "
                                            "gave 1.00/0.99/0.97 (seed 4; 3 wordings alone 0.98/0.91/0.87)"),
    s3_seen_task: Optional[str] = typer.Option(
        None, help="stage-3 retrieval rows of the evaluation's own templates (headscope.tasks, e.g. niah_single) instead of the "
                   "train family: trains on the seen wording and so inflates any evaluation on it (the study's 50M runs)"),
    fa_pos: str = typer.Option("nope", help="position encoding of the FA heads: nope (log-length scaled queries) or rope; RoPE fell "
                                            "to 0.56 at 4K against NoPE's 0.76 (50M, p = 1.9e-6)"),
    fa_gate: bool = typer.Option(True, "--fa-gate/--no-fa-gate", help="output gate on the FA heads (the study's)"),
    gdn_rope: bool = typer.Option(True, "--gdn-rope/--no-gdn-rope", help="RoPE on the GDN heads' q/k (the study's)"),
    seed: int = typer.Option(0, help="documents, row order, retrieval rows, the student's initialization"),
    ckpt_every: int = typer.Option(300, help="checkpoint every N steps (and always when a stage stops)"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda (default: cuda when available)"),
    devices: int = typer.Option(1, help="data-parallel training over this many local processes (one per GPU, or CPU/gloo)"),
    data_parallel: Optional[str] = typer.Option(
        None, help="with --devices > 1: 'ddp' (PyTorch DistributedDataParallel: the whole student on every device, the "
                   "fast step) or 'fsdp' (FSDP2 shards, the plain step); default: ddp where the fast step works"),
    gdn_kernel: str = typer.Option("auto", help="GDN kernel of the student: auto, torch or fla"),
    plain_step: bool = typer.Option(
        False, "--plain-step",
        help="the plain training step (full logits, per-parameter AdamW) instead of the fast one (fused LM-head "
             "loss; on CUDA also torch.compile, a CUDA graph and fused AdamW)",
    ),
    activation_checkpointing: bool = typer.Option(
        False, "--activation-checkpointing",
        help="keep only each student layer's input and recompute the layer in the backward: the same losses, less "
             "memory, one more student forward (`headscope plan-memory` shows what it saves)"),
    grad_accum: int = typer.Option(
        1, help="gradient accumulation: each step's rows as K micro-batches, one after the other (the same losses and "
                "gradients, a K-th of the activations; the batch sizes must be multiples of K)"),
    deterministic: bool = typer.Option(
        False, "--deterministic",
        help="PyTorch's deterministic algorithms (an op without one raises), CUBLAS_WORKSPACE_CONFIG=:4096:8 and "
             "deterministic cuDNN for the sampling and every step: two runs on one machine give the same weights; the "
             "parts outside PyTorch's switch (fla's Triton GDN kernels' tuned block sizes, several ranks' all-reduce) "
             "are listed in training.json's step_plan.nondeterministic (docs/conversion.md#deterministic-training)"),
    new_params_only: bool = typer.Option(
        False, "--new-params-only",
        help="stage 1 trains only the parameters the hybrid adds (GDN decay a_proj / A_log / dt_bias, beta b_proj, FA gate, "
             "short convolution, fusion gamma); q/k/v/o and the GDN heads' k/v rows stay the teacher's: fewer gradients "
             "and AdamW states (`headscope plan-memory --new-params-only`); needs stage 1"),
    teacher_dtype: str = typer.Option(
        "fp32", help="the teacher's weights while converting: fp32 (as loaded so far) or bf16 (half the bytes; the "
                     "student's master weights stay fp32; `headscope plan-memory --teacher-dtype`)"),
) -> None:
    import os

    with user_errors():
        from .train.stage_checks import check_convert_args
        from .train.recipe import ConvertRecipe, check_convert_dir, parse_tokens

        hm = check_convert_args(model=model, mask=mask, stage=stage, out=out, devices=devices, device=device,
                                gdn_kernel=gdn_kernel, data_parallel=data_parallel)
        from .train.step_plan import TEACHER_DTYPES
        from .validate import check_choice

        check_choice("--teacher-dtype", teacher_dtype, tuple(TEACHER_DTYPES))
        if new_params_only and stage not in (None, 1):
            raise HeadscopeInputError(f"--new-params-only applies to stage 1; --stage {stage} trains the whole student "
                                      "(drop the flag, or run --stage 1)")
        st = None
        if stage_tokens is not None:
            parts = [x for x in stage_tokens.split(",")]
            if len(parts) != 3:
                raise HeadscopeInputError(f"--stage-tokens {stage_tokens!r}: give three budgets (stage 1, 2, 3), e.g. 1.87M,6.88M,3.74M")
            st = tuple(parse_tokens(x, f"--stage-tokens (stage {k})") for k, x in enumerate(parts, 1))
        recipe = ConvertRecipe.from_cli(
            tokens=parse_tokens(tokens, "--tokens"), shares=_floats("--shares", shares, 3), stage_tokens=st,
            seq_len=seq_len, long_len=long_len, batch_size=batch_size, batch_long=batch_long, lr=_floats("--lr", lr, 3),
            docs=docs, heldout_docs=heldout_docs, doc_len=doc_len, sample_batch=sample_batch, sample_dtype=sample_dtype,
            corpus=str(corpus) if corpus else None, s2_retrieval=s2_retrieval, s2_wordings=s2_wordings,
            s3_retrieval=s3_retrieval, s3_wordings=s3_wordings, s3_seen_task=s3_seen_task, fa_pos=fa_pos, fa_gate=fa_gate,
            gdn_rope=gdn_rope, seed=seed, ckpt_every=ckpt_every)
        if devices > min(batch_size, batch_long):
            raise HeadscopeInputError(f"--batch-size {batch_size} / --batch-long {batch_long} cannot feed {devices} processes; "
                                      f"use batch sizes >= {devices}")
        stages = (stage,) if stage is not None else (1, 2, 3)
        check_convert_dir(out, recipe, stages, resume, cli=True)
        hybrid = {"gdn_kernel": gdn_kernel} if gdn_kernel != "auto" else None
        train_options: dict[str, Any] = {"fast": False} if plain_step else {}
        if activation_checkpointing:
            train_options["activation_checkpointing"] = True
        if grad_accum != 1:
            if grad_accum < 1 or batch_size % (grad_accum * devices) or batch_long % (grad_accum * devices):
                raise HeadscopeInputError(
                    f"--grad-accum {grad_accum}: use K >= 1 with --batch-size {batch_size} and --batch-long {batch_long} "
                    f"multiples of K x --devices ({max(grad_accum, 1) * devices})")
            train_options["grad_accum"] = grad_accum
        if data_parallel is not None:
            train_options["data_parallel"] = data_parallel
        if new_params_only:
            train_options["new_params_only"] = True
        if teacher_dtype != "fp32":
            train_options["teacher_dtype"] = teacher_dtype
        if deterministic:
            from .train.determinism import CUBLAS_WORKSPACE, check_environment

            check_environment()
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # before the process's first GEMM
            train_options["deterministic"] = True

        from .runtime import init_from_env, rank_device
        from .models import load_hf
        from .train.pipeline import convert_model, spawn_convert_model

        shard = init_from_env(device)  # under torchrun: RANK / WORLD_SIZE in the environment
        if shard is None or shard[0] == 0:
            for p in recipe.plan():
                if p["stage"] in stages:
                    steps = f"{p['steps']} step{'' if p['steps'] == 1 else 's'}"
                    typer.echo(f"stage {p['stage']}: {p['tokens']:,} tokens = {steps} of {p['rows_per_step']} x "
                               f"{p['row_len']}, lr {p['lr']:g}", err=True)
            note = recipe.rounding_note(stages)
            if note:
                typer.echo(note, err=True)
        kw = dict(recipe=recipe, stages=stages, resume=resume, hybrid_options=hybrid, train_options=train_options,
                  teacher_name=model)
        if devices > 1 and shard is None:
            result = spawn_convert_model(devices, model, hm, out, device=device, **kw)
        else:
            if shard is not None:
                device = rank_device(device, int(os.environ.get("LOCAL_RANK", shard[0])))
                if device.startswith("cuda"):
                    import torch

                    torch.cuda.set_device(device)
            teacher, tok, _ = load_hf(model, device=device, dtype=TEACHER_DTYPES[teacher_dtype])
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            result = convert_model(teacher, tok, hm, out, **kw)
            if shard is not None and shard[0] != 0:
                return
    _convert_report(result, out)


def _memory(peak: Optional[dict[str, Any]]) -> str:
    """The memory part of a stage's summary line: on CUDA the stage's peak allocation; on a CPU the process's maximum
    resident set size so far (``ru_maxrss``: it never goes down, so a later stage's includes the earlier ones')."""
    mem = (peak or {}).get("bytes")
    if not mem:
        return ""
    if str(peak.get("kind", "")).startswith("ru_maxrss"):  # type: ignore[union-attr]
        return f", process max RSS so far {mem / 2**30:.2f} GiB"
    return f", peak memory {mem / 2**30:.2f} GiB"


def _convert_report(result: dict[str, Any], out: Path) -> None:
    """One line per stage, then where the converted model is (or how to continue)."""
    import json

    for k, s in result["stages"].items():
        if s.get("skipped"):
            typer.echo(f"stage {k}: {s['skipped']} ({s['folder']})")
            continue
        typer.echo(f"stage {k}: {s['steps']}/{s['total_steps']} steps, {s['tokens']:,} tokens, final loss "
                   f"{s['final_loss'] if s['final_loss'] is None else round(s['final_loss'], 4)}, "
                   f"{s.get('seconds_total', s['seconds'])} s" + _memory(s.get("peak_memory"))
                   + (f" -> {s['folder']}" if s.get("folder") else ""))
    typer.echo(json.dumps({k: {x: v for x, v in s.items() if x in ("steps", "tokens", "final_loss", "finished", "folder")}
                           for k, s in result["stages"].items()}))
    if result["finished"]:
        typer.echo(f"converted model: {result['folder']} (AutoModelForCausalLM.from_pretrained('{result['folder']}', "
                   "trust_remote_code=True); training record: training.json)")
    else:
        last = max(result["stages"]) if result["stages"] else None
        typer.echo(f"stopped in stage {last}: rerun the same command with --resume to continue it exactly "
                   f"(checkpoint in {out}/stage{last}/checkpoint/)", err=True)
        raise typer.Exit(1)


def plan_memory_command(
    model: str = typer.Option("qwen3-1.7b", help="a shape (qwen3-1.7b, llama-3.1-8b, smollm2-135m) or a local "
                              "config.json / model directory; nothing is downloaded"),
    mask: Optional[Path] = typer.Option(None, help="the FA heads (mask.json of `headscope rank`); default --fa-share"),
    fa_share: float = typer.Option(0.125, help="without --mask: this share of each layer's heads kept FA (0.125 = 7:1)"),
    stage: List[int] = typer.Option([1, 2, 3], help="the stages to plan (repeat the option)"),
    batch_size: int = typer.Option(64, help="global rows per step of stages 1-2 (as `headscope convert`)"),
    seq_len: int = typer.Option(512, help="tokens per row of stages 1-2"),
    batch_long: int = typer.Option(16, help="global rows per step of stage 3"),
    long_len: int = typer.Option(2048, help="tokens per row of stage 3"),
    devices: int = typer.Option(1, help="GPUs training together (the rows are split over them)"),
    data_parallel: str = typer.Option("fsdp", help="with --devices > 1: fsdp (shards) or ddp (full copies)"),
    master: str = typer.Option("fp32", help="student weights and gradients: fp32 (the trainer's) or bf16 (planned only: "
                               "`headscope convert` trains fp32 master weights)"),
    optimizer: str = typer.Option("fp32", help="AdamW states: fp32 (the trainer's), bf16 or 8bit (planned only)"),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing",
                                                  help="keep only layer inputs (as `headscope convert --activation-checkpointing`)"),
    new_params_only: bool = typer.Option(False, "--new-params-only", help="stage 1 trains only the parameters the hybrid "
                                         "adds (as `headscope convert --new-params-only`)"),
    cpu_offload: bool = typer.Option(False, "--cpu-offload", help="FSDP2 CPU offload of the shards (planned only)"),
    grad_accum: int = typer.Option(1, help="gradient accumulation (`headscope convert --grad-accum`): activations of "
                                   "one micro-batch, a K-th of the rows per device"),
    teacher_dtype: str = typer.Option("fp32", help="the teacher's weights: fp32 or bf16 (as `headscope convert "
                                      "--teacher-dtype`, whose default is fp32 too)"),
    as_json: bool = typer.Option(False, "--json", help="print the plans as JSON"),
) -> None:
    """Per-device memory of conversion stages, computed without loading a model: student parameters, gradients,
    AdamW states, teacher weights, activations (an estimate), the loss chunk and FSDP2's gathered units, in GiB
    (headscope/train/memory_plan.py; docs/conversion.md#memory-plan)."""
    with user_errors():
        import json
        import math

        from .train.memory_plan import MemoryOptions, plan_memory, plan_table, shape_of
        from .train.stage_checks import check_stage

        for s in stage:
            check_stage(s)

        opts = MemoryOptions(devices=devices, data_parallel=data_parallel, master=master, optimizer=optimizer,
                             activation_checkpointing=activation_checkpointing, new_params_only=new_params_only,
                             cpu_offload=cpu_offload, teacher_dtype=teacher_dtype)
        if grad_accum < 1:
            raise HeadscopeInputError(f"--grad-accum {grad_accum}: use 1 (none) or more micro-batches per step")
        shape = shape_of(model)
        fa: Any = fa_share
        if mask is not None:
            from .masks import HeadMask

            fa = HeadMask.from_json(mask)
        for n in (batch_size, batch_long):
            if n < devices:
                raise HeadscopeInputError(f"a global batch of {n} rows cannot feed {devices} devices")
        rows = {1: (math.ceil(batch_size / devices / grad_accum), seq_len), 2: (math.ceil(batch_size / devices / grad_accum), seq_len),
                3: (math.ceil(batch_long / devices / grad_accum), long_len)}
        stages = sorted(set(stage))
        if as_json:
            plans = [plan_memory(shape, s, *rows[s], fa=fa, options=opts).as_dict() for s in stages]
            typer.echo(json.dumps({"shape": shape.name, "plans": plans}, default=str, indent=1))
        else:
            typer.echo(plan_table(shape, stages, rows, fa, opts))
