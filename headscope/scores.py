"""Scores and the Ranking: per-head IE statistics -> a table, a HeadMask, saved results.

Receivers only: the score of a head is its mean receiver IE over the used calibration pairs.
With senders, κ (computed by :mod:`headscope.analysis.kappa`) or several capabilities, :func:`fused_table` implements SPEC.md §6 (eq. 11, 12):
s_h^(c) = max(IE_recv, IE_send)·κ_h^(c), ŝ normalized per capability, S_h = Σ_c w_c ŝ_h^(c).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from .errors import HeadscopeInputError, InputFileNotFoundError
from .masks import Budget, HeadMask
from .runtime import atomic_torch_save, atomic_write_text


def head_table(ie: Float[Tensor, "pair layer head"], n_kv_heads: int) -> pd.DataFrame:
    """One row per (layer, head): mean and std of IE over pairs (NaN rows of skipped pairs ignored).

    Columns: layer, head, kv_group, ie_recv, ie_recv_std, n_pairs, score, rank (1 = most important).
    """
    x = ie.double().numpy()
    n_pairs, n_layers, n_heads = x.shape
    used = ~np.isnan(x).all(axis=(1, 2))
    xu = x[used]
    mean = xu.mean(0)
    std = xu.std(0, ddof=1) if xu.shape[0] > 1 else np.full_like(mean, np.nan)  # one pair: no spread
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

    def __repr__(self) -> str:
        p = self.provenance
        top = ", ".join(f"L{int(r.layer)}H{int(r.head)}" for r in self.top(5).itertuples())
        return (
            f"Ranking({p.get('model', '?')}, tasks={p.get('tasks')}, n_pairs={p.get('n_pairs')}, "
            f"{self.n_layers}x{self.n_heads} heads, top: {top})"
        )

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

    def mask(self, budget: Budget, min_per_layer: int = 1, raise_budget: bool = False) -> HeadMask:
        """FA heads for a budget (count, fraction or "LA:FA"), ≥ ``min_per_layer`` per layer.

        ``raise_budget``: a budget too small for ``min_per_layer`` in every layer is raised to the
        smallest that fits, with a warning recorded in the mask (see :meth:`HeadMask.select`).

        Raises:
            ValueError: budget above the head count, a ratio leaving no FA head, or (without
                ``raise_budget``) a budget too small for ``min_per_layer`` in every layer.
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
            self.matrix("score"), budget, int(self.geometry["n_kv_heads"]), min_per_layer=min_per_layer,
            meta={"budget": budget, **meta}, raise_budget=raise_budget,
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
            atomic_torch_save(d / "ie.pt", self.ie)
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "Ranking":
        """Read a directory written by :meth:`save`.

        Raises:
            InputFileNotFoundError (a FileNotFoundError and HeadscopeInputError): the directory or
                one of its files (scores.csv, ranking.json) is missing; the message names it.
            HeadscopeInputError: ``directory`` is a file, or a file is unreadable / of another format.
        """
        d = Path(directory).expanduser()
        fix = f"is {d} a directory written by `headscope rank` / Ranking.save?"
        if not d.exists():
            raise InputFileNotFoundError(f"run directory {d} is missing (no such directory); pass a directory written "
                                         "by `headscope rank` / Ranking.save")
        if not d.is_dir():
            raise HeadscopeInputError(f"{d} is a file, not a run directory; pass the directory `headscope rank` wrote")
        for f in ("scores.csv", "ranking.json"):
            if not (d / f).is_file():
                raise InputFileNotFoundError(f"{d / f} is missing; {fix}")
        try:
            meta = json.loads((d / "ranking.json").read_text())
            geometry = meta["geometry"]
            df = pd.read_csv(d / "scores.csv")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, pd.errors.ParserError) as e:
            raise HeadscopeInputError(f"{d} holds an unreadable ranking ({type(e).__name__}: {e}); {fix}") from None
        missing = [c for c in ("layer", "head") if c not in df.columns]
        if missing:
            raise HeadscopeInputError(f"{d / 'scores.csv'} lacks the columns {missing}; {fix}")
        ie = torch.load(d / "ie.pt") if (d / "ie.pt").exists() else None
        return cls(df, geometry, meta.get("provenance", {}), ie, meta.get("extras", {}))


# ---- SPEC.md §6: κ, per-capability scores and fusion (eq. 11, 12) -----------------------------
NORMALIZE = ("max", "minmax")
KAPPA = ("focus", "one")


def capability_score(
    ie_recv: Float[Tensor, "layer head"],
    ie_send: Float[Tensor, "layer head"] | None = None,
    kappa: Float[Tensor, "layer head"] | None = None,
) -> Float[Tensor, "layer head"]:
    """s_h^(c) = max(IE_recv, IE_send) · κ (SPEC.md §6, eq. 11); a missing IE_send / κ counts as −inf / 1."""
    s = ie_recv.double() if ie_send is None else torch.maximum(ie_recv.double(), ie_send.double())
    return s if kappa is None else s * kappa.double()


def normalize_score(s: Float[Tensor, "layer head"], how: str = "max") -> Float[Tensor, "layer head"]:
    """ŝ: ``"max"`` (default) divides by the largest score over heads; ``"minmax"`` maps to [0, 1].

    Raises:
        HeadscopeInputError (a ValueError): an unknown ``how``; ``"max"`` when no head has a positive
            score; ``"minmax"``
            when every head has the same score.
    """
    if how not in NORMALIZE:
        raise HeadscopeInputError(f"normalize={how!r} is not one of {NORMALIZE}")
    s = s.double()
    hi, lo = float(torch.nan_to_num(s, nan=-math.inf).max()), float(torch.nan_to_num(s, nan=math.inf).min())
    if how == "max":
        if not hi > 0:
            raise HeadscopeInputError(f"no head has a positive score (max {hi:.3g}); max-normalization is undefined, use 'minmax'")
        return s / hi
    if not hi > lo:
        raise HeadscopeInputError("every head has the same score; min-max normalization is undefined, use 'max'")
    return (s - lo) / (hi - lo)


def check_weights(weights: Any, tasks: Sequence[str]) -> dict[str, float]:
    """Capability weights w_c (SPEC.md §6, eq. 12): None = uniform; a sequence in task order or a dict.

    Raises:
        HeadscopeInputError (a ValueError): a count or keys that do not match the tasks, a negative
            weight, or weights
            that do not sum to 1 (within 1e-6).
    """
    tasks = list(tasks)
    if weights is None:
        return {t: 1.0 / len(tasks) for t in tasks}
    if isinstance(weights, dict):
        if set(weights) != set(tasks):
            raise HeadscopeInputError(f"weights are given for {sorted(weights)} but the tasks are {tasks}; give one weight per task")
        w = {t: float(weights[t]) for t in tasks}
    else:
        ws = [float(v) for v in weights]
        if len(ws) != len(tasks):
            raise HeadscopeInputError(f"{len(ws)} weight(s) for {len(tasks)} task(s) {tasks}; give one weight per task, in task order")
        w = dict(zip(tasks, ws))
    if any(not (v >= 0) for v in w.values()):
        raise HeadscopeInputError(f"weights {w} must be non-negative")
    total = sum(w.values())
    if abs(total - 1.0) > 1e-6:
        raise HeadscopeInputError(f"weights {w} sum to {total:.6g}, not 1; rescale them so that they sum to 1")
    return w


def fused_table(
    per_task: dict[str, dict[str, Any]],
    n_kv_heads: int,
    weights: dict[str, float],
    normalize: str = "max",
) -> pd.DataFrame:
    """The fused ranking table (SPEC.md §6).

    Args:
        per_task: for each capability c, ``{"ie": Float[Tensor, "pair layer head"] receiver IE,
            "ie_send": Float[Tensor, "layer head"] or None, "kappa": Float[Tensor, "layer head"] or None}``.
        weights: w_c (see :func:`check_weights`); normalize: ŝ (see :func:`normalize_score`).

    Returns:
        DataFrame with layer, head, kv_group, ie_recv, ie_recv_std, n_pairs (receiver statistics; with
        several capabilities ie_recv is the w-weighted mean and per-capability ``ie_recv_<c>``,
        ``ie_send_<c>``, ``kappa_<c>`` are added), ie_send, kappa (likewise), one ``s_<c>`` per
        capability (ŝ, normalized), score S_h = Σ_c w_c ŝ_h^(c), rank.
    """
    tasks = list(per_task)
    multi = len(tasks) > 1
    df = None
    fused = None
    recv_w = send_w = kap_w = None
    n_pairs = 0
    for c in tasks:
        d = per_task[c]
        t = head_table(d["ie"], n_kv_heads)
        shape = (t["layer"].max() + 1, t["head"].max() + 1)
        recv = torch.tensor(t["ie_recv"].to_numpy()).view(*shape)
        send = d.get("ie_send")
        kap = d.get("kappa")
        s_hat = normalize_score(capability_score(recv, send, kap), normalize)
        n_pairs += int(t["n_pairs"].iloc[0])
        send_v = (send.double() if send is not None else torch.full(shape, math.nan, dtype=torch.float64))
        kap_v = (kap.double() if kap is not None else torch.ones(shape, dtype=torch.float64))
        w = weights[c]
        if df is None:
            df = t.drop(columns=["score", "rank"]).copy()
            if multi:
                df["ie_recv_std"] = math.nan
            recv_w, send_w, kap_w, fused = w * recv, w * send_v, w * kap_v, w * s_hat
        else:
            recv_w, send_w, kap_w, fused = recv_w + w * recv, send_w + w * send_v, kap_w + w * kap_v, fused + w * s_hat
        if multi:
            df[f"ie_recv_{c}"] = recv.flatten().numpy()
            df[f"ie_send_{c}"] = send_v.flatten().numpy()
            df[f"kappa_{c}"] = kap_v.flatten().numpy()
        df[f"s_{c}"] = s_hat.flatten().numpy()
    assert df is not None and fused is not None
    if multi:
        df["ie_recv"] = recv_w.flatten().numpy()
    df["n_pairs"] = n_pairs
    df["ie_send"] = send_w.flatten().numpy()
    df["kappa"] = kap_w.flatten().numpy()
    df["score"] = fused.flatten().numpy()
    return add_rank(df)
