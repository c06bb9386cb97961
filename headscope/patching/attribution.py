"""Attribution patching (AtP) and the exact probes of blocks, layers and heads that a screen verifies with
(:mod:`headscope.patching.screen` screens and verifies).

AtP (Nanda 2023, "Attribution patching"; Syed et al. 2023) replaces each patched run by a first-order
Taylor step: for the noising patch of head h,

    m(x; z_h ← z_h(x')) − m(x)  ≈  Σ_{pos, d} ( z_h(x') − z_h(x) ) · ∂m/∂z_h |_x

so one forward and one backward pass of the clean run (plus the corrupted forward for z(x'))
estimate every head's effect at once. Kramár et al. 2024 (AtP*) name two failure modes: attention
saturation when patching queries/keys (their QK fix) and cancellation between paths (GradDrop).
The first does not arise here: we patch head *outputs* (hook_z), downstream of the softmax of the
patched head, so the saturated-softmax approximation error concerns only later heads' patterns and
is covered by the exact verification below. Instead of GradDrop we verify: heads that the screen
ranks high are re-measured exactly, and random spot checks of the unverified heads estimate how
many important heads the screen could have missed.

Measured limit of AtP (SmolLM2-135M, niah_single, 6 pairs of 256 tokens): the head with the largest
exact IE (L16H0, 0.35) gets AtP −0.011, rank 263 of 270, with the gradient taken at the clean or at
the corrupted run alike, so no re-ranking of AtP finds it. ``verify="auto"`` (:func:`screen_auto`)
therefore probes blocks of layers (and then layers, KV groups and heads, best first) where the probed
IE departs from the sum of the heads' AtP; that layer residual is 0.37 for layer 16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from ..models import LoadedModel
from ..readout import Direction, Readout
from ..tasks.base import Pair
from .contract import PlanEngine
from .engine import Engine
from .layer_ops import head_slice
from .pass_plan import Entry, LayerCtx, Plan
from .receivers import PairState, PatchResult, _auto_batch, check_pairs, sequences


def attribution_ie(
    model: LoadedModel,
    pairs: Sequence[Pair],
    lam: float | None = None,
    direction: Direction | None = None,
    progress: bool = False,
    readout: Readout | None = None,
) -> tuple[Float[Tensor, "pair layer head"], Tensor, Tensor]:
    """AtP estimate of receiver IE (eq. 10) for every head -> (IE estimate, m(x), m(x')).

    ``readout`` (or the older ``lam`` / ``direction``): the :class:`~headscope.readout.Readout`.
    Cost per pair: two forwards and one backward, independent of the number of heads.

    Raises:
        ValueError: as :func:`~headscope.patching.receivers.receiver_patching`.
    """
    ie, m_c, m_x, _ = _attribution(model, pairs, Readout.resolve(readout, lam, direction), progress, keep_bytes=0)
    return ie, m_c, m_x


def _attribution(
    model: LoadedModel,
    pairs: Sequence[Pair],
    readout: Readout,
    progress: bool,
    keep_bytes: float,
    grad_engine: PlanEngine | None = None,
) -> tuple[Tensor, Tensor, Tensor, dict[int, PairState]]:
    """:func:`attribution_ie` that also keeps each pair's clean/corrupted passes as a
    :class:`PairState` (for exact verification without re-running them) while they fit in ``keep_bytes``.

    ``grad_engine`` (e.g. a low-precision :class:`Engine`): take the gradient from its pass instead; the
    cached passes, m and the z differences stay those of the exact engine (one extra forward)."""
    check_pairs(model, pairs)
    direction, metric = readout.direction, readout.metric
    engine = Engine(model)
    g = model.geometry
    est = torch.empty(len(pairs), g.n_layers, g.n_heads, dtype=torch.float64)
    m_c = torch.empty(len(pairs), dtype=torch.float64)
    m_x = torch.empty(len(pairs), dtype=torch.float64)
    states: dict[int, PairState] = {}
    kept = 0.0
    for i, p in enumerate(tqdm(pairs, desc="attribution patching", disable=not progress)):
        clean_seq, corr_seq, read = sequences(p)
        base_seq, src_seq = (clean_seq, corr_seq) if direction == "noising" else (corr_seq, clean_seq)
        # positions before the first difference are the same in both prompts: there dz = 0, and the
        # source run and the gradient pass need only the suffix (prefix K/V from the base run)
        start = min(p.first_diff(), read[0])
        if grad_engine is None:
            logits, zs, base = engine.run_with_grad_cache(base_seq, read)
            m_base = metric(logits, p.answer, p.counter_answer)
            grads = [gz[:, start:] for gz in torch.autograd.grad(m_base, zs)]
        else:
            base = engine.run(base_seq, read)
            m_base = metric(base.logits, p.answer, p.counter_answer)
            logits, zs, _ = grad_engine.run_suffix(base, base_seq, start, read, grad=True)
            grads = torch.autograd.grad(metric(logits, p.answer, p.counter_answer), zs)
        _, _, src = engine.run_suffix(base, src_seq, start, read)
        m_src = float(metric(src.logits, p.answer, p.counter_answer))
        with torch.no_grad():
            for layer in range(g.n_layers):
                dz = (src.z[layer, start:] - base.z[layer, start:]).view(-1, g.n_heads, g.d_head)
                gr = grads[layer][0].view(-1, g.n_heads, g.d_head)
                est[i, layer] = (dz.double() * gr.double()).sum((0, 2)).cpu()
        mb = float(m_base.detach())
        m_c[i], m_x[i] = (mb, m_src) if direction == "noising" else (m_src, mb)
        size = sum(t.numel() * t.element_size() for c in (src, base) for t in (c.resid, c.z, c.k, c.v))
        if kept + size <= keep_bytes:
            runs = (base, src) if direction == "noising" else (src, base)
            states[i] = PairState(engine, p, readout, runs=runs)
            kept += size
        del logits, zs, grads
    # AtP estimates Δm = m_patched − m_base; the base run is the clean one when noising
    mc, mx = m_c[:, None, None], m_x[:, None, None]
    ie = readout.normalized_ie((mc if direction == "noising" else mx) + est, mc, mx)
    return ie.float(), m_c, m_x, states


@dataclass
class ScreenResult:
    """Screen-then-verify outcome.

    ie: Float[Tensor, "pair layer head"], exact IE for verified and spot-checked heads, AtP elsewhere.
    atp: Float[Tensor, "pair layer head"], the AtP screen for every head.
    verified, spot_checked: (layer, head) lists measured exactly.
    missed_estimate: estimated number of unverified heads whose exact mean IE would reach the
        verified top set (spot-check hit rate × unverified count) and its one-sided 95 % upper
        bound (Clopper–Pearson; 1.0 × unverified when every spot check is a miss).
    """

    ie: Tensor
    atp: Tensor
    exact: PatchResult
    verified: list[tuple[int, int]]
    spot_checked: list[tuple[int, int]]
    threshold: float
    spot_hits: int
    missed_estimate: float
    missed_upper95: float
    details: dict[str, Any] = field(default_factory=dict)
    stats: Any = None  # screen_auto's ScreenStats (``details`` holds it as a dict)


def recall_at_k(a: np.ndarray, b: np.ndarray, k: int = 10) -> float:
    """|top-k(a) ∩ top-k(b)| / k for two score arrays of the same shape (NaN = -inf)."""
    fa = np.nan_to_num(np.asarray(a, float).ravel(), nan=-np.inf)
    fb = np.nan_to_num(np.asarray(b, float).ravel(), nan=-np.inf)
    ta = set(np.argsort(-fa, kind="stable")[:k].tolist())
    tb = set(np.argsort(-fb, kind="stable")[:k].tolist())
    return len(ta & tb) / k


@torch.no_grad()
def probe_ie(
    engine: PlanEngine,
    states: dict[int, PairState],
    pairs: Sequence[Pair],
    patches: Sequence[tuple[int, Sequence[int]]],
    readout: Readout | float,
    direction: Direction | None = None,
    batch_size: int | None = None,
) -> Float[Tensor, "pair patch"]:
    """IE (eq. 10) of patching each ``(layer, heads)`` group of heads at once, per pair, with ``engine``
    (e.g. a low-precision :class:`Engine` for screening). ``patches`` must be in ascending layer order.
    Pairs without a state in ``states`` get a new one (computed with ``engine``). ``readout``: a
    :class:`~headscope.readout.Readout` (or, the older form, λ with ``direction``)."""
    readout = readout if isinstance(readout, Readout) else Readout(lam=readout, direction=direction or "noising")
    g = engine.g
    out = torch.empty(len(pairs), len(patches), dtype=torch.float64)
    for i, p in enumerate(pairs):
        st = states[i] if i in states else PairState(engine, p, readout)
        bs = batch_size or _auto_batch(engine.model, st.total - st.start, st.total, 2e9)
        for c0 in range(0, len(patches), bs):
            chunk = patches[c0 : c0 + bs]
            entries = []
            for layer, heads in chunk:
                z = st.base.z[layer, st.start :].clone()
                for h in heads:
                    sl = head_slice(h, g.d_head)
                    z[:, sl] = st.src.z[layer, st.start :, sl]
                entries.append((layer, z[None]))
            m = st.metric(engine.patched_logits_multi(st.base, entries, st.start, st.read)).double().cpu()
            out[i, c0 : c0 + len(chunk)] = st.ie_of(m)
    return out


@torch.no_grad()
def probe_blocks_ie(
    engine: PlanEngine,
    states: dict[int, PairState],
    pairs: Sequence[Pair],
    blocks: Sequence[tuple[int, int]],
    readout: Readout | float,
    direction: Direction | None = None,
) -> Float[Tensor, "pair block"]:
    """IE (eq. 10) of patching every head of the layers ``l0 <= layer < l1`` at once (hook_z at positions
    ``start..`` set to the source run's, in each of those layers), per pair and per ``(l0, l1)`` in
    ``blocks`` (ascending ``l0``), with ``engine``. All blocks of a pair run as one batch; each row joins
    at its ``l0`` from the cached residual there, and prefix keys/values come from the cache (causal: the
    patch changes no position before ``start``). Pairs without a state in ``states`` get a new one.

    Raises:
        ValueError: empty ``blocks``, a block outside the model's layers, or ``l0`` not ascending.
    """
    readout = readout if isinstance(readout, Readout) else Readout(lam=readout, direction=direction or "noising")
    g = engine.g
    if not blocks:
        raise ValueError("no blocks given")
    l0s = [a for a, _ in blocks]
    if l0s != sorted(l0s) or any(not 0 <= a < b <= g.n_layers for a, b in blocks):
        raise ValueError(f"blocks must be (l0, l1) with 0 <= l0 < l1 <= {g.n_layers}, ascending l0; got {blocks}")
    out = torch.empty(len(pairs), len(blocks), dtype=torch.float64)
    for i, p in enumerate(pairs):
        st = states[i] if i in states else PairState(engine, p, readout)
        base, src, start = st.base, st.src, st.start

        def inside_blocks(lay: int, z: Tensor, ctx: LayerCtx) -> Tensor:
            # rows of a block keep the source run's hook_z in every layer of the block
            rows = [j for j, bl in enumerate(ctx.tags) if bl is not None and bl[0] <= lay < bl[1]]
            if not rows:
                return z
            z = z.clone()
            z[rows] = src.z[lay, ctx.positions.to(src.z[lay].device)].to(z.device, z.dtype)
            return z

        entries = [Entry(a, src.z[a, start:][None].expand(1, -1, -1), tag=(a, b)) for a, b in blocks]
        res = engine.forward(Plan(read=st.read, base=base, start=start, enter=entries, edit=inside_blocks))
        m = st.metric(res.out).double().cpu()
        out[i] = st.ie_of(m)
    return out


