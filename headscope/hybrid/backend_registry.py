"""The hybrid's backends: which implementation computes each role of a call, chosen by data (issue 61).

A backend is one implementation of one **role**, registered by name, with that role's signature:

- ``train`` — a layer's training forward (gradients, no cache, no mask): ``fn(layer, x, cos, sin, position_ids)``;
- ``prefill`` — a layer's inference forward over a prompt (any call that is not one token into a cache) and
  ``decode`` — one token per sequence into the layer's cache: ``fn(layer, x, position_embeddings, position_ids,
  cache)`` -> [batch, time, hidden], the cache (a ``HybridDecodeCache`` or None) filled / advanced in place;
- ``captured_decode`` — a whole model's decode step into a ``HybridCache``: ``fn(model, input_ids, cache, kwargs)``
  -> the model's output, or None where the call is not one it computes.

``"reference"`` (every role, ``target`` None) is the saved modeling code's forward. Each backend says what it
:class:`Supports`; :class:`Needs` is what a layer (or model) requires. The model's InferenceConfig names one backend
per role, or ``"auto"``: the fastest that applies on the call's device. Nothing here runs on import: backends attach
to a model through :func:`headscope.hybrid.use_inference` (``hybridize``, ``headscope.hybrid.load``).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import HeadscopeInputError

ROLES = ("train", "prefill", "decode", "captured_decode")
FEATURES = ("window", "softcap", "partial_rotary", "biases", "qk_norm_teacher", "nope_layer", "logit_scale",
            "short_conv", "other_decoder_layer")


@dataclass(frozen=True)
class Needs:
    """What a layer (or, for ``captured_decode``, a model) requires of a backend: the names of :data:`FEATURES` it
    has, its parameters' dtype (``"float32"`` ...) and device type (``"cpu"``, ``"cuda"``)."""

    features: frozenset = frozenset()
    dtype: str = "float32"
    device: str = "cpu"


@dataclass(frozen=True)
class Supports:
    """What a backend computes exactly: the :data:`FEATURES` it handles, dtypes and device types."""

    features: frozenset = frozenset(FEATURES)
    dtypes: tuple = ("float32", "float64", "float16", "bfloat16")
    devices: tuple = ("cpu", "cuda")

    def missing(self, needs: Needs) -> list[str]:
        """What of ``needs`` this backend lacks (empty: it applies)."""
        out = [f"feature {f}" for f in sorted(needs.features - self.features)]
        if needs.dtype not in self.dtypes:
            out.append(f"dtype {needs.dtype}")
        if needs.device not in self.devices:
            out.append(f"device {needs.device}")
        return out


@dataclass(frozen=True)
class Backend:
    """One registered implementation of one role (:data:`ROLES`), named by an InferenceConfig: ``target`` —
    ``"module:function"`` (imported on first use) or None (the reference forward); ``supports``; ``speed`` — per
    device type a rank, ``"auto"`` picks the highest that applies (absent: never auto there); ``doc``: one line."""

    name: str
    role: str
    target: Optional[str]
    supports: Supports = Supports()
    speed: dict = field(default_factory=dict)
    doc: str = ""

    def fn(self) -> Optional[Callable]:
        """The function (None: the reference forward)."""
        if self.target is None:
            return None
        mod, name = self.target.split(":")
        return getattr(importlib.import_module(mod, __package__), name)


_FAST = frozenset({"biases", "partial_rotary", "window", "qk_norm_teacher", "logit_scale"})  # + Mistral, Gemma 3
_REGISTRY: dict[tuple[str, str], Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` (replacing one of the same role and name); returns it.

    Raises:
        ValueError: an unknown role, or the name ``"auto"``."""
    if backend.role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {backend.role!r}")
    if backend.name == "auto":
        raise ValueError("'auto' is not a backend name (it means: the fastest that applies)")
    _REGISTRY[(backend.role, backend.name)] = backend
    return backend


for _role in ROLES:
    register(Backend("reference", _role, None, speed={"cpu": 1, "cuda": 0},
                     doc="the saved modeling code's forward (layer.py): every feature, any device"))
register(Backend("fused", "train", ".inference.train_forward:fast_forward", Supports(_FAST | {"softcap",
                 "nope_layer"}), {"cpu": 0, "cuda": 10}, "one input GEMM, no head permutation, all GDN heads in one kernel call"))
register(Backend("lean", "prefill", ".inference.forward:prefill", Supports(_FAST | {"softcap"}), {"cpu": 0, "cuda": 10},
                 "fused projection, compiled glue, SDPA / flash-attn, GDN chunk forward in time blocks (FlashQLA at "
                 "head_dim 128 with an even number of GDN heads or one: prefill.flash_qla_shape; else fla)"))
register(Backend("lean", "decode", ".inference.forward:decode_step", Supports(_FAST), {"cpu": 0, "cuda": 10},
                 "Triton decode kernels (one launch: FA prep + split-K, GDN step), else compiled PyTorch"))
register(Backend("graph", "captured_decode", ".inference.model_step:model_forward",
                 Supports(_FAST), {"cpu": 0, "cuda": 10}, "the whole decode step replayed from one CUDA graph "
                 "(decoder layers of Llama's form, Gemma 3's or GPT-NeoX's)"))


def backends() -> list[dict[str, Any]]:
    """Every registered backend: name, role, what it supports (features, dtypes, devices), speed rank, doc."""
    return [{"name": b.name, "role": b.role, "features": sorted(b.supports.features), "dtypes": list(b.supports.dtypes),
             "devices": list(b.supports.devices), "speed": dict(b.speed), "doc": b.doc}
            for b in sorted(_REGISTRY.values(), key=lambda b: (ROLES.index(b.role), -max(b.speed.values(), default=0)))]


def names(role: str) -> list[str]:
    """The backend names registered for ``role``."""
    return sorted(n for r, n in _REGISTRY if r == role)


def select(role: str, name: str, needs: Needs, where: str = "") -> Backend:
    """The backend of ``role`` for ``needs``: the one named, or with ``name == "auto"`` the fastest that applies
    on ``needs.device`` (the reference when none is faster).

    Raises:
        HeadscopeInputError: ``name`` is not registered for the role, or does not apply (what it lacks is named,
            ``where`` says which layer)."""
    if name == "auto":
        fits = [b for b in _REGISTRY.values() if b.role == role and not b.supports.missing(needs)
                and needs.device in b.speed]
        return max(fits, key=lambda b: (b.speed[needs.device], b.target is None))
    b = _REGISTRY.get((role, name))
    if b is None:
        raise HeadscopeInputError(f"InferenceConfig.{role}={name!r} is not a {role} backend; registered: "
                                  f"{['auto'] + names(role)} (headscope.hybrid.backends())")
    lacks = b.supports.missing(needs)
    if lacks:
        raise HeadscopeInputError(f"InferenceConfig.{role}={name!r} does not apply{where}: the backend lacks "
                                  f"{', '.join(lacks)}; use {role}='auto' (the fastest that applies) or 'reference'")
    return b


def layer_needs(layer: Any, partial_rotary: bool = False) -> frozenset:
    """The :data:`FEATURES` a hybrid layer has (its ``LayerSpec``, options and head_dim; ``partial_rotary`` from the
    model config, which the layer does not keep)."""
    s, d = layer.spec, layer.head_dim
    have = {"window": s.window is not None, "softcap": s.softcap is not None, "partial_rotary": partial_rotary,
            "biases": s.q_bias or s.k_bias or s.v_bias or s.o_bias, "qk_norm_teacher": s.qk_norm == "teacher",
            "nope_layer": not s.rope, "short_conv": bool(layer.options.gdn_conv),
            "logit_scale": s.scaling is not None and abs(s.scaling - d ** -0.5) > 1e-12}
    return frozenset(k for k, v in have.items() if v)


def replace_all(config: Any, name: str) -> Any:
    """``config`` with every role set to ``name`` where it is registered for that role (e.g. "reference")."""
    return dataclasses.replace(config, **{r: name for r in ROLES if (r, name) in _REGISTRY or name == "auto"})
