"""The full HydraHead selection on one model (issue 3; SPEC.md §5–6): receivers + iterated senders for
several capabilities, κ, fusion, the 7:1 mask, and how the fused top set differs from the
receiver-only one.

Runs :func:`headscope.rank` twice on the same pairs: once with κ = retrieval focus (SPEC §6 default) and
once with κ ≡ 1. The receiver sweeps are stored per task under ``OUT/focus/<task>/`` and copied for the
κ ≡ 1 run, so only the (cheap) sender search and fusion are repeated.

Usage::

    python experiments/fused_selection.py --model smollm2-135m --pairs 6 --seq-len 512 --out runs/fused

Writes OUT/focus/ and OUT/one/ (each a saved Ranking with scores.csv, mask.json, provenance) and
OUT/report.json + OUT/report.md: per capability the pairs used, the gap m(x) − m(x'), the sender rounds
until convergence; per κ variant the fused top 20, the mask at ``--budget`` (FA heads, KV groups kept,
KV-cache fraction) and the overlap of the fused top-K with the receiver-only top-K (K = 10, 20 and the
budget's head count).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, List, Optional

import numpy as np
import pandas as pd
import typer

import headscope
from headscope.masks import parse_budget

app = typer.Typer(add_completion=False)


def _heads(df: pd.DataFrame, col: str, k: int) -> list[tuple[int, int]]:
    d = df.sort_values(col, ascending=False, kind="stable").head(k)
    return [(int(a), int(b)) for a, b in zip(d["layer"], d["head"])]


def _name(h: tuple[int, int]) -> str:
    return f"L{h[0]}H{h[1]}"


def summarize(r: Any, budget: str, min_per_layer: int, tasks: list[str]) -> dict[str, Any]:
    """Top heads, the mask and top-set overlaps of one fused Ranking."""
    df = r.scores
    n_heads = len(df)
    k_budget = parse_budget(budget, n_heads)
    mask = r.mask(budget, min_per_layer=min_per_layer)
    # receiver-only reference rankings: each capability's mean receiver IE, and their mean
    recv_cols = [c for c in df.columns if c.startswith("ie_recv_") and not c.endswith("_std")]
    refs: dict[str, str] = {}
    if "ie_recv" in df.columns:
        refs["ie_recv (mean over capabilities)"] = "ie_recv"
    for c in recv_cols:
        refs[c] = c
    overlaps: dict[str, Any] = {}
    for label, col in refs.items():
        overlaps[label] = {
            str(k): len(set(_heads(df, "score", k)) & set(_heads(df, col, k))) for k in (10, 20, k_budget)
        }
    # the receiver-only mask (same budget and constraint) vs the fused mask
    fa_fused = {(l, h) for l, hs in enumerate(mask.fa_heads) for h in hs}
    out = {
        "top20": [
            {k: (round(float(v), 4) if isinstance(v, (float, np.floating)) else (int(v) if isinstance(v, (int, np.integer)) else v))
             for k, v in row.items()}
            for row in df.sort_values("score", ascending=False).head(20).to_dict("records")
        ],
        "mask": {"budget": budget, "min_per_layer": min_per_layer, "n_fa": mask.n_fa, "summary": mask.summary(),
                 "kv_cache_fraction": round(float(mask.kv_cache_fraction), 4), "fa_heads": sorted(map(list, fa_fused))},
        "overlap_fused_vs_receiver_only": overlaps,
        "k_budget": k_budget,
    }
    if "ie_recv" in df.columns:
        from headscope.masks import HeadMask

        recv_mask = HeadMask.select(r.matrix("ie_recv"), budget, r.geometry["n_kv_heads"], min_per_layer=min_per_layer)
        fa_recv = {(l, h) for l, hs in enumerate(recv_mask.fa_heads) for h in hs}
        out["mask"]["overlap_with_receiver_only_mask"] = len(fa_fused & fa_recv)
    return out


def _markdown(rep: dict[str, Any]) -> str:
    L = [f"# Fused HydraHead selection: {rep['model']}", ""]
    L.append(f"Tasks {rep['tasks']}, {rep['pairs']} pairs each at {rep['seq_len']} tokens, seed {rep['seed']}, "
             f"device {rep['device']}, {rep['seconds']} s in all.")
    L.append("")
    L.append("| capability | pairs used | mean m(x) | mean m(x') | sender rounds | largest sender IE per round |")
    L.append("|---|---|---|---|---|---|")
    for t, v in rep["capabilities"].items():
        L.append(f"| {t} | {v['pairs_used']} | {v['m_clean']:.2f} | {v['m_corrupt']:.2f} | {v['n_rounds']} | "
                 f"{', '.join(f'{x:.3f}' for x in v['ie_send_max'])} |")
    for var in ("focus", "one"):
        s = rep[var]
        L += ["", f"## κ = {'retrieval focus' if var == 'focus' else '1'}", ""]
        cols = [c for c in s["top20"][0] if c in ("layer", "head", "ie_recv", "ie_send", "kappa", "score")
                or c.startswith("s_") or c.startswith("ie_recv_") and not c.endswith("std")]
        L.append("| rank | " + " | ".join(cols) + " |")
        L.append("|---|" + "---|" * len(cols))
        for i, row in enumerate(s["top20"], 1):
            L.append(f"| {i} | " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
        m = s["mask"]
        L += ["", f"Mask {m['budget']} (≥ {m['min_per_layer']} FA head per layer): {m['summary']}; "
              f"KV-cache fraction {m['kv_cache_fraction']}; shares "
              f"{m.get('overlap_with_receiver_only_mask', '?')} of {m['n_fa']} FA heads with the receiver-only mask."]
        L.append("")
        L.append("Overlap of the fused top-K with receiver-only top-K: " + "; ".join(
            f"{lab}: " + ", ".join(f"K={k}: {v}" for k, v in ov.items()) for lab, ov in s["overlap_fused_vs_receiver_only"].items()))
    return "\n".join(L) + "\n"


@app.command()
def main(
    model: str = typer.Option("smollm2-135m"),
    task: List[str] = typer.Option(["niah_single", "niah_multikey"]),
    pairs: int = typer.Option(6),
    seq_len: int = typer.Option(512),
    seed: int = typer.Option(0),
    budget: str = typer.Option("7:1"),
    min_per_layer: int = typer.Option(1),
    device: Optional[str] = typer.Option(None),
    out: Path = typer.Option(Path("runs/fused")),
    progress: bool = typer.Option(True),
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    lm = headscope.load_model(model, device=device)
    common = dict(tasks=tuple(task), n_pairs=pairs, seq_len=seq_len, seed=seed, senders=True, progress=progress)
    r_focus = headscope.rank(lm, kappa="focus", out_dir=out / "focus", **common)
    print(f"focus done in {time.time() - t0:.0f} s", flush=True)
    for t in task:  # reuse the receiver sweeps
        src, dst = out / "focus" / t, out / "one" / t
        if src.exists() and not dst.exists():
            shutil.copytree(src, dst)
    r_one = headscope.rank(lm, kappa="one", out_dir=out / "one", **common)
    caps = {}
    for t in task:
        pt = r_focus.provenance["per_task"][t]
        sr = r_focus.extras["sender_rounds"][t] if getattr(r_focus, "extras", None) else {}
        caps[t] = {
            "pairs_used": pt["n_pairs"] - len(pt["skipped_pairs"]),
            "m_clean": float(np.mean(pt["m_clean"])),
            "m_corrupt": float(np.mean(pt["m_corrupt"])),
            "n_rounds": sr.get("n_rounds"),
            "ie_send_max": [r["ie_send_max"] for r in sr.get("rounds", [])],
            "rounds": sr.get("rounds"),
        }
    rep = {
        "model": model, "tasks": list(task), "pairs": pairs, "seq_len": seq_len, "seed": seed,
        "device": str(next(lm.hf_model.parameters()).device), "seconds": round(time.time() - t0, 1),
        "capabilities": caps,
        "focus": summarize(r_focus, budget, min_per_layer, list(task)),
        "one": summarize(r_one, budget, min_per_layer, list(task)),
    }
    (out / "report.json").write_text(json.dumps(rep, indent=2, default=str))
    (out / "report.md").write_text(_markdown(rep))
    print(_markdown(rep))


if __name__ == "__main__":
    app()
