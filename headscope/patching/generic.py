"""The generic patching path: any architecture the TransformerLens bridge boots, through its hooks.

:class:`BridgeEngine` offers the two engine methods receiver patching needs (:meth:`run` and
:meth:`patched_logits_multi`) on top of ``TransformerBridge`` hook points: a full pass caches every
layer's ``blocks.{l}.attn.hook_z``; a patched batch runs one full forward of the prompt per row, with
a hook on each patched layer's ``hook_z`` that writes the row's given values there. Several heads'
(and several layers') patches share one forward, one row each. Nothing is reused across positions
or layers, so it is slower than the fast engine, but it makes no assumption about the architecture
beyond the bridge's own: it is exact wherever the bridge reproduces the model.

:func:`make_engine` picks the path: the fast engine where an adapter exists and passes its
self-check, the generic one where no adapter exists; an adapter that fails its self-check refuses
(an unknown variant must never give a silently wrong ranking).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..arch import UnsupportedArchitecture
from ..models import LoadedModel
from .engine import Engine
from .plan import RunCache

Path = Literal["auto", "fast", "generic"]
PATHS = ("auto", "fast", "generic")


class BridgeEngine:
    """Receiver patching through the TransformerLens bridge's ``hook_z`` hook points (any architecture
    the bridge boots). ``path = "generic"``."""

    path = "generic"

    def __init__(self, model: LoadedModel):
        self.model = model
        self.g = model.geometry
        self.device = model.device
        self.dtype = model.dtype
        self.bridge = model.bridge
        missing = [f"blocks.{i}.attn.hook_z" for i in range(self.g.n_layers)
                   if f"blocks.{i}.attn.hook_z" not in self.bridge.hook_dict]
        if missing:
            raise UnsupportedArchitecture(
                f"the TransformerLens bridge of {type(model.hf_model).__name__} has no {missing[0]} hook point; "
                "headscope cannot patch this model's heads")

    @torch.no_grad()
    def run(self, ids: Int[Tensor, "pos"], read: Sequence[int]) -> RunCache:
        """A full pass: hook_z of every layer ([layer, pos, H·dh]) and the logits at ``read``.
        ``resid``/``k``/``v`` are not kept (empty)."""
        names = [f"blocks.{i}.attn.hook_z" for i in range(self.g.n_layers)]
        logits, cache = self.bridge.run_with_cache(ids[None].to(self.device), names_filter=lambda n: n in names)
        z = torch.stack([cache[n][0].reshape(ids.numel(), -1) for n in names])
        empty = torch.empty(self.g.n_layers, 0)
        return RunCache(empty, z, empty, empty, logits[0, list(read)], ids=ids.detach().cpu())

    @torch.no_grad()
    def patched_logits_multi(self, base: RunCache, entries: Sequence[tuple[int, Float[Tensor, "rows suffix hd"]]],
                             start: int, read: Sequence[int]) -> Float[Tensor, "batch read vocab"]:
        """Each row of ``entries`` ``(layer, z_rows)`` is one forward of ``base``'s prompt whose layer-``layer``
        hook_z at positions ``start..`` is that row; all rows in one batch. Output rows follow ``entries``.

        Raises:
            ValueError: no entries, or a base pass without its prompt (not made by :meth:`run`).
        """
        if not entries:
            raise ValueError("no patched rows given")
        if base.ids is None:
            raise ValueError("the generic path needs a base pass made by BridgeEngine.run (it keeps the prompt)")
        ids = base.ids.to(self.device)
        g = self.g
        rows: dict[int, list[tuple[int, Tensor]]] = {}
        r = 0
        for layer, z in entries:
            for j in range(z.shape[0]):
                rows.setdefault(int(layer), []).append((r, z[j]))
                r += 1
        hooks = []
        for layer, members in rows.items():
            idx = torch.as_tensor([i for i, _ in members], device=self.device)
            vals = torch.stack([v for _, v in members]).to(self.device)

            def hook(zh: Tensor, hook: Any = None, idx: Tensor = idx, vals: Tensor = vals) -> Tensor:
                zh = zh.clone()
                zh[idx, start:] = vals.view(len(idx), -1, g.n_heads, g.d_head).to(zh.dtype)
                return zh

            hooks.append((f"blocks.{layer}.attn.hook_z", hook))
        logits = self.bridge.run_with_hooks(ids[None].expand(r, -1), fwd_hooks=hooks)
        return logits[:, list(read)]


def make_engine(model: LoadedModel, path: Path = "auto") -> Engine | BridgeEngine:
    """The engine for ``path``: ``"fast"`` (an architecture adapter, checked against the model's own
    forward when built), ``"generic"`` (the bridge's hooks) or ``"auto"`` (fast where an adapter
    exists, else generic, with a warning that says so).

    Raises:
        ValueError: an unknown path.
        UnsupportedArchitecture: ``path="fast"`` on a model without an adapter.
        EngineMismatch: the adapter's self-check failed (the message names the layer and the fix).
    """
    if path not in PATHS:
        raise ValueError(f"path={path!r}: use one of {PATHS}")
    if path == "generic":
        return BridgeEngine(model)
    try:
        eng = Engine(model)
    except UnsupportedArchitecture as e:
        from .engine import EngineMismatch

        if path == "fast" or isinstance(e, EngineMismatch):
            raise
        warnings.warn(f"{e}; running the generic bridge path (slower, exact)", stacklevel=3)
        return BridgeEngine(model)
    return eng
