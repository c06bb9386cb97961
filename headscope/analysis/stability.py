"""Ranking stability (SPEC.md §7; paper §5.7): Spearman ρ between the ranking from n calibration pairs
and the ranking from a reference of other pairs (random disjoint splits, or a held-out set), with the same
curve on head-shuffled IE as a noise baseline. Re-exported by :mod:`headscope.analysis.anatomy`.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Sequence

import numpy as np
import pandas as pd
from jaxtyping import Float, Int
from scipy.stats import rankdata
from torch import Tensor

DEFAULT_RHO_TARGET = 0.9
PAPER_RHO_AT_6 = 0.921  # the paper's ρ after 6 calibration pairs (§5.7)

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
        row["paper_rho"] = PAPER_RHO_AT_6
    return row


def n_for_rho(curve: pd.DataFrame, target: float = DEFAULT_RHO_TARGET, column: str = "rho_mean") -> int | None:
    """Smallest n whose ρ (``column``, default the bootstrap mean) reaches ``target``; None if none."""
    hit = curve[curve[column] >= target]
    return int(hit["n"].min()) if len(hit) else None
