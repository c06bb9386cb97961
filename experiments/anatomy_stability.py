"""Per-pair receiver IE of SmolLM2-135M (or ``--model``) for the anatomy table (issue 20; SPEC.md §7).

Ranks every head of SmolLM2-135M-Instruct by exact receiver activation patching (eq. 10) on
``niah_single`` pairs at 256 tokens, needle depth cycled over 0.1 … 0.9, and keeps the per-pair IE
(``ie.pt``, Float[pair, layer, head]) so that the stability curve can be drawn against a reference
built from pairs disjoint from the sample (``headscope.analysis.anatomy.stability_curve``). Then writes the
anatomy (critical share, per-layer Gini, stability with the noise baseline) without the model-
dependent parts (DLA, cosine), which ``headscope anatomy RUN`` adds.

    python experiments/anatomy_stability.py                 # compute (resumes), then summarize
    python experiments/anatomy_stability.py --summary-only  # summarize the stored run

Cost: 54 pairs × 270 heads = 14580 patched forwards of the suffix after the needle; about 2 h on
2 shared CPU cores (one torch thread), seconds on a GPU.

Output: ``experiments/anatomy-smollm2/run/`` (ranking.json, scores.csv, ie.pt; per-pair partial
results while it runs, so a rerun resumes) and ``experiments/anatomy-smollm2/anatomy/``
(anatomy.json, summary.json; stability, gini and IE heatmap as html and png).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's headscope, not an installed one

app = typer.Typer(add_completion=False)
HERE = Path(__file__).resolve().parent / "anatomy-smollm2"
SETTINGS = {"seq_len": 256, "seed": 0, "depth": (0.1, 0.3, 0.5, 0.7, 0.9)}


@app.command()
def main(
    out: Path = typer.Option(None, help="output directory (default experiments/anatomy-<model>/)"),
    model: str = typer.Option("smollm2-135m", help="model spec (e.g. gemma3-270m, installed as the README says)"),
    summary_only: bool = typer.Option(False, help="only summarize a stored run"),
    n_pairs: int = typer.Option(54, help="calibration pairs (the first 36 are the same pairs as a 36-pair run's)"),
    n_ref: int = typer.Option(48, help="pairs in the disjoint reference (issue 15: >= 48 beside 6 sampled)"),
    n_boot: int = typer.Option(500, help="random splits per n"),
    threads: int = typer.Option(1, help="torch CPU threads (1 is faster than 2 on a shared 2-core machine)"),
) -> None:
    import torch

    import headscope
    from headscope.analysis import anatomy as an
    from headscope.scores import Ranking

    if out is None:
        out = HERE if model == "smollm2-135m" else HERE.parent / f"anatomy-{model}"
    run = out / "run"
    if not summary_only:
        t0 = time.time()
        torch.set_num_threads(threads)
        headscope.rank(model, tasks=("niah_single",), out_dir=run, device="cpu", progress=True, n_pairs=n_pairs, **SETTINGS)
        print(f"ranked in {time.time() - t0:.0f} s")
    r = Ranking.load(run)
    n_used = int((~torch.isnan(r.ie).all(-1).all(-1)).sum())
    ns = list(range(1, n_used - n_ref + 1))
    a = an.anatomy(r, n_boot=n_boot, seed=0, ns=ns, n_ref=n_ref)
    a.save(out / "anatomy", formats=("html", "png"))
    d = a.to_dict()
    # for comparison: the old reading (reference = all pairs, containing the sample), and n = 6
    # against every other pair (the largest disjoint reference)
    biased = an.stability_curve(r.ie, ns=[6], n_boot=n_boot, seed=0, reference="all", noise=True, top_k=10)
    widest = an.stability_curve(r.ie, ns=[6], n_boot=n_boot, seed=0, n_ref=n_used - 6, noise=True, top_k=10)
    p = r.provenance
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True).stdout.strip()
    summary = {
        "summary_code": {"headscope": str(Path(an.__file__).parent), "commit": commit},
        "settings": {"n_pairs": n_pairs, **SETTINGS, "model": p.get("model"), "lambda": p.get("lambda"), "direction": p.get("direction")},
        "n_pairs_used": n_used,
        "skipped_pairs": p.get("skipped_pairs"),
        "n_ref": n_ref,
        "rho_at_6": d["stability"].get("rho_at_6"),
        "rho_at_6_against_all_other_pairs": an.stability_at(widest, 6),
        "rho_at_6_biased_reference_all": an.stability_at(biased, 6),
        "n_at_rho_0.9": d["stability"]["n_at_target"],
        "critical": d["critical"]["ie_recv"],
        "gini": {k: d["gini"]["ie_recv"][k] for k in ("negative", "mean", "min", "max")},
        "gini_abs": d["gini_other"]["ie_recv"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    app()
