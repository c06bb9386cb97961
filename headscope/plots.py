"""Plotly figures."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go


def heatmap(ranking: Any, column: str = "score", title: str | None = None) -> go.Figure:
    """Layer × head heatmap of ``ranking.scores[column]`` with hover text (rank, IE ± std, KV group)."""
    m = ranking.matrix(column)
    df = ranking.scores.set_index(["layer", "head"])
    n_layers, n_heads = m.shape
    text = np.empty((n_layers, n_heads), dtype=object)
    for (layer, head), row in df.iterrows():
        parts = [f"L{layer}H{head} (KV group {row['kv_group']})", f"rank {row['rank']}", f"{column} {row[column]:.4f}"]
        if "ie_recv_std" in row:
            parts.append(f"IE {row['ie_recv']:.4f} ± {row['ie_recv_std']:.4f}")
        text[layer, head] = "<br>".join(parts)
    fig = go.Figure(
        go.Heatmap(
            z=m,
            x=[f"H{h}" for h in range(n_heads)],
            y=[f"L{layer}" for layer in range(n_layers)],
            text=text,
            hoverinfo="text",
            colorscale="RdBu_r",
            zmid=0.0,
            colorbar={"title": column},
        )
    )
    model = ranking.provenance.get("model", "")
    fig.update_layout(
        title=title or f"{column} per head — {model}",
        xaxis_title="head",
        yaxis_title="layer",
        yaxis={"autorange": "reversed"},
        height=max(300, 22 * n_layers + 120),
        width=max(400, 60 * n_heads + 200),
    )
    return fig
