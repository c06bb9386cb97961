"""Anatomy after conversion (issue 40, item 4): where retrieval lives in a converted student.

A head-wise hybrid student (:func:`headscope.hybridize`, trained by :mod:`headscope.train`) keeps some heads as
softmax attention (FA) and turns the others into gated-delta-rule heads (GDN). Its heads are ranked like the
teacher's, FA and GDN heads alike, each at its output before the output projection (``o_proj``'s input columns,
the hybrid's ``hook_z``; :mod:`headscope.patching.hybrid_engine`), with the same readout and pairs:

* :func:`rank_heads` — receiver IE of every head (eq. 10) as a :class:`~headscope.scores.Ranking`, with a
  ``kind`` column (``"fa"`` / ``"gdn"``) for a hybrid; :meth:`Ranking.mask` and :func:`headscope.analysis.anatomy.anatomy`
  take it as they take the teacher's;
* :func:`kind_summary` — per kind: heads, mean IE, share of the positive IE mass, critical heads (IE > 0.1),
  and how many of the top-k heads are of that kind;
* :func:`compare_rankings` / :func:`head_comparison` — the teacher's top-k against the student's (overlap,
  Spearman ρ of IE over all heads and over each kind's heads, which of the teacher's top heads the student kept
  as FA, and their IE in the student);
* :func:`random_gdn_heads` and :func:`knockout_accuracy` — retrieval accuracy (teacher-forced greedy exact
  match, :func:`headscope.analysis.knockout.retrieval_correct`) with a set of heads ablated
  (:func:`headscope.analysis.knockout.ablate`, which hooks ``o_proj``: the student's FA heads, or as many random GDN heads
  as a control).
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np
import pandas as pd
from jaxtyping import Float

from .anatomy import DEFAULT_THRESHOLD, critical_share
from ..errors import HeadscopeInputError
from .knockout import Method, ablate, retrieval_correct
from ..models import LoadedModel
from ..patching.hybrid_engine import head_kinds, is_hybrid
from ..patching.receivers import receiver_patching
from ..readout import Readout
from ..scores import Ranking, head_table
from .stability import spearman_rows
from ..tasks.base import Pair

Head = tuple[int, int]


def rank_heads(
    model: LoadedModel,
    pairs: Sequence[Pair],
    readout: Readout | None = None,
    store_dir: str | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> Ranking:
    """Receiver IE of every head of ``model`` on ``pairs`` (exact activation patching, eq. 10), as a Ranking.

    The engine is :func:`~headscope.patching.contract.make_engine`'s ``"auto"``: for a head-wise hybrid the hybrid
    engine (every head at ``o_proj``'s input, FA and GDN alike), for the teacher the fast engine (hook_z).

    Args:
        model: a LoadedModel (a hybrid student or a transformer teacher).
        pairs: calibration pairs (clean / corrupted prompts, answer spans).
        readout: λ, direction, min_gap (default :class:`~headscope.readout.Readout()`).
        store_dir: every finished (pair, layer) is stored there; a rerun with the same configuration resumes.
        batch_size: patched rows per forward (default: sized to the device's free memory).
        progress: show a progress bar.

    Returns:
        Ranking: ``scores`` with columns ``layer, head, kv_group, ie_recv, ie_recv_std, n_pairs, score, rank`` and,
        for a hybrid, ``kind`` (``"fa"`` / ``"gdn"``); ``ie`` Float[Tensor, "pair layer head"]; ``provenance``
        with the engine path, readout, pairs' tasks and skipped pairs.

    Raises:
        GapError: every pair's clean–corrupted gap is below ``readout.min_gap`` (the model does not tell a⁺
            from a⁻ on these pairs); ValueError: pairs that break the pair contract or exceed the context.
    """
    readout = readout or Readout()
    res = receiver_patching(model, pairs, readout=readout, store_dir=store_dir, batch_size=batch_size,
                            progress=progress)
    df = head_table(res.ie, model.geometry.n_kv_heads)
    if is_hybrid(model.hf_model):
        kinds = head_kinds(model.hf_model)
        df.insert(3, "kind", [kinds[int(lay)][int(h)] for lay, h in zip(df["layer"], df["head"])])
    prov = {**model.provenance(), "tasks": sorted({p.task for p in pairs}), "n_pairs": len(pairs),
            "direction": readout.direction, "lambda": readout.lam, "min_gap": readout.min_gap, "path": res.path,
            "skipped": {int(k): v for k, v in res.skipped.items()}, "hybrid": "kind" in df.columns}
    return Ranking(df, model.geometry.to_dict(), prov, res.ie)


def _kinds(ranking: Ranking) -> pd.Series:
    if "kind" not in ranking.scores.columns:
        raise HeadscopeInputError("the ranking has no 'kind' column: rank a hybrid student with rank_heads")
    return ranking.scores["kind"]


def kind_summary(ranking: Ranking, threshold: float = DEFAULT_THRESHOLD, ks: Sequence[int] = (5, 10)
                 ) -> dict[str, Any]:
    """Where a hybrid's receiver IE sits, by head kind.

    Returns:
        ``{"fa": {...}, "gdn": {...}, "all": {...}}``; each: ``n_heads``, ``mean_ie`` (mean of ``score``),
        ``positive_mass_share`` (Σ max(IE, 0) over the kind's heads ÷ over all heads; NaN when no head has a
        positive IE), ``critical`` (:func:`~headscope.analysis.anatomy.critical_share` at ``threshold``), and
        ``top{k}`` (how many of the k best heads are of the kind) for every k of ``ks``.

    Raises:
        HeadscopeInputError: a ranking without the ``kind`` column.
    """
    df = ranking.scores
    kind = _kinds(ranking)
    s = df["score"].to_numpy(dtype=float)
    pos = np.clip(np.nan_to_num(s), 0, None)
    total = pos.sum()
    order = df.sort_values("rank")
    out: dict[str, Any] = {}
    for name, sel in (("fa", kind == "fa"), ("gdn", kind == "gdn"), ("all", kind == kind)):
        sel = sel.to_numpy()
        v = s[sel]
        d: dict[str, Any] = {
            "n_heads": int(sel.sum()),
            "mean_ie": float(np.nanmean(v)) if v.size and not np.isnan(v).all() else None,
            "positive_mass_share": float(pos[sel].sum() / total) if total > 0 else None,
            "critical": critical_share(np.nan_to_num(v), threshold) if v.size else None,
        }
        for k in ks:
            top = order.head(k)
            d[f"top{k}"] = int(len(top) if name == "all" else (top["kind"] == name).sum())
        out[name] = d
    return out


def head_comparison(teacher: Ranking, student: Ranking) -> pd.DataFrame:
    """One row per head: ``layer, head, [kind,] ie_teacher, ie_teacher_std, rank_teacher, ie_student,
    ie_student_std, rank_student`` (``kind`` from the student when it has one).

    Raises:
        HeadscopeInputError: the rankings are of different geometries.
    """
    if (teacher.n_layers, teacher.n_heads) != (student.n_layers, student.n_heads):
        raise HeadscopeInputError(f"rankings of {teacher.n_layers}x{teacher.n_heads} and {student.n_layers}x"
                                  f"{student.n_heads} heads: compare a student with its own teacher")
    cols = ["layer", "head", "score", "ie_recv_std", "rank"]
    t = teacher.scores[cols].rename(columns={"score": "ie_teacher", "ie_recv_std": "ie_teacher_std",
                                             "rank": "rank_teacher"})
    s_cols = cols + (["kind"] if "kind" in student.scores.columns else [])
    s = student.scores[s_cols].rename(columns={"score": "ie_student", "ie_recv_std": "ie_student_std",
                                               "rank": "rank_student"})
    df = t.merge(s, on=["layer", "head"])
    front = ["layer", "head"] + (["kind"] if "kind" in df.columns else [])
    return df[front + [c for c in df.columns if c not in front]].sort_values(["layer", "head"]).reset_index(drop=True)


def _spearman(a: Float[np.ndarray, "n"], b: Float[np.ndarray, "n"]) -> float | None:
    ok = ~(np.isnan(a) | np.isnan(b))
    if ok.sum() < 3:
        return None
    r = float(spearman_rows(a[ok], b[ok])[0])
    return None if np.isnan(r) else r


def compare_rankings(teacher: Ranking, student: Ranking, k: int = 10) -> dict[str, Any]:
    """The teacher's top-k heads against the student's (same geometry, the same pairs and readout).

    Returns:
        ``k``; ``overlap`` (|top-k(teacher) ∩ top-k(student)| ÷ k); ``spearman`` (ρ of IE over all heads, NaN
        heads left out; None below 3 heads or with all values tied) and, for a hybrid student,
        ``spearman_fa`` / ``spearman_gdn`` (over the heads the student kept as FA / turned into GDN) and
        ``teacher_top_kept_fa`` (how many of the teacher's top-k heads are FA in the student);
        ``teacher_top`` / ``student_top``: the k best heads of each, best first, as rows of
        :func:`head_comparison`.

    Raises:
        HeadscopeInputError: k < 1, or rankings of different geometries.
    """
    if k < 1:
        raise HeadscopeInputError(f"k={k}: compare at least the top 1 head")
    df = head_comparison(teacher, student)
    k = min(k, len(df))
    t_top = df.sort_values("rank_teacher").head(k)
    s_top = df.sort_values("rank_student").head(k)
    both = set(zip(t_top["layer"], t_top["head"])) & set(zip(s_top["layer"], s_top["head"]))
    a, b = df["ie_teacher"].to_numpy(dtype=float), df["ie_student"].to_numpy(dtype=float)
    out: dict[str, Any] = {"k": k, "overlap": len(both) / k, "spearman": _spearman(a, b)}
    if "kind" in df.columns:
        for kind in ("fa", "gdn"):
            sel = (df["kind"] == kind).to_numpy()
            out[f"spearman_{kind}"] = _spearman(a[sel], b[sel])
        out["teacher_top_kept_fa"] = int((t_top["kind"] == "fa").sum())

    def rows(x: pd.DataFrame) -> list[dict[str, Any]]:
        return [{c: (v.item() if hasattr(v, "item") else v) for c, v in r.items()} for r in x.to_dict("records")]

    out["teacher_top"], out["student_top"] = rows(t_top), rows(s_top)
    return out


def random_gdn_heads(kinds: Sequence[Sequence[str]], n: int, seed: int) -> list[Head]:
    """``n`` GDN heads drawn uniformly without replacement (seeded), sorted; ``kinds`` as :func:`head_kinds`.

    Raises:
        HeadscopeInputError: fewer than ``n`` GDN heads, or n < 0.
    """
    gdn = [(lay, h) for lay, ks in enumerate(kinds) for h, kd in enumerate(ks) if kd == "gdn"]
    if not 0 <= n <= len(gdn):
        raise HeadscopeInputError(f"cannot draw {n} of {len(gdn)} GDN heads")
    return sorted(random.Random(seed).sample(gdn, n))


def knockout_accuracy(
    model: LoadedModel, pairs: Sequence[Pair], heads: Sequence[Head], method: Method = "zero",
    reference: Any = None, batch_size: int = 16,
) -> dict[str, Any]:
    """Retrieval accuracy of ``model`` on ``pairs`` with ``heads`` ablated (none: the unablated baseline).

    Args:
        heads: (layer, head) pairs; their ``o_proj`` input columns are replaced (:func:`headscope.analysis.knockout.ablate`).
        method / reference: as :func:`~headscope.analysis.knockout.ablate` (``"mean"`` needs reference prompts or a
            :func:`~headscope.analysis.knockout.mean_reference`).

    Returns:
        ``{"accuracy", "correct" (per prompt, 0/1), "n", "n_heads", "heads"}``.

    Raises:
        ValueError: no pairs; as :func:`~headscope.analysis.knockout.ablate` for bad heads, methods or references.
    """
    if len(pairs) == 0:
        raise ValueError("knockout_accuracy needs at least one prompt")
    heads = [(int(lay), int(h)) for lay, h in heads]
    if heads:
        with ablate(model, heads, method, reference=reference):
            c = retrieval_correct(model, pairs, batch_size=batch_size)
    else:
        c = retrieval_correct(model, pairs, batch_size=batch_size)
    correct = [int(x) for x in c.tolist()]
    return {"accuracy": sum(correct) / len(correct), "correct": correct, "n": len(correct), "n_heads": len(heads),
            "heads": [list(h) for h in heads]}


__all__ = ["compare_rankings", "head_comparison", "kind_summary", "knockout_accuracy", "random_gdn_heads",
           "rank_heads"]
