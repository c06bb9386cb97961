"""Receiver importance by activation patching of hook_z (SPEC.md §4, paper eq. 10).

    IE_{l,h} = ( m(x) − m(x; O_{l,h} ← O_{l,h}(x')) ) / ( m(x) − m(x') )        (noising, default)
    IE_{l,h} = ( m(x'; O_{l,h} ← O_{l,h}(x)) − m(x') ) / ( m(x) − m(x') )       (denoising)

1 = the patch moves the whole clean–corrupt gap, 0 = no effect; values outside [0, 1] are kept.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from ..models import LoadedModel
from ..readout import (DEFAULT_LAMBDA, DEFAULT_MIN_GAP, Direction, LowPrecisionWarning, Readout,  # noqa: F401
                       answer_logit_scale, logit_diff, low_precision_pairs, read_positions)
from ..tasks.base import Pair, validate_pair
from .contract import PatchingEngine, make_engine
from .layer_ops import head_slice
from .pass_plan import Precision, RunCache
from .schedule import Schedule, heads_by_layer
from .self_check import load_records, save_records
from .store import Store


class GapError(ValueError):
    """No pair has a usable clean–corrupt gap |m(x) − m(x')|."""


@dataclass
class PatchResult:
    """Per-pair, per-head patching results.

    ie: Float[Tensor, "pair layer head"], normalized effect (NaN rows for skipped pairs).
    patched: Float[Tensor, "pair layer head"], m after the patch (logits).
    m_clean, m_corrupt: Float[Tensor, "pair"], m(x) and m(x') (logits).
    readout: the :class:`~headscope.readout.Readout` (λ, direction, min_gap) the numbers were read with.
    skipped: indices of pairs whose gap was below ``min_gap``, with the reason.
    path: the engine that ran (``"fast"`` / ``"generic"`` / ``"hybrid"``); precision: the engine's
    :class:`~headscope.patching.pass_plan.Precision`.
    """

    ie: Tensor
    patched: Tensor
    m_clean: Tensor
    m_corrupt: Tensor
    readout: Readout
    skipped: dict[int, str] = field(default_factory=dict)
    path: str = "fast"
    precision: Precision = Precision()

    @property
    def direction(self) -> str:
        return self.readout.direction

    @property
    def lam(self) -> float:
        return self.readout.lam

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


def _auto_batch(model: LoadedModel, suffix: int, total: int, mem_bytes: float, resid_bytes: int | None = None) -> int:
    """Patch rows per forward: as many as ``mem_bytes`` of activations allow, at most 4 layers' heads.

    Rows of several layers share one batch (see :meth:`PatchingEngine.patched_logits_multi`); bigger batches
    make the matmuls more efficient, up to a few thousand (row × position) at a time on a CPU.
    """
    g = model.geometry
    ffn = int(getattr(model.hf_model.config, "intermediate_size", 4 * g.d_model))
    b = 4 if model.dtype == torch.float32 else 2
    per_row = suffix * (6 * g.d_model + 3 * ffn + 2 * g.n_heads * total) * b
    if resid_bytes is not None and resid_bytes > b:  # a float32 residual stream of a low-precision model
        per_row += suffix * 2 * g.d_model * (resid_bytes - b)
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
    """Clean and corrupted passes of one pair, computed once and shared by all its patches, with the
    readout bound in: ``m_clean``, ``m_corrupt`` (logits) and :meth:`ie_of` read through ``readout``.

    Args:
        engine: the engine that runs the passes; pair: the calibration pair.
        readout: a :class:`~headscope.readout.Readout` (or, the older form, λ with ``direction``).
        runs: the (clean, corrupted) :class:`RunCache` when already computed (e.g. by AtP).
    """

    def __init__(
        self, engine: PatchingEngine, pair: Pair, readout: Readout | float, direction: Direction | None = None,
        runs: tuple[RunCache, RunCache] | None = None,
    ):
        self.readout = readout if isinstance(readout, Readout) else Readout(lam=readout, direction=direction or "noising")
        self.pair = pair
        clean_seq, corr_seq, self.read = sequences(pair)
        if runs is None:
            clean = engine.run(clean_seq, self.read)
            corr = engine.run(corr_seq, self.read)
        else:
            clean, corr = runs
        self.m_clean = float(self.metric(clean.logits))
        self.m_corrupt = float(self.metric(corr.logits))
        # magnitude of the answer logits, for the low-precision check of the gap (readout.min_trusted_gap)
        self.logit_scale = max(answer_logit_scale(r.logits, pair.answer, pair.counter_answer) for r in (clean, corr))
        self.base, self.src = (clean, corr) if self.direction == "noising" else (corr, clean)
        self.base_ids = clean_seq if self.direction == "noising" else corr_seq  # the prompt of ``base``
        # positions before the first clean/corrupted difference are identical in every run
        self.start = min(pair.first_diff(), self.read[0])
        self.total = clean_seq.numel()

    @property
    def direction(self) -> str:
        return self.readout.direction

    def metric(self, logits: Tensor) -> Tensor:
        """m (eq. 9) of logits at this pair's read positions (logits)."""
        return self.readout.metric(logits, self.pair.answer, self.pair.counter_answer)

    def ie_of(self, m: Tensor) -> Tensor:
        """IE (eq. 10) of patched metrics ``m`` (logits) of this pair (:meth:`Readout.normalized_ie`)."""
        return self.readout.normalized_ie(m, self.m_clean, self.m_corrupt)

    def base_metrics(self) -> dict[str, float]:
        """What the store keeps per pair: m(x), m(x'), the answer-logit scale."""
        return {"m_clean": self.m_clean, "m_corrupt": self.m_corrupt, "logit_scale": self.logit_scale}


def patch_rows(
    engine: PatchingEngine, st: PairState, rows: Sequence[tuple[int, int]], lam: float | None = None, batch_size: int = 64
) -> Iterator[tuple[list[tuple[int, int]], Tensor]]:
    """m after patching each (layer, head) of ``rows`` alone, ``batch_size`` rows per forward.

    ``rows`` must be in ascending layer order. Yields ``(chunk, m)`` per forward, m Float64[len(chunk)].
    The metric is ``st.readout``'s; ``lam`` (older form) must be None or equal to it.
    """
    if lam is not None and lam != st.readout.lam:
        raise ValueError(f"lam={lam} differs from the pair state's readout {st.readout}")
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
        yield ordered, st.metric(logits).double().cpu()


def patch_heads(
    engine: PatchingEngine, st: PairState, layer: int, heads: Sequence[int], lam: float | None = None, batch_size: int = 64
) -> Tensor:
    """m after patching each of ``heads`` of ``layer`` alone (one batch row per head) -> Float64[len(heads)]."""
    vals = {}
    for chunk, m in patch_rows(engine, st, [(layer, h) for h in heads], lam, batch_size):
        vals.update({h: float(v) for (_, h), v in zip(chunk, m)})
    return torch.tensor([vals[h] for h in heads], dtype=torch.float64)


class _States:
    """Pair states by index: the given ones, else one computed pair at a time."""

    def __init__(self, engine: PatchingEngine, pairs: Sequence[Pair], readout: Readout, given: dict[int, PairState] | None):
        self.engine, self.pairs, self.readout, self.given = engine, pairs, readout, given or {}
        self.cached: dict[int, PairState] = {}

    def __call__(self, i: int) -> PairState:
        if i in self.given:
            return self.given[i]
        if i not in self.cached:
            self.cached.clear()  # one pair's caches at a time
            self.cached[i] = PairState(self.engine, self.pairs[i], self.readout)
        return self.cached[i]


def receiver_patching(
    model: LoadedModel,
    pairs: Sequence[Pair],
    lam: float | None = None,
    direction: Direction | None = None,
    min_gap: float | None = None,
    batch_size: int | None = None,
    mem_bytes: float | None = None,
    store_dir: str | None = None,
    store_config: dict[str, Any] | None = None,
    progress: bool = True,
    heads: Sequence[tuple[int, int]] | None = None,
    shard: tuple[int, int] | None = None,
    states: dict[int, PairState] | None = None,
    path: str = "auto",
    readout: Readout | None = None,
    precision: Precision | None = None,
) -> PatchResult:
    """Exact activation patching of every head's hook_z, all positions, for every pair.

    Args:
        model: a :class:`~headscope.models.LoadedModel`.
        pairs: calibration pairs (:mod:`headscope.tasks`).
        readout: the :class:`~headscope.readout.Readout` (λ of eq. 9, direction, min_gap); default
            ``Readout()``. ``lam`` / ``direction`` / ``min_gap``: the older keywords, building one
            (``"noising"``: clean run, patch from x'; pairs with |m(x) − m(x')| < min_gap are skipped).
        batch_size: head patches per forward (default: sized to ``mem_bytes``).
        mem_bytes: activation memory a batch may use (default: half the free GPU memory on CUDA,
            2 GB on CPU).
        store_dir: a run directory; every finished (pair, layer) item is written there at once
            (atomically) and re-used when the same configuration runs again (resume after a crash).
        heads: patch only these (layer, head)s (others stay NaN); default all.
        shard: ``(rank, world_size)``: this process computes only every world_size-th work item
            (pair × layer), writes it to the store (``store_dir`` required), waits at a
            ``torch.distributed`` barrier when a process group is initialized, and returns the
            table merged from the store (see :mod:`headscope.patching.schedule`).
        states: clean/corrupted passes already computed, by pair index (built with the same readout;
            e.g. kept by :func:`~headscope.patching.attribution.screen_then_verify`).
        path: ``"auto"`` (the hybrid engine for a head-wise hybrid, else the fast engine where an architecture
            adapter exists, else the generic bridge path), ``"fast"``, ``"generic"`` or ``"hybrid"``
            (:func:`~headscope.patching.contract.make_engine`); the result's ``path`` says which ran.
        precision: the fast engine's :class:`~headscope.patching.pass_plan.Precision` (default: the
            model's dtype throughout; ``Precision("float32")``: a bf16/fp16 model's residual stream,
            norms and RoPE in float32, nearer a float32 forward); recorded in the result and the store.

    Returns:
        PatchResult (``.ie`` is Float[Tensor, "pair layer head"]).

    Raises:
        ValueError: no pairs, pairs that break the pair contract or exceed the context, a bad readout.
        GapError: every pair's gap is below ``min_gap``.
        ConfigMismatch: ``store_dir`` holds results of another configuration.
    """
    readout = Readout.resolve(readout, lam, direction, min_gap)
    check_pairs(model, pairs)
    g = model.geometry
    per_layer = heads_by_layer(g.n_layers, g.n_heads, heads)
    if shard is not None and (store_dir is None or not 0 <= shard[0] < shard[1]):
        raise ValueError(f"shard={shard} needs 0 <= rank < world_size and a store_dir shared by all ranks")
    precision = precision or Precision()
    store = None
    if store_dir is not None:
        cfg = {"kind": "receivers", "lam": readout.lam, "direction": readout.direction, **(store_config or {})}
        if precision != Precision():  # the default adds no key: stores written before keep resuming
            cfg["precision"] = precision.to_dict()
        store = Store(store_dir, {**cfg, "pairs": [hash_pair(p) for p in pairs]}, name="receivers")
        load_records(model.hf_model, store)  # the engine's self-checks this store's run passed before
    engine = make_engine(model, path, precision)  # type: ignore[arg-type]
    if mem_bytes is None:
        mem_bytes = 0.5 * torch.cuda.mem_get_info(model.device)[0] if model.device.type == "cuda" else 2e9
    sched = Schedule(len(pairs), per_layer, store, shard, progress,
                     desc=f"receiver patching, {engine.path} path (heads x pairs)")
    state = _States(engine, pairs, readout, states)
    sched.load_bases(lambda i: state(i).base_metrics())
    for i, rows in sched.pending().items():
        st = state(i)
        # a few patched rows against hooked forwards, once per new length
        engine.check_patches(st.base_ids, st.base, st.src, st.start, st.read)
        sched.leave_out_time()
        if store is not None:
            save_records(model.hf_model, store)
        bs = batch_size or _auto_batch(model, st.total - st.start, st.total, mem_bytes,
                                       torch.finfo(engine.resid_dtype).bits // 8)
        for chunk, vals in patch_rows(engine, st, rows, readout.lam, bs):  # the compute
            for (layer, h), v in zip(chunk, vals.tolist()):
                sched.record(i, layer, h, v)
    state.cached.clear()
    sched.gather()
    sched.close()
    n = len(pairs)
    patched = torch.full((n, g.n_layers, g.n_heads), math.nan, dtype=torch.float64)
    for it, vals in sched.done.items():
        for h in per_layer[it.layer]:
            patched[it.pair, it.layer, h] = vals[h]
    b = sched.bases
    m_clean = torch.tensor([b[i]["m_clean"] for i in range(n)], dtype=torch.float64)
    m_corr = torch.tensor([b[i]["m_corrupt"] for i in range(n)], dtype=torch.float64)
    scales = [b[i].get("logit_scale") for i in range(n)]
    res = finish(patched, m_clean, m_corr, readout, dtype=model.dtype, logit_scale=scales)
    res.path = engine.path
    res.precision = precision
    return res


def finish(
    patched: Tensor, m_clean: Tensor, m_corr: Tensor, readout: Readout | str, *legacy: float,
    dtype: torch.dtype | None = None, logit_scale: Sequence[float | None] | None = None,
) -> PatchResult:
    """Normalize patched metrics into IE (eq. 10) with ``readout``, skipping pairs with a gap below its
    ``min_gap``. (Older form: ``finish(patched, m_clean, m_corr, direction, lam, min_gap)``.)

    With ``dtype`` (the model's), a used pair whose gap is too small for it gets a
    :class:`~headscope.readout.LowPrecisionWarning` naming the pair and its gap
    (:func:`~headscope.readout.min_trusted_gap`; ``logit_scale``: per-pair answer-logit magnitude).
    """
    if not isinstance(readout, Readout):
        readout = Readout(lam=legacy[0], direction=readout, min_gap=legacy[1])  # type: ignore[arg-type]
    min_gap = readout.min_gap
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
    ie = readout.normalized_ie(patched, m_clean[:, None, None], m_corr[:, None, None])
    for i in skipped:
        ie[i] = math.nan
    return PatchResult(ie.float(), patched, m_clean, m_corr, readout, skipped)


def receiver_ie(
    model: LoadedModel,
    pairs: Sequence[Pair],
    lam: float | None = None,
    direction: Direction | None = None,
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
