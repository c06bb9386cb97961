"""Scores and the Ranking: per-head IE statistics -> a table, a HeadMask, saved results.

For receivers only (this version) the score of a head is its mean receiver IE over the used
calibration pairs; SPEC.md §6's full fusion (senders, κ, capabilities) extends this table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from .masks import Budget, HeadMask
from .patching.store import atomic_write_text


def head_table(ie: Float[Tensor, "pair layer head"], n_kv_heads: int) -> pd.DataFrame:
    """One row per (layer, head): mean and std of IE over pairs (NaN rows of skipped pairs ignored).

    Columns: layer, head, kv_group, ie_recv, ie_recv_std, n_pairs, score, rank (1 = most important).
    """
    x = ie.double().numpy()
    n_pairs, n_layers, n_heads = x.shape
    used = ~np.isnan(x).all(axis=(1, 2))
    xu = x[used]
    mean = xu.mean(0)
    std = xu.std(0, ddof=1) if xu.shape[0] > 1 else np.zeros_like(mean)
    layer, head = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    df = pd.DataFrame(
        {
            "layer": layer.ravel(),
            "head": head.ravel(),
            "kv_group": (head // (n_heads // n_kv_heads)).ravel(),
            "ie_recv": mean.ravel(),
            "ie_recv_std": std.ravel(),
            "n_pairs": int(used.sum()),
        }
    )
    df["score"] = df["ie_recv"]
    return add_rank(df)


def add_rank(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["rank"] = df["score"].rank(ascending=False, method="first").astype(int)
    return df


@dataclass
class Ranking:
    """The result of :func:`headscope.rank`.

    Attributes:
        scores: DataFrame, one row per (layer, head); columns at least
            ``layer, head, kv_group, ie_recv, ie_recv_std, score, rank``.
        geometry: n_layers, n_heads, n_kv_heads, d_head, d_model, n_ctx.
        provenance: model spec, headscope version, tasks and settings, seed, direction, λ, dtype, device.
        ie: Float[Tensor, "pair layer head"], the raw per-pair receiver IE (NaN rows = skipped pairs).
    """

    scores: pd.DataFrame
    geometry: dict[str, int]
    provenance: dict[str, Any] = field(default_factory=dict)
    ie: Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return int(self.geometry["n_layers"])

    @property
    def n_heads(self) -> int:
        return int(self.geometry["n_heads"])

    def matrix(self, column: str = "score") -> np.ndarray:
        """Float[ndarray, "layer head"] of a score column."""
        m = np.full((self.n_layers, self.n_heads), np.nan)
        m[self.scores["layer"].to_numpy(), self.scores["head"].to_numpy()] = self.scores[column].to_numpy()
        return m

    def top(self, k: int = 10) -> pd.DataFrame:
        """The k best heads, best first."""
        return self.scores.sort_values("rank").head(k).reset_index(drop=True)

    def mask(self, budget: Budget, min_per_layer: int = 1) -> HeadMask:
        """FA heads for a budget (count, fraction or "LA:FA"), ≥ ``min_per_layer`` per layer.

        Raises:
            ValueError: budget above the head count, a ratio leaving no FA head, or a budget too
                small for ``min_per_layer`` in every layer.
        """
        meta = {
            "model": self.provenance.get("model"),
            "tasks": self.provenance.get("tasks"),
            "n_pairs": self.provenance.get("n_pairs"),
            "seed": self.provenance.get("seed"),
            "score": self.provenance.get("score", "ie_recv"),
            "provenance": self.provenance,
        }
        return HeadMask.select(
            self.matrix("score"), budget, int(self.geometry["n_kv_heads"]), min_per_layer=min_per_layer, meta={"budget": budget, **meta}
        )

    def heatmap(self, column: str = "score", title: str | None = None) -> Any:
        """Plotly layer × head heatmap of a score column (see :func:`headscope.plots.heatmap`)."""
        from .plots import heatmap

        return heatmap(self, column=column, title=title)

    # ---- persistence ------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write scores.csv, ranking.json (geometry + provenance) and ie.pt into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / "scores.csv", self.scores.to_csv(index=False))
        meta = {"format": "headscope.Ranking/1", "geometry": self.geometry, "provenance": self.provenance,
                "extras": self.extras}
        atomic_write_text(d / "ranking.json", json.dumps(meta, indent=2, default=str))
        if self.ie is not None:
            torch.save(self.ie, d / "ie.pt")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "Ranking":
        """Read a directory written by :meth:`save`. Raises FileNotFoundError naming the missing file."""
        d = Path(directory)
        for f in ("scores.csv", "ranking.json"):
            if not (d / f).exists():
                raise FileNotFoundError(f"{d / f} is missing; is {d} a directory written by Ranking.save?")
        meta = json.loads((d / "ranking.json").read_text())
        ie = torch.load(d / "ie.pt") if (d / "ie.pt").exists() else None
        return cls(pd.read_csv(d / "scores.csv"), meta["geometry"], meta.get("provenance", {}), ie, meta.get("extras", {}))
