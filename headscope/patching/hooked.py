"""Engines that patch through the model's own forward with hooks: the parts they share.

:class:`HookedEngine` is the base of :class:`~headscope.patching.generic.BridgeEngine` (any model the TransformerLens
bridge boots, at its ``hook_z``) and :class:`~headscope.patching.hybrid_engine.HybridEngine` (a head-wise FA/GDN
hybrid, at each layer's ``o_proj`` input). Both implement :class:`~headscope.patching.contract.PatchingEngine` with
the same two passes, written here once:

* :meth:`HookedEngine.run`: one forward of the prompt, every layer's ``hook_z`` read by a hook;
* :meth:`HookedEngine.patched_logits_multi`: many patched rows in one forward, with two shortcuts that change no
  number beyond rounding: **the prefix once** (clean and corrupted prompts agree before ``start``, so the prompt's
  first ``start`` tokens run once into the model's own cache and each patched forward computes positions
  ``start..`` from a copy of it over its rows) and **rows join at their layer** (row 0 is the unpatched base; the
  rows that patch layer ``l`` join as copies of row 0 at the input of decoder layer ``l``). ``prefix`` and ``join``
  say which shortcuts are on; an engine gives one up (with a warning) where its check finds it wrong.

A subclass supplies one forward of its model with the hooks (:meth:`HookedEngine._forward`), the model's cache of a
prompt's prefix copied over rows (:meth:`HookedEngine._cached_rows`), and optionally a slower route of its own
(:meth:`HookedEngine._run_other`, :meth:`HookedEngine._patched_other`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..models import LoadedModel
from .pass_plan import RunCache, row_edits

# hook_z edits of one forward: layer -> (batch rows, values [rows, positions, H·dh], first computed position replaced)
Edits = dict[int, tuple[Tensor, Tensor, int]]


def z_hook(layer: int, S: int, edits: Edits | None, grab: list[Tensor] | None) -> Callable:
    """A forward pre-hook (``with_kwargs=True``) on the module whose input is layer ``layer``'s hook_z
    ([B, S, H·dh], or the same values in another shape): appends it to ``grab`` and replaces the rows of
    ``edits[layer]`` from their first replaced position on."""

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        z = args[0] if args else kwargs["input"]
        B = z.shape[0]
        if grab is not None:
            grab.append(z.detach().reshape(B, S, -1))
        if edits is None or layer not in edits:
            return None
        idx, vals, s0 = edits[layer]
        z2 = z.reshape(B, S, -1).clone()
        z2[idx, s0:] = vals.to(z2.device, z2.dtype)
        z2 = z2.view(z.shape)
        return ((z2, *args[1:]), kwargs) if args else (args, {**kwargs, "input": z2})

    return hook


def join_hook(n: int) -> Callable:
    """A forward pre-hook (``with_kwargs=True``) on a decoder layer: ``n`` copies of batch row 0 join the batch."""

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        h = args[0] if args else kwargs["hidden_states"]
        h = torch.cat([h, h[:1].expand(n, *h.shape[1:])])
        return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

    return hook


class HookedEngine:
    """What the hooked engines share (see the module). Subclasses set ``path`` and the shortcuts ``prefix`` and
    ``join``, and implement :meth:`_forward` and :meth:`_cached_rows`.

    Attributes:
        model, g (geometry), hf (the transformers model), device, dtype; resid_dtype: the model's dtype (the
        model's own forward keeps its residual stream in it).
    """

    path = "hooked"
    prefix = True
    join = True

    def __init__(self, model: LoadedModel):
        self.model = model
        self.g = model.geometry
        self.hf = model.hf_model
        self.device = model.device
        self.dtype = model.dtype
        self.resid_dtype = model.dtype
        self.why: list[str] = []  # the shortcuts given up, and why

    def __repr__(self) -> str:
        return f"{type(self).__name__}(prefix={self.prefix}, join={self.join})"

    # ---- what a subclass supplies --------------------------------------------------------------
    def _forward(self, ids: Int[Tensor, "batch pos"], read_off: Sequence[int], edits: Edits | None = None,
                 cache: Any = None, grab: list[Tensor] | None = None, join: dict[int, int] | None = None
                 ) -> Float[Tensor, "batch read vocab"]:
        """Logits at ``read_off`` (offsets into ``ids``) of one forward of the model: ``edits`` replace hook_z
        rows, ``grab`` collects every layer's hook_z [B, pos, H·dh]; ``cache``: the model's cache of the positions
        before ``ids`` (extended in place); ``join`` {layer: n}: n copies of row 0 join at that layer's input."""
        raise NotImplementedError

    def _cached_rows(self, ids: Int[Tensor, "pos"], start: int, rows: Sequence[int]) -> Any:
        """A fresh copy of the model's cache of ``ids[:start]`` holding ``rows[i]`` batch rows in layer i."""
        raise NotImplementedError

    def _run_other(self, ids: Tensor, read: list[int]) -> RunCache | None:
        """:meth:`run` by another route (e.g. the bridge's own hooks), or None for the plain one."""
        return None

    def _patched_other(self, ids: Tensor, flat: list[tuple[int, Tensor]], start: int, read: list[int]
                       ) -> Tensor | None:
        """:meth:`patched_logits_multi` by another route, or None for the plain one."""
        return None

    def _prefix_ok(self, base: RunCache, ids: Tensor, start: int, read: list[int]) -> bool:
        """Whether the cached prefix may be used for ``base``'s prompt (a subclass may check it first)."""
        return self.prefix

    # ---- the contract --------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, ids: Int[Tensor, "pos"], read: Sequence[int]) -> RunCache:
        """A full pass of a prompt: hook_z of every layer (``z`` [layer, pos, H·dh]) and the logits at ``read``
        ([read, vocab]); ``resid``/``k``/``v`` are not kept (empty); the prompt and ``read`` are."""
        read = [int(r) for r in read]
        ids = ids.detach().reshape(-1)
        other = self._run_other(ids, read)
        if other is not None:
            return other
        grab: list[Tensor] = []
        logits = self._forward(ids[None].to(self.device), read, grab=grab)
        empty = torch.empty(self.g.n_layers, 0)
        return RunCache(empty, torch.stack([z[0] for z in grab]), empty, empty, logits[0], ids=ids.cpu(), read=read)

    @torch.no_grad()
    def patched_logits_multi(self, base: RunCache, entries: Sequence[tuple[int, Float[Tensor, "rows suffix hd"]]],
                             start: int, read: Sequence[int]) -> Float[Tensor, "batch read vocab"]:
        """Each row of ``entries`` ``(layer, z_rows)`` is one forward of ``base``'s prompt whose layer-``layer``
        hook_z at positions ``start..`` is that row; all rows in one batch. Output rows follow ``entries``.

        Raises:
            ValueError: no entries, rows that do not cover ``start..``, a base pass without its prompt (not
                made by :meth:`run`).
        """
        if not entries:
            raise ValueError("no patched rows given")
        if base.ids is None:
            raise ValueError(f"the {self.path} engine needs a base pass made by its run() (it keeps the prompt)")
        ids = base.ids.to(self.device)
        T = int(ids.numel())
        read = [int(r) for r in read]
        flat = [(int(layer), z[j]) for layer, z in entries for j in range(z.shape[0])]
        if any(z.shape[0] != T - start for _, z in flat):
            raise ValueError(f"z rows must cover positions {start}..{T - 1} ({T - start} rows of hook_z)")
        other = self._patched_other(ids, flat, start, read)
        if other is not None:
            return other
        prefix = self.prefix and start > 0 and self._prefix_ok(base, ids, start, read)
        lead = 1 if self.join else 0  # with join, row 0 is the unpatched base row
        b = row_edits(flat, self.join, 0 if prefix else start, self.device)
        join, n = b.join, b.n
        seq = ids[None, start:] if prefix else ids[None]
        off = [p - start for p in read] if prefix else read
        cache = None
        if prefix:
            rows = ([1 + sum(c for lay, c in join.items() if lay <= i) for i in range(self.g.n_layers)] if join
                    else [n] * self.g.n_layers)
            cache = self._cached_rows(ids, start, rows)
        return b.unsort(self._forward(seq.expand(n, -1), off, b.edits, cache=cache, join=join)[lead:])

    def check_patches(self, ids: Int[Tensor, "pos"], base: RunCache, src: RunCache, start: int,
                      read: Sequence[int]) -> float:
        """Patched rows through the shortcuts against full forwards (engines that check per prompt length override
        this); 0.0: nothing checked here."""
        return 0.0
