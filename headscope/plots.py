"""Plotly figures."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go


def heatmap(ranking: Any, column: str = "score", title: str | None = None) -> go.Figure:
    """Layer × head heatmap of ``ranking.scores[column]`` with hover text (value, ± std over pairs
    for IE columns, rank by value); see :func:`matrix_heatmap`."""
    std = ranking.matrix("ie_recv_std") if column in ("ie_recv", "score") and "ie_recv_std" in ranking.scores else None
    model = ranking.provenance.get("model", "")
    return matrix_heatmap(ranking.matrix(column), column, title=title or f"{column} per head — {model}", std=std)


def matrix_heatmap(
    m: np.ndarray,
    label: str,
    title: str | None = None,
    std: np.ndarray | None = None,
    colorscale: str = "RdBu_r",
) -> go.Figure:
    """Layer × head heatmap of any Float[ndarray, "layer head"] (e.g. DLA) with hover text
    (head, value, ± std across pairs when given, rank by value)."""
    m = np.asarray(m, dtype=float)
    n_layers, n_heads = m.shape
    order = (-np.nan_to_num(m, nan=-np.inf)).ravel().argsort(kind="stable")
    rank = np.empty(m.size, dtype=int)
    rank[order] = np.arange(1, m.size + 1)
    rank = rank.reshape(m.shape)
    text = np.empty((n_layers, n_heads), dtype=object)
    for layer in range(n_layers):
        for head in range(n_heads):
            s = f"L{layer}H{head}<br>{label} {m[layer, head]:.4f}"
            if std is not None:
                s += f" ± {std[layer, head]:.4f}"
            text[layer, head] = s + f"<br>rank {rank[layer, head]}"
    fig = go.Figure(
        go.Heatmap(
            z=m,
            x=[f"H{h}" for h in range(n_heads)],
            y=[f"L{layer}" for layer in range(n_layers)],
            text=text,
            hoverinfo="text",
            colorscale=colorscale,
            zmid=0.0,
            colorbar={"title": label},
        )
    )
    fig.update_layout(
        title=title or label,
        xaxis_title="head",
        yaxis_title="layer",
        yaxis={"autorange": "reversed"},
        height=max(300, 22 * n_layers + 120),
        width=max(400, 60 * n_heads + 200),
    )
    return fig


def gini_bars(gini: dict, title: str = "per-layer Gini of head importance") -> go.Figure:
    """Bars of the per-layer Gini coefficient (``headscope.analysis.anatomy.layer_gini`` output), with the
    mean as a dashed line."""
    per = [np.nan if v is None else v for v in gini["per_layer"]]
    fig = go.Figure(
        go.Bar(
            x=list(range(len(per))),
            y=per,
            hovertemplate="layer %{x}<br>Gini %{y:.3f}<extra></extra>",
            name="Gini",
        )
    )
    fig.add_hline(y=gini["mean"], line_dash="dash", annotation_text=f"mean {gini['mean']:.3f}")
    fig.update_layout(title=title, xaxis_title="layer", yaxis_title="Gini", yaxis_range=[0, 1], width=800, height=400)
    return fig


def stability_plot(curve: Any, target: float = 0.9, title: str | None = None) -> go.Figure:
    """Spearman ρ vs number of calibration pairs n (``headscope.analysis.anatomy.stability_curve``), with the
    replicate percentile band, the target line and, when the curve has ``noise_*`` columns, the
    same curve on head-shuffled IE (noise baseline) with its band."""
    n = curve["n"].tolist()
    fig = go.Figure()
    series = [("", "mean ρ", "31,119,180")]
    if "noise_rho_mean" in curve:
        series.append(("noise_", "noise baseline (heads shuffled per pair)", "127,127,127"))
    for prefix, name, rgb in series:
        fig.add_trace(
            go.Scatter(
                x=n + n[::-1],
                y=curve[f"{prefix}rho_hi"].tolist() + curve[f"{prefix}rho_lo"].tolist()[::-1],
                fill="toself",
                fillcolor=f"rgba({rgb},0.2)",
                line={"width": 0},
                hoverinfo="skip",
                name="replicate band (2.5–97.5 %)" if not prefix else f"{name}: band",
                showlegend=not prefix,
            )
        )
        fig.add_trace(
            go.Scatter(
                x=n,
                y=curve[f"{prefix}rho_mean"],
                mode="lines+markers",
                name=name,
                line={"color": f"rgb({rgb})", "dash": "dash" if prefix else "solid"},
                customdata=np.stack([curve[f"{prefix}rho_lo"], curve[f"{prefix}rho_hi"]], -1),
                hovertemplate="n=%{x}<br>ρ=%{y:.3f} [%{customdata[0]:.3f}, %{customdata[1]:.3f}]<extra>" + name + "</extra>",
            )
        )
    if "topk_overlap" in curve:
        k = int(curve["top_k"].iloc[0])
        fig.add_trace(
            go.Scatter(
                x=n,
                y=curve["topk_overlap"],
                mode="lines+markers",
                line={"dash": "dot"},
                name=f"top-{k} overlap",
                hovertemplate=f"n=%{{x}}<br>share of the reference top-{k} found: %{{y:.2f}}<extra></extra>",
            )
        )
    fig.add_hline(y=target, line_dash="dash", annotation_text=f"ρ = {target}")
    if title is None:
        ref = f"{int(curve['n_ref'].iloc[0])} other pairs" if "n_ref" in curve else "reference pairs"
        title = f"ranking stability: Spearman ρ(n pairs, {ref})"
    fig.update_layout(
        title=title,
        xaxis_title="calibration pairs n",
        yaxis_title="Spearman ρ",
        width=700,
        height=420,
    )
    return fig


def cosine_matrix(c: np.ndarray, title: str = "layer-output cosine similarity, clean vs corrupted") -> go.Figure:
    """Heatmap of C[l, l'] = cos(clean layer l output, corrupted layer l' output)
    (``headscope.analysis.anatomy.layer_cosine``)."""
    c = np.asarray(c, dtype=float)
    L = c.shape[0]
    fig = go.Figure(
        go.Heatmap(
            z=c,
            x=list(range(L)),
            y=list(range(L)),
            colorscale="Viridis",
            colorbar={"title": "cos"},
            hovertemplate="clean L%{y} · corrupted L%{x}<br>cos %{z:.4f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis_title="corrupted run: layer",
        yaxis_title="clean run: layer",
        yaxis={"autorange": "reversed"},
        width=620,
        height=560,
    )
    return fig


def save_figure(fig: go.Figure, stem: Any, formats: Any = ("html", "png"), scale: float = 1.0) -> list:
    """Write ``fig`` to ``stem.html`` (self-contained but for plotly.js from the CDN) and/or
    ``stem.png`` (static export through kaleido, which needs a Chrome/Chromium on the machine:
    Debian ``apt-get install chromium``, or ``plotly_get_chrome``). One figure of :func:`save_figures`.

    Raises:
        InputRuntimeError (a RuntimeError and HeadscopeInputError): PNG requested but kaleido cannot
            find a browser (the message names the fix). HeadscopeInputError: an unknown format.
    """
    from pathlib import Path

    stem = Path(stem)
    return save_figures({stem.name: fig}, stem.parent, formats, scale)[stem.name]


def save_figures(figs: dict[str, go.Figure], directory: Any, formats: Any = ("html", "png"),
                 scale: float = 1.0) -> dict[str, list]:
    """Write each figure to ``directory/NAME.html`` and/or ``NAME.png`` / ``.svg`` / ``.pdf`` -> {name: paths}.

    The static files of all figures are exported in one kaleido call where plotly and kaleido >= 1 offer it
    (``plotly.io.write_images``: one browser for all of them; five anatomy figures 16.7 s one by one, 4.5 s
    together on a 2-core CPU, the same bytes), else one by one.

    Raises:
        InputRuntimeError (a RuntimeError and HeadscopeInputError): a static format requested but kaleido
            cannot find a browser (the message names the fix). HeadscopeInputError: an unknown format.
    """
    from pathlib import Path

    import plotly.io as pio

    from .errors import HeadscopeInputError, InputRuntimeError

    d = Path(directory)
    bad = [f for f in formats if f not in ("html", "png", "svg", "pdf")]
    if bad:
        raise HeadscopeInputError(f"unknown figure format {bad[0]!r}; use html, png, svg or pdf")
    out: dict[str, list] = {name: [d / f"{name}.{f}" for f in formats] for name in figs}
    static = [(fig, d / f"{name}.{f}") for name, fig in figs.items() for f in formats if f != "html"]
    for name, fig in figs.items():
        if "html" in formats:  # the same bytes on a rerun
            fig.write_html(str(d / f"{name}.html"), include_plotlyjs="cdn", div_id=f"headscope-{name}")
    if static:
        try:
            if _kaleido_batches():  # each figure's own layout size: write_images alone would draw every one at 700 x 500
                pio.write_images([fig for fig, _ in static], [str(p) for _, p in static], scale=scale,
                                 width=[fig.layout.width for fig, _ in static],
                                 height=[fig.layout.height for fig, _ in static])
            else:
                for fig, p in static:
                    fig.write_image(str(p), scale=scale)
        except Exception as e:  # kaleido's errors for a missing browser vary by version
            raise InputRuntimeError(
                f"static export to {static[0][1].parent} failed ({type(e).__name__}: {e}); kaleido >= 1 needs Chrome "
                "or Chromium: `apt-get install chromium` (Debian) or `plotly_get_chrome`, or save html only"
            ) from e
    return out


def _kaleido_batches() -> bool:
    """Whether ``plotly.io.write_images`` can export several figures in one call (plotly >= 6.1, kaleido >= 1)."""
    from importlib.metadata import PackageNotFoundError, version

    import plotly.io as pio

    try:
        return hasattr(pio, "write_images") and int(version("kaleido").split(".")[0]) >= 1
    except (PackageNotFoundError, ValueError):
        return False
