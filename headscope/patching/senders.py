"""Sender importance by path patching, one step back and iterated (SPEC.md §5).

For receivers R (heads) and a candidate sender s = (layer l_s, head h_s):

1. a clean run and a corrupted run (cached);
2. a clean run in which s's hook_z takes its corrupted value while every other head's hook_z and
   every MLP output are frozen at their clean values. Then the residual stream entering a layer
   l > l_s is exactly ``resid_clean[l] + W_O^{(l_s)}[:, h_s] (z_s(x') − z_s(x))`` — the change
   reaches later layers only along the direct path from s — and the receivers' Q/K/V inputs are
   the layer-normed (ln1) values of that residual. (Computed in closed form from the caches; the
   tests check it against three literal runs.)
3. a clean run in which only the receivers' Q, K and/or V inputs (``mode``: "qkv" (default), "kv"
   or "q") are replaced by the values of step 2; everything else runs freely. Its metric m gives

       IE_send(s) = ( m(x) − m(x; step 3) ) / ( m(x) − m(x') )           (as eq. 10)

A sender in a layer at or above every receiver's layer cannot reach them: IE_send = 0 exactly.
Path patching follows Wang et al. 2022 ("Interpretability in the Wild", IOI) and Goldowsky-Dill
et al. 2023 ("Localizing Model Behavior with Path Patching").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from ..models import LoadedModel
from ..readout import Readout, logit_diff
from ..tasks.base import Pair
from .contract import PlanEngine
from .engine import Engine
from .layer_ops import head_slice
from .pass_plan import RunCache
from .attention import attend
from .pass_plan import LayerCtx, Plan
from .receivers import PatchResult, check_pairs, finish, hash_pair, sequences
from .store import Store

MODES = ("qkv", "kv", "q", "k", "v", "qk", "qv")

Head = tuple[int, int]


def check_receivers(model: LoadedModel, receivers: Sequence[Head]) -> list[Head]:
    """Validate (layer, head) receivers against the model; raise ValueError naming the fix."""
    g = model.geometry
    out: list[Head] = []
    if len(receivers) == 0:
        raise ValueError("no receivers given; pass (layer, head) pairs, e.g. the top heads of a receiver ranking")
    for r in receivers:
        try:
            layer, head = (int(v) for v in r)
        except (TypeError, ValueError):
            raise ValueError(f"receiver {r!r} is not a (layer, head) pair") from None
        if not (0 <= layer < g.n_layers and 0 <= head < g.n_heads):
            raise ValueError(
                f"receiver (layer {layer}, head {head}) is outside the model "
                f"({g.n_layers} layers x {g.n_heads} heads: layer 0..{g.n_layers - 1}, head 0..{g.n_heads - 1})"
            )
        if (layer, head) not in out:
            out.append((layer, head))
    return out


def candidate_senders(model: LoadedModel, receivers: Sequence[Head]) -> list[Head]:
    """All heads in layers below the deepest receiver's layer (the only ones with a path to R)."""
    top = max(layer for layer, _ in receivers)
    return [(layer, h) for layer in range(top) for h in range(model.geometry.n_heads)]


def _pair_sender_effects(
    engine: PlanEngine,
    pair: Pair,
    receivers: list[Head],
    senders: list[Head],
    mode: str,
    lam: float,
    batch_size: int,
) -> dict[str, Tensor]:
    g = engine.g
    clean_seq, corr_seq, read = sequences(pair)
    clean = engine.run(clean_seq, read)
    corr = engine.run(corr_seq, read)
    m_clean = float(logit_diff(clean.logits, pair.answer, pair.counter_answer, lam))
    m_corr = float(logit_diff(corr.logits, pair.answer, pair.counter_answer, lam))
    start = min(pair.first_diff(), read[0])
    by_layer: dict[int, list[int]] = {}
    for layer, head in receivers:
        by_layer.setdefault(layer, []).append(head)
    # no path: every head that is not a candidate keeps the clean metric (IE exactly 0)
    patched = torch.full((g.n_layers, g.n_heads), m_clean, dtype=torch.float64)
    # a sender in layer l_s reaches only receivers in layers > l_s, and the run is clean up to the
    # first of them: rows start there (exactly equal to starting at the lowest receiver layer)
    groups: dict[int, list[Head]] = {}
    for ls, hs in senders:
        above = [lr for lr in by_layer if lr > ls]
        if above:
            groups.setdefault(min(above), []).append((ls, hs))
    for first, members in sorted(groups.items()):
        sub = {lr: hds for lr, hds in by_layer.items() if lr >= first}
        for b0 in range(0, len(members), batch_size):
            rows = members[b0 : b0 + batch_size]
            deltas = []
            for ls, hs in rows:
                # the sender's direct write to the residual: the attention branch of layer ls with this
                # head's hook_z from the corrupted run, minus the clean branch (exact through post-norms)
                sl = head_slice(hs, g.d_head)
                z_c = clean.z[ls, start:][None]
                z_s = z_c.clone()
                z_s[..., sl] = corr.z[ls, start:, sl]
                deltas.append((engine.attn_write(ls, z_s) - engine.attn_write(ls, z_c))[0])
            delta = torch.stack(deltas)  # [B, S, d_model]
            x_in = {lr: engine.ln1(lr, clean.resid[lr, start:][None] + delta) for lr in sub}
            logits = path_patched_logits(engine, clean, start, read, x_in, sub, mode)
            vals = logit_diff(logits, pair.answer, pair.counter_answer, lam).cpu().double()
            for (ls, hs), val in zip(rows, vals.tolist()):
                patched[ls, hs] = val
    return {"patched": patched, "m_clean": torch.tensor(m_clean, dtype=torch.float64),
            "m_corrupt": torch.tensor(m_corr, dtype=torch.float64)}


@torch.no_grad()
def path_patched_logits(
    engine: PlanEngine,
    base: RunCache,
    start: int,
    read: Sequence[int],
    x_in: dict[int, Float[Tensor, "batch suffix d_model"]],
    receivers: dict[int, Sequence[int]],
    mode: str = "qkv",
) -> Float[Tensor, "batch read vocab"]:
    """Logits at ``read`` of runs of ``base``'s prompt in which only the receivers' Q/K/V inputs change.

    For each receiver layer ``l``, the heads listed in ``receivers[l]`` compute their hook_z from
    queries (``"q"`` in ``mode``) and/or keys and values (``"k"``/``"v"``) projected from ``x_in[l]``
    (the attention input at positions ``start..``; earlier positions keep ``base``'s keys/values);
    everything else is the run's own (nothing downstream is frozen). Each batch row is one run (path
    patching step 3, Wang et al. 2022; SPEC.md §5).

    Raises:
        ValueError: no receivers.
    """
    engine.require_one_device("sender path patching")
    layers = sorted(receivers)
    if not layers:
        raise ValueError("no receivers given")
    B = next(iter(x_in.values())).shape[0]
    rep = engine.g.n_heads // engine.g.n_kv_heads
    dh = engine.g.d_head

    def receive(lay: int, z: Tensor, ctx: LayerCtx) -> Tensor:
        if lay not in receivers:
            return z
        q2, k2, v2 = engine.qkv(lay, x_in[lay], ctx.pos)
        T = ctx.k.shape[2]
        pre = T - k2.shape[2]  # cached prefix positions
        if q2.shape[2] != ctx.q.shape[2]:  # a trimmed last layer computes the read positions' queries only
            q2 = q2[:, :, ctx.positions - pre]
        z = z.clone()
        for hd in receivers[lay]:
            grp = hd // rep
            qh = q2[:, hd:hd + 1] if "q" in mode else ctx.q[:, hd:hd + 1]
            kh = torch.cat([ctx.k[:, grp:grp + 1, :pre], k2[:, grp:grp + 1]], 2) if "k" in mode else ctx.k[:, grp:grp + 1]
            vh = torch.cat([ctx.v[:, grp:grp + 1, :pre], v2[:, grp:grp + 1]], 2) if "v" in mode else ctx.v[:, grp:grp + 1]
            L = engine.layers[lay]
            z[:, :, hd * dh:(hd + 1) * dh] = attend(qh, kh, vh, ctx.positions, L.scaling, L.window, L.softcap)
        return z

    h0 = base.resid[layers[0], start:][None].expand(B, -1, -1)
    return engine.forward(Plan(read=read, base=base, start=start, resid_at=(layers[0], h0), edit=receive,
                               keep=False)).out


def sender_patching(
    model: LoadedModel,
    pairs: Sequence[Pair],
    receivers: Sequence[Head],
    mode: str = "qkv",
    senders: Sequence[Head] | None = None,
    lam: float | None = None,
    min_gap: float | None = None,
    batch_size: int = 16,
    store_dir: str | None = None,
    store_config: dict[str, Any] | None = None,
    store_name: str = "senders",
    progress: bool = True,
    readout: Readout | None = None,
) -> PatchResult:
    """Path-patching sender effects on ``receivers`` for every candidate sender and pair (SPEC.md §5).

    Args:
        receivers: (layer, head) receiver heads R.
        mode: which receiver inputs are patched: "qkv" (default), "kv", "q" (or "k", "v", "qk", "qv").
        senders: candidate senders (default: every head in a layer below the deepest receiver);
            other heads get IE_send = 0 (no path to R).
        readout: the :class:`~headscope.readout.Readout` (λ, min_gap; default ``Readout()``). Sender
            effects are always read in the noising direction (a denoising readout is read as noising).
            ``lam`` / ``min_gap``: the older keywords, building one.
        batch_size: senders per forward pass.
        store_dir: run directory for resumable per-pair results (``store_name`` sub-store).

    Returns:
        PatchResult whose ``.ie`` is Float[Tensor, "pair layer head"] (sender IE, noising).

    Raises:
        ValueError: receivers outside the model or empty, an unknown mode, bad pairs / pairs beyond
            the context; GapError: no pair separates a⁺ from a⁻.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES} (which receiver inputs to patch)")
    readout = replace(Readout.resolve(readout, lam, None, min_gap), direction="noising")
    lam = readout.lam
    recv = check_receivers(model, receivers)
    check_pairs(model, pairs)
    cands = candidate_senders(model, recv) if senders is None else check_receivers(model, senders)
    engine = Engine(model)
    store = None
    if store_dir is not None:
        cfg = {"kind": "senders", "lam": lam, "mode": mode, "receivers": sorted(recv), "senders": sorted(cands),
               **(store_config or {})}
        cfg["pairs"] = [hash_pair(p) for p in pairs]
        store = Store(store_dir, cfg, name=store_name)
    g = model.geometry
    n = len(pairs)
    patched = torch.full((n, g.n_layers, g.n_heads), math.nan, dtype=torch.float64)
    m_clean = torch.empty(n, dtype=torch.float64)
    m_corr = torch.empty(n, dtype=torch.float64)
    for i, pair in enumerate(tqdm(pairs, desc="sender patching", unit="pair", disable=not progress)):
        key = f"pair{i:05d}"
        if store is not None and store.has(key):
            res = store.get(key)
        else:
            res = _pair_sender_effects(engine, pair, recv, cands, mode, lam, batch_size)
            if store is not None:
                store.put(key, res)
        patched[i] = res["patched"]
        m_clean[i] = res["m_clean"]
        m_corr[i] = res["m_corrupt"]
    return finish(patched, m_clean, m_corr, readout)


def sender_ie(
    model: LoadedModel,
    pairs: Sequence[Pair],
    receivers: Sequence[Head],
    mode: str = "qkv",
    **kwargs: Any,
) -> Float[Tensor, "pair layer head"]:
    """Sender IE of every head on ``receivers`` for every pair (NaN rows for skipped pairs).

    See :func:`sender_patching` for the arguments and errors.
    """
    return sender_patching(model, pairs, receivers, mode=mode, **kwargs).ie


@dataclass
class SenderRounds:
    """The iterated sender search (SPEC.md §5).

    rounds: one dict per round: ``receivers`` (list of (layer, head)), ``ie_send``
        (Float[Tensor, "layer head"], mean over used pairs), ``top`` (the top set after the round).
    ie_send: Float[Tensor, "layer head"], per head the largest mean sender IE over the rounds.
    ie_send_pairs: Float[Tensor, "pair layer head"], per-pair values of the round that gave ie_send.
    converged: whether the top set stopped changing before ``max_rounds``.
    """

    rounds: list[dict[str, Any]] = field(default_factory=list)
    ie_send: Tensor | None = None
    ie_send_pairs: Tensor | None = None
    converged: bool = False


def _top_set(score: Tensor, k: int) -> list[Head]:
    flat = torch.nan_to_num(score, nan=-math.inf).flatten()
    idx = torch.argsort(flat, descending=True, stable=True)[:k].tolist()
    H = score.shape[1]
    return sorted((i // H, i % H) for i in idx)


def iterate_senders(
    model: LoadedModel,
    pairs: Sequence[Pair],
    ie_recv: Float[Tensor, "layer head"],
    top_k: int = 10,
    max_rounds: int = 3,
    mode: str = "qkv",
    store_dir: str | None = None,
    store_config: dict[str, Any] | None = None,
    progress: bool = True,
    **kwargs: Any,
) -> SenderRounds:
    """Senders become receivers until the top set stops changing, or ``max_rounds`` rounds.

    Round 1 uses the top ``top_k`` heads by receiver IE as receivers. After each round the top set
    is the top ``top_k`` heads by max(IE_recv, IE_send so far); the heads of the top set that have
    not been receivers yet are the next round's receivers. The search stops when the top set equals
    the previous one (or has no new head), or after ``max_rounds``.

    Raises:
        ValueError: top_k < 1, max_rounds < 1, and as :func:`sender_patching`.
    """
    if top_k < 1 or max_rounds < 1:
        raise ValueError(f"top_k={top_k} and max_rounds={max_rounds} must both be >= 1")
    g = model.geometry
    recv_mean = ie_recv.double()
    top = _top_set(recv_mean, top_k)
    receivers = list(top)
    seen: set[Head] = set()
    out = SenderRounds()
    best = torch.zeros(g.n_layers, g.n_heads, dtype=torch.float64)
    best_pairs = torch.zeros(len(pairs), g.n_layers, g.n_heads)
    for r in range(max_rounds):
        seen.update(receivers)
        if all(layer == 0 for layer, _ in receivers):
            res_mean = torch.zeros_like(best)
            res_pairs = torch.zeros_like(best_pairs)
        else:
            res = sender_patching(
                model, pairs, receivers, mode=mode, store_dir=store_dir, store_config=store_config,
                store_name=f"senders_round{r + 1}", progress=progress, **kwargs,
            )
            res_pairs = res.ie
            res_mean = torch.nanmean(res.ie.double(), 0)
        better = res_mean > best
        best = torch.where(better, res_mean, best)
        best_pairs = torch.where(better[None], res_pairs, best_pairs)
        new_top = _top_set(torch.maximum(recv_mean, best), top_k)
        out.rounds.append({"round": r + 1, "receivers": list(receivers), "ie_send": res_mean.float(), "top": new_top})
        nxt = [h for h in new_top if h not in seen]
        if new_top == top or not nxt:
            out.converged = True
            top = new_top
            break
        top = new_top
        receivers = nxt
    out.ie_send = best.float()
    out.ie_send_pairs = best_pairs
    return out
