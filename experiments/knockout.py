"""Knockout validation (SPEC.md §7; issue 6): retrieval accuracy after ablating K heads.

For each task, prompt length and ablation method, accuracy (greedy exact match of the needle value,
teacher-forced: ``headscope.analysis.knockout.retrieval_correct``) after ablating
* the top-K heads of a ranking (``headscope.rank`` on calibration pairs of a DIFFERENT seed from
  the evaluation prompts; the seeds and a prompt-overlap check are written to the output),
* K random heads (several seeds; mean and standard deviation),
* the bottom-K heads,
* whole layers holding about K heads (round(K / n_heads) layers, at least one, chosen by summed
  head score: layer-level versus head-level knockout).

K runs over a grid that always contains the number of critical heads (IE > 0.1) and 5 % of heads.

Results go to ``OUT/results.json`` after every condition (a rerun resumes); ``OUT/figure.html``
(and ``figure.png`` when kaleido works) is drawn from it, also alone with ``--plot-only``.

    python experiments/knockout.py --out runs/knockout --quick
    python experiments/knockout.py --out runs/knockout --device cuda
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False)
CRITICAL = 0.1


def _save(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def _k_grid(n_total: int, k_crit: int, k5: int, quick: bool) -> list[int]:
    base = [1, 4] if quick else [1, 2, 4, 8, 2 * k5, 4 * k5]
    return sorted({k for k in [*base, k_crit, k5] if 1 <= k <= n_total})


SETS = ("top", "random", "bottom", "layers")


def head_sets(scores, n_heads: int, k: int, random_seeds: int,
              kinds: tuple[str, ...] = SETS) -> dict[str, list[tuple[int, int]]]:
    """Condition name -> (layer, head) list for one K (scores: Ranking.scores DataFrame); ``kinds``
    picks which of top, random (``random_seeds`` draws), bottom and layers are made."""
    df = scores.sort_values("rank")
    all_heads = [(int(l), int(h)) for l, h in zip(df["layer"], df["head"])]
    sets = {"top": all_heads[:k], "bottom": all_heads[-k:]}
    for s in range(random_seeds):
        sets[f"random{s}"] = sorted(random.Random(1000 + s).sample(all_heads, k))
    n_lay = max(1, round(k / n_heads))
    layer_score = df.groupby("layer")["score"].sum().sort_values(ascending=False)
    layers = [int(x) for x in layer_score.index[:n_lay]]
    sets["layers"] = [(l, h) for l in sorted(layers) for h in range(n_heads)]
    return {name: heads for name, heads in sets.items() if name.rstrip("0123456789") in kinds}


@app.command()
def main(
    out: Path = typer.Option(Path("runs/knockout"), help="output directory (results.json, figure.html)"),
    model: str = typer.Option("smollm2-135m", help="model spec (see headscope.load_model)"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda (default: cuda if available)"),
    quick: bool = typer.Option(False, help="small run: 4 prompts, 256 tokens, K in {1, 4, critical, 5 %}"),
    tasks: str = typer.Option("niah_single", help="comma-separated task names (headscope.tasks.TASKS)"),
    lengths: str = typer.Option("256,1024,2048", help="prompt lengths in tokens"),
    depths: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="needle depths, cycled over the prompts"),
    n_prompts: int = typer.Option(50, help="evaluation prompts per task and length"),
    eval_seed: int = typer.Option(1000, help="seed of the evaluation prompts"),
    ref_seed: int = typer.Option(2000, help="seed of the mean-ablation reference prompts"),
    n_ref: int = typer.Option(8, help="reference prompts for mean ablation (per length)"),
    methods: str = typer.Option("zero,mean", help="ablation methods: zero, mean"),
    random_seeds: int = typer.Option(3, help="random-K head sets per K"),
    ranking: Optional[Path] = typer.Option(None, help="saved Ranking directory (default: rank now into OUT/ranking)"),
    rank_seed: int = typer.Option(0, help="seed of the calibration pairs when ranking here"),
    rank_pairs: int = typer.Option(6, help="calibration pairs when ranking here"),
    rank_len: int = typer.Option(512, help="calibration length when ranking here"),
    batch_size: int = typer.Option(16, help="prompts per forward"),
    ks: Optional[str] = typer.Option(None, help="comma-separated K values (default: a grid holding K critical and 5 %)"),
    sets: str = typer.Option(",".join(SETS), help="head sets per K: top, random, bottom, layers"),
    plot_only: bool = typer.Option(False, help="only redraw the figure from OUT/results.json"),
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    if plot_only:
        plot(json.loads(res_path.read_text()), out)
        return
    import torch

    import headscope
    from headscope.analysis.knockout import ablate, mean_reference, retrieval_correct
    from headscope.scores import Ranking
    from headscope.tasks import TASKS, make_pairs

    if quick:
        n_prompts, lengths, n_ref, random_seeds = min(n_prompts, 4), "256", min(n_ref, 2), min(random_seeds, 3)
        rank_pairs, rank_len = min(rank_pairs, 2), min(rank_len, 256)
    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    missing = [t for t in task_list if t not in TASKS]
    if missing:
        raise typer.BadParameter(f"unknown task(s) {missing}; available: {sorted(TASKS)}")
    lens = [int(x) for x in lengths.split(",")]
    dep = [float(x) for x in depths.split(",")]
    meths = [m.strip() for m in methods.split(",") if m.strip()]
    if any(m not in ("zero", "mean") for m in meths):
        raise typer.BadParameter("methods must be zero and/or mean")
    kinds = tuple(x.strip() for x in sets.split(",") if x.strip())
    if not kinds or any(x not in SETS for x in kinds):
        raise typer.BadParameter(f"--sets takes a comma-separated subset of {SETS}")
    k_list = None
    if ks is not None:
        try:
            k_list = sorted({int(x) for x in ks.split(",") if x.strip()})
        except ValueError:
            raise typer.BadParameter(f"--ks {ks!r}: comma-separated integers") from None

    t0 = time.time()
    lm = headscope.load_model(model, device=device)
    g = lm.geometry
    # ---- ranking (calibration pairs disjoint from the evaluation prompts) ------------------------
    if ranking is None:
        rdir = out / "ranking"
        if (rdir / "ranking.json").exists():
            rk = Ranking.load(rdir)
        else:
            rk = headscope.rank(lm, tasks=[task_list[0]], n_pairs=rank_pairs, seq_len=rank_len, seed=rank_seed,
                                depth=0.5, out_dir=rdir, progress=False)
    else:
        rk = Ranking.load(ranking)
    cal_seed = rk.provenance.get("seed")
    cal_settings = rk.provenance.get("task_settings", {})
    if cal_seed == eval_seed:
        raise typer.BadParameter(f"evaluation seed {eval_seed} equals the ranking's calibration seed; pick another")
    scores = rk.scores
    k_crit = int((scores["ie_recv"] > CRITICAL).sum())
    k5 = max(1, int(math.floor(0.05 * g.n_total + 0.5)))
    ks = _k_grid(g.n_total, k_crit, k5, quick) if k_list is None else k_list
    if not ks or not all(1 <= k <= g.n_total for k in ks):
        raise typer.BadParameter(f"--ks {ks}: each K must be in 1..{g.n_total}")

    data = json.loads(res_path.read_text()) if res_path.exists() else {}
    data.update({
        "model": lm.provenance(),
        "ranking": {
            "source": str(ranking) if ranking else str(out / "ranking"),
            "calibration_seed": cal_seed,
            "calibration_settings": cal_settings,
            "n_pairs": rk.provenance.get("n_pairs"),
            "top": [(int(l), int(h), float(s)) for l, h, s in rk.top(max(ks)).loc[:, ["layer", "head", "score"]].values],
        },
        "evaluation": {"tasks": task_list, "lengths": lens, "depths": dep, "n_prompts": n_prompts,
                       "seed": eval_seed, "mean_reference_seed": ref_seed, "n_ref": n_ref,
                       "metric": "greedy exact match of the needle value (teacher-forced argmax over the answer span)"},
        "disjointness": f"calibration pairs seed {cal_seed} ({cal_settings.get('seq_len')} tokens); evaluation prompts "
                        f"seed {eval_seed}; mean-ablation reference prompts seed {ref_seed}",
        "k": {"critical": k_crit, "critical_threshold": CRITICAL, "five_percent": k5, "grid": ks},
        "sets": list(kinds), "random_seeds": random_seeds, "command": " ".join(sys.argv),
        "quick": quick,
    })
    data.setdefault("results", {})
    cal_prompts = set()
    try:
        cal = make_pairs(task_list[0], lm.tokenizer, **cal_settings)
        cal_prompts = {tuple(p.clean.tolist()) for p in cal}
    except Exception as e:  # settings of a foreign ranking
        print(f"could not rebuild calibration prompts for the overlap check: {e}", file=sys.stderr)
    _save(res_path, data)
    print(f"K critical (IE>{CRITICAL}) = {k_crit}, K 5% = {k5}, grid {ks}; {data['disjointness']}", flush=True)

    pair_cache: dict = {}
    mref_cache: dict = {}

    def eval_pairs(task: str, L: int):
        if (task, L) not in pair_cache:
            pairs = make_pairs(task, lm.tokenizer, n_pairs=n_prompts, seq_len=L, depth=dep, seed=eval_seed)
            overlap = sum(tuple(p.clean.tolist()) in cal_prompts for p in pairs)
            data.setdefault("overlap", {})[f"{task}/{L}"] = overlap
            if overlap:
                print(f"WARNING: {overlap} evaluation prompts equal calibration prompts ({task}, {L})", flush=True)
            pair_cache[(task, L)] = pairs
        return pair_cache[(task, L)]

    def record(task: str, L: int, key: str, heads, method: str) -> None:
        if key in data["results"]:
            return
        pairs = eval_pairs(task, L)
        t = time.time()
        if not heads:
            c = retrieval_correct(lm, pairs, batch_size=batch_size)
        else:
            ref = None
            if method == "mean":
                if (task, L) not in mref_cache:
                    refs = make_pairs(task, lm.tokenizer, n_pairs=n_ref, seq_len=L, depth=dep, seed=ref_seed)
                    mref_cache[(task, L)] = mean_reference(lm, refs, range(g.n_layers))
                ref = mref_cache[(task, L)]
            with ablate(lm, heads, method, reference=ref):
                c = retrieval_correct(lm, pairs, batch_size=batch_size)
        c = c.tolist()
        data["results"][key] = {"accuracy": sum(c) / len(c), "correct": c,
                                "depths": [p.meta.get("depth") for p in pairs],
                                "heads": [list(h) for h in heads], "n_heads": len(heads),
                                "seconds": round(time.time() - t, 2)}
        _save(res_path, data)
        print(f"{key}: acc={sum(c) / len(c):.3f} ({len(heads)} heads)", flush=True)

    # the two acceptance K values first (every task, length, method), then the rest of the curve
    first = [k for k in ks if k in (k_crit, k5)] if k_list is None else ks
    for k_pass in (first, [k for k in ks if k not in first]):
        for task in task_list:
            for L in lens:
                record(task, L, f"{task}/{L}/baseline", [], "zero")
                for method in meths:
                    for k in k_pass:
                        for name, heads in head_sets(scores, g.n_heads, k, random_seeds, kinds).items():
                            record(task, L, f"{task}/{L}/{method}/{k}/{name}", heads, method)
    data["summary"] = summarize(data)
    data["seconds"] = round(time.time() - t0, 1)
    _save(res_path, data)
    print(json.dumps(data["summary"]["table"], indent=1))
    try:
        plot(data, out)
    except ImportError as e:
        print(f"figure skipped ({e}); run again with --plot-only where plotly is installed", flush=True)


def summarize(data: dict) -> dict:
    """Rows (task, length, method, K, top, random mean/sd, bottom, layers) from the raw results."""
    import numpy as np

    res = data["results"]
    rows = []
    for key in res:
        parts = key.split("/")
        if len(parts) != 5 or parts[4] != "top":
            continue
        task, L, method, k, _ = parts
        pre = f"{task}/{L}/{method}/{k}"
        rnd = [res[x]["accuracy"] for x in res if x.startswith(pre + "/random")]
        rows.append({
            "task": task, "length": int(L), "method": method, "k": int(k),
            "baseline": res.get(f"{task}/{L}/baseline", {}).get("accuracy"),
            "top": res[key]["accuracy"],
            "random_mean": float(np.mean(rnd)) if rnd else None,
            "random_sd": float(np.std(rnd, ddof=1)) if len(rnd) > 1 else None,
            "n_random": len(rnd),
            "bottom": res.get(pre + "/bottom", {}).get("accuracy"),
            "layers": res.get(pre + "/layers", {}).get("accuracy"),
            "layers_n_heads": res.get(pre + "/layers", {}).get("n_heads"),
        })
    rows.sort(key=lambda r: (r["task"], r["method"], r["length"], r["k"]))
    return {"table": rows}


def plot(data: dict, out: Path) -> None:
    """Accuracy versus K, one panel per (task, method) row and length column."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = data.get("summary", {}).get("table") or summarize(data)["table"]
    keys = sorted({(r["task"], r["method"]) for r in rows})
    lens = sorted({r["length"] for r in rows})
    fig = make_subplots(rows=len(keys), cols=len(lens), shared_yaxes=True,
                        subplot_titles=[f"{t} · {m} ablation · {L} tokens" for t, m in keys for L in lens])
    colors = {"top": "#d62728", "random": "#7f7f7f", "bottom": "#2ca02c", "layers": "#1f77b4"}
    for i, (t, m) in enumerate(keys, 1):
        for j, L in enumerate(lens, 1):
            rr = sorted([r for r in rows if r["task"] == t and r["method"] == m and r["length"] == L], key=lambda r: r["k"])
            if not rr:
                continue
            x = [r["k"] for r in rr]
            first = i == 1 and j == 1
            fig.add_trace(go.Scatter(x=x, y=[r["top"] for r in rr], name="top-K", mode="lines+markers",
                                     line_color=colors["top"], showlegend=first), i, j)
            fig.add_trace(go.Scatter(x=x, y=[r["random_mean"] for r in rr], name="random-K (mean ± sd)",
                                     mode="lines+markers", line_color=colors["random"], showlegend=first,
                                     error_y=dict(type="data", array=[r["random_sd"] or 0 for r in rr])), i, j)
            fig.add_trace(go.Scatter(x=x, y=[r["bottom"] for r in rr], name="bottom-K", mode="lines+markers",
                                     line_color=colors["bottom"], showlegend=first), i, j)
            fig.add_trace(go.Scatter(x=x, y=[r["layers"] for r in rr], name="whole layers (≈K heads)",
                                     mode="lines+markers", line_color=colors["layers"], line_dash="dot",
                                     showlegend=first), i, j)
            if rr[0]["baseline"] is not None:
                fig.add_hline(y=rr[0]["baseline"], line_dash="dash", line_color="black", row=i, col=j)
            fig.update_xaxes(type="log", title_text="K (heads ablated)", row=i, col=j)
    fig.update_yaxes(title_text="retrieval accuracy", range=[-0.05, 1.05])
    k = data.get("k", {})
    fig.update_layout(
        title=f"Knockout: {data.get('model', {}).get('model', '')} — K critical={k.get('critical')}, "
              f"5 %={k.get('five_percent')}; {data.get('disjointness', '')}",
        height=350 * len(keys) + 120, width=420 * len(lens) + 120, title_font_size=12)
    fig.write_html(out / "figure.html", include_plotlyjs="cdn")
    try:
        fig.write_image(out / "figure.png", scale=2)
    except Exception as e:  # kaleido missing or broken
        print(f"PNG skipped: {e}", flush=True)


if __name__ == "__main__":
    app()
