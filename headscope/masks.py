"""Head masks: which heads keep softmax full attention (FA) and which become GDN.

A :class:`HeadMask` is the hand-off between head selection (``headscope.scores``) and its two
consumers, knockout and the hybrid (``headscope.hybrid``). Budgets follow SPEC.md §6: a head
count, a fraction of all heads, or an ``"LA:FA"`` ratio string (``"7:1"`` keeps 1/8 = 12.5 % of
heads as FA). Selection is "constrained global screening": every layer first receives its best
``min_per_layer`` heads, then the remaining budget is filled from the global ranking.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np

from .errors import HeadscopeInputError, InputFileNotFoundError, InputTypeError
from .validate import check_int

Budget = Union[int, float, str]


class BudgetRaisedWarning(UserWarning):
    """The FA budget was raised to the smallest one that gives every layer ``min_per_layer`` heads."""


def budget_raised_note(budget: Budget, k: int, need: int, n_layers: int, n_heads: int, min_per_layer: int) -> str:
    """The sentence recorded when a budget of ``k`` FA heads is raised to ``need`` = min_per_layer × n_layers."""
    return (
        f"budget {budget!r} = {k} FA head(s) of {n_layers * n_heads} cannot give {min_per_layer} head(s) to each "
        f"of {n_layers} layers; raised to {need} ({need / (n_layers * n_heads):.1%} of the heads), the smallest "
        f"budget that does (min_per_layer=0, on the command line --min-per-layer 0, keeps {k})"
    )


def _kv_group_of(head: int, n_heads: int, n_kv_heads: int) -> int:
    return head // (n_heads // n_kv_heads)


def parse_budget(budget: Budget, n_total: int) -> int:
    """Turn a budget into a number of FA heads.

    Args:
        budget: an ``int`` head count; a ``float`` in (0, 1] read as a fraction of all heads;
            or a ratio string ``"LA:FA"`` (``"7:1"`` -> 1/8 of the heads), or a digit string.
        n_total: number of heads in the model (n_layers * n_heads).

    Returns:
        The FA head count K, 1 <= K <= n_total (fractions and ratios round to nearest, at least 1
        head must remain FA).

    Raises:
        HeadscopeInputError (a ValueError): a count above ``n_total`` or below 1, a fraction outside
            (0, 1], or a malformed ratio / a ratio that leaves no FA head.
    """
    if isinstance(budget, bool):
        raise HeadscopeInputError("budget must be a head count, a fraction or an 'LA:FA' ratio, not a bool")
    if isinstance(budget, str):
        s = budget.strip()
        if ":" in s:
            try:
                la, fa = (float(v) for v in s.split(":"))
            except ValueError:
                raise HeadscopeInputError(f"budget ratio {budget!r} is not of the form 'LA:FA', e.g. '7:1'") from None
            if la < 0 or fa <= 0:
                raise HeadscopeInputError(f"budget ratio {budget!r} leaves no FA head: FA must be > 0, e.g. '7:1'")
            k = round(n_total * fa / (la + fa))
            if k < 1:
                raise HeadscopeInputError(
                    f"budget ratio {budget!r} leaves no FA head among {n_total} heads; use a smaller LA:FA ratio"
                )
            return k
        try:
            budget = float(s) if "." in s else int(s)
        except ValueError:
            raise HeadscopeInputError(f"budget {budget!r} is not a count, a fraction or an 'LA:FA' ratio; write e.g. "
                                      "34 (FA heads), 0.125 (a fraction of the heads) or 7:1 (LA:FA)") from None
    if isinstance(budget, (int, np.integer)):
        if budget < 1 or budget > n_total:
            raise HeadscopeInputError(
                f"budget of {budget} FA heads is outside 1..{n_total} (the model has {n_total} heads); "
                "pass a smaller count, a fraction like 0.125, or a ratio like '7:1'"
            )
        return int(budget)
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise HeadscopeInputError(f"budget fraction {budget} must lie in (0, 1]; for a head count pass an int")
        return max(1, round(budget * n_total))
    raise HeadscopeInputError(f"budget {budget!r} of type {type(budget).__name__} is not understood")


@dataclass(frozen=True)
class HeadMask:
    """Per layer, the query heads that keep softmax full attention (FA); all others are GDN.

    Attributes:
        n_layers, n_heads, n_kv_heads: geometry of the model the mask was made for.
        fa_heads: tuple over layers of sorted tuples of FA query-head indices.
        meta: provenance (model, tasks, n pairs, seed, budget, score source); JSON-serializable.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    fa_heads: tuple[tuple[int, ...], ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise HeadscopeInputError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if len(self.fa_heads) != self.n_layers:
            raise HeadscopeInputError(f"mask lists {len(self.fa_heads)} layers but the geometry has {self.n_layers}")
        for layer, heads in enumerate(self.fa_heads):
            if len(set(heads)) != len(heads):
                raise HeadscopeInputError(f"layer {layer} lists a head twice: {list(heads)}")
            bad = [h for h in heads if not 0 <= h < self.n_heads]
            if bad:
                raise HeadscopeInputError(f"layer {layer} has head indices {bad} outside 0..{self.n_heads - 1}")
        object.__setattr__(self, "fa_heads", tuple(tuple(sorted(int(h) for h in hs)) for hs in self.fa_heads))

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_heads(
        cls, heads: Sequence[tuple[int, int]], n_layers: int, n_heads: int, n_kv_heads: int, meta: dict | None = None
    ) -> "HeadMask":
        """Mask from a list of (layer, head) FA pairs."""
        per: list[list[int]] = [[] for _ in range(n_layers)]
        for layer, head in heads:
            if not 0 <= layer < n_layers:
                raise HeadscopeInputError(f"layer {layer} outside 0..{n_layers - 1}")
            per[layer].append(int(head))
        return cls(n_layers, n_heads, n_kv_heads, tuple(tuple(p) for p in per), dict(meta or {}))

    @classmethod
    def select(
        cls,
        scores: "np.ndarray",
        budget: Budget,
        n_kv_heads: int,
        min_per_layer: int = 1,
        meta: dict | None = None,
        raise_budget: bool = False,
    ) -> "HeadMask":
        """Top-K heads by score under constrained global screening (SPEC.md §6).

        Args:
            scores: Float[ndarray, "layer head"], higher = more important (NaN counts as -inf).
            budget: FA head count, fraction, or "LA:FA" ratio (see :func:`parse_budget`).
            n_kv_heads: KV heads per layer (GQA geometry).
            min_per_layer: every layer keeps at least this many FA heads, its best ones.
            raise_budget: when the budget is below ``min_per_layer * n_layers``, raise it to that
                (the smallest budget meeting the constraint) with a :class:`BudgetRaisedWarning`,
                recorded in ``meta`` (``n_fa_requested``, ``budget_note``) and in :meth:`summary`,
                instead of raising ValueError.

        Raises:
            HeadscopeInputError (a ValueError): budget out of range, ``min_per_layer`` outside
                0..n_heads, or (without ``raise_budget``) ``min_per_layer * n_layers`` above the budget.
        """
        s = np.asarray(scores, dtype=float)
        n_layers, n_heads = s.shape
        k = parse_budget(budget, n_layers * n_heads)
        if min_per_layer < 0 or min_per_layer > n_heads:
            raise HeadscopeInputError(f"min_per_layer={min_per_layer} must lie in 0..{n_heads}")
        meta = dict(meta or {})
        meta.setdefault("budget", budget)
        need = min_per_layer * n_layers
        if need > k:
            if not raise_budget:
                raise HeadscopeInputError(
                    f"budget of {k} FA heads cannot give {min_per_layer} head(s) to each of {n_layers} layers "
                    f"(needs {need}); raise the budget, lower min_per_layer, or pass raise_budget=True"
                )
            note = budget_raised_note(budget, k, need, n_layers, n_heads, min_per_layer)
            warnings.warn(note, BudgetRaisedWarning, stacklevel=2)
            meta.update({"n_fa_requested": k, "budget_note": note})
            k = need
        s = np.where(np.isnan(s), -np.inf, s)
        chosen: set[tuple[int, int]] = set()
        for layer in range(n_layers):
            order = np.argsort(-s[layer], kind="stable")
            chosen.update((layer, int(h)) for h in order[:min_per_layer])
        flat = np.argsort(-s.ravel(), kind="stable")
        for idx in flat:
            if len(chosen) >= k:
                break
            chosen.add((int(idx // n_heads), int(idx % n_heads)))
        meta.update({"n_fa": k, "min_per_layer": min_per_layer})
        return cls.from_heads(sorted(chosen), n_layers, n_heads, n_kv_heads, meta)

    # ---- views --------------------------------------------------------------------------------
    @property
    def n_fa(self) -> int:
        return sum(len(h) for h in self.fa_heads)

    @property
    def n_total(self) -> int:
        return self.n_layers * self.n_heads

    def heads(self) -> list[tuple[int, int]]:
        """All FA heads as (layer, head) pairs, layer-major."""
        return [(layer, h) for layer, hs in enumerate(self.fa_heads) for h in hs]

    def gdn_heads(self, layer: int) -> tuple[int, ...]:
        return tuple(h for h in range(self.n_heads) if h not in self.fa_heads[layer])

    def as_array(self) -> np.ndarray:
        """Bool[ndarray, "layer head"], True = FA."""
        a = np.zeros((self.n_layers, self.n_heads), dtype=bool)
        for layer, h in self.heads():
            a[layer, h] = True
        return a

    def kv_groups(self) -> tuple[tuple[int, ...], ...]:
        """Per layer, the KV groups that must keep a KV cache (any of their query heads is FA)."""
        return tuple(
            tuple(sorted({_kv_group_of(h, self.n_heads, self.n_kv_heads) for h in hs})) for hs in self.fa_heads
        )

    @property
    def kv_cache_fraction(self) -> float:
        """Share of the teacher's KV cache that the hybrid keeps (kept KV groups / all KV groups)."""
        kept = sum(len(g) for g in self.kv_groups())
        return kept / (self.n_layers * self.n_kv_heads)

    def summary(self) -> dict[str, Any]:
        """Counts and the KV-cache share kept, plus ``notes``: human-readable caveats (a budget
        raised to fit ``min_per_layer``; a head-wise mask that saves no KV cache)."""
        out: dict[str, Any] = {
            "n_fa": self.n_fa,
            "n_total": self.n_total,
            "fa_fraction": self.n_fa / self.n_total,
            "kv_groups_kept": sum(len(g) for g in self.kv_groups()),
            "kv_cache_fraction": self.kv_cache_fraction,
        }
        notes = [self.meta["budget_note"]] if self.meta.get("budget_note") else []
        kv = self.kv_note()
        if kv:
            notes.append(kv)
        if notes:
            out["notes"] = notes
        return out

    def kv_note(self) -> str | None:
        """Why this mask keeps the whole KV cache, and what would save some; None when it saves some.

        A KV group (the key/value heads its query heads share) must stay cached as soon as one of
        its query heads is FA. With one KV head per layer (MQA) every layer holding an FA head keeps
        its whole KV cache, so a head-wise mask with >= 1 FA head per layer saves nothing; only
        whole layers without FA heads (a layer-wise mask: ``min_per_layer=0``, e.g. the
        ``layerwise`` selector) free KV cache.
        """
        if self.kv_cache_fraction < 1.0 or self.n_fa == self.n_total:
            return None
        if self.n_kv_heads == 1:
            k = int(self.meta.get("n_fa_requested", self.n_fa))
            n = min(self.n_layers, max(1, round(k / self.n_heads)))
            return (
                f"the model has one KV head per layer, so a layer with any FA head keeps its whole KV cache: "
                f"this head-wise mask keeps every KV group of its {sum(1 for hs in self.fa_heads if hs)} FA "
                f"layer(s) and saves no KV cache (only softmax-attention compute). A layer-wise mask saves KV "
                f"cache: e.g. {n} whole FA layer(s) ({n * self.n_heads} heads, about the budget of {k}) keep "
                f"{n}/{self.n_layers} = {n / self.n_layers:.1%} of it (min_per_layer=0; the layerwise selector); "
                f"`headscope mask RUN_DIR --kv-layers {n}` puts the head-wise FA heads into {n} layer(s) too"
            )
        return (
            "every KV group of every layer has an FA query head, so this mask keeps the whole KV cache; FA heads "
            "that share KV groups (or a layer-wise mask, min_per_layer=0) would save some"
        )

    # ---- serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "headscope.HeadMask/1",
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "fa_heads": {str(layer): list(hs) for layer, hs in enumerate(self.fa_heads)},
            "kv_groups": {str(layer): list(g) for layer, g in enumerate(self.kv_groups())},
            "summary": self.summary(),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HeadMask":
        """Inverse of :meth:`to_dict`.

        Raises:
            HeadscopeInputError: not a HeadMask dict, a missing or malformed field, or an invalid
                mask (a head listed twice or outside the layer).
        """
        if not isinstance(d, dict) or str(d.get("format", "")).split("/")[0] != "headscope.HeadMask":
            raise HeadscopeInputError("not a headscope HeadMask (missing 'format': 'headscope.HeadMask/1'); "
                                      "pass the mask.json written by `headscope rank` or HeadMask.to_json")
        try:
            n_layers = int(d["n_layers"])
            fa = tuple(tuple(int(h) for h in d["fa_heads"].get(str(layer), [])) for layer in range(n_layers))
            return cls(n_layers, int(d["n_heads"]), int(d["n_kv_heads"]), fa, dict(d.get("meta", {})))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            if isinstance(e, HeadscopeInputError):
                raise
            raise HeadscopeInputError(
                f"HeadMask dict is malformed ({type(e).__name__}: {e}); write it with HeadMask.to_json"
            ) from None

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, default=_json_default))
        tmp.replace(path)
        return path

    @classmethod
    def from_json(cls, path: str | Path) -> "HeadMask":
        """Read a mask written by :meth:`to_json` (``OUT/mask.json`` of ``headscope rank``).

        Raises:
            InputFileNotFoundError (a FileNotFoundError and HeadscopeInputError): no such file.
            HeadscopeInputError: a directory, a file that is not JSON, or not a HeadMask.
        """
        p = Path(path).expanduser()
        fix = "pass the mask.json written by `headscope rank` (OUT/mask.json) or HeadMask.to_json"
        if not p.exists():
            raise InputFileNotFoundError(f"mask file {p} does not exist; {fix}")
        if p.is_dir():
            raise HeadscopeInputError(f"mask {p} is a directory; {fix}")
        try:
            d = json.loads(p.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise HeadscopeInputError(f"mask file {p} is not JSON ({e}); {fix}") from None
        try:
            return cls.from_dict(d)
        except HeadscopeInputError as e:
            raise HeadscopeInputError(f"mask file {p}: {e}") from None

    def check_geometry(self, n_layers: int, n_heads: int, n_kv_heads: int) -> None:
        """Raise HeadscopeInputError (a ValueError) when the mask was made for another model geometry."""
        if (self.n_layers, self.n_heads, self.n_kv_heads) != (n_layers, n_heads, n_kv_heads):
            raise HeadscopeInputError(
                f"mask is for {self.n_layers} layers x {self.n_heads} heads ({self.n_kv_heads} KV heads) "
                f"but the model has {n_layers} x {n_heads} ({n_kv_heads} KV heads); rank this model first"
            )


# ---- checks before a model loads ----------------------------------------------------------------
def check_budget(budget: Budget, geometry: Any = None, min_per_layer: int = 1, name: str = "budget",
                 allow_raise: bool = False) -> int | None:
    """The syntax of a budget, and with ``geometry`` its head count and ``min_per_layer`` -> K or None.
    ``allow_raise``: a budget below ``min_per_layer`` per layer is accepted (the mask step raises it).

    Raises:
        HeadscopeInputError: a malformed budget, a count outside the model, a ratio leaving no FA
            head, a fraction outside (0, 1], or a budget too small for ``min_per_layer`` per layer.
    """
    mpl_name = "--min-per-layer" if name.startswith("--") else "min_per_layer"
    check_int(mpl_name, min_per_layer, lo=0)
    if geometry is None:
        parse_budget(budget, 10**9)  # syntax only: 'lots', '7:0', a fraction above 1
        return None
    k = parse_budget(budget, geometry.n_total)
    if min_per_layer > geometry.n_heads:
        raise HeadscopeInputError(
            f"{mpl_name}={min_per_layer} is more than the {geometry.n_heads} heads of a layer; lower {mpl_name}"
        )
    if min_per_layer * geometry.n_layers > k and not allow_raise:
        raise HeadscopeInputError(
            f"budget of {k} FA heads cannot give {min_per_layer} head(s) to each of {geometry.n_layers} layers; "
            f"raise {name} or lower {mpl_name}"
        )
    return k


def check_mask_layers(mask: HeadMask, min_per_layer: int) -> None:
    """Every layer of ``mask`` keeps at least ``min_per_layer`` FA heads. Raises HeadscopeInputError."""
    short = [(layer, len(hs)) for layer, hs in enumerate(mask.fa_heads) if len(hs) < min_per_layer]
    if short:
        raise HeadscopeInputError(
            f"layers {[s[0] for s in short]} have fewer than min_per_layer={min_per_layer} FA heads "
            f"(counts {[s[1] for s in short]}); select the mask with HeadMask.select(..., min_per_layer="
            f"{min_per_layer}) or pass min_per_layer=0"
        )


def as_mask(mask: Any) -> HeadMask:
    """A HeadMask from a HeadMask, its dict or a JSON path.

    Raises:
        InputTypeError: any other type. HeadscopeInputError / InputFileNotFoundError: a bad dict or file.
    """
    if isinstance(mask, HeadMask):
        return mask
    if isinstance(mask, dict):
        return HeadMask.from_dict(mask)
    if isinstance(mask, (str, os.PathLike)):
        return HeadMask.from_json(mask)
    raise InputTypeError(f"mask must be a HeadMask, its dict or a JSON path, not {type(mask).__name__}")


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    if math.isnan(o) if isinstance(o, float) else False:
        return None
    return str(o)
