"""The certified screen (``verify="auto"``): AtP and layer-block probes, refined best first, then exact
verification until the top ``top_k`` is certified. Entry points: :func:`screen_auto`, and
:func:`screen_then_verify` (a fixed share of heads verified exactly, plus random spot checks; or ``"auto"``).

1. AtP (Nanda 2023) of every head: exact clean and corrupted forwards (kept for step 4) and one
   forward + backward in ``probe_dtype`` for the gradient.
2. Block probes (:func:`~headscope.patching.attribution.probe_blocks_ie`): the hook_z of all heads of
   ``block`` consecutive layers patched at once, linear maps in ``probe_dtype`` (an approximation:
   residual stream, norms, softmax in the model's dtype). Where AtP is right, a unit's IE is about the
   sum of its heads' AtP; a residual ``|IE_unit − Σ_h AtP_h|`` above ``flag`` × (the ``top_k``-th
   largest AtP) flags the unit as one where AtP's linearisation fails (saturated attention downstream,
   cancellation; Kramár et al. 2024). Each head gets an optimistic score: ``AtP·s + |residual|`` of the
   smallest probed unit (:class:`Block`, :class:`Layer`, :class:`Group`) that holds it, with
   ``s = atp_slack`` for a positive AtP (1 otherwise), and ``probe + probe_margin`` once probed alone.
   The slack covers heads whose AtP error is hidden by opposite errors of other heads in their unit.
3. **Refine** (:meth:`_Screen.refine`), best first: while an unrefined flagged unit has a head whose
   score is above the ``top_k``-th score, refine it (block -> its layers -> its KV groups -> its heads,
   each level's probes in one batch, same residual test), unless verifying its competitive heads exactly
   is cheaper (an exact verification counted as ``verify_cost`` probes; "competitive" against the
   ``top_k``-th exact value so far, or before that a guess: the ``top_k``-th AtP after giving each flagged
   block's residual to its top head; the guess only steers cost, never the certificate).
4. **Certify** (:meth:`_Screen.verify`): exact verification (exact engine, ``receiver_patching``) of the
   heads that lead by that score (``top_k`` first, then ``max(1, top_k // 5)`` a round), until the
   ``top_k``-th largest verified exact mean IE is at least every unverified head's score.

The ranking never uses an exact number it did not measure; the certificate holds as far as the
optimistic scores bound the exact IE (``stats.certified`` says whether the loop stopped by it or ran
out of heads). They are not a proven bound: a unit's residual can be small because its heads' AtP
errors cancel. Without slack (``atp_slack=1``) this happened on the SmolLM2 ``niah_single`` pair of
seed 1: L4H4 (exact IE 0.083, rank 8; AtP 0.033) sat in a block whose AtP sum matched the block probe,
was never refined, and was missed (recall@10 0.9; 1.0 on the 7 other single-pair seeds 0–7). With the
default ``atp_slack=2`` all 8 seeds give the exact top 10 (12–24 heads verified instead of 10–17).
"""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence, Union

import torch
from scipy import stats as scipy_stats
from torch import Tensor

from ..rank_config import ScreenConfig
from ..errors import HeadscopeInputError
from ..models import LoadedModel
from ..readout import Direction, Readout
from ..tasks.base import Pair
from .attribution import ScreenResult, _attribution, attribution_ie, probe_blocks_ie, probe_ie
from .receivers import receiver_patching

Head = tuple[int, int]


@dataclass(frozen=True, order=True)
class Block:
    """Work unit: every head of layers ``l0 <= layer < l1`` (block number ``index``)."""

    index: int
    l0: int
    l1: int


@dataclass(frozen=True, order=True)
class Layer:
    """Work unit: every head of one layer."""

    layer: int


@dataclass(frozen=True, order=True)
class Group:
    """Work unit: the query heads of KV group ``kv`` of ``layer`` (one head when there is no GQA)."""

    layer: int
    kv: int


Unit = Union[Block, Layer, Group]


@dataclass
class Step:
    """One round's plan: units verified directly, units refined by probes, heads verified exactly."""

    direct: list[Unit] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    verify: list[Head] = field(default_factory=list)

    @property
    def refines(self) -> bool:
        return bool(self.blocks or self.layers or self.groups)

    def holds(self, u: Unit) -> bool:
        return u in self.direct or u in self.blocks or u in self.layers or u in self.groups


@dataclass
class ScreenStats:
    """What the screen did (the typed form of ``ScreenResult.details``; seconds per phase)."""

    n_verified: int = 0
    n_probed: int = 0
    n_group_probes: int = 0
    n_layer_probes: int = 0
    flagged_layers: list[int] = field(default_factory=list)
    refined_blocks: list[tuple[int, int]] = field(default_factory=list)
    refined_layers: list[int] = field(default_factory=list)
    flag_tol: float = 0.0
    theta_guess: float = 0.0
    certified: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    n_unverified: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("flagged_layers", "refined_blocks", "refined_layers"):
            d[k] = sorted(d[k])
        return d


class _Screen:
    """The state of the best-first loop: per head its optimistic score and the unrefined unit holding it."""

    def __init__(self, model: LoadedModel, cfg: Any, est: Tensor, blk: Tensor, blocks: list[Block], probe: Any):
        g = model.geometry
        self.g, self.cfg, self.est, self.probe = g, cfg, est, probe
        self.rep = g.n_heads // g.n_kv_heads
        self.score = est.clone()
        tau = float(est.flatten().sort(descending=True).values[cfg.top_k - 1])
        self.stats = ScreenStats(flag_tol=max(cfg.flag * abs(tau), 1e-3))
        self.unit: dict[Head, Unit | None] = {}
        self.exact_mean: dict[Head, float] = {}
        self.verified: list[Head] = []
        self.probed_mean: dict[Head, float] = {}
        gv = est.clone()  # guess of the final top_k-th exact IE: each flagged block's residual to its top head
        for b in blocks:
            r = float(blk[b.index]) - float(est[b.l0 : b.l1].sum())
            if self.flags(r):
                j = int(est[b.l0 : b.l1].flatten().argmax())
                gv[b.l0 + j // g.n_heads, j % g.n_heads] += abs(r)
            if b.l1 - b.l0 == 1:
                self.set_layer(b.l0, r)
                continue
            self.score[b.l0 : b.l1] = self.opt(est[b.l0 : b.l1]) + abs(r)
            for lay in range(b.l0, b.l1):
                for h in range(g.n_heads):
                    self.unit[(lay, h)] = b if self.flags(r) else None
        self.stats.theta_guess = float(gv.flatten().sort(descending=True).values[cfg.top_k - 1])

    # ---- scores and units
    def flags(self, r: float) -> bool:
        return abs(r) > self.stats.flag_tol

    def opt(self, e: Tensor) -> Tensor:
        """AtP's optimistic value before a unit residual is added: positive AtP times ``atp_slack``."""
        return torch.where(e > 0, e * self.cfg.atp_slack, e)

    def set_layer(self, lay: int, r: float) -> None:
        self.score[lay] = self.opt(self.est[lay]) + abs(r)
        if self.flags(r):
            self.stats.flagged_layers.append(lay)
        for h in range(self.g.n_heads):
            self.unit[(lay, h)] = Layer(lay) if self.flags(r) else None

    def heads_of(self, u: Unit) -> list[Head]:
        if isinstance(u, Block):
            return [(lay, h) for lay in range(u.l0, u.l1) for h in range(self.g.n_heads)]
        if isinstance(u, Layer):
            return [(u.layer, h) for h in range(self.g.n_heads)]
        return [(u.layer, h) for h in range(u.kv * self.rep, (u.kv + 1) * self.rep)]

    def refine_cost(self, u: Unit) -> float:
        """Probes a refinement of ``u`` costs."""
        if isinstance(u, Block):
            return u.l1 - u.l0
        if isinstance(u, Layer):
            return self.g.n_kv_heads + self.rep if self.rep > 1 else self.g.n_heads
        return self.rep

    def value(self, lh: Head) -> float:
        return self.exact_mean[lh] if lh in self.exact_mean else float(self.score[lh])

    # ---- one round
    def plan(self, n_next: int) -> Step:
        """Walk the heads best first: refine (or verify directly) the units of competitive heads, queue
        up to ``n_next`` competitive heads without a unit for exact verification."""
        step, n_ex, k = Step(), 0, self.cfg.top_k
        vals = sorted(self.exact_mean.values(), reverse=True)
        theta = vals[k - 1] if len(vals) >= k else self.stats.theta_guess  # steers cost only
        for lh in sorted(self.unit, key=self.value, reverse=True):
            if lh in self.exact_mean:
                n_ex += 1
                if n_ex >= k:
                    break
                continue
            u = self.unit[lh]
            if u is None:
                step.verify.append(lh)
                if len(step.verify) >= n_next:
                    break
            elif not step.holds(u):
                n_comp = sum(1 for lh2 in self.heads_of(u) if float(self.score[lh2]) > theta)
                if n_comp * self.cfg.verify_cost <= self.refine_cost(u):
                    step.direct.append(u)
                else:
                    {Block: step.blocks, Layer: step.layers, Group: step.groups}[type(u)].append(u)  # type: ignore[index]
        for u in step.direct:
            for lh2 in self.heads_of(u):
                self.unit[lh2] = None  # keeps its optimistic score; verified once it is competitive
        return step

    def refine(self, step: Step) -> None:
        """Probe the step's blocks (into layers), layers (into KV groups) and groups (into heads)."""
        g, rep, st = self.g, self.rep, self.stats
        if step.blocks:
            lays = [lay for b in sorted(step.blocks) for lay in range(b.l0, b.l1)]
            lp = self.probe([(lay, list(range(g.n_heads))) for lay in lays])
            st.n_layer_probes += len(lays)
            st.refined_blocks += [(b.l0, b.l1) for b in step.blocks]
            for lay, v in zip(lays, lp.tolist()):
                self.set_layer(lay, v - float(self.est[lay].sum()))
        groups = list(step.groups)
        layers = sorted(u.layer for u in step.layers)
        st.refined_layers += layers
        if layers and rep > 1:
            units = [(lay, list(range(k * rep, (k + 1) * rep))) for lay in layers for k in range(g.n_kv_heads)]
            grp = self.probe(units)
            st.n_group_probes += len(units)
            for (lay, hs), v in zip(units, grp.tolist()):
                r = abs(v - float(self.est[lay, hs].sum()))
                self.score[lay, hs] = self.opt(self.est[lay, hs]) + r
                for h in hs:
                    self.unit[(lay, h)] = Group(lay, hs[0] // rep) if r > st.flag_tol else None
        elif layers:  # no GQA: a layer refines straight into its heads
            for lay in layers:
                for h in range(g.n_heads):
                    self.unit[(lay, h)] = Group(lay, h)
            groups = sorted(set(groups) | {Group(lay, h) for lay in layers for h in range(g.n_heads)})
        if groups:
            cand = sorted((u.layer, h) for u in groups for h in range(u.kv * rep, (u.kv + 1) * rep)
                          if isinstance(self.unit[(u.layer, h)], Group))
            probe = self.probe([(lay, [h]) for lay, h in cand])
            st.n_probed += len(cand)
            for (lay, h), v in zip(cand, probe.tolist()):
                self.score[lay, h] = v + self.cfg.probe_margin
                self.probed_mean[(lay, h)] = v
                self.unit[(lay, h)] = None

    def result(self, atp: Tensor, patched: Tensor, res: Any, readout: Readout, secs: dict[str, float]) -> Any:
        """The ScreenResult: exact IE of the verified heads, the mean probe of heads probed alone, AtP elsewhere."""
        from .receivers import finish

        assert res is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # receiver_patching warned about skipped pairs already
            exact = finish(patched, res.m_clean, res.m_corrupt, readout)
        ie = atp.clone()
        for (lay, h), v in self.probed_mean.items():
            ie[:, lay, h] = v  # the mean probe (per-pair probes are not kept)
        for lay, h in self.verified:
            ie[:, lay, h] = exact.ie[:, lay, h]
        n = self.g.n_layers * self.g.n_heads
        self.stats.n_verified, self.stats.n_unverified, self.stats.seconds = len(self.verified), n - len(self.verified), secs
        kth = sorted(self.exact_mean.values(), reverse=True)[min(self.cfg.top_k, len(self.exact_mean)) - 1]
        return ScreenResult(ie=ie, atp=atp, exact=exact, verified=self.verified, spot_checked=[], threshold=kth,
                            spot_hits=0, missed_estimate=math.nan, missed_upper95=math.nan,
                            details=self.stats.as_dict(), stats=self.stats)

    def record_exact(self, heads: Sequence[Head], res: Any) -> None:
        """Exact results of verified heads (a :class:`~headscope.patching.receivers.PatchResult`)."""
        self.verified += list(heads)
        for lay, h in heads:
            self.exact_mean[(lay, h)] = float(res.ie[res.used, lay, h].double().mean())


def screen_auto(
    model: LoadedModel, pairs: Sequence[Pair], top_k: int = 10, lam: float | None = None,
    direction: str | None = None, min_gap: float | None = None, flag: float = 0.5,
    probe_dtype: torch.dtype = torch.bfloat16, probe_margin: float = 0.01, batch_size: int | None = None,
    store_dir: str | None = None, store_config: dict[str, Any] | None = None, keep_bytes: float = 2e9,
    progress: bool = True, verify_cost: float = 3.0, block: int = 4, atp_slack: float = 2.0,
    readout: Readout | None = None, config: Any = None,
) -> Any:
    """Screen with AtP and layer-block probes, refine best first, then verify exactly until the top
    ``top_k`` is certified (the algorithm: :mod:`headscope.patching.screen`).

    Args: ``config`` (a :class:`~headscope.rank_config.ScreenConfig`) or its fields as keywords (``top_k``,
    ``flag``, ``probe_dtype``, ``probe_margin``, ``verify_cost``, ``block``, ``atp_slack``, ``keep_bytes``);
    ``readout`` (or ``lam`` / ``direction`` / ``min_gap``); the rest as ``receiver_patching``.

    Returns:
        ScreenResult: ``ie`` Float[Tensor, "pair layer head"], exact where verified, the mean probe where
        probed alone, AtP elsewhere; ``threshold`` the ``top_k``-th verified exact mean IE; ``stats``
        (:class:`ScreenStats`, also as the ``details`` dict); spot-check fields 0 / NaN.

    Raises:
        HeadscopeInputError (a ValueError): top_k outside 1..#heads, atp_slack < 1, other bad settings.
    """
    from .engine import Engine

    cfg = config or ScreenConfig(top_k=top_k, flag=flag, probe_dtype=probe_dtype, probe_margin=probe_margin,
                                 verify_cost=verify_cost, block=block, atp_slack=atp_slack, keep_bytes=keep_bytes)
    cfg.check_model(model.geometry)
    if cfg.top_k > model.geometry.n_layers * model.geometry.n_heads:
        raise HeadscopeInputError(f"top_k={cfg.top_k} must be within 1..{model.geometry.n_layers * model.geometry.n_heads}")
    readout, g, t0 = Readout.resolve(readout, lam, direction, min_gap), model.geometry, time.perf_counter()
    low = Engine(model, matmul_dtype=cfg.torch_probe_dtype)
    atp, m_c, m_x, states = _attribution(model, pairs, readout, progress, cfg.keep_bytes, grad_engine=low)
    secs = {"atp": time.perf_counter() - t0}
    used = [i for i in range(len(pairs)) if abs(float(m_c[i] - m_x[i])) >= readout.min_gap] or list(range(len(pairs)))
    sub, sub_states = [pairs[i] for i in used], {k: states[i] for k, i in enumerate(used) if i in states}
    blocks = [Block(j, b, min(b + cfg.block, g.n_layers)) for j, b in enumerate(range(0, g.n_layers, cfg.block))]
    blk = probe_blocks_ie(low, sub_states, sub, [(b.l0, b.l1) for b in blocks], readout).mean(0)
    secs["block_probes"] = time.perf_counter() - t0 - secs["atp"]
    s = _Screen(model, cfg, atp[used].double().mean(0), blk, blocks,
                lambda units: probe_ie(low, sub_states, sub, units, readout, batch_size=batch_size).mean(0))
    patched = torch.full((len(pairs), g.n_layers, g.n_heads), math.nan, dtype=torch.float64)
    n_next, t_probe, res = cfg.top_k, 0.0, None
    while True:
        step = s.plan(n_next)
        if step.direct and not step.refines:
            continue
        if not (step.refines or step.verify):
            s.stats.certified = True
            break
        if step.refines:  # refined scores first: they may drop heads out of the verification queue
            t1 = time.perf_counter()
            s.refine(step)
            t_probe += time.perf_counter() - t1
            continue
        res = receiver_patching(model, pairs, readout=readout, batch_size=batch_size, store_dir=store_dir,
                                store_config=store_config, progress=progress, heads=step.verify, states=states)
        patched[:, [a for a, _ in step.verify], [b for _, b in step.verify]] = \
            res.patched[:, [a for a, _ in step.verify], [b for _, b in step.verify]]
        s.record_exact(step.verify, res)
        n_next = max(1, cfg.top_k // 5)
        if len(s.verified) == g.n_layers * g.n_heads:
            s.stats.certified = True
            break
    del low
    secs["refine_probes"] = t_probe
    secs["verify"] = time.perf_counter() - t0 - sum(secs.values())
    return s.result(atp, patched, res, readout, secs)


def screen_then_verify(
    model: LoadedModel,
    pairs: Sequence[Pair],
    verify: int | float | str = 0.1,
    spot_checks: int | float = 0.05,
    lam: float | None = None,
    direction: Direction | None = None,
    min_gap: float | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    store_dir: str | None = None,
    store_config: dict[str, Any] | None = None,
    progress: bool = True,
    top_k: int = 10,
    readout: Readout | None = None,
    screen: Any = None,
) -> ScreenResult:
    """AtP over all heads, then exact patching of the screen's top heads and of random spot checks.

    Args:
        verify: heads verified exactly: a count, or a fraction of all heads (default 10 %); or
            ``"auto"``: the layer-probe screen of :func:`screen_auto`, which verifies until its top
            ``top_k`` is certified (``spot_checks`` and ``seed`` are not used then).
        spot_checks: unverified heads measured exactly at random: count or fraction of the rest.
        seed: RNG of the spot checks.
        readout: the :class:`~headscope.readout.Readout` (or the older ``lam`` / ``direction`` / ``min_gap``).
        screen: a :class:`~headscope.rank_config.ScreenConfig` for ``verify="auto"`` (its ``top_k`` is capped
            at the model's head count); default from ``top_k``.
        Other arguments as :func:`~headscope.patching.receivers.receiver_patching`.

    Returns:
        ScreenResult. A spot-checked head counts as a miss when its exact mean IE reaches the
        smallest exact mean IE among the top-k verified heads (k = number verified // 2), i.e. it
        would have entered the upper half of the verified set; the miss estimate scales the hit
        rate to all unverified heads, with a one-sided Clopper–Pearson 95 % upper bound on the
        rate (beta.ppf(0.95, x + 1, n − x); 1.0 when all n spot checks are misses, x = n, where
        that expression is NaN).
    """
    readout = Readout.resolve(readout, lam, direction, min_gap)
    if verify == "auto":
        g = model.geometry
        screen = screen or ScreenConfig(top_k=top_k)
        # a model with fewer heads than top_k: certify them all
        screen = replace(screen, top_k=min(screen.top_k, g.n_layers * g.n_heads))
        return screen_auto(model, pairs, readout=readout, batch_size=batch_size, store_dir=store_dir,
                           store_config=store_config, progress=progress, config=screen)
    if isinstance(verify, str):
        raise ValueError(f"verify must be a count, a fraction or 'auto', not {verify!r}")
    g = model.geometry
    n_total = g.n_layers * g.n_heads
    k_ver = verify if isinstance(verify, int) else max(1, round(verify * n_total))
    if not 1 <= k_ver <= n_total:
        raise ValueError(f"verify={verify} gives {k_ver} heads; must be within 1..{n_total}")
    atp, m_c, m_x = attribution_ie(model, pairs, progress=progress, readout=readout)
    gap_ok = (m_c - m_x).abs() >= readout.min_gap
    mean_atp = atp[gap_ok].double().mean(0) if bool(gap_ok.any()) else atp.double().mean(0)
    order = torch.argsort(mean_atp.flatten(), descending=True).tolist()
    verified = [(i // g.n_heads, i % g.n_heads) for i in order[:k_ver]]
    rest = [(i // g.n_heads, i % g.n_heads) for i in order[k_ver:]]
    n_spot = spot_checks if isinstance(spot_checks, int) else round(spot_checks * len(rest))
    n_spot = max(0, min(len(rest), n_spot))
    spot = sorted(random.Random(seed).sample(rest, n_spot))
    exact = receiver_patching(
        model, pairs, readout=readout, batch_size=batch_size,
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
    upper = float(scipy_stats.beta.ppf(0.95, hits + 1, n_spot - hits)) if 0 < n_spot and hits < n_spot else 1.0
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
