"""``headscope mask``: masks from a saved ranking at a KV-cache budget (:mod:`headscope.kv_budget`), the head-wise arm
beside the layer-wise arm at the same KV share; ``headscope.cli`` registers it on its app."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .cli_errors import user_errors

MASK_HELP = """Masks at a KV-cache budget from a ranking `headscope rank` saved (RUN_DIR: scores.csv, ranking.json):
the head-wise arm keeps its FA heads within the KV cache of --kv-layers L layers (L x KV heads KV groups; on a
model with one KV head per layer, such as Gemma 3 270M, any FA head keeps its layer's whole cache, so: at most L
layers), the layer-wise arm keeps L whole layers: the same KV-cache share, L / layers.

Head-wise: --budget K (count, fraction or LA:FA ratio of all heads): the K heads of the largest summed score that
lie in at most L layers' KV groups (exact, dynamic programming: the groups whose best heads carry the most score,
and as many FA heads in each as the scores say); or --heads-per-group k: the top k heads of each of the L x KV-heads
groups whose top k heads score highest. Layer-wise: --layerwise even (evenly spaced, the studies' layer-wise arms)
or score (the layers of the largest summed score).

Writes OUT/headwise.json and OUT/layerwise.json (mask.json files for `headscope convert --mask`) and
OUT/kv_budget.json (per arm: FA heads, KV-cache share, KV groups kept, layers, FA heads per layer, summed score);
prints the two arms. docs/conversion.md#masks-at-a-kv-cache-budget."""


def mask_command(
    run_dir: Path = typer.Argument(..., help="a run directory written by `headscope rank` / Ranking.save"),
    kv_layers: int = typer.Option(..., help="the KV budget: the KV cache of this many whole layers (share L / layers)"),
    budget: Optional[str] = typer.Option(None, help="head-wise FA heads: a count, fraction or LA:FA ratio of all heads"),
    heads_per_group: Optional[int] = typer.Option(
        None, help="instead of --budget: this many FA heads in each chosen KV group (a layer, with one KV head per layer)"),
    layerwise: str = typer.Option("even", help="the layer-wise arm's layers: even (evenly spaced) or score"),
    out: Optional[Path] = typer.Option(None, help="output folder (default RUN_DIR/kv_L{kv_layers})"),
) -> None:
    with user_errors():
        from .kv_budget import arm_row, check_kv_budget, layerwise_at, select_in_kv_budget
        from .scores import Ranking
        from .validate import check_choice

        check_choice("--layerwise", layerwise, ("even", "score"))
        r = Ranking.load(run_dir)
        g = r.geometry
        n_kv = int(g["n_kv_heads"])
        check_kv_budget(r.n_layers, r.n_heads, n_kv, kv_layers, budget, heads_per_group, cli=True)
        meta = {"model": r.provenance.get("model"), "tasks": r.provenance.get("tasks"), "ranking": str(run_dir),
                "score": r.provenance.get("score", "ie_recv")}
        scores = r.matrix("score")
        head = select_in_kv_budget(scores, n_kv, kv_layers, budget, heads_per_group, meta=meta)
        layer = layerwise_at(scores, n_kv, kv_layers, by=layerwise, meta=meta)  # type: ignore[arg-type]
        d = out or run_dir / f"kv_L{kv_layers}"
        d.mkdir(parents=True, exist_ok=True)
        head.to_json(d / "headwise.json")
        layer.to_json(d / "layerwise.json")
        rows = [arm_row("headwise", head), arm_row(f"layerwise ({layerwise})", layer)]
        from .runtime import atomic_write_text

        atomic_write_text(d / "kv_budget.json", json.dumps(
            {"ranking": str(run_dir), "kv_layers": kv_layers, "budget": budget, "heads_per_group": heads_per_group,
             "geometry": {"n_layers": r.n_layers, "n_heads": r.n_heads, "n_kv_heads": n_kv}, "arms": rows}, indent=2))
    for row in rows:
        per = ", ".join(f"L{k}:{v}" for k, v in row["fa_per_layer"].items())
        typer.echo(f"{row['arm']}: {row['n_fa']} FA heads of {r.n_layers * r.n_heads}, KV cache kept "
                   f"{row['kv_cache_fraction']:.1%} ({row['kv_groups_kept']} KV groups), layers {per}, "
                   f"summed score {row['score_sum']:.4g}")
    typer.echo(f"wrote {d}/: headwise.json, layerwise.json, kv_budget.json")
