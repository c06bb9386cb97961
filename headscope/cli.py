"""The ``headscope`` command line (typer)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, help="Find retrieval-critical attention heads by causal intervention.")


@app.callback()
def main() -> None:
    """headscope: rank attention heads by causal importance (HydraHead, SPEC.md)."""


@app.command()
def rank(
    model: str = typer.Option("smollm2-135m", help="'smollm2-135m', a local HF directory, a .gguf path or a cached hub id"),
    task: List[str] = typer.Option(["niah_single"], help="capability (repeatable)"),
    pairs: int = typer.Option(6, "--pairs", help="calibration pairs per task"),
    seq_len: int = typer.Option(512, help="prompt length in tokens"),
    depth: List[float] = typer.Option([0.5], help="needle depth(s), fractions in [0, 1] (repeatable, cycled over pairs)"),
    seed: int = typer.Option(0),
    lam: float = typer.Option(0.9, "--lambda", help="decay λ of the span readout (eq. 9)"),
    direction: str = typer.Option("noising", help="noising (default) or denoising"),
    budget: str = typer.Option("7:1", help="FA budget for mask.json: head count, fraction or LA:FA ratio"),
    min_per_layer: int = typer.Option(1, help="at least this many FA heads per layer in mask.json"),
    out: Path = typer.Option(Path("runs/rank"), help="output directory (resumes if it holds the same run)"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda (default: cuda when available)"),
    top: int = typer.Option(10, help="print this many top heads"),
) -> None:
    """Rank every head; write OUT/scores.csv, OUT/mask.json and OUT/heatmap.html."""
    import headscope

    try:
        r = headscope.rank(
            model=model,
            tasks=tuple(task),
            n_pairs=pairs,
            seq_len=seq_len,
            seed=seed,
            depth=depth[0] if len(depth) == 1 else tuple(depth),
            lam=lam,
            direction=direction,  # type: ignore[arg-type]
            out_dir=out,
            device=device,
        )
        mask = r.mask(budget, min_per_layer=min_per_layer)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    mask.to_json(out / "mask.json")
    r.heatmap().write_html(str(out / "heatmap.html"), include_plotlyjs="cdn")
    p = r.provenance
    typer.echo(
        f"{p['model']}: {p['n_pairs']} pair(s) of {p['tasks']} at ~{seq_len} tokens, {p['direction']}, "
        f"lambda={lam}; m(x) mean {sum(p['m_clean']) / len(p['m_clean']):.2f}, "
        f"m(x') mean {sum(p['m_corrupt']) / len(p['m_corrupt']):.2f}; {p['seconds']} s"
    )
    typer.echo(f"top {top} heads by receiver IE:")
    typer.echo(r.top(top)[["rank", "layer", "head", "kv_group", "ie_recv", "ie_recv_std"]].to_string(index=False))
    s = mask.summary()
    typer.echo(
        f"mask ({budget}, >= {min_per_layer}/layer): {s['n_fa']} FA heads of {s['n_total']}, "
        f"KV cache kept {s['kv_cache_fraction']:.1%}"
    )
    typer.echo(f"wrote {out / 'scores.csv'}, {out / 'mask.json'}, {out / 'heatmap.html'}")


@app.command()
def anatomy(
    run_dir: Path = typer.Argument(..., help="a run directory written by `headscope rank` / Ranking.save"),
    out: Optional[Path] = typer.Option(None, help="output directory (default RUN_DIR/anatomy)"),
    threshold: float = typer.Option(0.1, help="IE above this marks a head critical"),
    boot: int = typer.Option(200, help="bootstrap replicates per n for the stability curve"),
    seed: int = typer.Option(0, help="seed of the bootstrap"),
    use_model: bool = typer.Option(
        True, "--model/--no-model", help="load the run's model and re-generate its pairs for DLA and layer cosine"
    ),
    fmt: List[str] = typer.Option(["html", "png"], "--format", help="figure formats (repeatable): html, png"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda, for DLA and cosine"),
) -> None:
    """Head anatomy of a saved run: write OUT/anatomy.json and the figures (SPEC.md §7)."""
    from . import anatomy as an
    from .scores import Ranking

    out = out or run_dir / "anatomy"
    try:
        r = Ranking.load(run_dir)
        model = pairs = None
        if use_model:
            from .models import load_model

            model = load_model(r.provenance.get("model") or "smollm2-135m", device=device)
            pairs = an.pairs_of_run(r, model.tokenizer)
        a = an.anatomy(r, model=model, pairs=pairs, threshold=threshold, n_boot=boot, seed=seed)
        written = a.save(out, formats=tuple(fmt))
    except (ValueError, NotImplementedError, FileNotFoundError, RuntimeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    d = a.to_dict()
    for col, c in d["critical"].items():
        g = d["gini"][col]
        typer.echo(
            f"{col}: {c['n_critical']}/{c['n_heads']} critical ({c['critical_share']:.1%}, IE > {threshold}), "
            f"{c['convertible_share']:.1%} safely convertible; Gini mean {g['mean']:.3f} "
            f"(range {g['min']:.3f}-{g['max']:.3f})"
        )
    if "stability" in d:
        curve = d["stability"]["curve"]
        typer.echo(
            "stability rho(n): " + ", ".join(f"{row['n']}:{row['rho_mean']:.3f}" for row in curve)
            + f"; rho >= {a.rho_target} from n = {d['stability']['n_at_target']}"
        )
    typer.echo(f"wrote {out / 'anatomy.json'} and {sum(len(v) for k, v in written.items() if k != 'json')} figure file(s)")


def run() -> None:  # pragma: no cover
    app(sys.argv[1:])


if __name__ == "__main__":  # pragma: no cover
    app()
