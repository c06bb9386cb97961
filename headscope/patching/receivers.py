"""Receiver importance by activation patching of hook_z (SPEC.md §4, paper eq. 10).

    IE_{l,h} = ( m(x) − m(x; O_{l,h} ← O_{l,h}(x')) ) / ( m(x) − m(x') )        (noising, default)
    IE_{l,h} = ( m(x'; O_{l,h} ← O_{l,h}(x)) − m(x') ) / ( m(x) − m(x') )       (denoising)

1 = the patch moves the whole clean–corrupt gap, 0 = no effect; values outside [0, 1] are kept.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from ..models import LoadedModel
from ..readout import DEFAULT_LAMBDA, logit_diff, read_positions
from ..tasks.base import Pair, validate_pair
from .engine import Engine, head_slice
from .store import Store

Direction = Literal["noising", "denoising"]
DEFAULT_MIN_GAP = 0.1


class GapError(ValueError):
    """No pair has a usable clean–corrupt gap |m(x) − m(x')|."""


@dataclass
class PatchResult:
    """Per-pair, per-head patching results.

    ie: Float[Tensor, "pair layer head"], normalized effect (NaN rows for skipped pairs).
    patched: Float[Tensor, "pair layer head"], m after the patch (logits).
    m_clean, m_corrupt: Float[Tensor, "pair"], m(x) and m(x') (logits).
    skipped: indices of pairs whose gap was below ``min_gap``, with the reason.
    """

    ie: Tensor
    patched: Tensor
    m_clean: Tensor
    m_corrupt: Tensor
    direction: str
    lam: float
    skipped: dict[int, str] = field(default_factory=dict)

    @property
    def used(self) -> list[int]:
        return [i for i in range(self.ie.shape[0]) if i not in self.skipped]


def sequences(pair: Pair) -> tuple[Tensor, Tensor, list[int]]:
    """(clean ⊕ a⁺[:-1], corrupted ⊕ a⁺[:-1], read positions): teacher forcing with the clean answer."""
    tail = pair.answer[:-1]
    return torch.cat([pair.clean, tail]), torch.cat([pair.corrupted, tail]), read_positions(pair.length, pair.n_answer)


def check_pairs(model: LoadedModel, pairs: Sequence[Pair]) -> None:
    """Raise ValueError naming the fix for an empty list or pairs that do not fit the model."""
    if len(pairs) < 1:
        raise ValueError("no calibration pairs given (n_pairs must be >= 1)")
    n_ctx = model.geometry.n_ctx
    for i, p in enumerate(pairs):
        validate_pair(p, decode=model.tokenizer.decode)
        total = p.length + p.n_answer - 1
        if n_ctx and total > n_ctx:
            raise ValueError(
                f"pair {i} needs {total} tokens but the model's context is {n_ctx}; use a shorter seq_len"
            )


def _auto_batch(model: LoadedModel, suffix: int, total: int, mem_bytes: float) -> int:
    g = model.geometry
    ffn = int(getattr(model.hf_model.config, "intermediate_size", 4 * g.d_model))
    per_row = suffix * (6 * g.d_model + 3 * ffn + 2 * g.n_heads * total) * (4 if model.dtype == torch.float32 else 2)
    return max(1, min(g.n_heads, int(mem_bytes // max(per_row, 1))))


def _pair_effects(
    engine: Engine, pair: Pair, lam: float, direction: Direction, batch_size: int | None, mem_bytes: float
) -> dict[str, Tensor]:
    g = engine.g
    clean_seq, corr_seq, read = sequences(pair)
    clean = engine.run(clean_seq, read)
    corr = engine.run(corr_seq, read)
    m_clean = float(logit_diff(clean.logits, pair.answer, pair.counter_answer, lam))
    m_corr = float(logit_diff(corr.logits, pair.answer, pair.counter_answer, lam))
    base, src = (clean, corr) if direction == "noising" else (corr, clean)
    start = min(pair.first_diff(), read[0])
    T = clean_seq.numel()
    bs = batch_size or _auto_batch(engine.model, T - start, T, mem_bytes)
    patched = torch.empty(g.n_layers, g.n_heads, dtype=torch.float64)
    for layer in range(g.n_layers):
        zb = base.z[layer, start:]
        zs = src.z[layer, start:]
        for h0 in range(0, g.n_heads, bs):
            heads = list(range(h0, min(g.n_heads, h0 + bs)))
            rows = zb[None].repeat(len(heads), 1, 1)
            for r, h in enumerate(heads):
                sl = head_slice(h, g.d_head)
                rows[r, :, sl] = zs[:, sl]
            logits = engine.patched_logits(base, layer, rows, start, read)
            patched[layer, heads] = logit_diff(logits, pair.answer, pair.counter_answer, lam).cpu()
    return {"patched": patched, "m_clean": torch.tensor(m_clean), "m_corrupt": torch.tensor(m_corr)}


def receiver_patching(
    model: LoadedModel,
    pairs: Sequence[Pair],
    lam: float = DEFAULT_LAMBDA,
    direction: Direction = "noising",
    min_gap: float = DEFAULT_MIN_GAP,
    batch_size: int | None = None,
    mem_bytes: float = 2e9,
    store_dir: str | None = None,
    store_config: dict[str, Any] | None = None,
    progress: bool = True,
) -> PatchResult:
    """Exact activation patching of every head's hook_z, all positions, for every pair.

    Args:
        model: a :class:`~headscope.models.LoadedModel`.
        pairs: calibration pairs (:mod:`headscope.tasks`).
        lam: λ of the readout (eq. 9).
        direction: ``"noising"`` (clean run, patch from x'; default) or ``"denoising"``.
        min_gap: pairs with |m(x) − m(x')| below this (logits) are skipped and reported.
        batch_size: head patches per forward (default: sized to ``mem_bytes``).
        store_dir: a run directory; each finished pair is written there at once and re-used when the
            same configuration runs again (resume after a crash).

    Returns:
        PatchResult (``.ie`` is Float[Tensor, "pair layer head"]).

    Raises:
        ValueError: no pairs, pairs that break the pair contract or exceed the context, a bad direction.
        GapError: every pair's gap is below ``min_gap``.
    """
    if direction not in ("noising", "denoising"):
        raise ValueError(f"direction must be 'noising' or 'denoising', not {direction!r}")
    check_pairs(model, pairs)
    engine = Engine(model)
    store = None
    if store_dir is not None:
        cfg = {"kind": "receivers", "lam": lam, "direction": direction, **(store_config or {})}
        cfg["pairs"] = [hash_pair(p) for p in pairs]
        store = Store(store_dir, cfg, name="receivers")
    g = model.geometry
    n = len(pairs)
    patched = torch.full((n, g.n_layers, g.n_heads), math.nan, dtype=torch.float64)
    m_clean = torch.empty(n, dtype=torch.float64)
    m_corr = torch.empty(n, dtype=torch.float64)
    for i, pair in enumerate(tqdm(pairs, desc="receiver patching", unit="pair", disable=not progress)):
        key = f"pair{i:05d}"
        if store is not None and store.has(key):
            res = store.get(key)
        else:
            res = _pair_effects(engine, pair, lam, direction, batch_size, mem_bytes)
            if store is not None:
                store.put(key, res)
        patched[i] = res["patched"]
        m_clean[i] = res["m_clean"]
        m_corr[i] = res["m_corrupt"]
    return finish(patched, m_clean, m_corr, direction, lam, min_gap)


def finish(
    patched: Tensor, m_clean: Tensor, m_corr: Tensor, direction: str, lam: float, min_gap: float
) -> PatchResult:
    """Normalize patched metrics into IE (eq. 10), skipping pairs with a gap below ``min_gap``."""
    gap = m_clean - m_corr
    skipped: dict[int, str] = {}
    for i, gp in enumerate(gap.tolist()):
        if not abs(gp) >= min_gap:
            skipped[i] = f"|m(x) - m(x')| = {abs(gp):.3g} < min_gap={min_gap}"
    if len(skipped) == len(gap):
        raise GapError(
            f"every pair has a clean-corrupt gap below min_gap={min_gap} (gaps: {[round(v, 4) for v in gap.tolist()]}); "
            "the model does not tell a+ from a- on these pairs: check the task, use longer answers or lower min_gap"
        )
    if skipped:
        warnings.warn(f"skipped {len(skipped)} pair(s) with a near-zero gap: {skipped}", stacklevel=3)
    g3 = gap[:, None, None]
    if direction == "noising":
        ie = (m_clean[:, None, None] - patched) / g3
    else:
        ie = (patched - m_corr[:, None, None]) / g3
    for i in skipped:
        ie[i] = math.nan
    return PatchResult(ie.float(), patched, m_clean, m_corr, direction, lam, skipped)


def receiver_ie(
    model: LoadedModel,
    pairs: Sequence[Pair],
    lam: float = DEFAULT_LAMBDA,
    direction: Direction = "noising",
    **kwargs: Any,
) -> Float[Tensor, "pair layer head"]:
    """Receiver IE of every head for every pair (eq. 10); NaN rows for skipped pairs.

    See :func:`receiver_patching` for the arguments and errors.
    """
    return receiver_patching(model, pairs, lam=lam, direction=direction, **kwargs).ie


def hash_pair(p: Pair) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in (p.clean, p.corrupted, p.answer, p.counter_answer):
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


# ---- the plain reference: one hook at a time through TransformerLens -------------------------
@torch.no_grad()
def reference_patched_metric(
    model: LoadedModel, pair: Pair, lam: float = DEFAULT_LAMBDA, direction: Direction = "noising"
) -> tuple[Tensor, float, float]:
    """Brute force through the bridge: one full forward per head with a ``hook_z`` hook.

    Returns (Float[Tensor, "layer head"] patched m, m(x), m(x')). Slow; for tests and as the
    generic path for architectures the fast engine does not cover.
    """
    b = model.bridge
    g = model.geometry
    clean_seq, corr_seq, read = sequences(pair)
    names = lambda n: n.endswith("attn.hook_z")  # noqa: E731
    logits_c, cache_c = b.run_with_cache(clean_seq[None].to(model.device), names_filter=names)
    logits_x, cache_x = b.run_with_cache(corr_seq[None].to(model.device), names_filter=names)
    m_c = float(logit_diff(logits_c[0, read], pair.answer, pair.counter_answer, lam))
    m_x = float(logit_diff(logits_x[0, read], pair.answer, pair.counter_answer, lam))
    base_seq, src = (clean_seq, cache_x) if direction == "noising" else (corr_seq, cache_c)
    out = torch.empty(g.n_layers, g.n_heads, dtype=torch.float64)
    for layer in range(g.n_layers):
        name = f"blocks.{layer}.attn.hook_z"
        for h in range(g.n_heads):

            def hook(z: Tensor, hook: Any = None, h: int = h, name: str = name) -> Tensor:
                z = z.clone()
                z[:, :, h] = src[name][:, :, h]
                return z

            logits = b.run_with_hooks(base_seq[None].to(model.device), fwd_hooks=[(name, hook)])
            out[layer, h] = float(logit_diff(logits[0, read], pair.answer, pair.counter_answer, lam))
    return out, m_c, m_x
