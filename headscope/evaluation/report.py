"""The report of ``headscope eval``: a markdown table and a self-contained plotly page, from retention_summary.csv.

Both read ``OUT/retention_summary.csv`` (:func:`headscope.evaluation.retention.retention_table`): one row per
model x cell with its accuracy (hits / n, 95 % Wilson interval), the teacher's on the same prompts and the
retention (accuracy / teacher accuracy, paired bootstrap interval), and the greedy-generation check.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

from ..runtime import atomic_write_text


def _num(v: Any) -> Optional[float]:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _fmt(v: Any, digits: int = 2) -> str:
    x = _num(v)
    return "–" if x is None else f"{x:.{digits}f}"


def report_markdown(summary: Any, teacher: str = "teacher", title: str = "Retrieval retention") -> str:
    """The markdown report of a retention summary (a pandas DataFrame of retention_summary.csv): per model other than
    ``teacher``, one table with a row per task x formats x length: accuracy (hits / n) with its 95 % Wilson
    interval, the teacher's accuracy on the same prompts, the retention with its paired bootstrap interval, and the
    generation agreement (prompts where free greedy generation's exact match equals teacher forcing's / prompts
    generated). With only the teacher stored, its own table."""
    lines = [f"# {title}", "",
             "Accuracy: teacher-forced greedy exact match of the answer (hits / n, 95 % Wilson interval). Retention: the "
             "model's accuracy / the teacher's on the same prompts (95 % paired bootstrap interval). Agreement: prompts "
             "where free greedy generation's exact match equals teacher forcing's, of those generated.", ""]
    models = [m for m in dict.fromkeys(summary["model"].tolist()) if m != teacher] or [teacher]
    for m in models:
        part = summary[summary["model"] == m].sort_values(["formats", "task", "length"])
        for (seed, tokens), g in part.groupby(["seed", "tokens"], sort=True):
            head = f"## {m}" + (f" (seed {seed}, {tokens:,} training tokens)" if int(tokens) else "")
            lines += [head, "", "| task | formats | length | n | accuracy | 95 % CI | teacher | retention | 95 % CI | agreement |",
                      "|---|---|---:|---:|---:|---|---:|---:|---|---:|"]
            for _, r in g.iterrows():
                ret = _num(r.get("retention"))
                ci = f"{_fmt(r.get('retention_lo'))}–{_fmt(r.get('retention_hi'))}" if ret is not None else "–"
                gen_n = int(_num(r.get("gen_n")) or 0)
                agree = f"{int(r['gen_agree'])}/{gen_n}" if gen_n else "–"
                lines.append(f"| {r['task']} | {r['formats']} | {int(r['length'])} | {int(r['n'])} | {_fmt(r['accuracy'])} | "
                             f"{_fmt(r['accuracy_lo'])}–{_fmt(r['accuracy_hi'])} | {_fmt(r.get('teacher_accuracy'))} | "
                             f"{_fmt(ret)} | {ci} | {agree} |")
            lines.append("")
    return "\n".join(lines)


def report_figure(summary: Any, teacher: str = "teacher", tasks: Optional[Sequence[str]] = None) -> Any:
    """Plotly figure: accuracy (95 % Wilson interval as error bars) against prompt length, one panel per task, one
    line per model x formats (the teacher dashed, beside the others)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    tasks = list(tasks or dict.fromkeys(summary["task"].tolist()))
    fig = make_subplots(rows=1, cols=len(tasks), subplot_titles=tasks, shared_yaxes=True)
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    keys = list(dict.fromkeys(zip(summary["model"], summary["seed"], summary["tokens"], summary["formats"])))
    labels = {k: f"{k[0]}" + (f" s{k[1]}" if len({(a, b, c) for a, b, c, _ in keys if a == k[0]}) > 1 else "")
              + f" ({k[3]})" for k in keys}
    for i, key in enumerate(keys):
        m, seed, tokens, fmt = key
        is_teacher = m == teacher
        for j, task in enumerate(tasks):
            g = summary[(summary["model"] == m) & (summary["seed"] == seed) & (summary["tokens"] == tokens)
                        & (summary["formats"] == fmt) & (summary["task"] == task)].sort_values("length")
            if not len(g):
                continue
            fig.add_trace(go.Scatter(
                x=g["length"], y=g["accuracy"], mode="lines+markers", name=labels[key], legendgroup=labels[key],
                showlegend=j == 0, line={"color": "#555555" if is_teacher else palette[i % len(palette)],
                                         "dash": "dash" if is_teacher else ("dot" if fmt == "seen" else "solid")},
                error_y={"type": "data", "symmetric": False, "array": g["accuracy_hi"] - g["accuracy"],
                         "arrayminus": g["accuracy"] - g["accuracy_lo"]},
                hovertemplate="%{x} tokens: %{y:.2f}<extra>" + labels[key] + "</extra>"), row=1, col=j + 1)
    fig.update_xaxes(type="log", title_text="prompt length (tokens)", tickvals=sorted(set(summary["length"])))
    fig.update_yaxes(range=[0, 1.05], title_text="accuracy", row=1, col=1)
    fig.update_layout(title="Retrieval accuracy against prompt length (teacher dashed; 95 % Wilson intervals)",
                      height=420, width=max(600, 330 * len(tasks)))
    return fig


def write_report(out: str | Path, teacher: str = "teacher") -> dict[str, Path]:
    """OUT/report.md and OUT/report.html (self-contained: plotly.js inlined, works offline) from
    OUT/retention_summary.csv. Returns the paths written (report.html left out where plotly is missing)."""
    import pandas as pd

    out = Path(out)
    summary = pd.read_csv(out / "retention_summary.csv")
    written = {"md": out / "report.md"}
    atomic_write_text(written["md"], report_markdown(summary, teacher))
    try:
        fig = report_figure(summary, teacher)
    except ImportError:
        return written
    html = fig.to_html(include_plotlyjs=True, full_html=True)
    atomic_write_text(out / "report.html", html)
    written["html"] = out / "report.html"
    return written
