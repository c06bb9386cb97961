"""What one engine pass computes (:class:`Plan`), in which precision (:class:`Precision`), and what it keeps
(:class:`RunCache`, :class:`PassResult`).

Every pass of :meth:`headscope.patching.engine.Engine.forward` is described by a plan: which rows
start from the embedding and which join later from a cached pass (with their ``hook_z`` given),
which positions are computed (positions before ``start`` come from the cache: causal attention
cannot let them see later tokens), which layers' ``hook_z`` are edited, which positions are read,
and whether autograd runs. Receivers, senders, probes, attribution, selectors and anatomy are
short plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class Precision:
    """How the engine keeps a bf16/fp16 model's activations (recorded with results and in stores).

    Attributes:
        residual: ``"model"`` (default): the residual stream in the model's dtype, every add rounded to it,
            as the model's own forward computes. ``"float32"``: the residual stream, the norms, RoPE and
            every residual add in float32; the projections, the MLP and attention still run in the model's
            dtype (float32 accumulation inside the kernels, inputs rounded once to the model's dtype), and
            the cached residual streams are float32 (2x their memory). Closer to a float32 forward of the
            same weights than the model's own low-precision forward. For a float32 model both are the same
            computation.

    Raises:
        ValueError: another ``residual``.
    """

    residual: Literal["model", "float32"] = "model"

    def __post_init__(self) -> None:
        if self.residual not in ("model", "float32"):
            raise ValueError(f"Precision.residual={self.residual!r}: use 'model' or 'float32'")

    def to_dict(self) -> dict[str, Any]:
        """``{"residual": ...}`` (JSON-able)."""
        return {"residual": self.residual}


class LayerStack:
    """Per-layer tensors that live on their layers' devices, indexed like a stacked tensor:
    ``stack[layer, ...]`` is ``items[layer][...]`` and ``shape`` is ``(n_layers, *items[0].shape)``."""

    def __init__(self, items: Sequence[Tensor]):
        self.items = list(items)

    def __getitem__(self, idx):  # type: ignore[no-untyped-def]
        if isinstance(idx, tuple):
            return self.items[idx[0]][idx[1:]]
        if isinstance(idx, int):
            return self.items[idx]
        raise TypeError("index a LayerStack with an int layer first (stack[layer, ...])")

    def __len__(self) -> int:
        return len(self.items)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.items), *self.items[0].shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.items[0].dtype

    def stacked(self, device: torch.device | str) -> Tensor:
        """One tensor [layer, ...] on ``device``."""
        return torch.stack([t.to(device) for t in self.items])


def stack_layers(items: list[Tensor], per_layer: bool) -> Tensor | LayerStack:
    return LayerStack(items) if per_layer else torch.stack(items)


@dataclass
class RunCache:
    """Activations of one full pass of a (pos,) prompt.

    resid: Float[Tensor, "layer pos d_model"], residual stream entering each layer.
    z: Float[Tensor, "layer pos n_heads*d_head"], hook_z of each layer (flattened heads).
    k, v: Float[Tensor, "layer n_kv pos d_head"], keys (after RoPE / QK-norm) and values.
    logits: Float[Tensor, "read vocab"], logits at the read positions.
    ids: the prompt (kept by the generic bridge path, which re-runs it).
    read: the positions of ``logits`` (kept by the generic bridge path).

    For a model spread over devices, resid/z/k/v are :class:`LayerStack` s (each layer's entry on its
    layer's device) with the same ``[layer, ...]`` indexing.
    """

    resid: Tensor
    z: Tensor
    k: Tensor
    v: Tensor
    logits: Tensor
    ids: Tensor | None = None
    read: Sequence[int] | None = None


@dataclass
class Entry:
    """Rows that join a pass at ``layer`` with their hook_z given there (their attention at that layer
    is not computed): z Float[Tensor, "rows suffix n_heads*d_head"] over positions ``start..``.
    Each row starts from the plan's ``base`` residual entering ``layer``. ``tag`` labels the rows
    (one tag per row, or one for all) for the plan's ``edit``."""

    layer: int
    z: Tensor
    tag: Any = None


@dataclass
class LayerCtx:
    """What a plan's ``edit`` sees at one layer.

    layer: the layer; tags: one label per batch row (Entry tags; None for embedding rows);
    positions: absolute positions of the computed queries (all of ``start..``, or only the read
    positions in a trimmed last layer); x: the attention input (ln1 output) of the rows;
    q: [B, H, S, dh] queries after RoPE; k, v: [B, KV, T, dh] keys/values of all positions
    (the cached prefix joined to the computed ones); pos: the pass's positional tables
    (``engine.qkv(layer, x, pos)`` recomputes projections from another input).
    """

    layer: int
    tags: list
    positions: Tensor
    x: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    pos: Any


@dataclass
class Plan:
    """One pass of :meth:`Engine.forward`.

    Attributes:
        read: absolute positions whose output is returned (logits, or the final residual).
        ids: Int[Tensor, "pos"], the prompt: ``rows`` rows start from its embedding at layer 0.
            Without ids, rows come from ``enter`` / ``resid_at`` only.
        base: a cached pass of the same prompt: positions < ``start`` attend to its keys/values,
            and joining rows start from its residual stream.
        start: first computed position (0: all). Requires ``base`` when > 0.
        rows: batch rows started from the embedding.
        enter: rows that join later (:class:`Entry`), in ascending layer order.
        resid_at: ``(layer, h)``: rows that start at ``layer`` from residual h [B, suffix, d_model].
        edit: ``edit(layer, z, ctx) -> z``: replaces the running rows' hook_z of a layer
            (``ctx`` is a :class:`LayerCtx`). Patches, probes, knockouts and path patching live here.
        attn: ``attn(layer, q, k, v) -> z``: computes attention instead of the model's own
            (selectors' gated or linear variants); gradients flow.
        grad: run under autograd; each layer's hook_z requires grad and is returned.
        keep: return a :class:`RunCache` of row 0 (the base prefix joined to the computed positions).
        logits: unembed the output (False: return the last layer's residual at ``read``).
    """

    read: Sequence[int]
    ids: Tensor | None = None
    base: RunCache | None = None
    start: int = 0
    rows: int = 1
    enter: Sequence[Entry] = ()
    resid_at: tuple[int, Tensor] | None = None
    edit: Callable[[int, Tensor, LayerCtx], Tensor] | None = None
    attn: Callable[[int, Tensor, Tensor, Tensor], Tensor] | None = None
    grad: bool = False
    keep: bool = False
    logits: bool = True


@dataclass
class PassResult:
    """Output of :meth:`Engine.forward`.

    out: Float[Tensor, "batch read vocab"] logits (or Float[Tensor, "batch read d_model"] residual
    when ``plan.logits`` is False); rows in batch order (embedding rows, ``resid_at`` rows, then
    ``enter`` rows in their order). z: every computed layer's hook_z ([B, suffix, H·dh]) when
    ``plan.grad``; cache: the :class:`RunCache` when ``plan.keep``; tags: the row labels.
    """

    out: Tensor
    z: list[Tensor] = field(default_factory=list)
    cache: RunCache | None = None
    tags: list = field(default_factory=list)


@dataclass
class RowEdits:
    """Patched rows of one batched suffix pass, grouped by the layer they patch (the batched engines' shared
    bookkeeping: :meth:`~headscope.patching.hooked.HookedEngine.patched_logits_multi`).

    Attributes:
        order: row indices of the flat entries sorted by layer (stable); ``unsort`` puts outputs back.
        edits: layer → (batch row indices [k], hook_z rows [k, suffix, hd] on ``device``, first replaced position).
        join: with joining rows, layer → rows that join at that layer; else None.
        n: batch rows the pass computes (1 with joining rows: the rest join on the way).
    """

    order: list[int]
    edits: dict[int, tuple[Tensor, Tensor, int]]
    join: dict[int, int] | None
    n: int

    def unsort(self, out: Tensor) -> Tensor:
        """Outputs in the pass's (layer-sorted) row order → the entries' order."""
        back = torch.empty(len(self.order), dtype=torch.long, device=out.device)
        back[torch.as_tensor(self.order, device=out.device)] = torch.arange(len(self.order), device=out.device)
        return out[back]


def row_edits(flat: Sequence[tuple[int, Tensor]], join: bool, first: int, device: Any) -> RowEdits:
    """Group ``flat`` (layer, hook_z rows [suffix, hd]) entries into a batched pass's edits: rows sorted by layer,
    row 0 the unpatched base row when ``join``; ``first``: first replaced position of the computed ones."""
    order = sorted(range(len(flat)), key=lambda i: flat[i][0])
    lead = 1 if join else 0
    vals: dict[int, list[Tensor]] = {}
    idx: dict[int, list[int]] = {}
    for r, i in enumerate(order):
        layer, z = flat[i]
        vals.setdefault(layer, []).append(z)
        idx.setdefault(layer, []).append(lead + r)
    edits = {lay: (torch.as_tensor(idx[lay], device=device), torch.stack(v).to(device), first) for lay, v in vals.items()}
    return RowEdits(order, edits, {lay: len(v) for lay, v in vals.items()} if join else None, 1 if join else len(flat))
