"""Head anatomy (SPEC.md §7; paper section 5.7 and figure 2): how importance is spread over heads.

* :func:`critical_share` — share of heads whose IE exceeds a threshold (default 0.1), and the share
  that is safely convertible (|IE| ≤ threshold), per capability and fused.
* :func:`gini` / :func:`layer_gini` — per-layer Gini coefficient of head importance.
* :func:`stability_curve` — Spearman ρ between the ranking from n calibration pairs and the ranking
  from a reference of other pairs (random disjoint splits, or a held-out set), with the same curve on
  head-shuffled IE as a noise baseline; :func:`n_for_rho` — the smallest n with ρ ≥ 0.9.
* :func:`direct_logit_attribution` — each head's direct contribution to m = a⁺ − a⁻ (eq. 9 weights)
  through its o_proj slice, the frozen final-norm scale and the unembedding (figure 2a).
* :func:`layer_cosine` — cosine similarity of layer outputs of the clean and corrupted runs across
  depth (figure 2b).
* :func:`anatomy` — all of it for a :class:`~headscope.scores.Ranking`, as an :class:`Anatomy`
  (``.to_dict()``, ``.figures()``, ``.save(dir)``).

Paper figures to compare against: 29 of 448 heads (≈ 6.5 %) critical, ≈ 90.8 % safely convertible;
Gini mean 0.622, range 0.399–0.915; ρ ≈ 0.921 after 6 calibration pairs.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from .dla import DLA, direct_logit_attribution, layer_cosine  # noqa: F401  (re-exported)
from ..errors import HeadscopeInputError
from ..readout import DEFAULT_LAMBDA
from .stability import (  # noqa: F401  (re-exported)
    DEFAULT_RHO_TARGET,
    PAPER_RHO_AT_6,
    Reference,
    n_for_rho,
    spearman_rows,
    stability_at,
    stability_curve,
    stability_samples,
    stability_splits,
)
from ..validate import check_choice, check_device, check_int, check_out_dir, check_real

DEFAULT_THRESHOLD = 0.1
PAPER = {
    "critical_share": 29 / 448,
    "convertible_share": 0.908,
    "gini_mean": 0.622,
    "gini_min": 0.399,
    "gini_max": 0.915,
    "rho_at_6": PAPER_RHO_AT_6,
}
Negative = Literal["abs", "clip", "raise"]
# (default) Gini of importance clips negative IE at 0: the paper states IE ∈ [0, 1] (eq. 10), i.e. a
# head's importance is the share of the gap its patch removes, never below "no effect". The paper does
# not say how its Gini treats negative IE; "abs" (magnitude of the effect) is the other reading, and
# anatomy() reports it too. On [-1, 0.5, 0.5, 2]: clip 0.5, abs 0.3125.
DEFAULT_NEGATIVE: Negative = "clip"
NEGATIVE_NOTE = {
    "clip": "negative IE clipped to 0 (the paper's IE range [0, 1], eq. 10)",
    "abs": "negative IE replaced by its magnitude",
    "raise": "no negative values allowed",
}


# ---- critical heads ----------------------------------------------------------------------------
def importance_columns(scores: pd.DataFrame) -> list[str]:
    """The columns of a score table that anatomy reports on: ``s_<capability>`` (one per
    capability, when present), ``ie_recv`` and ``score`` (the fused score)."""
    cols = [c for c in scores.columns if c.startswith("s_")]
    cols += [c for c in ("ie_recv", "score") if c in scores.columns]
    return cols


def critical_share(
    values: Float[np.ndarray, "n"] | pd.Series | Sequence[float],
    threshold: float = DEFAULT_THRESHOLD,
    convertible_threshold: float | None = None,
) -> dict[str, float]:
    """Share of heads that are causally critical and share that are safely convertible.

    critical: value > ``threshold``; safely convertible (default reading): |value| ≤
    ``convertible_threshold`` (default: ``threshold``) — a head whose patch moves m by at most that
    fraction of the clean–corrupt gap in either direction. Heads with value < −threshold (the patch
    *raises* m) are neither and are counted as ``n_negative``. NaN values raise.

    Returns:
        dict with n_heads, n_critical, n_convertible, n_negative, critical_share, convertible_share.

    Raises:
        ValueError: empty input, NaN values, or a negative threshold.
    """
    x = np.asarray(values, dtype=float).ravel()
    if x.size == 0:
        raise ValueError("no head values given")
    if np.isnan(x).any():
        raise ValueError("head values contain NaN; drop skipped heads/pairs before computing shares")
    ct = threshold if convertible_threshold is None else convertible_threshold
    if threshold < 0 or ct < 0:
        raise ValueError(f"thresholds must be >= 0 (got {threshold}, {ct})")
    n = x.size
    n_crit = int((x > threshold).sum())
    n_conv = int((np.abs(x) <= ct).sum())
    return {
        "threshold": float(threshold),
        "convertible_threshold": float(ct),
        "n_heads": n,
        "n_critical": n_crit,
        "n_convertible": n_conv,
        "n_negative": int((x < -threshold).sum()),
        "critical_share": n_crit / n,
        "convertible_share": n_conv / n,
    }


# ---- concentration -----------------------------------------------------------------------------
def _nonneg(x: np.ndarray, negative: Negative) -> np.ndarray:
    if negative == "abs":
        return np.abs(x)
    if negative == "clip":
        return np.clip(x, 0.0, None)
    if negative == "raise":
        if (x < 0).any():
            raise ValueError("negative importance values; pass negative='abs' or 'clip'")
        return x
    raise ValueError(f"negative must be 'abs', 'clip' or 'raise', not {negative!r}")


def gini(x: Float[np.ndarray, "n"] | Sequence[float], negative: Negative = DEFAULT_NEGATIVE) -> float:
    """Gini coefficient G = Σ_i Σ_j |x_i − x_j| / (2 n² μ) (mean absolute difference over twice
    the mean; Gini 1912). 0 = importance spread evenly, (n−1)/n = all on one head.

    Negative values (heads whose patch raises m) are mapped by ``negative``: ``"clip"`` (default:
    to 0, as the paper's IE ∈ [0, 1] of eq. 10 reads), ``"abs"`` (importance = magnitude of the
    effect) or ``"raise"``. The choice changes the figure: [-1, 0.5, 0.5, 2] gives 0.5 clipped,
    0.3125 with magnitudes. Returns NaN when every (mapped) value is 0 (no importance to distribute).

    Raises:
        ValueError: empty input or NaN values.
    """
    v = np.asarray(x, dtype=float).ravel()
    if v.size == 0:
        raise ValueError("gini of an empty vector")
    if np.isnan(v).any():
        raise ValueError("gini: values contain NaN")
    v = _nonneg(v, negative)
    mu = v.mean()
    if mu == 0:
        return math.nan
    return float(np.abs(v[:, None] - v[None, :]).sum() / (2 * v.size**2 * mu))


def layer_gini(matrix: Float[np.ndarray, "layer head"], negative: Negative = DEFAULT_NEGATIVE) -> dict[str, Any]:
    """Gini of head importance within each layer (:func:`gini`), and its mean / min / max over layers.

    Returns:
        dict with negative (the mapping of negative values used), per_layer (list, None for an
        all-zero layer), mean, min, max (over finite layers), argmin_layer, argmax_layer.

    Raises:
        ValueError: every layer has zero importance, NaN values, or an unknown ``negative``.
    """
    m = np.asarray(matrix, dtype=float)
    g = np.array([gini(row, negative) for row in m])
    ok = np.isfinite(g)
    if not ok.any():
        raise ValueError("every layer has zero importance; nothing to measure")
    return {
        "negative": negative,
        "per_layer": [None if not np.isfinite(v) else float(v) for v in g],
        "mean": float(g[ok].mean()),
        "min": float(g[ok].min()),
        "max": float(g[ok].max()),
        "argmin_layer": int(np.where(ok, g, np.inf).argmin()),
        "argmax_layer": int(np.where(ok, g, -np.inf).argmax()),
    }


# ---- everything for a Ranking ------------------------------------------------------------------
@dataclass
class Anatomy:
    """Head anatomy of a Ranking (see :func:`anatomy`)."""

    ranking: Any
    threshold: float
    critical: dict[str, dict[str, float]]
    gini: dict[str, dict[str, Any]]
    stability: pd.DataFrame | None
    rho_target: float
    stability_settings: dict[str, Any] = field(default_factory=dict)
    dla: DLA | None = None
    cosine: np.ndarray | None = None
    gini_other: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The per-layer Gini summary under the other reading of negative IE (``abs`` when ``gini`` clips,
    ``clip`` otherwise): mean / min / max and the mapping, for comparison."""

    @property
    def n_rho(self) -> int | None:
        return None if self.stability is None else n_for_rho(self.stability, self.rho_target)

    def to_dict(self) -> dict[str, Any]:
        p = self.ranking.provenance
        neg = next(iter(self.gini.values()))["negative"] if self.gini else None
        d: dict[str, Any] = {
            "format": "headscope.Anatomy/1",
            "model": p.get("model"),
            "tasks": p.get("tasks"),
            "n_pairs": p.get("n_pairs"),
            "task_settings": p.get("task_settings"),
            "threshold": self.threshold,
            "critical": self.critical,
            "gini_negative": {
                "negative": neg,
                "meaning": NEGATIVE_NOTE.get(neg) if neg else None,
                "note": "the paper does not say how its Gini treats negative IE; gini_other gives the other reading",
            },
            "gini": self.gini,
            "gini_other": self.gini_other,
            "paper": PAPER,
        }
        if self.stability is not None:
            d["stability"] = {
                **self.stability_settings,
                "target": self.rho_target,
                "n_at_target": self.n_rho,
                "rho_at_6": stability_at(self.stability, 6),
                "curve": self.stability.to_dict(orient="records"),
            }
        if self.dla is not None:
            mean = self.dla.mean
            order = np.argsort(-mean.ravel())[:10]
            d["dla"] = {
                "unit": "logits (eq. 9 weights), final-norm scale frozen to the attributed run",
                "heads_sum_mean": float(self.dla.heads.sum((1, 2)).mean()),
                "other_mean": dict(zip(self.dla.components, self.dla.other.mean(0).tolist())),
                "m_mean": float(self.dla.m.mean()),
                "top_heads": [
                    {"layer": int(i // mean.shape[1]), "head": int(i % mean.shape[1]), "dla": float(mean.ravel()[i])}
                    for i in order
                ],
                "per_head_mean": mean.tolist(),
            }
        if self.cosine is not None:
            d["cosine"] = {"diagonal": np.diag(self.cosine).tolist(), "matrix": self.cosine.tolist()}
        return d

    def figures(self) -> dict[str, Any]:
        """{name: plotly Figure}: heatmaps of IE / score (/ DLA), Gini bars, stability curve, cosine."""
        from .. import plots

        r = self.ranking
        figs: dict[str, Any] = {"heatmap_ie": plots.heatmap(r, "ie_recv", title=f"receiver IE per head — {r.provenance.get('model', '')}")}
        if "score" in r.scores and not np.allclose(r.scores["score"], r.scores["ie_recv"], equal_nan=True):
            figs["heatmap_score"] = plots.heatmap(r, "score")
        if self.dla is not None:
            figs["heatmap_dla"] = plots.matrix_heatmap(self.dla.mean, "DLA (logits)", title="direct logit attribution to a⁺ − a⁻ per head", std=self.dla.heads.std(0).numpy() if self.dla.heads.shape[0] > 1 else None)
        col = "score" if "score" in self.gini else next(iter(self.gini))
        neg = self.gini[col].get("negative", DEFAULT_NEGATIVE)
        what = f"|{col}|" if neg == "abs" else f"max({col}, 0)" if neg == "clip" else col
        figs["gini"] = plots.gini_bars(self.gini[col], title=f"per-layer Gini of {what}")
        if self.stability is not None:
            figs["stability"] = plots.stability_plot(self.stability, target=self.rho_target)
        if self.cosine is not None:
            figs["cosine"] = plots.cosine_matrix(self.cosine)
        return figs

    def save(self, directory: str | Path, formats: Sequence[str] = ("html", "png")) -> dict[str, list[Path]]:
        """Write anatomy.json and every figure (``formats``: any of html, png, svg, pdf) into ``directory``.

        Returns {"json": [path], figure name: [paths]}.
        """
        from ..runtime import atomic_write_text
        from ..plots import save_figures

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        out: dict[str, list[Path]] = {"json": [d / "anatomy.json"]}
        atomic_write_text(d / "anatomy.json", json.dumps(self.to_dict(), indent=2, default=_json_default))
        out.update(save_figures(self.figures(), d, formats))
        return out


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return None if not np.isfinite(o) else float(o)
    return str(o)


def anatomy(
    ranking: Any,
    model: Any | None = None,
    pairs: Sequence[Any] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    negative: Negative = DEFAULT_NEGATIVE,
    n_boot: int = 200,
    seed: int = 0,
    replace: bool = False,
    rho_target: float = DEFAULT_RHO_TARGET,
    lam: float | None = None,
    top_k: int | None = 10,
    ns: Sequence[int] | None = None,
    n_ref: int | None = None,
    reference: Reference | Tensor | np.ndarray = "split",
    noise: bool = True,
) -> Anatomy:
    """Head anatomy of a :class:`~headscope.scores.Ranking` (SPEC.md §7).

    Critical/convertible shares and per-layer Gini (negative IE mapped by ``negative``, default
    clipped at 0; the other reading is kept in ``gini_other``) for every importance column
    (``s_<capability>``, ``ie_recv``, ``score``); the stability curve from ``ranking.ie`` (when
    stored, ≥ 2 usable pairs) against a reference disjoint from the sample by default, with the
    noise baseline (``noise``) and, with ``top_k``, the top-k overlap (arguments ``ns``, ``n_ref``,
    ``reference``, ``replace``, ``n_boot``, ``seed`` as :func:`stability_curve`); with ``model`` and
    ``pairs``, the DLA of every head (clean run) and the clean-vs-corrupted layer-output cosine
    matrix. ``lam`` defaults to the ranking's λ.

    Raises:
        ValueError: no importance column in the score table, or bad stability arguments.
    """
    df = ranking.scores
    cols = importance_columns(df)
    if not cols:
        raise ValueError("the score table has none of the columns s_<capability>, ie_recv, score")
    critical = {c: critical_share(df[c].to_numpy(), threshold) for c in cols}
    gini_d = {c: layer_gini(ranking.matrix(c), negative) for c in cols}
    other: Negative = "abs" if negative != "abs" else "clip"
    gini_o = {}
    for c in cols:
        try:
            g = layer_gini(ranking.matrix(c), other)
            gini_o[c] = {k: g[k] for k in ("negative", "mean", "min", "max")}
        except ValueError:  # e.g. every value negative: nothing left after clipping
            gini_o[c] = {"negative": other, "mean": None, "min": None, "max": None}
    curve = None
    st: dict[str, Any] = {}
    if ranking.ie is not None and (~torch.isnan(ranking.ie).all(-1).all(-1)).sum() >= 2:
        curve = stability_curve(ranking.ie, ns=ns, n_boot=n_boot, seed=seed, replace=replace, top_k=top_k,
                                reference=reference, n_ref=n_ref, noise=noise)
        st = {
            "n_boot": n_boot, "seed": seed, "replace": replace,
            "statistic": "spearman rho of mean receiver IE",
            "reference": reference if isinstance(reference, str) else "held-out set",
            "n_ref": int(curve["n_ref"].iloc[0]),
            "reference_note": {
                "split": "every replicate splits the pairs at random into n_ref reference pairs and a disjoint pool the n pairs come from",
                "all": "mean over all pairs, which contain the sample (biased upward: pure noise gives rho > 0)",
            }.get(reference if isinstance(reference, str) else "", "a separately ranked held-out set of n_ref pairs"),
        }
        if noise:
            st["noise"] = "same curve for IE with every pair's heads shuffled independently (no shared ranking)"
    dla = cos = None
    if model is not None and pairs is not None:
        lam = float(ranking.provenance.get("lambda", DEFAULT_LAMBDA)) if lam is None else lam
        dla = direct_logit_attribution(model, pairs, lam)
        cos = layer_cosine(model, pairs)
    return Anatomy(ranking, threshold, critical, gini_d, curve, rho_target, st, dla, cos, gini_o)


# ---- the checks of `headscope anatomy`, before a model loads ---------------------------------------
FIGURE_FORMATS = ("html", "png", "svg", "pdf")


def check_figure_formats(formats: Sequence[str]) -> None:
    """Known formats; a static one (png, svg, pdf) needs kaleido and a Chrome/Chromium.

    Raises:
        HeadscopeInputError: an unknown format, or no way to export static images.
    """
    formats = list(formats)
    if not formats:
        raise HeadscopeInputError(f"--format: give at least one of {', '.join(FIGURE_FORMATS)}")
    for fmt in formats:
        check_choice("--format", fmt, FIGURE_FORMATS)
    if any(fmt != "html" for fmt in formats):
        fix = "or write html only (--format html)"
        if importlib.util.find_spec("kaleido") is None:
            raise HeadscopeInputError(f"static figures (png, svg, pdf) need kaleido: pip install kaleido, {fix}")
        try:
            from choreographer.browsers.chromium import Chromium

            found = Chromium.find_browser(skip_local=False)
        except Exception:  # another kaleido: let the export itself decide
            return
        if not found:
            raise HeadscopeInputError(
                f"static figures (png, svg, pdf) need Chrome or Chromium: `apt-get install chromium` or `plotly_get_chrome`, {fix}"
            )


def check_anatomy_args(run_dir: Any, out: Any, threshold: Any, boot: Any, formats: Sequence[str], use_model: bool,
                       device: Any, seed: Any = 0) -> tuple[Any, Any]:
    """``headscope anatomy``: the run directory, the output place, the numbers and, with the model, that
    the run's model and pairs can be re-created. Returns (Ranking, model spec or None).

    Raises:
        HeadscopeInputError (InputFileNotFoundError): a missing or broken run directory, a bad value,
            a run whose model or pairs cannot be re-created (then ``--no-model`` is the fix).
    """
    from ..models import check_model
    from ..scores import Ranking

    r = Ranking.load(run_dir)
    check_real("--threshold", threshold, 0.0, fix="IE above it marks a head critical")
    check_int("--boot", boot, lo=1)
    check_int("--seed", seed)
    check_figure_formats(formats)
    check_out_dir(out, "--out")
    cols = [c for c in r.scores.columns if c in ("ie_recv", "score") or c.startswith("s_")]
    if not cols:
        raise HeadscopeInputError(f"{run_dir}/scores.csv has none of the columns ie_recv, score, s_<capability>; "
                                  "is it a table written by headscope rank?")
    if not use_model:
        return r, None
    p = r.provenance
    spec = p.get("model_spec") or p.get("model") or "smollm2-135m"
    try:
        g = check_model(spec, "the run's model")
    except HeadscopeInputError as e:
        raise HeadscopeInputError(f"{e} (the run's model cannot be loaded: pass --no-model to skip DLA and cosine)") from e
    if g is not None and (g.n_layers, g.n_heads) != (r.n_layers, r.n_heads):
        raise HeadscopeInputError(
            f"the run's model spec {spec!r} now names a model of {g.n_layers}x{g.n_heads} heads, the run has "
            f"{r.n_layers}x{r.n_heads}; pass --no-model"
        )
    tasks, settings = p.get("tasks"), p.get("task_settings")
    if not tasks or settings is None or len(tasks) != 1:
        raise HeadscopeInputError(
            "the run's provenance does not say how its single task's pairs were generated (several tasks or "
            "ready-made pairs); pass --no-model"
        )
    check_device(device, "--device")
    return r, spec


def pairs_of_run(ranking: Any, tokenizer: Any) -> list[Any]:
    """Re-generate the calibration pairs of a saved run from its provenance (tasks, task_settings).

    Raises:
        ValueError: the provenance lacks the task settings (pairs were passed in by hand), more
            than one task, or a pair count that differs from the stored results.
    """
    from ..tasks import make_pairs

    p = ranking.provenance
    tasks, settings = p.get("tasks"), p.get("task_settings")
    if not tasks or settings is None or len(tasks) != 1:
        raise ValueError("the run's provenance does not say how its pairs were generated; pass pairs explicitly")
    s = dict(settings)
    if isinstance(s.get("depth"), list):
        s["depth"] = tuple(s["depth"])
    pairs = make_pairs(tasks[0], tokenizer, **s)
    n = ranking.ie.shape[0] if ranking.ie is not None else p.get("n_pairs")
    if n is not None and len(pairs) != int(n):
        raise ValueError(
            f"the run's settings give {len(pairs)} pairs but its results hold {n}; pass the run's pairs explicitly"
        )
    return pairs
