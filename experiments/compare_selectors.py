"""Compare head selectors on SmolLM2-135M (issue 9): agreement with the causal ranking, knockout, cost.

For every selector in :data:`headscope.selectors.SELECTORS`:

* top-K overlap |top_K(selector) ∩ top_K(causal)| / K and Spearman ρ (scipy.stats.spearmanr) of its
  head scores against the causal ranking's scores;
* knockout efficacy: greedy (teacher-forced, = greedy generation of the answer span) exact-match
  accuracy on ``--n-eval`` niah_single prompts of ``--ko-len`` tokens after zero-ablating the
  selector's top-K heads (``hook_z`` rows zeroed with ``headscope.analysis.knockout.ablate``), against the
  unablated accuracy;
* cost: wall and CPU seconds of the selector on this machine (the causal ranking's cost is its own run's).

Results are saved as they go to ``--out`` (rankings/<name>/, knockout.json, table.csv/.md,
figure.html); a rerun resumes. ``--causal-store`` reuses a receiver-patching store (a directory
with ``receivers/pair*.pt``) written by ``headscope.rank(..., out_dir=...)``, read-only.

Example:
    python experiments/compare_selectors.py --out /work/runs-selectors --n-eval 12 --ko-len 1024 --k 27
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

import headscope
from headscope.readout import greedy_exact_match
from headscope.analysis.knockout import ablate
from headscope.scores import Ranking, head_table
from headscope.selectors import select
from headscope.selectors.base import passkey_prompts


@torch.inference_mode()
def accuracy(lm, prompts, heads, done: list[bool], save) -> list[bool]:
    with ablate(lm, heads, method="zero") if heads else contextlib.nullcontext():
        for p in prompts[len(done):]:
            logits = lm.hf_model(p.ids[None]).logits[0, p.read]
            done.append(bool(greedy_exact_match(logits, p.answer)))
            save()
    return done


def causal_from_store(store: Path, out: Path, geometry: dict) -> Ranking:
    """Build the receivers-only causal Ranking from a headscope receiver store (read-only)."""
    from headscope.patching.receivers import finish

    items = sorted((store / "receivers").glob("pair*.pt"))
    if not items:
        raise FileNotFoundError(f"{store}/receivers has no pair*.pt items; run headscope.rank(..., out_dir={store}) first")
    res = [torch.load(p, weights_only=False) for p in items]
    pr = finish(torch.stack([r["patched"] for r in res]), torch.stack([r["m_clean"] for r in res]).double(),
                torch.stack([r["m_corrupt"] for r in res]).double(), "noising", 0.9, 0.1)
    cfg = json.loads((store / "receivers" / "config.json").read_text())
    t_start = (store / "receivers" / "config.json").stat().st_mtime
    secs = max(p.stat().st_mtime for p in items) - t_start
    prov = {"selector": "causal", "source_store": str(store), "store_config": cfg, "n_pairs": len(items),
            "skipped_pairs": pr.skipped, "seconds": round(secs, 1), "cpu_seconds": None,
            "score": "ie_recv (mean over pairs)"}
    r = Ranking(head_table(pr.ie, geometry["n_kv_heads"]), geometry, prov, pr.ie)
    r.save(out)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/work/runs-selectors")
    ap.add_argument("--n-eval", type=int, default=12, help="knockout prompts")
    ap.add_argument("--ko-len", type=int, default=1024, help="knockout prompt length (tokens)")
    ap.add_argument("--k", type=int, default=27, help="top-K heads ablated / compared (27 = 10%% of 270)")
    ap.add_argument("--sel-len", type=int, default=256, help="calibration length of retrieval_score/rope_dependence")
    ap.add_argument("--gate-len", type=int, default=128, help="training length of the gate selectors")
    ap.add_argument("--gate-steps", type=int, default=12)
    ap.add_argument("--n-sel", type=int, default=12, help="calibration prompts per selector")
    ap.add_argument("--causal-store", default=None, help="reuse a receiver store instead of computing causal")
    ap.add_argument("--causal-pairs", type=int, default=12)
    ap.add_argument("--causal-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = headscope.load_model("smollm2-135m", device="cpu")
    depths = (0.1, 0.3, 0.5, 0.7, 0.9)
    sel_settings = {
        "random": dict(seed=0),
        "uniform_per_layer": dict(seed=0),
        "layerwise": dict(n_fa_layers=max(1, a.k // lm.geometry.n_heads)),
        "retrieval_score": dict(n_prompts=a.n_sel, seq_lens=a.sel_len, depths=depths, seed=1),
        "rope_dependence": dict(n_prompts=a.n_sel, seq_lens=a.sel_len, depths=depths, seed=1, n_queries=32),
        "duo_gates": dict(steps=a.gate_steps, n_prompts=a.n_sel, seq_lens=a.gate_len, depths=depths, seed=1),
        "flashmorph_gates": dict(steps=a.gate_steps, n_prompts=a.n_sel, seq_lens=a.gate_len, depths=depths, seed=1),
    }
    order = ["causal", "random", "uniform_per_layer", "layerwise", "retrieval_score", "rope_dependence",
             "duo_gates", "flashmorph_gates"]
    if a.only:
        order = [m for m in order if m in a.only or m == "causal"]

    ko_path = out / "knockout.json"
    ko = json.loads(ko_path.read_text()) if ko_path.exists() else {}
    cfg = {"n_eval": a.n_eval, "ko_len": a.ko_len, "k": a.k, "seed": 12345, "depths": list(depths)}
    if ko.get("config", cfg) != cfg:
        raise SystemExit(f"{ko_path} was written with other settings {ko['config']}; use another --out")
    ko["config"] = cfg
    ko.setdefault("hits", {})

    def save_ko() -> None:
        tmp = ko_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ko, indent=1))
        tmp.replace(ko_path)

    evalp = passkey_prompts(lm, a.n_eval, a.ko_len, depths, seed=12345)
    t = time.time()
    accuracy(lm, evalp, [], ko["hits"].setdefault("none", []), save_ko)
    print(f"baseline acc {np.mean(ko['hits']['none']):.3f} ({time.time() - t:.0f}s)", flush=True)

    rankings: dict[str, Ranking] = {}
    for m in order:
        d = out / "rankings" / m
        if (d / "ranking.json").exists():
            r = Ranking.load(d)
        elif m == "causal" and a.causal_store:
            r = causal_from_store(Path(a.causal_store), d, lm.geometry.to_dict())
        else:
            s = dict(sel_settings.get(m, {}))
            if m == "causal":
                s = dict(n_pairs=a.causal_pairs, seq_len=a.causal_len, depth=depths, seed=1, out_dir=str(out / "causal_store"))
            t0, c0 = time.time(), time.process_time()
            r = select(lm, m, **s)
            r.provenance["seconds"] = round(time.time() - t0, 1)
            r.provenance["cpu_seconds"] = round(time.process_time() - c0, 1)
            r.save(d)
        rankings[m] = r
        print(f"{m}: {r.provenance.get('seconds')} s; top5 {r.top(5)[['layer', 'head']].values.tolist()}", flush=True)
        t = time.time()
        heads = r.top(a.k)[["layer", "head"]].values.tolist()
        accuracy(lm, evalp, heads, ko["hits"].setdefault(m, []), save_ko)
        print(f"  knockout top-{a.k}: acc {np.mean(ko['hits'][m]):.3f} ({time.time() - t:.0f}s)", flush=True)
        write_table(out, rankings, ko, a.k)


def write_table(out: Path, rankings: dict[str, Ranking], ko: dict, k: int) -> pd.DataFrame:
    causal = rankings.get("causal")
    rows = []
    for m, r in rankings.items():
        row = {"selector": m}
        if causal is not None:
            c = causal.matrix("score").ravel()
            s = r.matrix("score").ravel()
            for kk in sorted({10, k}):
                tc = set(map(tuple, causal.top(kk)[["layer", "head"]].values.tolist()))
                ts = set(map(tuple, r.top(kk)[["layer", "head"]].values.tolist()))
                row[f"overlap@{kk}"] = len(tc & ts) / kk
            row["spearman"] = float(spearmanr(s, c).statistic)
        hits = ko["hits"].get(m, [])
        row[f"acc_ko_top{k}"] = float(np.mean(hits)) if hits else np.nan
        row["n_eval"] = len(hits)
        row["seconds"] = r.provenance.get("seconds")
        row["cpu_seconds"] = r.provenance.get("cpu_seconds")
        rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs["acc_unablated"] = float(np.mean(ko["hits"]["none"]))
    df.to_csv(out / "table.csv", index=False)
    md = df.to_markdown(index=False, floatfmt=".3f") if _has_tabulate() else df.to_string(index=False)
    (out / "table.md").write_text(f"unablated accuracy: {df.attrs['acc_unablated']:.3f} "
                                  f"({len(ko['hits']['none'])} prompts, {ko['config']['ko_len']} tokens)\n\n{md}\n")
    figure(out, df, k)
    return df


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401

        return True
    except ImportError:
        return False


def figure(out: Path, df: pd.DataFrame, k: int) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cols = [c for c in (f"overlap@{k}", "spearman", f"acc_ko_top{k}") if c in df]
    fig = make_subplots(rows=1, cols=len(cols), subplot_titles=cols, shared_yaxes=True)
    for i, c in enumerate(cols, 1):
        fig.add_trace(go.Bar(y=df["selector"], x=df[c], orientation="h", name=c, showlegend=False), row=1, col=i)
    fig.add_vline(x=df.attrs["acc_unablated"], line_dash="dash", row=1, col=len(cols))
    fig.update_layout(title=f"Head selectors on SmolLM2-135M: agreement with the causal ranking and top-{k} knockout "
                      "(dashed: unablated accuracy)", height=420, width=1100)
    fig.write_html(out / "figure.html")
    if os.environ.get("HEADSCOPE_PNG"):
        fig.write_image(out / "figure.png")


if __name__ == "__main__":
    main()
