"""Attribution patching (AtP) as a screen, and screen-then-verify.

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
therefore probes whole layers (and then KV groups and heads) where the layer's probed IE departs
from the sum of its heads' AtP; that layer residual is 0.37 for layer 16.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from jaxtyping import Float
from scipy import stats
from torch import Tensor
from tqdm.auto import tqdm

from ..models import LoadedModel
from ..readout import DEFAULT_LAMBDA, logit_diff
from ..tasks.base import Pair
from .engine import Engine, head_slice
from .receivers import (
    DEFAULT_MIN_GAP,
    Direction,
    PairState,
    _auto_batch,
    PatchResult,
    check_pairs,
    finish,
    receiver_patching,
    sequences,
)


def attribution_ie(
    model: LoadedModel,
    pairs: Sequence[Pair],
    lam: float = DEFAULT_LAMBDA,
    direction: Direction = "noising",
    progress: bool = False,
) -> tuple[Float[Tensor, "pair layer head"], Tensor, Tensor]:
    """AtP estimate of receiver IE (eq. 10) for every head -> (IE estimate, m(x), m(x')).

    Cost per pair: two forwards and one backward, independent of the number of heads.

    Raises:
        ValueError: as :func:`~headscope.patching.receivers.receiver_patching`.
    """
    ie, m_c, m_x, _ = _attribution(model, pairs, lam, direction, progress, keep_bytes=0)
    return ie, m_c, m_x


def _attribution(
    model: LoadedModel,
    pairs: Sequence[Pair],
    lam: float,
    direction: Direction,
    progress: bool,
    keep_bytes: float,
    grad_engine: Engine | None = None,
) -> tuple[Tensor, Tensor, Tensor, dict[int, PairState]]:
    """:func:`attribution_ie` that also keeps each pair's clean/corrupted passes as a
    :class:`PairState` (for exact verification without re-running them) while they fit in ``keep_bytes``.

    ``grad_engine`` (e.g. a low-precision :class:`Engine`): take the gradient from its pass instead; the
    cached passes, m and the z differences stay those of the exact engine (one extra forward)."""
    check_pairs(model, pairs)
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
            m_base = logit_diff(logits, p.answer, p.counter_answer, lam)
            grads = [gz[:, start:] for gz in torch.autograd.grad(m_base, zs)]
        else:
            base = engine.run(base_seq, read)
            m_base = logit_diff(base.logits, p.answer, p.counter_answer, lam)
            logits, zs, _ = grad_engine.run_suffix(base, base_seq, start, read, grad=True)
            grads = torch.autograd.grad(logit_diff(logits, p.answer, p.counter_answer, lam), zs)
        _, _, src = engine.run_suffix(base, src_seq, start, read)
        m_src = float(logit_diff(src.logits, p.answer, p.counter_answer, lam))
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
            states[i] = PairState(engine, p, lam, direction, runs=runs)
            kept += size
        del logits, zs, grads
    gap = (m_c - m_x)[:, None, None]
    ie = -est / gap if direction == "noising" else est / gap
    return ie.float(), m_c, m_x, states


@dataclass
class ScreenResult:
    """Screen-then-verify outcome.

    ie: Float[Tensor, "pair layer head"], exact IE for verified and spot-checked heads, AtP elsewhere.
    atp: Float[Tensor, "pair layer head"], the AtP screen for every head.
    verified, spot_checked: (layer, head) lists measured exactly.
    missed_estimate: estimated number of unverified heads whose exact mean IE would reach the
        verified top set (spot-check hit rate × unverified count) and its 95 % upper bound.
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


def screen_then_verify(
    model: LoadedModel,
    pairs: Sequence[Pair],
    verify: int | float | str = 0.1,
    spot_checks: int | float = 0.05,
    lam: float = DEFAULT_LAMBDA,
    direction: Direction = "noising",
    min_gap: float = DEFAULT_MIN_GAP,
    seed: int = 0,
    batch_size: int | None = None,
    store_dir: str | None = None,
    store_config: dict[str, Any] | None = None,
    progress: bool = True,
    top_k: int = 10,
) -> ScreenResult:
    """AtP over all heads, then exact patching of the screen's top heads and of random spot checks.

    Args:
        verify: heads verified exactly: a count, or a fraction of all heads (default 10 %); or
            ``"auto"``: the layer-probe screen of :func:`screen_auto`, which verifies until its top
            ``top_k`` is certified (``spot_checks`` and ``seed`` are not used then).
        spot_checks: unverified heads measured exactly at random: count or fraction of the rest.
        seed: RNG of the spot checks.
        Other arguments as :func:`~headscope.patching.receivers.receiver_patching`.

    Returns:
        ScreenResult. A spot-checked head counts as a miss when its exact mean IE reaches the
        smallest exact mean IE among the top-k verified heads (k = number verified // 2), i.e. it
        would have entered the upper half of the verified set; the miss estimate scales the hit
        rate to all unverified heads, with a Clopper–Pearson 95 % upper bound.
    """
    if verify == "auto":
        g = model.geometry
        top_k = min(top_k, g.n_layers * g.n_heads)  # a model with fewer heads than top_k: certify them all
        return screen_auto(model, pairs, top_k=top_k, lam=lam, direction=direction, min_gap=min_gap,
                           batch_size=batch_size, store_dir=store_dir, store_config=store_config,
                           progress=progress)
    if isinstance(verify, str):
        raise ValueError(f"verify must be a count, a fraction or 'auto', not {verify!r}")
    g = model.geometry
    n_total = g.n_layers * g.n_heads
    k_ver = verify if isinstance(verify, int) else max(1, round(verify * n_total))
    if not 1 <= k_ver <= n_total:
        raise ValueError(f"verify={verify} gives {k_ver} heads; must be within 1..{n_total}")
    atp, m_c, m_x = attribution_ie(model, pairs, lam, direction, progress=progress)
    gap_ok = (m_c - m_x).abs() >= min_gap
    mean_atp = atp[gap_ok].double().mean(0) if bool(gap_ok.any()) else atp.double().mean(0)
    order = torch.argsort(mean_atp.flatten(), descending=True).tolist()
    verified = [(i // g.n_heads, i % g.n_heads) for i in order[:k_ver]]
    rest = [(i // g.n_heads, i % g.n_heads) for i in order[k_ver:]]
    n_spot = spot_checks if isinstance(spot_checks, int) else round(spot_checks * len(rest))
    n_spot = max(0, min(len(rest), n_spot))
    spot = sorted(random.Random(seed).sample(rest, n_spot))
    exact = receiver_patching(
        model, pairs, lam=lam, direction=direction, min_gap=min_gap, batch_size=batch_size,
        store_dir=store_dir, store_config=store_config, progress=progress, heads=verified + spot,
    )
    ie = atp.clone()
    for layer, h in verified + spot:
        ie[:, layer, h] = exact.ie[:, layer, h]
    used = exact.used
    ver_means = sorted((float(exact.ie[used, layer, h].mean()) for layer, h in verified), reverse=True)
    threshold = ver_means[max(0, len(ver_means) // 2 - 1)]
    hits = sum(1 for layer, h in spot if float(exact.ie[used, layer, h].mean()) >= threshold)
    n_unver = len(rest) - n_spot
    rate = hits / n_spot if n_spot else math.nan
    upper = float(stats.beta.ppf(0.95, hits + 1, n_spot - hits)) if n_spot else 1.0
    return ScreenResult(
        ie=ie,
        atp=atp,
        exact=exact,
        verified=verified,
        spot_checked=spot,
        threshold=threshold,
        spot_hits=hits,
        missed_estimate=rate * n_unver if n_spot else math.nan,
        missed_upper95=upper * n_unver,
        details={"n_verified": k_ver, "n_spot": n_spot, "n_unverified": n_unver},
    )


def recall_at_k(a: np.ndarray, b: np.ndarray, k: int = 10) -> float:
    """|top-k(a) ∩ top-k(b)| / k for two score arrays of the same shape (NaN = -inf)."""
    fa = np.nan_to_num(np.asarray(a, float).ravel(), nan=-np.inf)
    fb = np.nan_to_num(np.asarray(b, float).ravel(), nan=-np.inf)
    ta = set(np.argsort(-fa, kind="stable")[:k].tolist())
    tb = set(np.argsort(-fb, kind="stable")[:k].tolist())
    return len(ta & tb) / k


@torch.no_grad()
def probe_ie(
    engine: Engine,
    states: dict[int, PairState],
    pairs: Sequence[Pair],
    patches: Sequence[tuple[int, Sequence[int]]],
    lam: float,
    direction: Direction,
    batch_size: int | None = None,
) -> Float[Tensor, "pair patch"]:
    """IE (eq. 10) of patching each ``(layer, heads)`` group of heads at once, per pair, with ``engine``
    (e.g. a low-precision :class:`Engine` for screening). ``patches`` must be in ascending layer order.
    Pairs without a state in ``states`` get a new one (computed with ``engine``)."""
    g = engine.g
    out = torch.empty(len(pairs), len(patches), dtype=torch.float64)
    for i, p in enumerate(pairs):
        st = states[i] if i in states else PairState(engine, p, lam, direction)
        bs = batch_size or _auto_batch(engine.model, st.total - st.start, st.total, 2e9)
        gap = st.m_clean - st.m_corrupt
        for c0 in range(0, len(patches), bs):
            chunk = patches[c0 : c0 + bs]
            entries = []
            for layer, heads in chunk:
                z = st.base.z[layer, st.start :].clone()
                for h in heads:
                    sl = head_slice(h, g.d_head)
                    z[:, sl] = st.src.z[layer, st.start :, sl]
                entries.append((layer, z[None]))
            m = logit_diff(engine.patched_logits_multi(st.base, entries, st.start, st.read),
                           p.answer, p.counter_answer, lam).double().cpu()
            out[i, c0 : c0 + len(chunk)] = (st.m_clean - m) / gap if direction == "noising" else (m - st.m_corrupt) / gap
    return out


def screen_auto(
    model: LoadedModel,
    pairs: Sequence[Pair],
    top_k: int = 10,
    lam: float = DEFAULT_LAMBDA,
    direction: Direction = "noising",
    min_gap: float = DEFAULT_MIN_GAP,
    flag: float = 0.5,
    probe_dtype: torch.dtype = torch.bfloat16,
    probe_margin: float = 0.01,
    batch_size: int | None = None,
    store_dir: str | None = None,
    store_config: dict[str, Any] | None = None,
    keep_bytes: float = 2e9,
    progress: bool = True,
) -> ScreenResult:
    """Screen with AtP and whole-layer probes, then verify exactly until the top ``top_k`` is certified.

    1. AtP (Nanda 2023) of every head: exact clean and corrupted forwards (kept for step 4) and one
       forward + backward in ``probe_dtype`` for the gradient.
    2. Layer probes: each layer's hook_z patched as a whole (all heads at once), with the linear maps in
       ``probe_dtype`` (an approximation: residual stream, norms, softmax in the model's dtype). Where
       AtP is right, a layer's IE is about the sum of its heads' AtP; a residual
       ``|IE_layer − Σ_h AtP_h|`` above ``flag`` × (the ``top_k``-th largest AtP) flags the layer as one
       where AtP's linearisation fails (saturated attention downstream, cancellation; Kramár et al. 2024).
    3. In flagged layers, probes of each KV group (its heads at once) and the same residual test per
       group; then probes of each head of a flagged group (all in ``probe_dtype``). Each head gets an
       optimistic score: probed heads ``probe + probe_margin``, others ``AtP + |residual|`` of the
       smallest probed unit (group or layer) that holds it.
    4. Exact verification (exact engine, :func:`receiver_patching`) in order of that score, in chunks
       (``top_k + 2`` first, then ``top_k // 2``),
       until the ``top_k``-th largest verified exact mean IE is at least the largest unverified score.

    The ranking never uses an exact number it did not measure; the certificate in step 4 holds as
    far as the optimistic scores bound the exact IE (``details["certified"]`` says whether the loop
    stopped by it or ran out of heads).

    Returns:
        ScreenResult: ``ie`` exact where verified, the probe where probed, AtP elsewhere; ``threshold``
        the ``top_k``-th verified exact mean IE; spot-check fields are 0 / NaN.
    """
    g = model.geometry
    n_total = g.n_layers * g.n_heads
    if not 1 <= top_k <= n_total:
        raise ValueError(f"top_k={top_k} must be within 1..{n_total}")
    t0 = time.perf_counter()
    secs: dict[str, float] = {}
    low = Engine(model, matmul_dtype=probe_dtype)
    atp, m_c, m_x, states = _attribution(model, pairs, lam, direction, progress, keep_bytes, grad_engine=low)
    secs["atp"] = time.perf_counter() - t0
    gap_ok = (m_c - m_x).abs() >= min_gap
    used = [i for i in range(len(pairs)) if bool(gap_ok[i])] or list(range(len(pairs)))
    est = atp[used].double().mean(0)  # [L, H]
    sub = [pairs[i] for i in used]
    sub_states = {k: states[i] for k, i in enumerate(used) if i in states}
    lay = probe_ie(low, sub_states, sub, [(lay_, list(range(g.n_heads))) for lay_ in range(g.n_layers)],
                   lam, direction, batch_size).mean(0)
    resid = lay - est.sum(1)
    secs["layer_probes"] = time.perf_counter() - t0 - sum(secs.values())
    tau = float(est.flatten().sort(descending=True).values[top_k - 1])
    tol = max(flag * abs(tau), 1e-3)
    flagged = [lay_ for lay_ in range(g.n_layers) if abs(float(resid[lay_])) > tol]
    score = est + resid.abs()[:, None]
    # KV-group probes in flagged layers, then head probes in flagged groups
    rep = g.n_heads // g.n_kv_heads
    groups = [(lay_, list(range(k * rep, (k + 1) * rep))) for lay_ in flagged for k in range(g.n_kv_heads)]
    cand: list[tuple[int, int]] = []
    if groups and rep > 1:
        grp = probe_ie(low, sub_states, sub, groups, lam, direction, batch_size).mean(0)
        for (lay_, hs), v in zip(groups, grp.tolist()):
            r = abs(v - float(est[lay_, hs].sum()))
            score[lay_, hs] = est[lay_, hs] + r
            if r > tol:
                cand += [(lay_, h) for h in hs]
    else:
        cand = [(lay_, h) for lay_, hs in groups for h in hs]
    ie = atp.clone()
    if cand:
        probe = probe_ie(low, sub_states, sub, [(lay_, [h]) for lay_, h in cand], lam, direction, batch_size).mean(0)
        for (lay_, h), v in zip(cand, probe.tolist()):
            score[lay_, h] = v + probe_margin
            ie[:, lay_, h] = v  # the mean probe (per-pair probes are not kept)
    del low
    secs["group_head_probes"] = time.perf_counter() - t0 - sum(secs.values())
    order = torch.argsort(score.flatten(), descending=True).tolist()
    heads_order = [(i // g.n_heads, i % g.n_heads) for i in order]
    verified: list[tuple[int, int]] = []
    exact_mean: dict[tuple[int, int], float] = {}
    patched = torch.full((len(pairs), g.n_layers, g.n_heads), math.nan, dtype=torch.float64)
    res = None
    n_next = top_k + 2
    certified = False
    while len(verified) < n_total:
        new = heads_order[len(verified) : len(verified) + n_next]
        verified += new
        res = receiver_patching(
            model, pairs, lam=lam, direction=direction, min_gap=min_gap, batch_size=batch_size,
            store_dir=store_dir, store_config=store_config, progress=progress, heads=new, states=states,
        )
        for lay_, h in new:
            patched[:, lay_, h] = res.patched[:, lay_, h]
            exact_mean[(lay_, h)] = float(res.ie[res.used, lay_, h].double().mean())
        kth = sorted(exact_mean.values(), reverse=True)[min(top_k, len(exact_mean)) - 1]
        rest = [float(score[lh]) for lh in heads_order[len(verified) :]]
        if len(exact_mean) >= top_k and (not rest or kth >= max(rest)):
            certified = True
            break
        n_next = max(1, top_k // 2)
    assert res is not None
    secs["verify"] = time.perf_counter() - t0 - sum(secs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # receiver_patching warned about skipped pairs already
        exact = finish(patched, res.m_clean, res.m_corrupt, direction, lam, min_gap)
    for lay_, h in verified:
        ie[:, lay_, h] = exact.ie[:, lay_, h]
    return ScreenResult(
        ie=ie, atp=atp, exact=exact, verified=verified, spot_checked=[], threshold=kth, spot_hits=0,
        missed_estimate=math.nan, missed_upper95=math.nan,
        details={"n_verified": len(verified), "n_probed": len(cand), "n_group_probes": len(groups), "flagged_layers": flagged,
                 "flag_tol": tol, "certified": certified, "seconds": secs, "n_unverified": n_total - len(verified)},
    )
