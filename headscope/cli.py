"""The ``headscope`` command line (typer).

Every command checks all its arguments, paths and preconditions before it loads a model, samples
data or starts a sweep (:mod:`headscope.checks`). An expected error (:class:`headscope.HeadscopeInputError`
and its subclasses, such as a model spec that cannot be loaded or a bad pair; a pair set without a
usable gap; a resume into a store of another configuration; an unsupported option) is printed as one
line ``error: ...`` on stderr with exit code 2. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import typer

from .errors import HeadscopeInputError
from .readout import DEFAULT_LAMBDA

app = typer.Typer(add_completion=False, help="Find retrieval-critical attention heads by causal intervention.")


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
    """headscope: rank attention heads by causal importance (HydraHead, SPEC.md)."""


@app.command()
def rank(
    model: str = typer.Option("smollm2-135m", help="'smollm2-135m', 'gemma3-270m', a local HF directory, a .gguf path or a cached hub id"),
    task: List[str] = typer.Option(["niah_single"], help="capability (repeatable)"),
    pairs: int = typer.Option(6, "--pairs", help="calibration pairs per task"),
    seq_len: int = typer.Option(512, help="prompt length in tokens"),
    depth: List[float] = typer.Option([0.5], help="needle depth(s), fractions in [0, 1] (repeatable, cycled over pairs)"),
    seed: int = typer.Option(0),
    lam: float = typer.Option(DEFAULT_LAMBDA, "--lambda", help="decay λ of the span readout (eq. 9)"),
    direction: str = typer.Option("noising", help="noising (default) or denoising"),
    min_gap: float = typer.Option(0.1, help="skip pairs whose |m(x) - m(x')| is below this (logits)"),
    budget: str = typer.Option("7:1", help="FA budget for mask.json: head count, fraction or LA:FA ratio"),
    min_per_layer: int = typer.Option(1, help="at least this many FA heads per layer in mask.json"),
    out: Path = typer.Option(Path("runs/rank"), help="output directory (resumes if it holds the same run)"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda (default: cuda when available)"),
    top: int = typer.Option(10, help="print this many top heads"),
    mode: str = typer.Option("exact", help="exact (every head patched) or screen (AtP screen + exact verification)"),
    verify: str = typer.Option("auto", help="screen mode: 'auto' (verify until no unverified head's optimistic score reaches the top 10; a "
                               "heuristic, see the README), or a head "
                               "count / fraction verified exactly after the AtP screen, with --spot-checks"),
    spot_checks: float = typer.Option(0.05, help="screen mode with a count/fraction --verify: random unverified heads "
                                      "patched exactly to estimate what the screen missed"),
    devices: int = typer.Option(1, help="shard the sweep over this many local processes (one per GPU, or CPU/gloo)"),
    senders: bool = typer.Option(False, "--senders", help="add iterated sender path patching (SPEC.md §5) and fuse"),
    weight: List[float] = typer.Option([], "--weight", help="capability weight, one per --task in order (default uniform; must sum to 1)"),
    kappa: Optional[str] = typer.Option(None, help="'focus' (retrieval focus, default when fusing) or 'one' (κ ≡ 1)"),
    normalize: str = typer.Option("max", help="per-capability normalization: max or minmax"),
    sender_mode: str = typer.Option("qkv", help="receiver inputs patched by senders: qkv, kv or q"),
    top_k: int = typer.Option(10, help="receivers of the first sender round (top heads by receiver IE)"),
    max_rounds: int = typer.Option(3, help="sender rounds at most (senders become receivers)"),
    device_map: Optional[str] = typer.Option(None, help="auto or balanced: spread a model that does not fit one GPU over all GPUs (layers)"),
    path: str = typer.Option("auto", help="exact patching path: auto (fast engine where an architecture adapter exists, else the TransformerLens bridge's hooks), fast or generic"),
) -> None:
    """Rank every head; write OUT/scores.csv, OUT/mask.json and OUT/heatmap.html.

    Every argument is checked before the model loads (errors: one line, exit code 2)."""
    with user_errors():
        from .checks import (check_budget, check_device_map, check_int, check_model, check_rank_args,
                             check_rank_store, parse_verify)

        g = check_model(model, "--model")  # the geometry from the config / GGUF metadata, no weights
        check_int("--devices", devices, lo=1, fix="need at least one process")
        check_int("--top", top, lo=0)
        check_device_map(device_map, devices, "--device-map")
        check_budget(budget, g, min_per_layer, "--budget", allow_raise=True)
        settings = dict(
            model=model,
            tasks=tuple(task),
            n_pairs=pairs,
            seq_len=seq_len,
            seed=seed,
            depth=depth[0] if len(depth) == 1 else tuple(depth),
            lam=lam,
            direction=direction,
            min_gap=min_gap,
            mode=mode,
            senders=senders,
            weights=list(weight) if weight else None,
            kappa=kappa,
            normalize=normalize,
            sender_mode=sender_mode,
            top_k=top_k,
            max_rounds=max_rounds,
        )
        v = parse_verify(verify)  # in every mode: a typo is not silently ignored
        sc = int(spot_checks) if spot_checks >= 1 else spot_checks
        if mode == "screen":
            settings.update(verify=v, spot_checks=sc)
        args = {"verify": v, "spot_checks": sc, **{k: val for k, val in settings.items() if k != "model"}}
        tasks = check_rank_args(**args, out_dir=out, device=device, device_map=device_map,
                                shard=(0, devices) if devices > 1 else None, geometry=g, cli=True)
        fused = senders or len(tasks) > 1 or bool(weight) or kappa is not None
        check_rank_store(out, tasks, fused, model, {"n_pairs": pairs, "seq_len": seq_len, "seed": seed,
                                                   "depth": settings["depth"]}, lam, direction)
        if path not in ("auto", "fast", "generic"):
            raise HeadscopeInputError(f"--path {path!r}: use auto, fast or generic")
        if path != "auto":
            settings["path"] = path
        run_rank = _run_rank(settings, model, budget, min_per_layer, out, device, devices, device_map)
        if run_rank is None:
            return
        r = run_rank
    mask, mask_error = _mask_step(r, budget, min_per_layer, out)
    r.heatmap().write_html(str(out / "heatmap.html"), include_plotlyjs=True)  # self-contained: works offline
    p = r.provenance
    typer.echo(
        f"{p['model']}: {p['n_pairs']} pair(s) of {p['tasks']} at ~{seq_len} tokens, {p['direction']}, "
        f"lambda={lam}; m(x) mean {sum(p['m_clean']) / len(p['m_clean']):.2f}, "
        f"m(x') mean {sum(p['m_corrupt']) / len(p['m_corrupt']):.2f}; {p['seconds']} s"
    )
    cols = ["rank", "layer", "head", "kv_group", "ie_recv", "ie_recv_std"]
    fused = "kappa" in r.scores.columns
    if fused:
        cols = ["rank", "layer", "head", "kv_group", "ie_recv", "ie_send", "kappa"]
        cols += [c for c in r.scores.columns if c.startswith("s_")] + ["score"]
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
            f"KV cache kept {s['kv_cache_fraction']:.1%}"
        )
        for note in s.get("notes", []):
            typer.echo(f"note: {note}", err=True)
    typer.echo(f"wrote {out}/: scores.csv, {'mask.json, ' if mask is not None else ''}heatmap.html, ranking.json "
               "(provenance), ie.pt and the resumable per-item store")
    if mask is None:
        typer.echo(f"error: no mask.json written: {mask_error}; the ranking is saved, rerun with another --budget "
                   "to get a mask from it without patching again", err=True)
        raise typer.Exit(1)


def _run_rank(settings: dict, model: str, budget: str, min_per_layer: int, out: Path, device: Optional[str],
              devices: int, device_map: Optional[str]) -> Optional[tuple]:
    """Load the model and run the (checked) ranking -> (Ranking, HeadMask), or None on a rank != 0."""
    import headscope

    from .checks import check_budget
    from .distributed import init_from_env, spawn_rank

    lm = headscope.load_model(model, device=device, device_map=device_map)
    # again where the config could not be read; a budget too small for --min-per-layer is raised after ranking
    check_budget(budget, lm.geometry, min_per_layer, "--budget", allow_raise=True)
    settings = {**settings, "model": lm}
    shard = init_from_env(device)  # under torchrun: RANK / WORLD_SIZE in the environment
    if devices > 1 and shard is None:
        r = spawn_rank(devices, out, device=device, **{**settings, "model": model})  # each rank loads its own
    else:
        r = headscope.rank(out_dir=out, device=device, shard=shard, device_map=device_map, **settings)
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


@app.command()
def convert(
    model: str = typer.Option("smollm2-135m", help="teacher: 'smollm2-135m', 'gemma3-270m', a local HF directory, a .gguf path or a cached hub id"),
    mask: Path = typer.Option(..., help="mask.json (HeadMask) with the FA heads"),
    stage: int = typer.Option(..., help="1 = layer-wise alignment, 2 = global distillation, 3 = long-context fine-tuning"),
    tokens: int = typer.Option(..., help="token budget of this stage"),
    out: Path = typer.Option(..., help="conversion directory; stage k writes OUT/stage{k}/ and reads OUT/stage{k-1}/student.pt"),
    resume: bool = typer.Option(False, "--resume", help="continue OUT/stage{k}/checkpoint.pt exactly"),
    seq_len: Optional[int] = typer.Option(None, help="row length (default 512 for stages 1-2, 2048 for stage 3)"),
    batch_size: int = typer.Option(8, help="rows per step"),
    lr: Optional[float] = typer.Option(None, help="peak learning rate (default 1e-3 for stage 1, 1e-4 otherwise)"),
    ckpt_every: int = typer.Option(100, help="checkpoint every N steps (and always on exit)"),
    text_docs: int = typer.Option(256, help="documents sampled from the teacher (cached in OUT/data)"),
    doc_len: int = typer.Option(512, help="tokens per sampled document"),
    corpus: Optional[Path] = typer.Option(None, help="user text file instead of sampled text (documents split by blank lines)"),
    retrieval_frac: float = typer.Option(0.25, help="stage 3: share of rows that are synthetic retrieval examples"),
    retrieval_task: str = typer.Option("niah_single", help="stage 3: retrieval task (headscope.tasks)"),
    seed: int = typer.Option(0),
    device: Optional[str] = typer.Option(None, help="cpu / cuda (default: cuda when available)"),
    devices: int = typer.Option(1, help="data-parallel training over this many local processes (FSDP2; one per GPU, or CPU/gloo)"),
    gdn_kernel: str = typer.Option("auto", help="GDN kernel of the student: auto, torch or fla"),
    plain_step: bool = typer.Option(
        False, "--plain-step",
        help="the plain training step (full logits, per-parameter AdamW) instead of the fast one (fused LM-head "
             "loss; on CUDA also torch.compile, a CUDA graph and fused AdamW)",
    ),
) -> None:
    """Convert a model into a head-wise FA/GDN hybrid, one stage of the three-stage transfer at a time.

    Data parallel: --devices N spawns N processes (or run under torchrun --nproc-per-node N -m
    headscope.cli convert ...); a checkpoint resumes on any number of devices. Every argument, the
    mask against the teacher's config, OUT/stage{k-1}/student.pt and the checkpoint (--resume) are
    checked before the teacher loads or text is sampled (errors: one line, exit code 2)."""
    import json
    import os

    with user_errors():
        from .train import DataConfig, TrainConfig
        from .train.checks import check_convert_args, check_stage_inputs

        hm = check_convert_args(model=model, mask=mask, stage=stage, tokens=tokens, out=out, batch_size=batch_size,
                                lr=lr, ckpt_every=ckpt_every, devices=devices, device=device, gdn_kernel=gdn_kernel)
        L = seq_len or (2048 if stage == 3 else 512)
        cfg = TrainConfig(
            stage=stage, tokens=tokens, batch_size=batch_size, lr=lr or (1e-3 if stage == 1 else 1e-4), ckpt_every=ckpt_every, seed=seed,
            fast=False if plain_step else None,
        )
        data = DataConfig(
            seq_len=L, text_docs=text_docs, doc_len=doc_len, corpus=str(corpus) if corpus else None,
            retrieval_frac=retrieval_frac if stage == 3 else 0.0, retrieval_task=retrieval_task, seed=seed,
        )
        # the previous stage's student, the checkpoint (--resume or not), the corpus, enough rows per batch
        check_stage_inputs(out, stage, cfg, data, resume, world=devices, cli=True)
        hybrid = {"gdn_kernel": gdn_kernel} if gdn_kernel != "auto" else None

        from .distributed import init_from_env, rank_device
        from .models import load_hf
        from .train import convert_stage
        from .train.pipeline import spawn_convert

        shard = init_from_env(device)  # under torchrun: RANK / WORLD_SIZE in the environment
        if devices > 1 and shard is None:
            summary = spawn_convert(devices, model, hm, stage, out, device=device, config=cfg, data=data, resume=resume,
                                    hybrid_options=hybrid)
        else:
            if shard is not None:
                device = rank_device(device, int(os.environ.get("LOCAL_RANK", shard[0])))
                if device.startswith("cuda"):
                    import torch

                    torch.cuda.set_device(device)
            teacher, tok, name = load_hf(model, device=device)
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            _, summary = convert_stage(teacher, tok, hm, stage, out, config=cfg, data=data, resume=resume, hybrid_options=hybrid)
            if shard is not None and shard[0] != 0:
                return
    typer.echo(json.dumps(summary))


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
        from . import anatomy as an
        from .checks import check_anatomy_args

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
            + f"; rho >= {a.rho_target} from n = {d['stability']['n_at_target']}"
        )
    typer.echo(f"wrote {out / 'anatomy.json'} and {sum(len(v) for k, v in written.items() if k != 'json')} figure file(s)")


def run() -> None:  # pragma: no cover
    app(sys.argv[1:])


if __name__ == "__main__":  # pragma: no cover
    app()
