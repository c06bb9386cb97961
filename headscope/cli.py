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

from .runtime import lean_gc

if __name__ == "__main__":  # a command process: collections tuned before the heavy imports (runtime.lean_gc)
    lean_gc()

import typer  # noqa: E402

from .cli_convert import CONVERT_HELP, convert, plan_memory_command
from .cli_errors import user_errors
from .cli_mask import MASK_HELP, mask_command
from .errors import HeadscopeInputError

app = typer.Typer(add_completion=False, rich_markup_mode="markdown",
                  help="Find retrieval-critical attention heads by causal intervention.")

#: columns of the help off a terminal (piped, redirected): rich's 80 cut option names and defaults with an ellipsis
HELP_WIDTH = 120


def help_width(on_terminal: bool, environ: typing.Mapping[str, str]) -> Optional[int]:
    """The width typer renders help at (``typer.rich_utils.MAX_WIDTH``): None (the terminal's own, or what
    TERMINAL_WIDTH / COLUMNS say) on a terminal or where the user set a width, else :data:`HELP_WIDTH`."""
    if on_terminal or environ.get("TERMINAL_WIDTH") or environ.get("COLUMNS"):
        return None
    return HELP_WIDTH


def _set_help_width() -> None:
    import typer.rich_utils

    if typer.rich_utils.MAX_WIDTH is None:  # typer read no TERMINAL_WIDTH
        typer.rich_utils.MAX_WIDTH = help_width(bool(sys.stdout and sys.stdout.isatty()), os.environ)


_set_help_width()


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

    Every argument is checked before the model loads (errors: one line, exit code 2): the command's own options, the
    ranking's settings, then the call as a whole (model, output folder, shards, store, budget)."""
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
        if r.scores["ie_send"].isna().all():  # senders not patched (no --senders): no column of NaN
            cols.remove("ie_send")
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
    fmt: List[str] = typer.Option(["html", "png"], "--format",
                                  help="figure formats (repeatable): html, png, svg, pdf (png, svg and pdf need kaleido "
                                       "and Chromium)"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda, for DLA and cosine"),
) -> None:
    """Head anatomy of a saved run: write OUT/anatomy.json and the figures (SPEC.md §7).

    The run directory, the formats (png, svg and pdf need kaleido and Chromium) and, with --model, the run's model
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

        from .generation import check_generate_args, generate_text, resolve_dtype, summary
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
    typer.echo(summary(res, next(m.parameters()).device, dtype), err=True)


# the commands in the workflow's order, in three panels of `headscope --help`
_FIND, _CONVERT, _USE = "Find the heads", "Convert the model", "Evaluate and generate"
app.command("rank", rich_help_panel=_FIND)(rank)
app.command("anatomy", rich_help_panel=_FIND)(anatomy)
app.command("mask", help=MASK_HELP, rich_help_panel=_FIND)(mask_command)
app.command("plan-memory", rich_help_panel=_CONVERT)(plan_memory_command)
app.command("convert", help=CONVERT_HELP, rich_help_panel=_CONVERT)(convert)
app.command("eval", help=_EVAL_HELP, rich_help_panel=_USE)(eval_command)
app.command("generate", rich_help_panel=_USE)(generate)


if __name__ == "__main__":  # pragma: no cover
    app()
