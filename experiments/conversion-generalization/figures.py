"""Issue 62's figures and paired tests, from retention.csv alone (the study's columns plus ``source``, ``agreement``).

    python experiments/conversion-generalization/figures.py --retention experiments/conversion-generalization/retention.csv \
        --out experiments/conversion-generalization/figures [--cells records/cli_cells.jsonl.gz] [--pair LEVER,REFERENCE ...]

writes (plotly, HTML + PNG through :func:`headscope.plots.save_figures`):

* ``long_context``: accuracy against prompt length on the unseen cells, one panel per task, the default student
  (:data:`DEFAULT_ARM`: mean over seeds, min–max bars) beside the teacher (dashed) (question 1);
* ``budget_curve``: retention (student ÷ teacher on the same prompts) against the FA share 1 / (R + 1) of the arms
  named ``KIND-Rto1`` (head-wise ``headwise``, layer-wise at the same KV share ``layerwise``, HydraHead with ≥ 1 FA head
  per layer ``hydra``), one panel per task, a line per arm kind and length; cells whose teacher is below
  ``--min-teacher`` have no retention and are left out (question 3);
* ``gemma3``: Gemma 3 270M's arms (``gemma-*``) beside its teacher, accuracy per task and length (question 4);

and ``paired.csv``, printed as a table: each lever beside its reference (:data:`PAIRS`, or ``--pair``) on every cell
both have in one eval folder (``source``): the per-seed accuracies, their mean difference, the paired t-test across
seeds (``p_seeds``: scipy's ``ttest_rel``, df = seeds − 1; undefined with one seed or differences that do not vary)
and, with ``--cells``, McNemar's exact test on the prompts pooled over those seeds (``p_prompts``,
:func:`headscope.evaluation.accuracy.paired_exact_test`). A lever moved a cell when ``p_seeds`` < ``--alpha`` with
≥ 2 seeds (issue 62, item 5).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the package's default recipe (both data levers) as the labels carry it, and the default student (question 1)
LEVERS = "+s2_retrieval=0.25+s3_wordings=6"
DEFAULT_ARM = "hydra-7to1" + LEVERS
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")
SHORT = {"niah_single": "single needle", "niah_multikey": "multi-key", "niah_multivalue": "multi-value",
         "variable_tracking": "variable tracking"}
#: the levers of issue 62 and what each is measured against (same seeds' documents, same prompts)
PAIRS = ([(f"headwise-{r}to1{LEVERS}", f"layerwise-{r}to1{LEVERS}") for r in (3, 7, 15, 31)]
         + [(f"gemma-headwise-kv3{LEVERS}", f"gemma-layerwise-kv3{LEVERS}"),
            (f"rank4-7to1{LEVERS}", f"rank1-7to1{LEVERS}"),
            (f"{DEFAULT_ARM}+s3_tokens=2x", DEFAULT_ARM),
            (DEFAULT_ARM, "teacher")])
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
PAIRED_COLUMNS = ["lever", "reference", "source", "task", "formats", "length", "seeds", "lever_accuracy",
                  "reference_accuracy", "differences", "mean_difference", "p_seeds", "n_prompts", "only_lever",
                  "only_reference", "p_prompts", "moved"]


def length_text(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def arm_budget(model: str) -> Optional[tuple[str, int, str]]:
    """(kind, R, levers) of a label ``KIND-Rto1[+lever=value...]`` (``headwise-7to1+s2_retrieval=0.25``), else None."""
    m = re.fullmatch(r"(.+?)-(\d+)to1((?:\+.*)?)", model)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def read_retention(path: Path) -> pd.DataFrame:
    """retention.csv with ``source`` filled (older files: ``study``) and ``retention`` = accuracy ÷ teacher's (NaN where
    the teacher scored 0)."""
    df = pd.read_csv(path)
    if "source" not in df:
        df["source"] = "study"
    df["retention"] = df.accuracy / df.teacher_accuracy.where(df.teacher_accuracy > 0)
    return df


def _spread(g: pd.DataFrame, col: str) -> pd.DataFrame:
    """Mean, min and max of ``col`` per length over the rows of ``g`` (seeds, sources), sorted by length."""
    return g.groupby("length")[col].agg(["mean", "min", "max", "count"]).reset_index().sort_values("length")


def long_context_figure(df: pd.DataFrame, models: Sequence[str] = (DEFAULT_ARM,), formats: str = "unseen") -> Any:
    """Question 1: accuracy against length per task, each model (mean over seeds, min–max) and the teacher of the same
    eval folders (the sources the models' rows come from), lengths on a log2 axis."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    d = df[df.formats == formats]
    srcs = set(d[d.model.isin(models)].source)
    tasks = [t for t in TASKS if t in set(d[d.model.isin(models)].task)]
    fig = make_subplots(rows=1, cols=max(1, len(tasks)), subplot_titles=[SHORT[t] for t in tasks], shared_yaxes=True,
                        horizontal_spacing=0.04)
    colors = {"teacher": "black", **{m: PALETTE[i % len(PALETTE)] for i, m in enumerate(models)}}
    for k, t in enumerate(tasks, 1):
        for name, g, dash in [("teacher", d[(d.model == "teacher") & d.source.isin(srcs) & (d.task == t)], "dash"),
                              *[(m, d[(d.model == m) & (d.task == t)], "solid") for m in models]]:
            if not len(g):
                continue
            s = _spread(g, "accuracy")
            fig.add_trace(go.Scatter(x=s.length, y=s["mean"], mode="lines+markers", name=name.replace(LEVERS, ""),
                                     legendgroup=name, showlegend=k == 1, line={"dash": dash, "color": colors[name]},
                                     error_y={"type": "data", "symmetric": False, "array": s["max"] - s["mean"],
                                              "arrayminus": s["mean"] - s["min"]}), row=1, col=k)
        ticks = sorted(set(d[d.task == t].length))
        fig.update_xaxes(type="log", tickvals=ticks, ticktext=[length_text(int(x)) for x in ticks], tickangle=0,
                         title="prompt length" if k == 1 else None, row=1, col=k)
    fig.update_yaxes(title="accuracy (unseen formats)", range=[0, 1.05], row=1, col=1)
    fig.update_layout(title="Accuracy against prompt length, unseen formats: student (default recipe; mean over seeds, "
                      "min–max) and teacher", width=330 * max(1, len(tasks)) + 220, height=440,
                      legend={"orientation": "h", "y": -0.2})
    return fig


def budget_figure(df: pd.DataFrame, tasks: Sequence[str] = ("niah_single", "niah_multikey"),
                  kinds: Sequence[str] = ("headwise", "layerwise", "hydra"), levers: str = LEVERS,
                  formats: str = "unseen", min_teacher: float = 0.2) -> Any:
    """Question 3: retention against the FA share 1 / (R + 1) of the arms ``KIND-Rto1`` + ``levers``, one panel per
    task, a line per (kind, length): mean over seeds, min–max bars; cells whose teacher accuracy is below
    ``min_teacher`` are left out (their retention is noise)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = []
    for r in df[(df.formats == formats) & (df.teacher_accuracy >= min_teacher)].itertuples():
        b = arm_budget(r.model)
        if b and b[0] in kinds and b[2] == levers and r.task in tasks:
            rows.append({"kind": b[0], "ratio": b[1], "fa_share": 1 / (b[1] + 1), "task": r.task, "length": r.length,
                         "retention": r.retention})
    d = pd.DataFrame(rows, columns=["kind", "ratio", "fa_share", "task", "length", "retention"])
    fig = make_subplots(rows=1, cols=len(tasks), subplot_titles=[SHORT[t] for t in tasks], shared_yaxes=True)
    dashes = {"headwise": "solid", "layerwise": "dash", "hydra": "dot"}
    lengths = sorted(set(d.length))
    for k, t in enumerate(tasks, 1):
        for (kind, L), g in d[d.task == t].groupby(["kind", "length"], sort=True):
            s = g.groupby("fa_share").retention.agg(["mean", "min", "max"]).reset_index().sort_values("fa_share")
            name = f"{kind}, {length_text(int(L))}"
            fig.add_trace(go.Scatter(x=s.fa_share, y=s["mean"], mode="lines+markers", name=name, legendgroup=name,
                                     showlegend=k == 1, line={"dash": dashes.get(kind, "dashdot"),
                                                              "color": PALETTE[lengths.index(L) % len(PALETTE)]},
                                     error_y={"type": "data", "symmetric": False, "array": s["max"] - s["mean"],
                                              "arrayminus": s["mean"] - s["min"]}), row=1, col=k)
        ratios = sorted(set(d.ratio), reverse=True)
        fig.update_xaxes(type="log", title="FA share of heads, 1 / (R + 1)", tickvals=[1 / (r + 1) for r in ratios],
                         ticktext=[f"{r}:1 ({100 / (r + 1):.3g} %)" for r in ratios], row=1, col=k)
    fig.add_hline(y=0.9, line_dash="dot", annotation_text="0.9")
    fig.update_yaxes(title="retention (student ÷ teacher)", row=1, col=1)
    fig.update_layout(title="Retention against the FA budget: head-wise vs layer-wise at the same KV-cache share "
                            f"(cells with teacher ≥ {min_teacher})", width=520 * len(tasks) + 200, height=460)
    return fig


def gemma_figure(df: pd.DataFrame, prefix: str = "gemma-", formats: str = "unseen") -> Any:
    """Question 4: accuracy per (task, length) of Gemma 3 270M's arms (models named ``prefix``...) and the teacher of
    their eval folders, grouped bars (mean over seeds, min–max)."""
    import plotly.graph_objects as go

    d = df[df.formats == formats]
    arms = sorted(m for m in set(d.model) if m.startswith(prefix))
    srcs = set(d[d.model.isin(arms)].source)
    d = d[d.model.isin(arms) | ((d.model == "teacher") & d.source.isin(srcs))]
    cells = sorted({(t, int(L)) for t, L in zip(d.task, d.length)}, key=lambda c: (TASKS.index(c[0]) if c[0] in TASKS
                                                                                   else 99, c[1]))
    x = [f"{SHORT.get(t, t)} {length_text(L)}" for t, L in cells]
    fig = go.Figure()
    for m in ["teacher", *arms]:
        g = d[d.model == m].groupby(["task", "length"]).accuracy.agg(["mean", "min", "max"])
        y = [g.loc[c, "mean"] if c in g.index else None for c in cells]
        hi = [g.loc[c, "max"] - g.loc[c, "mean"] if c in g.index else None for c in cells]
        lo = [g.loc[c, "mean"] - g.loc[c, "min"] if c in g.index else None for c in cells]
        fig.add_trace(go.Bar(x=x, y=y, name=m.replace(LEVERS, ""), error_y={"type": "data", "symmetric": False,
                                                                            "array": hi, "arrayminus": lo}))
    fig.update_layout(barmode="group", title="Gemma 3 270M: head-wise vs layer-wise at the same KV-cache share, and the "
                      "teacher (unseen formats; mean over seeds, min–max)", yaxis={"title": "accuracy", "range": [0, 1.05]},
                      width=max(700, 60 * len(x) * (1 + len(arms))), height=460)
    return fig


def _cells(path: Optional[Path]) -> dict[tuple, list[int]]:
    """Per-prompt outcomes of ``cli_cells.jsonl.gz`` keyed (source, model, seed, tokens, task, formats, length)."""
    if path is None or not Path(path).exists():
        return {}
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        cells = [json.loads(line) for line in fh if line.strip()]
    return {(c.get("source", "cli"), c["model"], int(c["seed"]), int(c["tokens"]), c["task"], c["formats"],
             int(c["length"])): c["correct"] for c in cells}


def paired_table(df: pd.DataFrame, pairs: Sequence[tuple[str, str]] = PAIRS, cells: Optional[dict] = None,
                 alpha: float = 0.05) -> pd.DataFrame:
    """Each (lever, reference) of ``pairs`` on every (source, task, formats, length) where both have rows: the seeds
    both were trained on (the teacher: its one row beside every seed of the lever; otherwise the same tokens), their
    accuracies, the differences lever − reference per seed, their mean, the paired t-test across seeds (p_seeds; NaN with
    one seed or with differences that do not vary, where the test is undefined) and, where ``cells`` holds both sides'
    per-prompt outcomes, McNemar's exact test on the prompts pooled over the seeds. ``moved``: p_seeds < alpha with at
    least two seeds. Columns :data:`PAIRED_COLUMNS`."""
    from scipy.stats import ttest_rel

    from headscope.evaluation.accuracy import paired_exact_test

    cells = cells or {}
    out = []
    key = ["source", "task", "formats", "length"]
    for lever, ref in pairs:
        a_rows, b_rows = df[df.model == lever], df[df.model == ref]
        for k, ga in a_rows.groupby(key, sort=True):
            gb = b_rows[(b_rows[key] == pd.Series(k, index=key)).all(axis=1)]
            if not len(gb):
                continue
            if ref == "teacher":
                t = gb.iloc[0]
                matched = [(r.seed, r.tokens, r.accuracy, int(t.seed), int(t.tokens), t.accuracy) for r in ga.itertuples()]
            else:
                by = {(int(r.seed), int(r.tokens)): r.accuracy for r in gb.itertuples()}
                matched = [(r.seed, r.tokens, r.accuracy, r.seed, r.tokens, by[(int(r.seed), int(r.tokens))])
                           for r in ga.itertuples() if (int(r.seed), int(r.tokens)) in by]
            if not matched:
                continue
            matched.sort()
            a = np.array([m[2] for m in matched], float)
            b = np.array([m[5] for m in matched], float)
            diff = a - b
            p = float("nan")
            if len(diff) >= 2 and np.ptp(diff) > 0:
                p = float(ttest_rel(a, b).pvalue)
            x, y = [], []
            for sa, ta, _, sb, tb, _ in matched:
                ca, cb = cells.get((k[0], lever, int(sa), int(ta), *k[1:])), cells.get((k[0], ref, int(sb), int(tb), *k[1:]))
                if ca is None or cb is None or len(ca) != len(cb):
                    x = y = None
                    break
                x += ca
                y += cb
            mc = paired_exact_test(x, y) if x else None
            out.append({"lever": lever, "reference": ref, "source": k[0], "task": k[1], "formats": k[2],
                        "length": int(k[3]), "seeds": " ".join(str(int(m[0])) for m in matched),
                        "lever_accuracy": float(a.mean()), "reference_accuracy": float(b.mean()),
                        "differences": " ".join(f"{v:+.2f}" for v in diff), "mean_difference": float(diff.mean()),
                        "p_seeds": p, "n_prompts": mc["n"] if mc else None, "only_lever": mc["only_a"] if mc else None,
                        "only_reference": mc["only_b"] if mc else None, "p_prompts": mc["p_value"] if mc else None,
                        "moved": bool(len(diff) >= 2 and p == p and p < alpha)})
    return pd.DataFrame(out, columns=PAIRED_COLUMNS)


def paired_text(t: pd.DataFrame) -> str:
    """The paired table as text (one line per lever and cell; the arms without the default levers' suffix)."""
    if not len(t):
        return "no lever shares a cell with its reference yet"
    v = t.assign(lever=t.lever.str.replace(LEVERS, "", regex=False),
                 reference=t.reference.str.replace(LEVERS, "", regex=False), length=t.length.map(length_text))
    cols = ["lever", "reference", "source", "task", "length", "seeds", "differences", "mean_difference", "p_seeds",
            "p_prompts", "moved"]
    return v[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}")


def build(retention: Path, out: Path, cells: Optional[Path] = None, pairs: Sequence[tuple[str, str]] = PAIRS,
          formats: Sequence[str] = ("html", "png"), alpha: float = 0.05, min_teacher: float = 0.2) -> dict[str, Any]:
    """Every figure and the paired table from ``retention`` into ``out`` (see the module docstring).
    Returns {"figures": {name: paths}, "paired": the table}."""
    from headscope.plots import save_figures

    df = read_retention(retention)
    out.mkdir(parents=True, exist_ok=True)
    figs = {"long_context": long_context_figure(df), "budget_curve": budget_figure(df, min_teacher=min_teacher),
            "gemma3": gemma_figure(df)}
    paths = save_figures(figs, out, formats)
    t = paired_table(df, pairs, _cells(cells), alpha)
    t.to_csv(out / "paired.csv", index=False)
    return {"figures": paths, "paired": t}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--retention", type=Path, default=HERE / "retention.csv")
    p.add_argument("--out", type=Path, default=HERE / "figures")
    p.add_argument("--cells", type=Path, default=None, help="per-prompt cells (records/cli_cells.jsonl.gz): McNemar's p")
    p.add_argument("--pair", action="append", default=None,
                   help="LEVER,REFERENCE: two model labels (repeatable; default: issue 62's, PAIRS)")
    p.add_argument("--formats", default="html,png", help="figure files: html, png, svg, pdf")
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--min-teacher", type=float, default=0.2, help="budget curve: cells whose teacher is below this")
    a = p.parse_args(argv)
    pairs = [tuple(x.split(",")) for x in a.pair] if a.pair else PAIRS
    if any(len(x) != 2 for x in pairs):
        raise SystemExit("--pair LEVER,REFERENCE: a lever's label and its reference's, e.g. "
                         f"'headwise-7to1{LEVERS},layerwise-7to1{LEVERS}'")
    res = build(a.retention, a.out, a.cells, pairs, tuple(a.formats.split(",")), a.alpha, a.min_teacher)
    for name, ps in res["figures"].items():
        print(f"{name}: {', '.join(str(x) for x in ps)}")
    print(paired_text(res["paired"]))
    print(f"paired table: {a.out / 'paired.csv'}", flush=True)


if __name__ == "__main__":
    main()
