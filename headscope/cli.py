"""The ``headscope`` command line (typer).

Every command checks all its arguments, paths and preconditions before it loads a model, samples
data or starts a sweep (each check lives beside its config or function). An expected error (:class:`headscope.HeadscopeInputError`
and its subclasses, such as a model spec that cannot be loaded or a bad pair; a pair set without a
usable gap; a resume into a store of another configuration; an unsupported option) is printed as one
line ``error: ...`` on stderr with exit code 2. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import typing
from pathlib import Path
from typing import Any, Iterator, List, Optional

import typer

from .errors import HeadscopeInputError

app = typer.Typer(add_completion=False, rich_markup_mode="markdown",
                  help="Find retrieval-critical attention heads by causal intervention.")


def expected_errors() -> tuple[type[BaseException], ...]:
    """The exception types the CLI reports as one line with exit code 2."""
    from .errors import HeadscopeInputError
    from .patching.receivers import GapError
    from .patching.store import ConfigMismatch

    return (HeadscopeInputError, GapError, ConfigMismatch, NotImplementedError)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn an expected error into ``error: <one line>`` on stderr and exit code 2; re-raise the rest."""
    try:
        yield
    except Exception as e:
        if not isinstance(e, expected_errors()):
            raise
        from .errors import one_line

        typer.echo(f"error: {one_line(e)}", err=True)
        raise typer.Exit(2) from None


@app.callback()
def main() -> None:
    """headscope: rank attention heads by causal importance, convert, evaluate and generate (HydraHead, SPEC.md)."""


#: options of ``headscope rank`` that are about the command (output, mask, printing, processes), not the
#: ranking; the ranking's own options are generated from :mod:`headscope.rank_config` (:func:`_rank_options`)
_COMMAND_OPTIONS = [
    ("model", str, "smollm2-135m", "--model",
     "'smollm2-135m', 'gemma3-270m', a local HF directory, a .gguf path or a cached hub id"),
    ("budget", str, "7:1", "--budget", "FA budget for mask.json: head count, fraction or LA:FA ratio"),
    ("min_per_layer", int, 1, "--min-per-layer", "at least this many FA heads per layer in mask.json"),
    ("out", Path, Path("runs/rank"), "--out", "output directory (resumes if it holds the same run)"),
    ("top", int, 10, "--top", "print this many top heads"),
    ("devices", int, 1, "--devices", "shard the sweep over this many local processes (one per GPU, or CPU/gloo)"),
]


def _rank_options() -> list[inspect.Parameter]:
    """The parameters of ``headscope rank``: the command's own, then one per config field (:func:`headscope.rank_config.cli_fields`)."""
    from .rank_config import cli_fields

    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=tp,
                                default=typer.Option(default, flag, help=help))
              for name, tp, default, flag, help in _COMMAND_OPTIONS]
    for f in cli_fields():
        tp = f.type
        if typing.get_origin(tp) is list:
            tp = List[typing.get_args(tp)[0]]  # type: ignore[misc]
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=tp,
                                        default=typer.Option(f.default, f.flag, help=f.help)))
    return params


@contextlib.contextmanager
def flag_names() -> Iterator[None]:
    """A :class:`~headscope.errors.SettingError` raised inside names the setting by its ``headscope rank`` flag
    (``n_pairs`` -> ``--pairs``): the config and the API validate under the settings' own names."""
    from .errors import SettingError

    try:
        yield
    except SettingError as e:
        from .rank_config import cli_names

        raise e.renamed(cli_names()) from None


def rank(**values: Any) -> None:
    """Rank every head; write OUT/scores.csv, OUT/mask.json and OUT/heatmap.html.

    Every argument is checked before the model loads (errors: one line, exit code 2): the command's own options
    here, the ranking's settings when its config is made (:class:`headscope.rank_config.RankConfig`), the call (model,
    output folder, shards, store, budget) once by the API (:func:`headscope.api.check_call`)."""
    out: Path = values["out"]
    budget, min_per_layer, top = values["budget"], values["min_per_layer"], values["top"]
    with user_errors(), flag_names():
        from .rank_config import RankConfig, config_from_cli
        from .validate import check_int

        model, devices = values["model"], values["devices"]
        check_int("--devices", devices, lo=1, fix="need at least one process")
        check_int("--top", top, lo=0)
        kw = config_from_cli(values)  # rank()'s keywords from the generated options
        if kw["device_map"] is not None and devices > 1:
            raise HeadscopeInputError(
                "--device-map spreads one model over the GPUs; --devices shards the sweep: use one of them")
        cfg = RankConfig.from_kwargs(**kw)  # validates itself
        r = _run_rank(cfg, model, budget, min_per_layer, out, devices)
        if r is None:
            return
    _report(r, cfg, budget, min_per_layer, out, top)


rank.__signature__ = inspect.Signature(_rank_options())  # type: ignore[attr-defined]
rank.__annotations__ = {p.name: p.annotation for p in rank.__signature__.parameters.values()}  # type: ignore[attr-defined]
app.command("rank")(rank)


def _report(r: Any, cfg: Any, budget: str, min_per_layer: int, out: Path, top: int) -> None:
    """Write the mask and the heatmap of a finished ranking and print its summary."""
    mask, mask_error = _mask_step(r, budget, min_per_layer, out)
    heatmap_error = _heatmap_step(r, out)
    p = r.provenance
    typer.echo(
        f"{p['model']}: {p['n_pairs']} pair(s) of {p['tasks']} at ~{cfg.seq_len} tokens, {p['direction']}, "
        f"lambda={cfg.readout.lam}; m(x) mean {sum(p['m_clean']) / len(p['m_clean']):.2f}, "
        f"m(x') mean {sum(p['m_corrupt']) / len(p['m_corrupt']):.2f}; {p['seconds']} s"
        + (f"; {p['path']} path" if p.get("path") else "")
    )
    cols = ["rank", "layer", "head", "kv_group", "ie_recv", "ie_recv_std"]
    fused = "kappa" in r.scores.columns
    if fused:
        cols = ["rank", "layer", "head", "kv_group", "ie_recv", "ie_send", "kappa"]
        cols += [c for c in r.scores.columns if c.startswith("s_")] + ["score"]
    if "kind" in r.scores.columns:  # a converted model: each head's kind, FA or GDN
        cols.insert(cols.index("kv_group") + 1, "kind")
    typer.echo(f"top {top} heads by {'fused score S' if fused else 'receiver IE'}:")
    typer.echo(r.top(top)[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    scr = p.get("screen")
    if scr:
        extra = "" if scr.get("spot_checked", 0) == 0 else (
            f"; {scr['spot_checked']} spot checks found {scr['spot_hits']} missed head(s) "
            f"(estimate {scr['missed_estimate']:.1f}, 95% upper bound {scr['missed_upper95']:.1f})")
        typer.echo(f"screen: {scr['verified']} head(s) verified exactly{extra}; the others carry their AtP estimate")
    for t, info in r.extras.get("sender_rounds", {}).items():
        typer.echo(f"senders for {t}: {info['n_rounds']} round(s), converged={info['converged']}")
    if mask is not None:
        s = mask.summary()
        typer.echo(
            f"mask ({budget}, >= {min_per_layer}/layer): {s['n_fa']} FA heads of {s['n_total']}, "
            f"KV cache kept {s['kv_cache_fraction']:.1%} ({s['kv_groups_kept']} of {mask.n_layers * mask.n_kv_heads} "
            "KV groups: a group keeps its cache if any of its query heads is FA)"
        )
        for note in s.get("notes", []):
            typer.echo(f"note: {note}", err=True)
    typer.echo(f"wrote {out}/: scores.csv, {'mask.json, ' if mask is not None else ''}"
               f"{'heatmap.html, ' if heatmap_error is None else ''}ranking.json (provenance), ie.pt and the resumable "
               "per-item store")
    if heatmap_error is not None:
        typer.echo(f"warning: no heatmap.html written: {heatmap_error}. The ranking is saved; draw the heatmap later "
                   f"with `headscope.Ranking.load('{out}').heatmap()` once plotly is installed (pip install plotly)",
                   err=True)
    if mask is None:
        typer.echo(f"error: no mask.json written: {mask_error}; the ranking is saved, rerun with another --budget "
                   "to get a mask from it without patching again", err=True)
        raise typer.Exit(1)


def _heatmap_step(r: Any, out: Path) -> str | None:
    """OUT/heatmap.html (self-contained, works offline) -> None, or the reason it could not be drawn: plotly
    missing (a declared dependency, but absent where wheels were installed with --no-deps, e.g. a GPU image)
    must not cost the ranking already computed and saved."""
    try:
        fig = r.heatmap()
    except ImportError as e:
        return f"plotly could not be imported ({e})"
    fig.write_html(str(out / "heatmap.html"), include_plotlyjs=True)
    return None


def _run_rank(cfg: Any, model: str, budget: str, min_per_layer: int, out: Path, devices: int) -> Optional[Any]:
    """Check the call once, load the model and run the ranking -> Ranking, or None on a rank != 0. The budget is
    checked against the model's heads before it loads where its config is read, else right after."""
    import dataclasses

    from .api import check_call, run
    from .distributed import spawn_rank
    from .masks import check_budget
    from .runtime import init_from_env

    def budget_fits(geometry: Any) -> None:  # a budget too small for --min-per-layer is raised after ranking
        check_budget(budget, geometry, min_per_layer, "--budget", allow_raise=True)

    shard = init_from_env(cfg.device)  # under torchrun: RANK / WORLD_SIZE in the environment
    if devices > 1 and shard is None:
        check_call(model, cfg, out_dir=out, shard=(0, devices), on_geometry=budget_fits)
        return spawn_rank(devices, out, device=cfg.device, config=dataclasses.replace(cfg, device=None),
                          model=model)  # each rank loads its own
    r = run(model, cfg, out_dir=out, shard=shard, on_geometry=budget_fits)
    if shard is not None and shard[0] != 0:
        return None
    return r


def _mask_step(r: "object", budget: str, min_per_layer: int, out: Path) -> tuple[object, str | None]:
    """mask.json from a saved ranking: a budget too small for ``min_per_layer`` is raised to the
    smallest that fits (noted in mask.json's summary); any other failure writes no mask and returns
    its reason, never discarding the ranking."""
    import warnings

    from headscope.masks import BudgetRaisedWarning

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BudgetRaisedWarning)  # printed from the summary's notes
            mask = r.mask(budget, min_per_layer=min_per_layer, raise_budget=True)  # type: ignore[attr-defined]
        mask.to_json(out / "mask.json")
    except (ValueError, OSError) as e:
        return None, str(e)
    return mask, None


_CONVERT_HELP = """Convert a model into a head-wise FA/GDN hybrid: the three-stage transfer (SPEC.md §9) with the
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


@app.command(help=_CONVERT_HELP)
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
) -> None:
    import os

    with user_errors():
        from .train.stage_checks import check_convert_args
        from .train.recipe import ConvertRecipe, check_convert_dir, parse_tokens

        hm = check_convert_args(model=model, mask=mask, stage=stage, out=out, devices=devices, device=device,
                                gdn_kernel=gdn_kernel, data_parallel=data_parallel)
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

        from .runtime import init_from_env, rank_device
        from .models import load_hf
        from .train.pipeline import convert_model, spawn_convert_model

        shard = init_from_env(device)  # under torchrun: RANK / WORLD_SIZE in the environment
        if shard is None or shard[0] == 0:
            for p in recipe.plan():
                if p["stage"] in stages:
                    typer.echo(f"stage {p['stage']}: {p['tokens']:,} tokens = {p['steps']} steps of {p['rows_per_step']} x "
                               f"{p['row_len']}, lr {p['lr']:g}", err=True)
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
            teacher, tok, _ = load_hf(model, device=device)
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            result = convert_model(teacher, tok, hm, out, **kw)
            if shard is not None and shard[0] != 0:
                return
    _convert_report(result, out)


def _convert_report(result: dict[str, Any], out: Path) -> None:
    """One line per stage, then where the converted model is (or how to continue)."""
    import json

    for k, s in result["stages"].items():
        if s.get("skipped"):
            typer.echo(f"stage {k}: {s['skipped']} ({s['folder']})")
            continue
        mem = (s.get("peak_memory") or {}).get("bytes")
        typer.echo(f"stage {k}: {s['steps']}/{s['total_steps']} steps, {s['tokens']:,} tokens, final loss "
                   f"{s['final_loss'] if s['final_loss'] is None else round(s['final_loss'], 4)}, "
                   f"{s.get('seconds_total', s['seconds'])} s" + (f", peak memory {mem / 2**30:.2f} GiB" if mem else "")
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


@app.command()
def anatomy(
    run_dir: Path = typer.Argument(..., help="a run directory written by `headscope rank` / Ranking.save"),
    out: Optional[Path] = typer.Option(None, help="output directory (default RUN_DIR/anatomy)"),
    threshold: float = typer.Option(0.1, help="IE above this marks a head critical"),
    boot: int = typer.Option(200, help="bootstrap replicates per n for the stability curve"),
    seed: int = typer.Option(0, help="seed of the bootstrap"),
    n_ref: Optional[int] = typer.Option(
        None, help="pairs in the reference the n-pair ranking is compared with, disjoint from the sample "
        "(default: pairs minus the largest n; n runs to half the pairs)"
    ),
    negative: str = typer.Option("clip", help="Gini of negative IE: clip (to 0, the paper's IE range) or abs"),
    use_model: bool = typer.Option(
        True, "--model/--no-model", help="load the run's model and re-generate its pairs for DLA and layer cosine"
    ),
    fmt: List[str] = typer.Option(["html", "png"], "--format", help="figure formats (repeatable): html, png"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda, for DLA and cosine"),
) -> None:
    """Head anatomy of a saved run: write OUT/anatomy.json and the figures (SPEC.md §7).

    The run directory, the formats (png needs kaleido and Chromium) and, with --model, the run's model
    spec and task settings are checked before the model loads (errors: one line, exit code 2)."""
    out = out or run_dir / "anatomy"
    with user_errors():
        from .analysis import anatomy as an
        from .analysis.anatomy import check_anatomy_args

        r, spec = check_anatomy_args(run_dir, out, threshold, boot, fmt, use_model, device, seed)
        model = pairs = None
        if use_model:
            from .models import load_model

            model = load_model(spec, device=device)
            pairs = an.pairs_of_run(r, model.tokenizer)
        if negative not in ("clip", "abs"):
            raise ValueError(f"--negative must be clip or abs, not {negative!r}")
        a = an.anatomy(r, model=model, pairs=pairs, threshold=threshold, n_boot=boot, seed=seed, n_ref=n_ref,
                       negative=negative)  # type: ignore[arg-type]
        written = a.save(out, formats=tuple(fmt))
        kinds = None
        if "kind" in r.scores.columns:  # a converted model: where the IE sits, FA heads against GDN heads
            import json

            from .runtime import atomic_write_text
            from .analysis.student_anatomy import kind_summary

            kinds = kind_summary(r, threshold=threshold)
            atomic_write_text(out / "kinds.json", json.dumps(kinds, indent=2))
    d = a.to_dict()
    typer.echo(f"Gini: {d['gini_negative']['meaning']}")
    for col, c in d["critical"].items():
        g, o = d["gini"][col], d["gini_other"][col]
        other = f"; {o['negative']}: {o['mean']:.3f}" if o.get("mean") is not None else ""
        typer.echo(
            f"{col}: {c['n_critical']}/{c['n_heads']} critical ({c['critical_share']:.1%}, IE > {threshold}), "
            f"{c['convertible_share']:.1%} safely convertible; Gini mean {g['mean']:.3f} "
            f"(range {g['min']:.3f}-{g['max']:.3f}{other})"
        )
    if "stability" in d:
        curve = d["stability"]["curve"]
        typer.echo(
            f"stability rho(n) against {d['stability']['n_ref']} disjoint pairs [noise baseline]: "
            + ", ".join(f"{row['n']}:{row['rho_mean']:.3f} [{row['noise_rho_mean']:.3f}]" for row in curve)
            + (f"; rho >= {a.rho_target} from n = {n}" if (n := d["stability"]["n_at_target"]) is not None
               else f"; rho stays below {a.rho_target} up to n = {curve[-1]['n'] if curve else 0}")
        )
    if kinds is not None:
        for kd in ("fa", "gdn"):
            k = kinds[kd]
            mass = "–" if k["positive_mass_share"] is None else f"{k['positive_mass_share']:.1%}"
            typer.echo(f"{kd.upper()} heads: {k['n_heads']}, mean IE {k['mean_ie'] if k['mean_ie'] is None else round(k['mean_ie'], 3)}, "
                       f"{mass} of the positive IE, {k['top5']} of the top 5, {k['top10']} of the top 10")
    typer.echo(f"wrote {out / 'anatomy.json'}{', kinds.json' if kinds is not None else ''} and "
               f"{sum(len(v) for k, v in written.items() if k != 'json')} figure file(s)")


_EVAL_HELP = """Score MODEL on the retention suite: retrieval of a value hidden in a long prompt, per task x length x format.

MODEL (and --teacher): a converted folder (`headscope convert`), a local HF directory, a .gguf file, a hub id already
in the local cache, or 'smollm2-135m'. Every cell's n prompts are scored by teacher-forced greedy exact match of the
answer (batched, bf16 autocast on CUDA) and the first --gen-n by free greedy generation (the `agreement` column: how
often the two agree). With --teacher, the teacher is scored on the same prompts and retention = accuracy / teacher's.

Haystack of the unseen cells: --corpus FILE (your text, documents separated by blank lines); else --haystack-docs
documents of --doc-len tokens sampled from the teacher (from MODEL without --teacher) and kept in OUT/haystack/, the
conversion study's haystack; --corpus builtin: the package's filler sentences (fast, for smoke runs; not natural text).
The seen cells use the built-in filler and the RULER templates.

Writes OUT/retention.csv (model, seed, tokens, task, formats, length, n, hits, accuracy, teacher_accuracy, agreement,
source=cli), OUT/retention_summary.csv (intervals, retention), OUT/retention_seeds.csv (per cell over seeds),
OUT/report.md, OUT/report.html, OUT/eval.json (the run's settings), OUT/prompts/ (the prompt sets) and the per-prompt
records OUT/cells/NAME__sSEED__tTOKENS/TASK.FORMATS.LENGTH.json.gz. Resumable per cell: a rerun skips the cells
already stored with the same settings; several models evaluated into one OUT share the teacher's cells and the
prompts and appear in one table. Every argument is checked before a model loads (errors: one line, exit code 2)."""


@app.command("eval", help=_EVAL_HELP)
def eval_command(
    model: str = typer.Argument(..., help="the model to score: converted folder, HF directory, .gguf, cached hub id or 'smollm2-135m'"),
    teacher: Optional[str] = typer.Option(None, help="reference model scored on the same prompts (retention = accuracy / its accuracy)"),
    formats: List[str] = typer.Option(["unseen"], help="template families: unseen (wordings no conversion trains on, natural-text "
                                       "haystack) and/or seen (the RULER templates); repeat or comma-separate"),
    tasks: List[str] = typer.Option(["niah_single,niah_multikey,niah_multivalue,variable_tracking"],
                                    help="retrieval tasks; repeat or comma-separate"),
    lengths: List[str] = typer.Option(["1024,2048,4096"], help="prompt lengths in tokens (1024 or 1K); repeat or comma-separate"),
    n: int = typer.Option(100, help="prompts per cell (needle depths evenly spread over the haystack)"),
    gen_n: int = typer.Option(20, help="prompts per cell also scored by free greedy generation (0: none)"),
    gen_max_len: int = typer.Option(4096, help="the generation check only in cells of at most this many tokens"),
    batch_tokens: int = typer.Option(32768, help="tokens per forward of the teacher-forced scoring (prompts per batch = this // length)"),
    corpus: Optional[str] = typer.Option(None, help="haystack of the unseen cells: a text file (documents separated by blank lines) "
                                         "or 'builtin' (the package's filler); default: documents sampled from the teacher / model"),
    haystack_docs: int = typer.Option(1024, help="documents sampled for the haystack (without --corpus)"),
    doc_len: int = typer.Option(512, help="tokens per sampled haystack document"),
    seed: int = typer.Option(0, help="added to the prompt and haystack seeds (0: the conversion study's prompts)"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda / cuda:N (default: cuda when available)"),
    dtype: str = typer.Option("float32", help="weights' dtype: float32, bfloat16 or float16 (on CUDA the forward runs under bf16 autocast either way)"),
    out: Path = typer.Option(Path("runs/eval"), help="output folder (a rerun resumes; several models may share it)"),
    name: Optional[str] = typer.Option(None, help="the model's name in the tables (default: its folder's name; DIR/stageK -> DIR-stageK)"),
    workers: int = typer.Option(max(1, min(8, (os.cpu_count() or 2) - 1)),
                                help="processes building the prompt sets (CPU-bound; default: the cores less one, at most 8)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="a progress bar over cells and prompts"),
) -> None:
    with user_errors():
        from .evaluation.runner import check_eval_args, run_eval

        cfg = check_eval_args(model, teacher, formats, tasks, lengths, n, gen_n, gen_max_len, batch_tokens, corpus,
                              haystack_docs, doc_len, seed, device, dtype, out, name, workers)
        res = run_eval(cfg, progress=progress, log=lambda s: typer.echo(s, err=True))
    typer.echo(Path(res["report"]["md"]).read_text())
    typer.echo(f"wrote {out}/: retention.csv ({res['rows']} rows), retention_summary.csv, report.md"
               + (", report.html" if "html" in res["report"] else "") + f", cells/ (per-prompt records); {res['seconds']} s")


@app.command()
def generate(
    model: str = typer.Argument(..., help="converted folder, HF directory, .gguf, cached hub id or 'smollm2-135m'"),
    prompt: Optional[str] = typer.Argument(None, help="the prompt (default: --file, else read from stdin)"),
    file: Optional[Path] = typer.Option(None, help="read the prompt from this text file"),
    max_new_tokens: int = typer.Option(128, help="tokens to generate at most (stops earlier at end-of-sequence)"),
    temperature: float = typer.Option(0.0, help="0: greedy decoding; > 0: sampling at this temperature"),
    top_p: float = typer.Option(1.0, help="nucleus sampling mass, with --temperature > 0 (1.0: off)"),
    seed: int = typer.Option(0, help="torch seed set before sampling"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the tokenizer's chat template (one user turn)"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda / cuda:N (default: cuda when available)"),
    dtype: str = typer.Option("auto", help="weights' dtype: auto (bfloat16 on CUDA, float32 on a CPU), float32, "
                              "bfloat16 or float16"),
) -> None:
    """Generate text from MODEL with transformers' generate: print the new text, then (on stderr) tokens per second.

    A converted hybrid takes its fast path where the device has one (CUDA), by itself, through its own forward. Every
    argument is checked before the model loads (errors: one line, exit code 2)."""
    with user_errors():
        import torch

        from .generation import check_generate_args, generate_text, resolve_dtype
        from .models import load_hf

        cfg = check_generate_args(model, prompt, file, max_new_tokens, temperature, top_p, seed, device, dtype, chat)
        dtype = resolve_dtype(dtype, device, torch.cuda.is_available())
        if prompt is None:
            if file is not None:
                prompt = file.read_text(encoding="utf-8", errors="replace")
            elif sys.stdin is None or sys.stdin.isatty():
                raise HeadscopeInputError("no prompt: pass it as an argument, with --file, or on stdin")
            else:
                prompt = sys.stdin.read()
        if not prompt.strip():
            raise HeadscopeInputError("the prompt is empty: pass it as an argument, with --file or on stdin")
        m, tok, _ = load_hf(model, device=device, dtype=getattr(torch, dtype))
        res = generate_text(m, tok, prompt, cfg)
    typer.echo(res["text"])
    typer.echo(f"{res['new_tokens']} new tokens after {res['prompt_tokens']} prompt tokens in {res['seconds']:.2f} s: "
               f"{res['tokens_per_s']:.1f} tokens/s ({next(m.parameters()).device}, {dtype})", err=True)


@app.command("plan-memory")
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
    master: str = typer.Option("fp32", help="student weights and gradients: fp32 (the trainer's) or bf16"),
    optimizer: str = typer.Option("fp32", help="AdamW states: fp32, bf16 or 8bit"),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing", help="keep only layer inputs"),
    new_params_only: bool = typer.Option(False, "--new-params-only", help="stage 1 trains only the new parameters"),
    cpu_offload: bool = typer.Option(False, "--cpu-offload", help="FSDP2 CPU offload of the shards"),
    grad_accum: int = typer.Option(1, help="gradient accumulation (`headscope convert --grad-accum`): activations of "
                                   "one micro-batch, a K-th of the rows per device"),
    teacher_dtype: str = typer.Option("bf16", help="the teacher's weights: bf16, or fp32 (what `headscope convert` "
                                      "holds: it loads the teacher in float32)"),
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


def run() -> None:  # pragma: no cover
    app(sys.argv[1:])


if __name__ == "__main__":  # pragma: no cover
    app()
