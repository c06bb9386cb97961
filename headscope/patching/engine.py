"""The patching engine: one forward pass over a :class:`~headscope.patching.pass_plan.Plan`, for every
architecture an adapter describes (:mod:`headscope.arch`).

Patched passes reuse everything a patch cannot change (the reuse that makes exact patching cheap):

* a patch of head ``h`` in layer ``l`` leaves layers ``< l`` and the attention pattern of layer ``l``
  as they were, so a patched row joins the batch at layer ``l`` from the cached residual stream,
  with its hook_z given (:class:`~headscope.patching.pass_plan.Entry`);
* where clean and corrupted prompts agree up to position ``p``, every activation at positions
  ``< p`` is identical in every run (causal attention), so patched runs compute positions ``>= p``
  only, attending to the cached keys/values of positions ``< p``;
* the last layer computes the read positions only, and logits are read there;
* many patches run at once, one per batch row, rows of several layers sharing later layers' matmuls.

The engine computes with the transformers modules themselves (looked up through TransformerBridge
wrappers) or with views of their weights; a module that carries hooks is called, so hooks run. The layer's pieces
are :class:`~headscope.patching.layer_ops.LayerOps`; this module is the pass over them. The activation patched is
TransformerLens ``hook_z`` (``[batch, pos, n_heads * d_head]``).

Every engine checks itself against the model's own forward (:mod:`headscope.patching.self_check`, comparisons in
:mod:`headscope.patching.reference_check`), in the model's dtype and on its device: a short prompt when it is built, then the
first prompt of every length beyond the longest checked (the first calibration pair's own clean sequence, through
:meth:`Engine.run`), so that whatever acts only on longer inputs (a sliding window, a length-switched RoPE table) is
seen at the length the ranking uses. A check passed is kept per (model, dtype, precision, what the adapter read) and
length, for every engine of the same model in the process and in a run's store, and not repeated. Every layer must agree to
:func:`~headscope.patching.reference_check.tolerance` (1e-3 in fp32, 8·eps in 16-bit types: 6.25e-2 in bf16),
or the engine refuses, naming the layer and the first part that disagrees. In 16-bit types each layer
is computed from the model's own input to it (teacher-forced), so the two forwards' rounding does not
accumulate over the stack. The sliding windows are read from the
masks the model passes to its layers in that forward. :func:`~headscope.patching.reference_check.check_patches`
compares a few patched rows with one hooked forward each (what reusing the prefix could get wrong).

A model spread over several devices (``device_map``) runs too: every layer computes on the device of
its weights and keeps its caches there (:class:`~headscope.patching.pass_plan.LayerStack`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..arch import UnsupportedArchitecture
from ..models import LoadedModel
from . import attention
from .reference_check import EngineMismatch, tolerance
from .layer_ops import LayerOps, Positions, head_slice
from .pass_plan import Entry, LayerCtx, LayerStack, PassResult, Plan, Precision, RunCache, stack_layers
from .self_check import SelfCheck

__all__ = ["Engine", "EngineMismatch", "Entry", "LayerStack", "Plan", "Positions", "Precision", "RunCache",
           "UnsupportedArchitecture", "head_slice", "tolerance"]


class Engine(LayerOps):
    """Runs a LoadedModel layer by layer from its architecture's parts (:func:`headscope.arch.adapt`): one pass,
    :meth:`forward`, per :class:`~headscope.patching.pass_plan.Plan`, and the plans every caller uses (:meth:`run`,
    :meth:`run_suffix`, :meth:`patched_logits_multi`, ...). Implements
    :class:`~headscope.patching.contract.PlanEngine` (and so :class:`~headscope.patching.contract.PatchingEngine`).

    Args:
        model: the model.
        matmul_dtype: e.g. ``torch.bfloat16``: the projections and attention run in that dtype
            (weights copied once; residual stream, norms and unembedding stay in the model's dtype).
            An approximation for screening only: exact patching uses the default (None).
        check: check against the model's own forward (default True): :meth:`self_check` on a short prompt
            now, and again on the first prompt of every longer length, unless an engine of the same model passed
            it before (:class:`~headscope.patching.self_check.SelfCheck`); engines with ``matmul_dtype``, an
            approximation by design, are not checked.
        precision: :class:`~headscope.patching.pass_plan.Precision` (default: the residual stream in the model's
            dtype); with ``Precision("float32")`` a bf16/fp16 model's residual stream, norms and RoPE run in float32.

    Raises:
        ValueError: ``matmul_dtype`` together with a float32 residual of a low-precision model.
        UnsupportedArchitecture: no adapter for the model's family (use ``path="generic"``).
        EngineMismatch: the self-check failed (the message names the layer and part).
    """

    path = "fast"

    def __init__(self, model: LoadedModel, matmul_dtype: torch.dtype | None = None, check: bool = True,
                 precision: Precision | None = None):
        super().__init__(model, matmul_dtype, precision)
        self.checks = SelfCheck(self, enabled=check and matmul_dtype is None)
        self.checks.at_build()

    @property
    def check(self) -> bool:
        """Whether this engine checks itself against the model's forward."""
        return self.checks.enabled

    @property
    def checked_len(self) -> int:
        """Prompts up to this length agree with the model's own forward (checked by this or another engine)."""
        return self.checks.checked_len()

    # ---- the one pass -----------------------------------------------------------------------
    def forward(self, plan: Plan) -> PassResult:
        """Run one :class:`~headscope.patching.pass_plan.Plan` (see there for what each field does).

        Raises:
            ValueError: a plan without rows, ``start`` > 0 without ``base``, a read position before
                ``start``, entries out of layer order or not covering ``start..``.
        """
        read = [int(r) for r in plan.read]
        start = plan.start
        enter = list(plan.enter)
        if plan.ids is not None:
            T = int(plan.ids.numel())
        elif plan.base is not None:
            T = int(plan.base.resid.shape[1])
        else:
            raise ValueError("a plan needs ids or a base pass")
        if start > 0 and plan.base is None:
            raise ValueError("start > 0 needs a base pass for the prefix")
        if plan.ids is not None:
            self.checks.before_pass(plan.ids)
        if not read or min(read) < start or max(read) >= T:
            raise ValueError(f"read positions {read[:3]}... must lie in start={start}..{T - 1}")
        layers_in = [e.layer for e in enter]
        if layers_in != sorted(layers_in):
            raise ValueError(f"entries must be in ascending layer order, got layers {layers_in}")
        S = T - start
        for e in enter:
            if e.z.shape[1] != S:
                raise ValueError(f"z rows of layer {e.layer} cover {e.z.shape[1]} positions; the suffix has {S}")
        if plan.ids is None and plan.resid_at is None and not enter:
            raise ValueError("a plan needs rows: ids, resid_at or enter")
        n_layers = self.g.n_layers
        trim = not (plan.keep or plan.grad)
        first = 0 if plan.ids is not None else min([e.layer for e in enter] + (
            [plan.resid_at[0]] if plan.resid_at is not None else []))
        dev0 = self.layers[first].device
        positions = torch.arange(start, T, device=dev0)
        ridx = {}  # read offsets into the suffix, per device

        def offsets(dev: torch.device) -> Tensor:
            if dev not in ridx:
                ridx[dev] = torch.as_tensor([r - start for r in read], device=dev)
            return ridx[dev]

        h: Tensor | None = None
        tags: list = []
        zs: list[Tensor] = []
        kept: dict[str, list[Tensor]] = {"resid": [], "z": [], "k": [], "v": []}
        with torch.set_grad_enabled(plan.grad):
            if plan.ids is not None:
                ids = plan.ids.to(dev0)[None, start:]
                h = self.embed(ids, positions)
                if plan.rows > 1:
                    h = h.expand(plan.rows, -1, -1)
                tags = [None] * plan.rows
            pos = self.positions(positions, h if h is not None else plan.base.resid[first])  # type: ignore[union-attr]
            for lay in range(first, n_layers):
                L = self.layers[lay]
                dev = L.device
                last = trim and lay == n_layers - 1
                if plan.resid_at is not None and plan.resid_at[0] == lay:
                    hr = plan.resid_at[1].to(dev, self.resid_dtype)
                    h = hr if h is None else torch.cat([h.to(dev), hr])
                    tags += [None] * hr.shape[0]
                z = None
                if h is not None:
                    h = h.to(dev)
                    if plan.keep:
                        kept["resid"].append(h[0])
                    B = h.shape[0]
                    x = self.ln1(lay, h)
                    qr = offsets(dev) if last else None
                    q, k, v = self.qkv(lay, x, pos, q_rows=qr)
                    if plan.keep:
                        kept["k"].append(k[0])
                        kept["v"].append(v[0])
                    if start > 0:
                        kp = plan.base.k[lay, :, :start][None].to(k.dtype)  # type: ignore[union-attr]
                        vp = plan.base.v[lay, :, :start][None].to(v.dtype)  # type: ignore[union-attr]
                        k = torch.cat([kp.expand(B, -1, -1, -1), k if k.shape[0] == B else k.expand(B, -1, -1, -1)], 2)
                        v = torch.cat([vp.expand(B, -1, -1, -1), v if v.shape[0] == B else v.expand(B, -1, -1, -1)], 2)
                    qpos = positions.to(dev)[qr] if last else positions.to(dev)
                    z = plan.attn(lay, q, k, v) if plan.attn is not None else self.attend(lay, q, k, v, qpos)
                    if last:
                        h = h[:, qr]
                    if plan.edit is not None:
                        z = plan.edit(lay, z, LayerCtx(lay, tags, qpos, x, q, k, v, pos))
                    if plan.grad:
                        if not z.requires_grad:
                            z.requires_grad_(True)
                        z.retain_grad()
                        zs.append(z)
                    if plan.keep:
                        kept["z"].append(z[0])
                new = [e for e in enter if e.layer == lay]
                if new:
                    zn = torch.cat([e.z.to(dev) for e in new]) if len(new) > 1 else new[0].z.to(dev)
                    hn = plan.base.resid[lay, start:].to(dev)[None].expand(zn.shape[0], S, -1)  # type: ignore[union-attr]
                    if last:
                        zn, hn = zn[:, offsets(dev)], hn[:, offsets(dev)]
                    h = hn if h is None else torch.cat([h, hn.to(h.dtype)])
                    z = zn if z is None else torch.cat([z, zn.to(z.dtype)])
                    for e in new:
                        tags += list(e.tag) if isinstance(e.tag, list) else [e.tag] * e.z.shape[0]
                assert h is not None and z is not None
                h = self.post_attn(lay, h, z)
            assert h is not None
            if not trim:
                h = h[:, offsets(h.device)]
            out = self.unembed(h) if plan.logits else h
        cache = None
        if plan.keep:
            cache = self._cache(plan, kept, start, out[0])
        return PassResult(out, zs, cache, tags)

    def _cache(self, plan: Plan, kept: dict[str, list[Tensor]], start: int, logits: Tensor) -> RunCache:
        md = self.multi_device
        resid = [t.detach() for t in kept["resid"]]
        z = [t.detach() for t in kept["z"]]
        k, v = [t.detach() for t in kept["k"]], [t.detach() for t in kept["v"]]
        if start > 0:
            b = plan.base
            assert b is not None
            resid = [torch.cat([b.resid[i, :start], t.to(b.resid[i].dtype)]) for i, t in enumerate(resid)]
            z = [torch.cat([b.z[i, :start], t.to(b.z[i].dtype)]) for i, t in enumerate(z)]
            k = [torch.cat([b.k[i, :, :start], t.to(b.k[i].dtype)], 1) for i, t in enumerate(k)]
            v = [torch.cat([b.v[i, :, :start], t.to(b.v[i].dtype)], 1) for i, t in enumerate(v)]
        return RunCache(stack_layers(resid, md), stack_layers(z, md), stack_layers(k, md), stack_layers(v, md),
                        logits.detach())

    # ---- plans everyone uses ----------------------------------------------------------------
    @torch.no_grad()
    def run(self, ids: Int[Tensor, "pos"], read: Sequence[int],
            z_override: Callable[[int, Tensor], Tensor] | None = None) -> RunCache:
        """One full pass of a prompt, caching resid, hook_z, K and V of every layer (logits at ``read``).
        ``z_override(layer, z) -> z`` may replace a layer's hook_z."""
        edit = None if z_override is None else (lambda lay, z, ctx: z_override(lay, z))
        if edit is None and self.checks.needed(int(ids.numel())):
            return self.checks.checked_run(ids, read)  # the first prompt of a new length: also the check's pass
        res = self.forward(Plan(read=read, ids=ids, keep=True, edit=edit))
        assert res.cache is not None
        return res.cache

    def run_with_grad_cache(self, ids: Int[Tensor, "pos"], read: Sequence[int], keep_cache: bool = True
                            ) -> tuple[Tensor, list[Tensor], RunCache | None]:
        """A differentiable full pass: (logits at ``read`` [read, vocab], every layer's hook_z [1, T, H·dh]
        with grad retained, the detached :class:`RunCache` or None with ``keep_cache=False``)."""
        self.require_one_device("attribution patching (run_with_grad)")
        res = self.forward(Plan(read=read, ids=ids, grad=True, keep=keep_cache))
        return res.out[0], res.z, res.cache

    def run_with_grad(self, ids: Int[Tensor, "pos"], read: Sequence[int]) -> tuple[Tensor, list[Tensor]]:
        """:meth:`run_with_grad_cache` without the cache."""
        logits, zs, _ = self.run_with_grad_cache(ids, read, keep_cache=False)
        return logits, zs

    def run_suffix(self, base: RunCache, ids: Int[Tensor, "pos"], start: int, read: Sequence[int],
                   grad: bool = False) -> tuple[Tensor, list[Tensor], RunCache | None]:
        """A pass of ``ids`` that shares its first ``start`` tokens with ``base``'s prompt: only positions
        ``start..`` are computed. Returns (logits at read, hook_z of every layer at start.. when ``grad``,
        the joined :class:`RunCache` when not ``grad``).

        Raises:
            ValueError: ``start`` outside 0..len(ids)-1 or a read position before ``start``.
        """
        self.require_one_device("suffix passes (run_suffix)")
        T = ids.numel()
        if not 0 <= start < T or min(read) < start:
            raise ValueError(f"start={start} must be in 0..{T - 1} and at most the first read position {min(read)}")
        res = self.forward(Plan(read=read, ids=ids, base=base, start=start, grad=grad, keep=not grad))
        return res.out[0], res.z, res.cache

    @torch.no_grad()
    def patched_logits_multi(self, base: RunCache, entries: Sequence[tuple[int, Float[Tensor, "rows suffix hd"]]],
                             start: int, read: Sequence[int]) -> Float[Tensor, "batch read vocab"]:
        """Patched passes of several layers in one batch: each row of ``entries`` ``(layer, z_rows)``
        (ascending layers) is one run of ``base``'s prompt whose layer-``layer`` hook_z at ``start..`` is
        that row. Output rows follow the order of ``entries``.

        Raises:
            ValueError: no entries, layers not ascending, rows that do not cover ``start..``.
        """
        if not entries:
            raise ValueError("no patched rows given")
        return self.forward(Plan(read=read, base=base, start=start,
                                 enter=[Entry(int(lay), z) for lay, z in entries])).out

    def patched_logits(self, base: RunCache, layer: int, z_rows: Float[Tensor, "batch suffix hd"], start: int,
                       read: Sequence[int]) -> Float[Tensor, "batch read vocab"]:
        """:meth:`patched_logits_multi` for rows of one layer."""
        return self.patched_logits_multi(base, [(layer, z_rows)], start, read)

    @torch.no_grad()
    def attention_mass(self, ids: Int[Tensor, "pos"], rows: Sequence[int], span: tuple[int, int]
                       ) -> Float[Tensor, "layer head"]:
        """Mean attention probability that each head puts on key positions ``span`` (end exclusive),
        averaged over the query positions ``rows``, in a clean pass of ``ids``."""
        self.require_one_device("attention_mass")
        out = torch.empty(self.g.n_layers, self.g.n_heads, dtype=torch.float64)
        rows_t = torch.as_tensor(sorted(rows), device=self.device)

        def grab(lay: int, z: Tensor, ctx: LayerCtx) -> Tensor:
            L = self.layers[lay]
            sel = torch.searchsorted(ctx.positions, rows_t)
            p = attention.probs(ctx.q[:, :, sel], ctx.k, rows_t, L.scaling, L.window, L.softcap)
            out[lay] = p[0, :, :, span[0]:span[1]].sum(-1).mean(-1).double().cpu()
            return z

        self.forward(Plan(read=list(rows_t.tolist()), ids=ids, edit=grab))
        return out

    # ---- the self-check (headscope.patching.self_check) --------------------------------------
    def needs_check(self, n_tokens: int) -> bool:
        """Whether a prompt of ``n_tokens`` is longer than every prompt checked so far (and checks are on)."""
        return self.checks.needed(n_tokens)

    def self_check(self, n_tokens: int = 12, tol: float | None = None, ids: Tensor | None = None) -> float:
        """A prompt through the engine and through the model's own forward, now (also where checked before):
        :meth:`~headscope.patching.self_check.SelfCheck.run`. Returns the largest relative difference.

        Raises:
            EngineMismatch: naming the first layer and part that disagrees, and the fix (``path="generic"``).
        """
        return self.checks.run(n_tokens, tol, ids)

    def check_patches(self, ids: Int[Tensor, "pos"], base: RunCache, src: RunCache, start: int,
                      read: Sequence[int]) -> float:
        """A few patched rows against the model's forward with a hook_z patch each, once per new prompt length
        (:meth:`~headscope.patching.self_check.SelfCheck.patches`); 0.0 when checked before or checks are off.

        Raises:
            EngineMismatch: naming the layer, head and fix.
        """
        return self.checks.patches(ids, base, src, start, read)
