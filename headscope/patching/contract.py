"""The engine contract: what every patching engine offers, and :func:`make_engine`, which picks one.

Three engines run receiver patching (:func:`~headscope.patching.receivers.receiver_patching`):

* ``"fast"``: :class:`~headscope.patching.engine.Engine`, the model computed layer by layer from the parts an
  architecture adapter reads (checked against the model's own forward);
* ``"generic"``: :class:`~headscope.patching.generic.BridgeEngine`, any model the TransformerLens bridge boots,
  through its ``hook_z``;
* ``"hybrid"``: :class:`~headscope.patching.hybrid_engine.HybridEngine`, a head-wise FA/GDN hybrid's heads at their
  ``o_proj`` input.

Each implements :class:`PatchingEngine`: a base pass of a prompt (:meth:`~PatchingEngine.run`, a
:class:`~headscope.patching.pass_plan.RunCache` holding every layer's ``hook_z`` and the logits at the read positions),
patched rows (:meth:`~PatchingEngine.patched_logits_multi`: one forward of the base prompt per row, the row's
``hook_z`` replacing one layer's from ``start`` on) and a check of patched rows against the model's own forward
(:meth:`~PatchingEngine.check_patches`). The fast engine also runs any :class:`~headscope.patching.pass_plan.Plan` and
exposes its per-layer pieces (:class:`PlanEngine`): senders, attribution, the screen's probes, the selectors, DLA and
κ use those. Callers use these members only; what is private to an engine stays in its module.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal, Protocol, Sequence, runtime_checkable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..arch import UnsupportedArchitecture
from ..model_specs import Geometry
from ..models import LoadedModel
from .pass_plan import PassResult, Plan, Precision, RunCache

if TYPE_CHECKING:  # pragma: no cover
    from ..arch import Arch, LayerParts
    from .layer_ops import Positions

__all__ = ["PATHS", "Path", "PatchingEngine", "PlanEngine", "make_engine"]

Path = Literal["auto", "fast", "generic", "hybrid"]
PATHS = ("auto", "fast", "generic", "hybrid")


@runtime_checkable
class PatchingEngine(Protocol):
    """What receiver patching needs of an engine (every engine implements it).

    Attributes:
        path: ``"fast"``, ``"generic"`` or ``"hybrid"`` (recorded with results).
        model: the :class:`~headscope.models.LoadedModel`; g: its :class:`~headscope.model_specs.Geometry`;
        device, dtype: where and in what the model computes; resid_dtype: the dtype of the engine's residual
            stream (float32 for a low-precision model run with ``Precision("float32")``, else ``dtype``).
    """

    path: str
    model: LoadedModel
    g: Geometry
    device: torch.device
    dtype: torch.dtype
    resid_dtype: torch.dtype

    def run(self, ids: Int[Tensor, "pos"], read: Sequence[int]) -> RunCache:
        """The base pass: every layer's hook_z (``z`` [layer, pos, H·dh]) and the logits at ``read``."""
        ...

    def patched_logits_multi(self, base: RunCache, entries: Sequence[tuple[int, Float[Tensor, "rows suffix hd"]]],
                             start: int, read: Sequence[int]) -> Float[Tensor, "batch read vocab"]:
        """Patched rows: each row of ``entries`` ``(layer, z_rows)`` (ascending layers) is one run of ``base``'s
        prompt whose layer-``layer`` hook_z at ``start..`` is that row; logits at ``read``, rows in entry order."""
        ...

    def check_patches(self, ids: Int[Tensor, "pos"], base: RunCache, src: RunCache, start: int,
                      read: Sequence[int]) -> float:
        """A few patched rows (hook_z from ``src``) against the model's own forward with the same patch, once per
        new prompt length; returns the largest relative difference (0.0 when nothing was checked). Raises
        :class:`~headscope.patching.reference_check.EngineMismatch` where the engine cannot be trusted."""
        ...


@runtime_checkable
class PlanEngine(PatchingEngine, Protocol):
    """An engine that runs any :class:`~headscope.patching.pass_plan.Plan` over the model's per-layer parts (the fast
    engine, :class:`~headscope.patching.engine.Engine`).

    Attributes:
        arch: the adapter's :class:`~headscope.arch.Arch` (embedding, final norm, unembedding, RoPE tables);
        layers: its per-layer :class:`~headscope.arch.LayerParts` (the per-layer views: projections, norms, scale,
            window, soft-cap, RoPE kind, device); multi_device: the layers live on several devices.
    """

    arch: "Arch"
    layers: "list[LayerParts]"
    multi_device: bool

    def forward(self, plan: Plan) -> PassResult:
        """One pass of ``plan``."""
        ...

    def run_suffix(self, base: RunCache, ids: Int[Tensor, "pos"], start: int, read: Sequence[int],
                   grad: bool = False) -> tuple[Tensor, list[Tensor], RunCache | None]:
        """A pass of ``ids`` that shares its first ``start`` tokens with ``base``'s prompt."""
        ...

    def run_with_grad_cache(self, ids: Int[Tensor, "pos"], read: Sequence[int], keep_cache: bool = True
                            ) -> tuple[Tensor, list[Tensor], RunCache | None]:
        """A differentiable full pass: logits at ``read``, every layer's hook_z with grad retained, the cache."""
        ...

    def require_one_device(self, what: str) -> None:
        """Raises NotImplementedError naming ``what`` when the model is spread over several devices."""
        ...

    def positions(self, positions: Tensor, like: Tensor) -> "Positions":
        """The positional tables of a pass whose computed positions are ``positions``."""
        ...

    def embed(self, ids: Int[Tensor, "batch pos"], positions: Tensor) -> Tensor:
        """The residual stream entering layer 0."""
        ...

    def ln1(self, layer: int, h: Tensor) -> Tensor:
        """The attention input of the layer (its pre-attention norm)."""
        ...

    def lin(self, p: Any, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """A linear map of the model (:class:`~headscope.arch.Proj`) applied to ``x``."""
        ...

    def project(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Attention input -> q, k, v before RoPE."""
        ...

    def rotate(self, layer: int, t: Tensor, cos_sin: tuple[Tensor, Tensor] | None) -> Tensor:
        """The layer's RoPE of ``t``."""
        ...

    def qkv(self, layer: int, x: Tensor, pos: "Positions", q_rows: Tensor | None = None
            ) -> tuple[Tensor, Tensor, Tensor]:
        """Attention input -> q [B, H, S, dh], k, v [B, KV, S, dh] after RoPE."""
        ...

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor) -> Tensor:
        """The layer's attention -> hook_z [B, S, H·dh]."""
        ...

    def attn_out(self, layer: int, z: Tensor, residual: Tensor | None = None) -> Tensor:
        """The output projection of hook_z ``z`` (plus ``residual``)."""
        ...

    def attn_write(self, layer: int, z: Tensor) -> Tensor:
        """What the attention branch adds to the residual stream given hook_z ``z``."""
        ...

    def mlp_write(self, layer: int, h: Tensor) -> Tensor:
        """What the MLP branch adds to the residual stream given the residual ``h`` it reads."""
        ...

    def post_attn(self, layer: int, h: Tensor, z: Tensor) -> Tensor:
        """The residual after the layer, given its input ``h`` and hook_z ``z``."""
        ...

    def final(self, h: Tensor) -> Tensor:
        """The final norm of the residual stream."""
        ...

    def head(self, x: Tensor) -> Tensor:
        """Logits of final-normed hidden states."""
        ...

    def unembed(self, h: Tensor) -> Tensor:
        """Logits of residual ``h``."""
        ...

    def attention_mass(self, ids: Int[Tensor, "pos"], rows: Sequence[int], span: tuple[int, int]
                       ) -> Float[Tensor, "layer head"]:
        """Mean attention probability of each head on key positions ``span``, over query positions ``rows``."""
        ...


def make_engine(model: LoadedModel, path: Path = "auto", precision: Precision | None = None) -> PatchingEngine:
    """The engine for ``path``: ``"fast"`` (an architecture adapter, checked against the model's own forward when
    built), ``"generic"`` (the bridge's hooks), ``"hybrid"`` (a head-wise FA/GDN hybrid's heads at their ``o_proj``
    input) or ``"auto"`` (hybrid for a hybrid, else fast where an adapter exists, else generic, with a warning that
    says so). ``precision``: the fast engine's :class:`~headscope.patching.pass_plan.Precision` (a float32 residual
    stream needs the fast engine).

    Raises:
        ValueError: an unknown path; a float32-residual precision of a low-precision model on the generic or
            hybrid path; ``"fast"`` / ``"generic"`` on a hybrid, ``"hybrid"`` on another model.
        UnsupportedArchitecture: ``path="fast"`` on a model without an adapter.
        EngineMismatch: the adapter's self-check failed (the message names the layer and the fix).
    """
    from .reference_check import EngineMismatch
    from .engine import Engine
    from .generic import BridgeEngine
    from .hybrid_engine import HybridEngine, is_hybrid

    if path not in PATHS:
        raise ValueError(f"path={path!r}: use one of {PATHS}")
    f32 = precision is not None and precision.residual == "float32" and model.dtype != torch.float32
    hybrid = is_hybrid(model.hf_model)
    if hybrid and path in ("fast", "generic"):
        raise ValueError(f"path={path!r} on a head-wise hybrid: use path='auto' or 'hybrid' (its heads are patched "
                         "at the o_proj input by the hybrid engine)")
    if path == "hybrid" and not hybrid:
        raise ValueError("path='hybrid' needs a head-wise hybrid (headscope.hybridize); use 'auto' for this model")
    if hybrid:
        if f32:
            raise ValueError("Precision(residual='float32') runs on the fast engine only; a hybrid runs in its own dtype "
                             "(load it in float32 for a float32 residual stream)")
        return HybridEngine(model)
    if path == "generic":
        if f32:
            raise ValueError("Precision(residual='float32') runs on the fast engine only: use path='fast' or 'auto', "
                             "or the default Precision()")
        return BridgeEngine(model)
    try:
        return Engine(model, precision=precision)
    except UnsupportedArchitecture as e:
        if path == "fast" or isinstance(e, EngineMismatch):
            raise
        if f32:
            raise ValueError(f"{e}; Precision(residual='float32') needs the fast engine: use the default "
                             "Precision() for the generic bridge path") from e
        warnings.warn(f"{e}; running the generic bridge path (slower, exact)", stacklevel=3)
        return BridgeEngine(model)
