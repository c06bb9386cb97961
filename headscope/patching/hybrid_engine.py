"""Receiver patching of a head-wise FA/GDN hybrid (:func:`headscope.hybridize`): every head, FA and GDN alike.

Where a head's output is: a hybrid layer (:class:`~headscope.hybrid.HeadwiseHybridAttention`) writes each head's
output (softmax attention of an FA head, times its output gate when there is one; the gated delta rule of a GDN
head) into the head's slot of the teacher's head order, fuses every head alone (eq. 13–14: RMSNorm over its
``d_head`` values, times γ_h) and projects with the teacher's ``o_proj``. The input of ``o_proj``,
``[batch, pos, n_heads·d_head]``, is the hybrid's ``hook_z``: columns ``h·d_head .. (h+1)·d_head`` are head h's
output before the output projection. The fusion acts on each head alone, so taking a head's columns from another
run is the same as taking its output before the fusion from that run.

:class:`HybridEngine` implements :class:`~headscope.patching.contract.PatchingEngine` (the passes of
:class:`~headscope.patching.hooked.HookedEngine`, and :meth:`~HybridEngine.check_patches`), so
``receiver_patching`` and ``headscope.rank`` run unchanged on a hybrid (:func:`~headscope.patching.contract.make_engine`
picks it: ``path = "hybrid"``). It runs the model's own forward with forward pre-hooks on ``o_proj`` (read or
replace ``hook_z`` rows) and on the decoder layers, and two shortcuts that change no number beyond rounding:

* **the prefix once**: clean and corrupted prompts agree before position ``start``, so every activation there is
  the same in every run (causal attention, a causal GDN recurrence and short convolution); the prompt's first
  ``start`` tokens run once into the model's :class:`~headscope.hybrid.HybridCache` (the kept KV groups' K/V, the
  GDN state and the convolution tail at ``start``), and each patched forward computes positions ``start..`` only,
  from a copy of that cache over its rows;
* **rows join at their layer**: row 0 is the unpatched base; at the input of decoder layer ``l`` the rows that
  patch a head of layer ``l`` join as copies of row 0 (a patch at layer ``l`` changes nothing before it);
* logits at the read positions only (``logits_to_keep``), many patched rows per forward.

A hook on ``o_proj`` sends its layer to the reference forward (the fast inference paths apply ``o_proj``'s weights
directly; :class:`headscope.hybrid.inference.inference_config.LayerBackends`): every pass of this engine hooks every layer,
so clean, corrupted and patched runs take the same path.

Checks (:meth:`HybridEngine.check_patches`, on the first pair of every new prompt length): two patched rows (the
first FA head and the first GDN head of the earliest layers that have one) through the shortcuts against the
model's full forward with that head's columns replaced at every position; a shortcut that disagrees beyond
:func:`~headscope.patching.reference_check.tolerance` is given up with a warning (slower, exact), and if full forwards
disagree too the engine raises :class:`~headscope.patching.reference_check.EngineMismatch`.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..arch import UnsupportedArchitecture
from ..models import LoadedModel
from .reference_check import EngineMismatch, tolerance
from .hooked import Edits, HookedEngine, join_hook, z_hook
from .layer_ops import head_slice
from .pass_plan import RunCache

KINDS = ("fa", "gdn")


def hybrid_layers(hf_model: nn.Module) -> list[Any] | None:
    """The :class:`~headscope.hybrid.HeadwiseHybridAttention` of every decoder layer, or None when ``hf_model`` is
    not a head-wise hybrid (some layer's attention is another module)."""
    from ..hybrid.layer import HeadwiseHybridAttention
    from ..hybrid.modeling_hybrid import attention_name, decoder_layers

    try:
        layers = list(decoder_layers(hf_model))
        mods = [getattr(layer, attention_name(layer)) for layer in layers]
    except (ValueError, AttributeError):
        return None
    return mods if mods and all(isinstance(m, HeadwiseHybridAttention) for m in mods) else None


def is_hybrid(hf_model: nn.Module) -> bool:
    """Whether every decoder layer of ``hf_model`` is a head-wise hybrid attention layer."""
    return hybrid_layers(hf_model) is not None


def head_kinds(hf_model: nn.Module) -> list[list[str]]:
    """Per layer, per query head: ``"fa"`` (softmax attention) or ``"gdn"`` (gated delta rule).

    Raises:
        UnsupportedArchitecture: ``hf_model`` is not a head-wise hybrid.
    """
    mods = hybrid_layers(hf_model)
    if mods is None:
        raise UnsupportedArchitecture(f"{type(hf_model).__name__} is not a head-wise hybrid (headscope.hybridize)")
    return [["fa" if h in m.fa_heads else "gdn" for h in range(m.n_heads)] for m in mods]


def _copy_cache(cache: Any, config: Any, rows: Sequence[int], max_len: int) -> Any:
    """A new :class:`~headscope.hybrid.HybridCache` whose layer ``i`` holds ``rows[i]`` copies of ``cache``'s one
    sequence (K/V, GDN state, convolution tail), room for ``max_len`` tokens."""
    from ..hybrid.cache import HybridCache, HybridDecodeCache

    out = HybridCache(config, max_len=max_len)
    for slot, src, n in zip(out.layers, cache.layers, rows):
        dc = src.dc

        def rep(t: Tensor | None, time_dim: bool = False) -> Tensor | None:
            if t is None:
                return None
            if time_dim and t.shape[2] < max_len:  # K/V [1, n_keep, cap, d]: room for the suffix
                t = torch.cat([t, t.new_zeros(*t.shape[:2], max_len - t.shape[2], t.shape[3])], 2)
            return t.repeat_interleave(n, 0) if n > 1 else t.clone()

        new = HybridDecodeCache(rep(dc.k, True), rep(dc.v, True), rep(dc.S), rep(dc.conv), max(max_len, dc.max_len))
        new.length = dc.length
        slot.dc = new
    return out


class HybridEngine(HookedEngine):
    """Receiver patching of a head-wise hybrid's heads at ``o_proj``'s input (``path = "hybrid"``).

    ``prefix`` (the cached prefix) and ``join`` (rows join at their layer) say which shortcuts are on; ``why``
    lists those given up, and why.

    Args:
        model: a LoadedModel whose ``hf_model`` is a hybrid (:func:`headscope.hybridize`, or a saved hybrid).
        check: check the shortcuts on the first pair of every new length (:meth:`check_patches`; default True).

    Raises:
        UnsupportedArchitecture: the model is not a head-wise hybrid.
    """

    path = "hybrid"

    def __init__(self, model: LoadedModel, check: bool = True):
        mods = hybrid_layers(model.hf_model)
        if mods is None:
            raise UnsupportedArchitecture(f"{type(model.hf_model).__name__} is not a head-wise hybrid; the hybrid "
                                          "engine patches models made by headscope.hybridize")
        from ..hybrid.modeling_hybrid import decoder_layers

        super().__init__(model)
        self.attn = mods
        self.blocks = list(decoder_layers(self.hf))
        self.kinds = head_kinds(self.hf)
        self.check = check
        self.tol = tolerance(self.dtype)
        self.prefix = True
        self.join = True
        self.patch_checked_len = 0
        self._prefix: tuple[Tensor, Any] | None = None  # (prefix ids, HybridCache of them)

    # ---- one forward of the model ---------------------------------------------------------------
    def _forward(self, ids: Int[Tensor, "batch pos"], read_off: Sequence[int], edits: Edits | None = None,
                 cache: Any = None, grab: list[Tensor] | None = None, join: dict[int, int] | None = None
                 ) -> Float[Tensor, "batch read vocab"]:
        """Logits at ``read_off`` (offsets into ``ids``) of one forward of the model. Every layer's ``o_proj``
        gets a pre-hook (so every layer runs its reference forward): ``edits`` replace hook_z rows, ``grab``
        collects each layer's hook_z [B, pos, H·dh]; ``cache``: the HybridCache of the positions before ``ids``
        (extended in place); ``join`` {layer: n}: n copies of row 0 join the batch at that layer's input."""
        S = ids.shape[1]
        off = [int(o) for o in read_off]
        hooks = []

        try:
            for i, m in enumerate(self.attn):
                hooks.append(m.o_proj.register_forward_pre_hook(z_hook(i, S, edits, grab), with_kwargs=True))
            for i, n in (join or {}).items():
                hooks.append(self.blocks[i].register_forward_pre_hook(join_hook(n), with_kwargs=True))
            keep = S - min(off)
            out = self.hf(input_ids=ids, use_cache=cache is not None, past_key_values=cache, logits_to_keep=keep)
        finally:
            for h in hooks:
                h.remove()
        logits = out.logits
        return logits[:, torch.as_tensor(off, device=logits.device) - (S - logits.shape[1])]

    def _prefix_cache(self, ids: Int[Tensor, "pos"], start: int) -> Any:
        """The HybridCache of ``ids[:start]`` (one sequence; computed once per prompt prefix)."""
        from ..hybrid.cache import HybridCache

        if self._prefix is not None and torch.equal(self._prefix[0], ids[:start]):
            return self._prefix[1]
        cache = HybridCache(self.hf.config, max_len=start)
        self._forward(ids[None, :start], [start - 1], cache=cache)
        self._prefix = (ids[:start].clone(), cache)
        return cache

    def _cached_rows(self, ids: Int[Tensor, "pos"], start: int, rows: Sequence[int]) -> Any:
        """A copy of the HybridCache of ``ids[:start]`` with ``rows[i]`` rows in layer i, room for ``ids``."""
        return _copy_cache(self._prefix_cache(ids, start), self.hf.config, rows, int(ids.numel()))

    # ---- checks ---------------------------------------------------------------------------------
    def rows_to_check(self) -> list[tuple[int, int]]:
        """The (layer, head) rows :meth:`check_patches` runs: the first FA head and the first GDN head of the
        earliest layers that have one (rows of early layers pass every later layer's shortcut)."""
        rows = []
        for kind in KINDS:
            found = next(((lay, h) for lay, ks in enumerate(self.kinds) for h, k in enumerate(ks) if k == kind), None)
            if found is not None:
                rows.append(found)
        return sorted(rows)

    def _full_rows(self, ids: Tensor, base: RunCache, src: RunCache, rows: Sequence[tuple[int, int]],
                   read: Sequence[int]) -> Tensor:
        """The model's full forward of ``ids``, one batch row per (layer, head) of ``rows``, with that head's
        hook_z columns taken from ``src`` at every position (no shortcut)."""
        dh = self.g.d_head
        edits: Edits = {}
        for lay in sorted({lay for lay, _ in rows}):
            r_idx = [r for r, (l2, _) in enumerate(rows) if l2 == lay]
            z = base.z[lay][None].repeat(len(r_idx), 1, 1)
            for j, r in enumerate(r_idx):
                sl = head_slice(rows[r][1], dh)
                z[j, :, sl] = src.z[lay][:, sl].to(z.dtype)
            edits[lay] = (torch.as_tensor(r_idx, device=self.device), z, 0)
        return self._forward(ids[None].to(self.device).expand(len(rows), -1), read, edits)

    @torch.no_grad()
    def check_patches(self, ids: Int[Tensor, "pos"], base: RunCache, src: RunCache, start: int,
                      read: Sequence[int]) -> float:
        """Patched rows through the shortcuts against the model's full forward with the same patch (once per new
        prompt length; 0.0 when checked before or checks are off). A shortcut that disagrees is given up
        (warning); returns the largest relative difference of the logits at ``read`` that remains.

        Raises:
            EngineMismatch: full forwards with the patch disagree with the shortcuts' rows even without shortcuts.
        """
        T = int(ids.numel())
        if not self.check or T <= self.patch_checked_len:
            return 0.0
        rows = self.rows_to_check()
        dh = self.g.d_head
        entries = []
        for lay in sorted({lay for lay, _ in rows}):
            heads = [h for l2, h in rows if l2 == lay]
            z = base.z[lay, start:][None].repeat(len(heads), 1, 1)
            for r, h in enumerate(heads):
                sl = head_slice(h, dh)
                z[r, :, sl] = src.z[lay, start:][:, sl].to(z.dtype)
            entries.append((lay, z))
        want = self._full_rows(ids, base, src, rows, read)

        def diff() -> float:
            got = self.patched_logits_multi(base, entries, start, read)
            scale = float(want.float().abs().max().clamp_min(1e-6))
            return float((got.float() - want.float()).abs().max()) / scale

        d = diff()
        if not d <= self.tol:  # find the shortcut at fault: each one alone off, else both
            on = [w for w in ("prefix", "join") if getattr(self, w)]
            off: list[str] = []
            for what in on:
                setattr(self, what, False)
                self._prefix = None
                d2 = diff()
                if d2 <= self.tol:
                    off, d = [what], d2
                    break
                setattr(self, what, True)
            if not off and on:
                for what in on:
                    setattr(self, what, False)
                off, d = on, diff()
            for what in off:
                name = "the cached prefix" if what == "prefix" else "rows joining at their layer"
                self.why.append(f"{what}: patched rows with {name} differ from full forwards at {T} tokens")
                warnings.warn(f"hybrid engine: patched rows with {name} differ from full forwards with the same patch "
                              f"at {T} tokens; running without the {what!r} shortcut (slower, exact)", stacklevel=3)
        if not d <= self.tol:
            raise EngineMismatch(
                f"the hybrid engine's patched rows {rows} differ from {type(self.hf).__name__}'s own forward with the "
                f"same o_proj input patch by {d:.2e} (relative) over a {T}-token prompt, without any shortcut; "
                "report this with the model's config")
        self.patch_checked_len = T
        return d


__all__ = ["HybridEngine", "KINDS", "head_kinds", "hybrid_layers", "is_hybrid"]
