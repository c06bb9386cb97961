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

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from scipy.stats import rankdata
from torch import Tensor

from .readout import DEFAULT_LAMBDA, logit_diff, span_weights

DEFAULT_THRESHOLD = 0.1
DEFAULT_RHO_TARGET = 0.9
PAPER = {
    "critical_share": 29 / 448,
    "convertible_share": 0.908,
    "gini_mean": 0.622,
    "gini_min": 0.399,
    "gini_max": 0.915,
    "rho_at_6": 0.921,
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


# ---- stability ---------------------------------------------------------------------------------
Reference = Literal["split", "all"]


def _used_pairs(ie: Tensor | np.ndarray, what: str = "ie", min_pairs: int = 2) -> np.ndarray:
    x = ie.double().numpy() if isinstance(ie, Tensor) else np.asarray(ie, dtype=float)
    if x.ndim != 3:
        raise ValueError(f"{what} must be [pair, layer, head], got shape {x.shape}")
    used = ~np.isnan(x).all(axis=(1, 2))
    if used.sum() < min_pairs:
        raise ValueError(f"stability needs at least {min_pairs} usable pairs in {what}, got {int(used.sum())}; rank with more pairs")
    return x[used].reshape(int(used.sum()), -1)


def stability_samples(
    n_pairs: int, ns: Sequence[int], n_boot: int, seed: int = 0, replace: bool = True
) -> dict[int, Int[np.ndarray, "boot n"]]:
    """The pair indices of every replicate when the reference is all pairs (``reference="all"``, or
    a held-out set): {n: Int[ndarray, "boot n"]}, drawn from ``range(n_pairs)``.

    Raises:
        ValueError: an n below 1, or above n_pairs without replacement.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for n in ns:
        if n < 1 or (not replace and n > n_pairs):
            raise ValueError(f"n={n} outside 1..{n_pairs} pairs")
        out[int(n)] = np.stack([rng.choice(n_pairs, size=n, replace=replace) for _ in range(n_boot)])
    return out


def stability_splits(
    n_pairs: int, ns: Sequence[int], n_boot: int, n_ref: int, seed: int = 0, replace: bool = False
) -> dict[int, tuple[Int[np.ndarray, "boot n"], Int[np.ndarray, "boot n_ref"]]]:
    """Random disjoint splits of the pairs into a sample and a reference, for every replicate.

    Each replicate permutes ``range(n_pairs)``, takes the first ``n_ref`` as the reference and draws
    the n-pair sample from the other ``n_pairs − n_ref``: the first n of them (``replace=False``,
    n distinct pairs) or n drawn with replacement from them (a bootstrap of the held-out pool).

    Returns:
        {n: (Int[ndarray, "boot n"] sample indices, Int[ndarray, "boot n_ref"] reference indices)};
        within a replicate no index is in both.

    Raises:
        ValueError: n_ref outside 1..n_pairs − 1, or an n below 1 or (without replacement) above
            n_pairs − n_ref.
    """
    pool = n_pairs - n_ref
    if not 1 <= n_ref <= n_pairs - 1:
        raise ValueError(f"n_ref={n_ref}: the reference needs 1..{n_pairs - 1} of the {n_pairs} pairs, leaving the rest to sample")
    rng = np.random.default_rng(seed)
    out = {}
    for n in ns:
        if n < 1 or (not replace and n > pool):
            raise ValueError(
                f"n={n} outside 1..{pool}: {n_pairs} pairs minus a reference of {n_ref} leave {pool} to sample "
                "(lower n_ref or rank more pairs)"
            )
        perms = np.stack([rng.permutation(n_pairs) for _ in range(n_boot)])
        ref, rest = perms[:, :n_ref], perms[:, n_ref:]
        if replace:
            sample = np.take_along_axis(rest, rng.integers(0, pool, size=(n_boot, n)), axis=1)
        else:
            sample = rest[:, :n]
        out[int(n)] = (sample, ref)
    return out


def spearman_rows(
    a: Float[np.ndarray, "boot head"], b: Float[np.ndarray, "boot head"] | Float[np.ndarray, "head"]
) -> Float[np.ndarray, "boot"]:
    """Spearman ρ of every row of ``a`` with the matching row of ``b`` (or with ``b`` itself when it
    is one vector): Pearson correlation of average ranks, as ``scipy.stats.spearmanr``.

    A row with a NaN, or with all values tied on either side, gives NaN.
    """
    a = np.atleast_2d(np.asarray(a, dtype=float))
    b = np.broadcast_to(np.asarray(b, dtype=float), a.shape)
    bad = np.isnan(a).any(1) | np.isnan(b).any(1)
    ra = rankdata(np.nan_to_num(a), axis=1)
    rb = rankdata(np.nan_to_num(b), axis=1)
    ra -= ra.mean(1, keepdims=True)
    rb -= rb.mean(1, keepdims=True)
    den = np.sqrt((ra * ra).sum(1) * (rb * rb).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = (ra * rb).sum(1) / den
    rho[bad | (den == 0)] = np.nan
    return rho


def _topk_overlap(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    b = np.broadcast_to(b, a.shape)
    ta = np.argsort(-a, axis=1, kind="stable")[:, :k]
    tb = np.argsort(-b, axis=1, kind="stable")[:, :k]
    return np.array([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(ta, tb)])


def _summary(rhos: np.ndarray, band: tuple[float, float], prefix: str = "") -> dict[str, float]:
    r = rhos[np.isfinite(rhos)]
    nan = math.nan
    return {
        f"{prefix}rho_mean": float(r.mean()) if r.size else nan,
        f"{prefix}rho_std": float(r.std(ddof=1)) if r.size > 1 else nan,
        f"{prefix}rho_median": float(np.median(r)) if r.size else nan,
        f"{prefix}rho_lo": float(np.percentile(r, band[0])) if r.size else nan,
        f"{prefix}rho_hi": float(np.percentile(r, band[1])) if r.size else nan,
    }


def stability_curve(
    ie: Float[Tensor, "pair layer head"] | np.ndarray,
    ns: Sequence[int] | None = None,
    n_boot: int = 200,
    seed: int = 0,
    replace: bool = False,
    band: tuple[float, float] = (2.5, 97.5),
    top_k: int | None = None,
    reference: Reference | Float[Tensor, "ref_pair layer head"] | np.ndarray = "split",
    n_ref: int | None = None,
    noise: bool = False,
) -> pd.DataFrame:
    """Spearman ρ between the head ranking from n pairs and a reference ranking, over n.

    The n-pair ranking is the mean IE per head over n pairs; ρ is ``scipy.stats.spearmanr`` (average
    ranks for ties) with the mean IE of the reference. ``reference`` says which pairs:

    * ``"split"`` (default): pairs disjoint from the sample. Every replicate splits the usable pairs
      at random into a reference of ``n_ref`` pairs and a pool from which the n pairs are taken
      (:func:`stability_splits`). Noise common to sample and reference cannot raise ρ, so pure
      noise gives ρ ≈ 0 at every n. The curve's ceiling is the reliability of an ``n_ref``-pair
      ranking, not 1.
    * a Tensor / array [ref_pair, layer, head]: a separately ranked held-out set (its usable pairs'
      mean IE, fixed); the n pairs are drawn from all usable pairs of ``ie``.
    * ``"all"``: the mean over all pairs, which contains the sampled ones (the old, upward-biased
      reading: on pure noise, IE of 20 pairs × 4 × 8 heads, it gives ρ ≈ 0.4 at n = 6). For
      comparison only.

    Without replacement (default) the n pairs are n distinct pairs, as in "ρ after 6 calibration
    samples"; ``replace=True`` draws them with replacement (bootstrap). Skipped pairs (all-NaN
    rows) are left out. With ``noise``, the same curve for IE whose heads are shuffled within every
    pair independently (fresh shuffle per replicate): a null with each pair's IE distribution but no
    shared ranking, drawn as a baseline. With ``top_k``, also the mean share of the reference top-k
    heads found in the n-pair top-k (``topk_overlap``): ρ over every head is dominated by the order
    of the many near-zero heads, the overlap by the heads a mask would keep.

    Args:
        ie: per-pair receiver IE (fraction of the clean–corrupt gap, eq. 10).
        ns: sample sizes (default 1..⌊pairs/2⌋ for "split", 1..pairs otherwise).
        n_boot: replicates per n; seed: their RNG; band: percentiles of ρ reported as lo / hi.
        n_ref: reference size for "split" (default: pairs − max(ns), the largest reference the
            largest n leaves; the same for every n of the curve).

    Returns:
        DataFrame, one row per n: n, n_ref, rho_mean, rho_std (over replicates), rho_median,
        rho_lo, rho_hi, n_boot (finite replicates); with ``noise`` the same statistics prefixed
        ``noise_``; with ``top_k``, top_k and topk_overlap.

    Raises:
        ValueError: fewer than 2 usable pairs (or none in a held-out reference), a reference of
            another head shape, an unknown ``reference``, n_ref with a non-split reference, or an n
            / n_ref outside the range.
    """
    x = _used_pairs(ie)
    n_pairs, n_h = x.shape
    rng = np.random.default_rng([seed, 1])
    if isinstance(reference, str):
        if reference not in ("split", "all"):
            raise ValueError(f"reference must be 'split', 'all' or an IE array, not {reference!r}")
        split = reference == "split"
    else:
        split = False
    if not split and n_ref is not None:
        raise ValueError("n_ref sets the size of a 'split' reference; it has no meaning for another reference")
    if ns is None:
        ns = list(range(1, (n_pairs // 2 if split else n_pairs) + 1))
    ns = [int(n) for n in ns]
    if not ns:
        raise ValueError("ns is empty")
    fixed: np.ndarray | None = None
    if split:
        n_ref = n_pairs - max(ns) if n_ref is None else int(n_ref)
        draws = stability_splits(n_pairs, ns, n_boot, n_ref, seed, replace)
    else:
        if isinstance(reference, str):  # "all"
            fixed, n_ref = x.mean(0), n_pairs
        else:
            ref = _used_pairs(reference, "reference", min_pairs=1)
            if ref.shape[1] != n_h:
                raise ValueError(f"reference has {ref.shape[1]} heads per pair, ie has {n_h}")
            fixed, n_ref = ref.mean(0), ref.shape[0]
        draws = {n: (idx, None) for n, idx in stability_samples(n_pairs, ns, n_boot, seed, replace).items()}

    def ranks_of(data: np.ndarray, idx: np.ndarray, ref_idx: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        sample = data[idx].mean(1)  # [boot, head]
        if ref_idx is not None:
            return sample, data[ref_idx].mean(1)
        if isinstance(reference, str):  # "all": the reference is the same data's all-pairs mean
            return sample, data.mean(0)
        return sample, fixed  # held-out set, never shuffled

    rows = []
    for n, (idx, ref_idx) in draws.items():
        sample, refm = ranks_of(x, idx, ref_idx)
        rhos = spearman_rows(sample, refm)
        row: dict[str, Any] = {"n": n, "n_ref": int(n_ref), **_summary(rhos, band), "n_boot": int(np.isfinite(rhos).sum())}
        if noise:
            null = np.empty(len(idx))
            for b in range(len(idx)):
                xs = rng.permuted(x, axis=1)  # every pair's heads shuffled on their own
                s_b, r_b = ranks_of(xs, idx[b : b + 1], None if ref_idx is None else ref_idx[b : b + 1])
                null[b] = spearman_rows(s_b, r_b)[0]
            row.update(_summary(null, band, "noise_"))
        if top_k:
            row.update({"top_k": int(top_k), "topk_overlap": float(_topk_overlap(sample, np.asarray(refm), top_k).mean())})
        rows.append(row)
    return pd.DataFrame(rows)


def stability_at(curve: pd.DataFrame, n: int = 6) -> dict[str, Any] | None:
    """The row of ``curve`` at n (ρ mean, std, band; noise baseline when present) as a dict, with
    the paper's value for n = 6; None when n is not on the curve."""
    hit = curve[curve["n"] == n]
    if not len(hit):
        return None
    row = {k: (v.item() if hasattr(v, "item") else v) for k, v in hit.to_dict(orient="records")[0].items()}
    if n == 6:
        row["paper_rho"] = PAPER["rho_at_6"]
    return row


def n_for_rho(curve: pd.DataFrame, target: float = DEFAULT_RHO_TARGET, column: str = "rho_mean") -> int | None:
    """Smallest n whose ρ (``column``, default the bootstrap mean) reaches ``target``; None if none."""
    hit = curve[curve[column] >= target]
    return int(hit["n"].min()) if len(hit) else None


# ---- direct logit attribution (figure 2a) -------------------------------------------------------
@dataclass
class DLA:
    """Direct logit attribution of one or more pairs.

    heads: Float[Tensor, "pair layer head"], each head's direct contribution to m (logits).
    other: Float[Tensor, "pair component"], the remaining components in ``components`` order
        (embed, then per layer the o_proj bias when it has one, then mlp.{l}).
    total: Float[Tensor, "pair"], m computed from the final residual with the frozen norm scale
        (equals heads.sum + other.sum).
    m: Float[Tensor, "pair"], m from the model's own logits.
    """

    heads: Tensor
    other: Tensor
    components: list[str]
    total: Tensor
    m: Tensor

    @property
    def mean(self) -> Float[np.ndarray, "layer head"]:
        return self.heads.mean(0).numpy()


def _frozen_norm(norm: Any, h: Tensor) -> tuple[Callable[[Tensor], Tensor], Tensor | None]:
    """A norm linearized at the run's activations ``h`` [n, d] (its scale frozen, the standard DLA
    convention): returns (the linear map applied to a component [n, d] or [..., n, d], the norm's
    constant bias or None). RMSNorm (Llama ``w·x·s``, Gemma ``(1+w)·x·s``) and LayerNorm
    (``w·(x − mean x)·s + b``) are supported.

    Raises:
        NotImplementedError: another kind of norm.
    """
    if norm is None:
        return (lambda c: c), None
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    hd = h.double()
    if isinstance(norm, torch.nn.LayerNorm):
        mu = hd.mean(-1, keepdim=True)
        s = torch.rsqrt((hd - mu).pow(2).mean(-1, keepdim=True) + norm.eps)
        gain = w.double() if w is not None else torch.ones_like(hd[0])
        return (lambda c: (c.double() - c.double().mean(-1, keepdim=True)) * s * gain), (
            None if norm.bias is None else norm.bias.double())
    if w is None or eps is None or "RMSNorm" not in type(norm).__name__:
        raise NotImplementedError(f"DLA needs an RMSNorm or LayerNorm, got {type(norm).__name__}")
    gain = (1.0 + w.double()) if "Gemma" in type(norm).__name__ else w.double()
    s = torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + float(eps))
    return (lambda c: c.double() * s * gain), None


@torch.no_grad()
def direct_logit_attribution(
    model: Any, pairs: Sequence[Any], lam: float = DEFAULT_LAMBDA, run: Literal["clean", "corrupted"] = "clean"
) -> DLA:
    """Each head's direct contribution to the λ-weighted logit difference m (eq. 9), figure 2a.

    For read position j the final residual is h_j = embed + Σ_l (attention branch + MLP branch of
    layer l), and the attention branch is Σ_h W_O^{l,h} z^{l,h}_j + b_O^l (times Granite's residual
    multiplier; through Gemma's / OLMo 2's post-attention norm). Every norm on the path (the final
    norm, post-attention norms) is linearized by freezing its scale to the value of the run being
    attributed (standard DLA convention), so the attributions add up exactly to m of that run. A
    component c then contributes Σ_j w_j N_j(c_j) · (W_U[a⁺_j] − W_U[a⁻_j]) / divisor, w_j = λ^j/Σλ^j,
    N_j the frozen final norm. With final-logit soft-capping (Gemma 2/3) the attribution is of the
    logits before the cap (``total`` then differs from ``m``).

    Args:
        model: a LoadedModel with a fast-engine adapter.
        pairs: calibration pairs.
        lam: λ of eq. 9; run: attribute the clean run (default) or the corrupted one.

    Returns:
        :class:`DLA` (heads [pair, layer, head] in logits).

    Raises:
        NotImplementedError: a norm other than RMSNorm / LayerNorm on the path.
    """
    from .patching.engine import Engine, head_slice
    from .patching.receivers import sequences

    eng = Engine(model)
    g = eng.g
    WU = eng.arch.lm_head.weight  # [vocab, d_model]
    ub = eng.arch.lm_head.bias
    div = eng.arch.logit_divisor
    heads_all, other_all, total_all, m_all = [], [], [], []
    names: list[str] = []
    for pair in pairs:
        clean, corr, read = sequences(pair)
        cache = eng.run(clean if run == "clean" else corr, read)
        ridx = torch.as_tensor(read, device=eng.device)
        w = span_weights(len(read), lam).to(eng.device).double()
        u = (WU[pair.answer.to(eng.device)] - WU[pair.counter_answer.to(eng.device)]).double()  # [ans, d]
        comps: list[tuple[str, Tensor]] = [("embed", cache.resid[0, ridx].double())]
        head_c = torch.empty(g.n_layers, g.n_heads, len(read), g.d_model, dtype=torch.float64, device=eng.device)
        h = None
        for layer in range(g.n_layers):
            L = eng.layers[layer]
            h_in = cache.resid[layer, ridx]
            z = cache.z[layer, ridx]  # [ans, H*dh]
            Wo, bo = L.o.weight, L.o.bias
            o_full = eng.lin(L.o, z)
            post, post_b = _frozen_norm(L.post_attn_norm, o_full)
            rm = L.residual_multiplier
            for hd in range(g.n_heads):
                sl = head_slice(hd, g.d_head)
                head_c[layer, hd] = post(z[:, sl] @ Wo[:, sl].T) * rm
            if bo is not None:
                comps.append((f"attn_bias.{layer}", post(bo.expand_as(o_full)) * rm))
            if post_b is not None:
                comps.append((f"attn_norm_bias.{layer}", post_b.expand_as(o_full) * rm))
            attn = eng.attn_write(layer, z)
            mid = h_in + attn
            mlp = eng.mlp_write(layer, h_in if L.parallel else mid)
            comps.append((f"mlp.{layer}", mlp.double()))
            h = mid + mlp
        assert h is not None
        fin, fin_b = _frozen_norm(eng.arch.final_norm, h)
        if fin_b is not None:
            comps.append(("final_norm_bias", fin_b.expand_as(h)))
        if ub is not None:
            comps.append(("unembed_bias", torch.zeros_like(h, dtype=torch.float64)))

        def contrib(c: Tensor, normed: bool = False) -> Tensor:
            x = c if normed else fin(c)
            return ((x * u).sum(-1) * w).sum(-1) / div

        heads_all.append(contrib(head_c).cpu())
        names = [n for n, _ in comps]
        vals = [contrib(c, normed=n == "final_norm_bias") for n, c in comps]
        if ub is not None:  # the unembedding bias adds b[a+] - b[a-] at every read position
            vals[-1] = ((ub[pair.answer.to(ub.device)] - ub[pair.counter_answer.to(ub.device)]).double() * w).sum() / div
        other_all.append(torch.stack(vals).cpu())
        total = contrib(h)
        if fin_b is not None:
            total = total + contrib(fin_b.expand_as(h), normed=True)
        if ub is not None:
            total = total + vals[-1]
        total_all.append(total.cpu())
        m_all.append(logit_diff(cache.logits, pair.answer, pair.counter_answer, lam).cpu())
    return DLA(torch.stack(heads_all), torch.stack(other_all), names, torch.stack(total_all), torch.stack(m_all))


# ---- layer-output cosine similarity (figure 2b) ------------------------------------------------
@torch.no_grad()
def layer_cosine(model: Any, pairs: Sequence[Any]) -> Float[np.ndarray, "layer layer"]:
    """Cosine similarity between layer outputs of the clean and the corrupted run, across depth.

    C[l, l'] = cos( h_clean^{(l)}, h_corrupted^{(l')} ) where h^{(l)} is the residual stream after
    layer l (the layer's output) at the answer-reading positions (:func:`read_positions`); the
    cosine is averaged over read positions and pairs. The diagonal shows where along depth the
    corrupted run's representation departs from the clean one; off-diagonal entries show how
    similar outputs of different depths are.

    Returns:
        Float[ndarray, "layer layer"] (rows: clean layer, columns: corrupted layer).
    """
    from .patching.engine import Engine
    from .patching.receivers import sequences

    eng = Engine(model)
    g = eng.g
    acc = np.zeros((g.n_layers, g.n_layers))
    n = 0
    for pair in pairs:
        clean, corr, read = sequences(pair)
        ridx = torch.as_tensor(read, device=eng.device)
        outs = []
        for seq in (clean, corr):
            cache = eng.run(seq, read)
            last = eng.post_attn(g.n_layers - 1, cache.resid[-1, ridx][None], cache.z[-1, ridx][None])[0]
            outs.append(torch.cat([cache.resid[1:, ridx], last[None]]).double())  # [layer, ans, d]
        a = torch.nn.functional.normalize(outs[0], dim=-1)
        b = torch.nn.functional.normalize(outs[1], dim=-1)
        acc += torch.einsum("lad,mad->lm", a, b).cpu().numpy() / len(read)
        n += 1
    if n == 0:
        raise ValueError("layer_cosine needs at least one pair")
    return acc / n


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
        from . import plots

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
        """Write anatomy.json and every figure (``formats``: html and/or png) into ``directory``.

        Returns {"json": [path], figure name: [paths]}.
        """
        from .runtime import atomic_write_text
        from .plots import save_figure

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        out: dict[str, list[Path]] = {"json": [d / "anatomy.json"]}
        atomic_write_text(d / "anatomy.json", json.dumps(self.to_dict(), indent=2, default=_json_default))
        for name, fig in self.figures().items():
            out[name] = save_figure(fig, d / name, formats)
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


def pairs_of_run(ranking: Any, tokenizer: Any) -> list[Any]:
    """Re-generate the calibration pairs of a saved run from its provenance (tasks, task_settings).

    Raises:
        ValueError: the provenance lacks the task settings (pairs were passed in by hand), more
            than one task, or a pair count that differs from the stored results.
    """
    from .tasks import make_pairs

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
