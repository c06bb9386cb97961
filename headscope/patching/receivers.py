"""Receiver importance by activation patching of hook_z (SPEC.md §4, paper eq. 10).

    IE_{l,h} = ( m(x) − m(x; O_{l,h} ← O_{l,h}(x')) ) / ( m(x) − m(x') )        (noising, default)
    IE_{l,h} = ( m(x'; O_{l,h} ← O_{l,h}(x)) − m(x') ) / ( m(x) − m(x') )       (denoising)

1 = the patch moves the whole clean–corrupt gap, 0 = no effect; values outside [0, 1] are kept.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Sequence

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from ..models import LoadedModel
from ..readout import (DEFAULT_LAMBDA, LowPrecisionWarning, answer_logit_scale, logit_diff, low_precision_pairs,
                       normalized_ie, read_positions)
from ..tasks.base import Pair, validate_pair
from .engine import Engine, RunCache, head_slice
from .generic import make_engine
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
    path: str = "fast"

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
    """Patch rows per forward: as many as ``mem_bytes`` of activations allow, at most 4 layers' heads.

    Rows of several layers share one batch (see :meth:`Engine.patched_logits_multi`); bigger batches
    make the matmuls more efficient, up to a few thousand (row × position) at a time on a CPU.
    """
    g = model.geometry
    ffn = int(getattr(model.hf_model.config, "intermediate_size", 4 * g.d_model))
    per_row = suffix * (6 * g.d_model + 3 * ffn + 2 * g.n_heads * total) * (4 if model.dtype == torch.float32 else 2)
    cap = ROWS_CAP_LAYERS * g.n_heads
    if torch.device(model.device).type == "cpu":
        # on a CPU, batches of about CPU_ROW_TOKENS (row x position) keep the activations cache-sized;
        # bigger ones only add allocation and page-fault time (measured on SmolLM2, 2 cores: 18 rows
        # of 123 positions 11.1 s, 36 rows 12.3 s for all 270 heads)
        cap = min(cap, max(1, CPU_ROW_TOKENS // max(suffix, 1)))
    return max(1, min(cap, int(mem_bytes // max(per_row, 1))))


ROWS_CAP_LAYERS = 4
CPU_ROW_TOKENS = 2304


class PairState:
    """Clean and corrupted passes of one pair, computed once and shared by all its patches."""

    def __init__(
        self, engine: Engine, pair: Pair, lam: float, direction: Direction,
        runs: tuple[RunCache, RunCache] | None = None,
    ):
        """``runs``: the (clean, corrupted) :class:`RunCache` when already computed (e.g. by AtP)."""
        self.pair = pair
        clean_seq, corr_seq, self.read = sequences(pair)
        if runs is None:
            clean = engine.run(clean_seq, self.read)
            corr = engine.run(corr_seq, self.read)
        else:
            clean, corr = runs
        self.m_clean = float(logit_diff(clean.logits, pair.answer, pair.counter_answer, lam))
        self.m_corrupt = float(logit_diff(corr.logits, pair.answer, pair.counter_answer, lam))
        # magnitude of the answer logits, for the low-precision check of the gap (readout.min_trusted_gap)
        self.logit_scale = max(answer_logit_scale(r.logits, pair.answer, pair.counter_answer) for r in (clean, corr))
        self.base, self.src = (clean, corr) if direction == "noising" else (corr, clean)
        # positions before the first clean/corrupted difference are identical in every run
        self.start = min(pair.first_diff(), self.read[0])
        self.total = clean_seq.numel()
        self.direction = direction

    def ie_of(self, m: Tensor) -> Tensor:
        """IE (eq. 10) of patched metrics ``m`` (logits) of this pair: (m(x) − m) / gap when noising,
        (m − m(x')) / gap when denoising, gap = m(x) − m(x')."""
        return normalized_ie(m, self.m_clean, self.m_corrupt, self.direction)


def patch_rows(
    engine: Engine, st: PairState, rows: Sequence[tuple[int, int]], lam: float, batch_size: int
) -> Iterator[tuple[list[tuple[int, int]], Tensor]]:
    """m after patching each (layer, head) of ``rows`` alone, ``batch_size`` rows per forward.

    ``rows`` must be in ascending layer order. Yields ``(chunk, m)`` per forward, m Float64[len(chunk)].
    """
    g = engine.g
    for c0 in range(0, len(rows), batch_size):
        chunk = list(rows[c0 : c0 + batch_size])
        entries = []
        for layer in sorted({lay for lay, _ in chunk}):
            heads = [h for lay, h in chunk if lay == layer]
            zb = st.base.z[layer, st.start :]
            zs = st.src.z[layer, st.start :]
            z = zb[None].repeat(len(heads), 1, 1)
            for r, h in enumerate(heads):
                sl = head_slice(h, g.d_head)
                z[r, :, sl] = zs[:, sl]
            entries.append((layer, z))
        logits = engine.patched_logits_multi(st.base, entries, st.start, st.read)
        ordered = [(layer, h) for layer, _ in entries for h in [hh for ll, hh in chunk if ll == layer]]
        yield ordered, logit_diff(logits, st.pair.answer, st.pair.counter_answer, lam).double().cpu()


def patch_heads(
    engine: Engine, st: PairState, layer: int, heads: Sequence[int], lam: float, batch_size: int
) -> Tensor:
    """m after patching each of ``heads`` of ``layer`` alone (one batch row per head) -> Float64[len(heads)]."""
    vals = {}
    for chunk, m in patch_rows(engine, st, [(layer, h) for h in heads], lam, batch_size):
        vals.update({h: float(v) for (_, h), v in zip(chunk, m)})
    return torch.tensor([vals[h] for h in heads], dtype=torch.float64)


def receiver_patching(
    model: LoadedModel,
    pairs: Sequence[Pair],
    lam: float = DEFAULT_LAMBDA,
    direction: Direction = "noising",
    min_gap: float = DEFAULT_MIN_GAP,
    batch_size: int | None = None,
    mem_bytes: float | None = None,
    store_dir: str | None = None,
    store_config: dict[str, Any] | None = None,
    progress: bool = True,
    heads: Sequence[tuple[int, int]] | None = None,
    shard: tuple[int, int] | None = None,
    states: dict[int, PairState] | None = None,
    path: str = "auto",
) -> PatchResult:
    """Exact activation patching of every head's hook_z, all positions, for every pair.

    Args:
        model: a :class:`~headscope.models.LoadedModel`.
        pairs: calibration pairs (:mod:`headscope.tasks`).
        lam: λ of the readout (eq. 9).
        direction: ``"noising"`` (clean run, patch from x'; default) or ``"denoising"``.
        min_gap: pairs with |m(x) − m(x')| below this (logits) are skipped and reported.
        batch_size: head patches per forward (default: sized to ``mem_bytes``).
        mem_bytes: activation memory a batch may use (default: half the free GPU memory on CUDA,
            2 GB on CPU).
        store_dir: a run directory; every finished (pair, layer) item is written there at once
            (atomically) and re-used when the same configuration runs again (resume after a crash).
        heads: patch only these (layer, head)s (others stay NaN); default all.
        shard: ``(rank, world_size)``: this process computes only every world_size-th work item
            (pair × layer), writes it to the store (``store_dir`` required), waits at a
            ``torch.distributed`` barrier when a process group is initialized, and returns the
            table merged from the store (see :mod:`headscope.distributed`).
        states: clean/corrupted passes already computed, by pair index (built with the same ``lam``
            and ``direction``; e.g. kept by :func:`~headscope.patching.attribution.screen_then_verify`).
        path: ``"auto"`` (the fast engine where an architecture adapter exists, else the generic bridge
            path), ``"fast"`` or ``"generic"`` (:func:`~headscope.patching.generic.make_engine`); the
            result's ``path`` says which ran.

    Returns:
        PatchResult (``.ie`` is Float[Tensor, "pair layer head"]).

    Raises:
        ValueError: no pairs, pairs that break the pair contract or exceed the context, a bad direction.
        GapError: every pair's gap is below ``min_gap``.
        ConfigMismatch: ``store_dir`` holds results of another configuration.
    """
    if direction not in ("noising", "denoising"):
        raise ValueError(f"direction must be 'noising' or 'denoising', not {direction!r}")
    check_pairs(model, pairs)
    if shard is not None and (store_dir is None or not 0 <= shard[0] < shard[1]):
        raise ValueError(f"shard={shard} needs 0 <= rank < world_size and a store_dir shared by all ranks")
    g = model.geometry
    per_layer: dict[int, list[int]] = {}
    for layer, h in heads if heads is not None else [(a, b) for a in range(g.n_layers) for b in range(g.n_heads)]:
        if not (0 <= layer < g.n_layers and 0 <= h < g.n_heads):
            raise ValueError(f"head ({layer}, {h}) is outside the model's {g.n_layers} layers x {g.n_heads} heads")
        per_layer.setdefault(int(layer), []).append(int(h))
    engine = make_engine(model, path)  # type: ignore[arg-type]
    if mem_bytes is None:
        if model.device.type == "cuda":
            mem_bytes = 0.5 * torch.cuda.mem_get_info(model.device)[0]
        else:
            mem_bytes = 2e9
    store = None
    if store_dir is not None:
        cfg = {"kind": "receivers", "lam": lam, "direction": direction, **(store_config or {})}
        cfg["pairs"] = [hash_pair(p) for p in pairs]
        store = Store(store_dir, cfg, name="receivers")
    n = len(pairs)
    patched = torch.full((n, g.n_layers, g.n_heads), math.nan, dtype=torch.float64)
    m_clean = torch.empty(n, dtype=torch.float64)
    m_corr = torch.empty(n, dtype=torch.float64)
    bar = tqdm(total=n * sum(len(v) for v in per_layer.values()), desc=f"receiver patching, {engine.path} path (heads x pairs)", unit="patch",
               disable=not progress)
    given = states
    cached: dict[int, PairState] = {}

    def state(i: int) -> PairState:
        if given is not None and i in given:
            return given[i]
        if i not in cached:
            cached.clear()  # one pair's caches at a time
            cached[i] = PairState(engine, pairs[i], lam, direction)
        return cached[i]

    def mine(idx: int) -> bool:
        return shard is None or idx % shard[1] == shard[0]

    bases: dict[int, dict[str, float]] = {}
    for i in range(n):
        key = f"pair{i:05d}_base"
        if store is not None and store.has(key):
            bases[i] = store.get(key)
        elif mine(i):
            st = state(i)
            bases[i] = {"m_clean": st.m_clean, "m_corrupt": st.m_corrupt, "logit_scale": st.logit_scale}
            if store is not None:
                store.put(key, bases[i])
    items = [(i, layer) for i in range(n) for layer in sorted(per_layer)]
    done: dict[tuple[int, int], dict[int, float]] = {}
    work: dict[int, list[tuple[int, int]]] = {}  # pair -> (layer, head) still to compute, layer order
    for idx, (i, layer) in enumerate(items):
        key = f"pair{i:05d}_L{layer:03d}"
        have: dict[int, float] = store.get(key) if store is not None and store.has(key) else {}
        todo = [h for h in per_layer[layer] if h not in have]
        done[(i, layer)] = have
        if todo and mine(idx):
            work.setdefault(i, []).extend((layer, h) for h in todo)
        else:
            bar.update(len(per_layer[layer]))
    for i, rows in work.items():
        st = state(i)
        bs = batch_size or _auto_batch(model, st.total - st.start, st.total, mem_bytes)
        left = {layer: sum(1 for lay, _ in rows if lay == layer) for layer, _ in rows}
        for chunk, vals in patch_rows(engine, st, rows, lam, bs):
            for (layer, h), v in zip(chunk, vals.tolist()):
                done[(i, layer)] = {**done[(i, layer)], h: v}
                left[layer] -= 1
                if left[layer] == 0:
                    if store is not None:
                        store.put(f"pair{i:05d}_L{layer:03d}", done[(i, layer)])
                    bar.update(len(per_layer[layer]))
    cached.clear()
    if shard is not None:
        # every rank wrote its items into the shared store; wait for all, then read the others' items
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        for i in range(n):
            bases[i] = store.get(f"pair{i:05d}_base")
        for i, layer in items:
            done[(i, layer)] = store.get(f"pair{i:05d}_L{layer:03d}")
    for i in range(n):
        m_clean[i], m_corr[i] = bases[i]["m_clean"], bases[i]["m_corrupt"]
    for (i, layer), vals in done.items():
        for h in per_layer[layer]:
            patched[i, layer, h] = vals[h]
    bar.close()
    scales = [bases[i].get("logit_scale") for i in range(n)]
    res = finish(patched, m_clean, m_corr, direction, lam, min_gap, dtype=model.dtype, logit_scale=scales)
    res.path = engine.path
    return res


def finish(
    patched: Tensor, m_clean: Tensor, m_corr: Tensor, direction: str, lam: float, min_gap: float,
    dtype: torch.dtype | None = None, logit_scale: Sequence[float | None] | None = None,
) -> PatchResult:
    """Normalize patched metrics into IE (eq. 10), skipping pairs with a gap below ``min_gap``.

    With ``dtype`` (the model's), a used pair whose gap is too small for it gets a
    :class:`~headscope.readout.LowPrecisionWarning` naming the pair and its gap
    (:func:`~headscope.readout.min_trusted_gap`; ``logit_scale``: per-pair answer-logit magnitude).
    """
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
    low = low_precision_pairs(gap, dtype, logit_scale, skip=skipped) if dtype is not None else {}
    if low:
        warnings.warn("; ".join(low.values()) + ": compute in float32, or use pairs with a larger gap",
                      LowPrecisionWarning, stacklevel=3)
    ie = normalized_ie(patched, m_clean[:, None, None], m_corr[:, None, None], direction)
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
