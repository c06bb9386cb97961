"""One frozen configuration of the hybrid's fast backends, attached per model (:func:`use_inference`).

Every choice of the fast paths is a field of :class:`InferenceConfig` — none a module-level switch — so two models in
one process can differ and a result file records the choices (``dataclasses.asdict``); variants are
``dataclasses.replace(cfg, ...)``, the defaults the measured best (docs/performance-variants.md). Its role fields name
the backends (``headscope/hybrid/backend_registry.py``) that attach to the layers (:class:`LayerBackends`, ``layer.backends``)
and the model (:class:`ModelBackends`, ``model.backends``), which the saved modeling code calls when they are set.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch

from ..backend_registry import ROLES, Backend, Needs, layer_needs, select
from ..fa_kernels import fa_attention, flash_attn_available
from ..gdn_kernels import fla_available, gated_delta_rule

_WHERE = ("cuda", "always", "never")
_DECODE_GRAPHS = ("all", "static", "never")


@dataclass(frozen=True)
class InferenceConfig:
    """The fast backends' choices (all validated on construction).

    Attributes:
        train, prefill, decode, captured_decode: each role's backend (``headscope.hybrid.backends()``): a name, or
            ``"auto"`` — the fastest that applies on the call's device (CUDA: ``fused`` / ``lean`` / ``lean`` /
            ``graph`` for the six families' layers; CPU: ``"reference"``, the saved code's forward). A
            named backend that does not apply raises HeadscopeInputError (``use_inference``, or a first call on
            another device / dtype).
        compile_glue: ``torch.compile`` the lean backends' elementwise glue on CUDA (eager elsewhere).
        gdn_block_tokens: batch × time tokens per GDN kernel call in a prefill; None: ``gdn_block_work`` (tokens ×
            GDN heads × d² per call) eagerly, under a CUDA graph ``tokens // gdn_graph_block_divisor`` (≥
            ``gdn_graph_block_min``; divisor 0: the eager rule).
        eager_gdn_graphs: an eager prefill without autograd replays its GDN heads as fixed-shape blocks from CUDA
            graphs: ``"cuda"`` (CUDA, fla), ``"always"`` (also on CPU, without graphs: tests), ``"never"``;
            ``eager_graph_tokens`` per block (a shorter prefill: a power of two ≥ ``eager_graph_min``), at most
            ``eager_graph_max`` block shapes held.
        flash_qla: FlashQLA's GDN chunk forward instead of fla's where it applies (prefill.flash_qla_applies).
        fused_out_max_d: a decode step folds the output fusion (gate, RMSNorm, γ) into its kernels up to this d.
        tail_backend, tail_mode: ``torch.compile`` backend and mode of StaticDecoder's compiled layer tails;
            ``fused_gate_up_max_bytes``: its fused tail's one gate/up GEMM up to this size per layer;
            ``tail_kernel``: its decode step (≤ 16 rows) runs each layer's tail (combination, o_proj, norm, MLP,
            next norm and input projection) as one Triton launch (``kernels/layer_tail.py``).
        decode_graphs: which decode steps of ``generate`` replay the ``graph`` backend: ``"all"``, ``"static"``
            (only ``cache_implementation="static"``'s, with compiled tails), ``"never"``.

    Raises:
        ValueError: a field outside its allowed values (named in the message).
    """

    train: str = "auto"
    prefill: str = "auto"
    decode: str = "auto"
    captured_decode: str = "auto"
    compile_glue: bool = True
    gdn_block_tokens: Optional[int] = None
    gdn_block_work: int = 1 << 31
    gdn_graph_block_divisor: int = 4
    gdn_graph_block_min: int = 2048
    eager_gdn_graphs: str = "cuda"
    eager_graph_tokens: int = 8192
    eager_graph_min: int = 256
    eager_graph_max: int = 8
    flash_qla: bool = True
    fused_out_max_d: int = 64
    tail_backend: Any = "inductor"
    tail_mode: Optional[str] = None
    fused_gate_up_max_bytes: int = 32 << 20
    tail_kernel: bool = True
    decode_graphs: str = "all"

    def __post_init__(self) -> None:
        for name in ROLES:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"InferenceConfig.{name} must be a backend name or 'auto'; got {getattr(self, name)!r}")
        if self.eager_gdn_graphs not in _WHERE:
            raise ValueError(f"InferenceConfig.eager_gdn_graphs must be one of {_WHERE}; got {self.eager_gdn_graphs!r}")
        if self.decode_graphs not in _DECODE_GRAPHS:
            raise ValueError(f"InferenceConfig.decode_graphs must be one of {_DECODE_GRAPHS}; got {self.decode_graphs!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                raise ValueError(f"InferenceConfig.{f.name} must be True or False; got {v!r}")
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"InferenceConfig.{f.name} must be an integer ≥ 0; got {v!r}")
        blk = self.gdn_block_tokens
        if blk is not None and (not isinstance(blk, int) or isinstance(blk, bool) or blk < 1):
            raise ValueError(f"InferenceConfig.gdn_block_tokens must be None or an integer ≥ 1; got {blk!r}")
        for name in ("eager_graph_tokens", "eager_graph_min", "eager_graph_max", "gdn_graph_block_min",
                     "gdn_block_work"):
            if getattr(self, name) < 1:
                raise ValueError(f"InferenceConfig.{name} must be ≥ 1; got {getattr(self, name)}")
        if not (isinstance(self.tail_backend, str) and self.tail_backend) and not callable(self.tail_backend):
            raise ValueError(f"InferenceConfig.tail_backend must be a torch.compile backend (a name or a callable); "
                             f"got {self.tail_backend!r}")
        if self.tail_mode is not None and not isinstance(self.tail_mode, str):
            raise ValueError(f"InferenceConfig.tail_mode must be None or a torch.compile mode; got {self.tail_mode!r}")


DEFAULT = InferenceConfig()


def _needs(features: frozenset, w: torch.Tensor) -> Needs:
    return Needs(features, str(w.dtype).removeprefix("torch."), w.device.type)


class LayerBackends:
    """A hybrid layer's backends (``layer.backends``, set by :func:`use_inference`): the config, the layer's
    :data:`~headscope.hybrid.backends.FEATURES`, the backend chosen per (role, device, dtype), and the fast paths'
    per-layer state (``plan``: the inference plan; ``train_index``: the fused training step's index tensors)."""

    def __init__(self, config: InferenceConfig, features: frozenset):
        self.config, self.features = config, features
        self.plan: Any = None
        self.train_index: Any = None
        self._chosen: dict = {}
        self._fns: dict = {}

    def backend(self, layer: Any, role: str, w: torch.Tensor) -> Backend:
        """The backend of ``role`` for the layer with parameters like ``w`` (dtype, device; memoized).

        Raises:
            HeadscopeInputError: the config names a backend that does not apply to this layer."""
        key = (role, w.device.type, w.dtype)
        b = self._chosen.get(key)
        if b is None:
            b = self._chosen[key] = select(role, getattr(self.config, role), _needs(self.features, w),
                                                    f" to layer {layer.layer_idx}")
        return b

    def attention(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        """The reference forward's FA heads with the kernel of ``layer.options.fa_kernel`` (flash-attn where it
        applies; ``fa_kernels.fa_attention``)."""
        return fa_attention(q, k, v, layer.scaling, True, mask, layer.options.fa_kernel, layer.spec.window,
                            layer.spec.softcap)

    def gdn(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            h0: Optional[torch.Tensor]) -> tuple:
        """The reference forward's GDN heads with the kernel of ``layer.options.gdn_kernel`` (fla on CUDA;
        ``gdn_kernels.gated_delta_rule``)."""
        return gated_delta_rule(q, k, v, g, beta, scale=layer.gdn_scale, initial_state=h0,
                                kernel=layer.options.gdn_kernel, chunk_size=layer.options.chunk_size)

    def fn(self, layer: Any, role: str) -> Optional[Callable]:
        """``role``'s backend function for the layer's parameters (None: the reference), resolved once per dtype."""
        w = layer.q_proj.weight
        key = (role, w.device.type, w.dtype)
        if key not in self._fns:
            self._fns[key] = self.backend(layer, role, w).fn()
        return self._fns[key]

    def __call__(self, layer: Any, x: torch.Tensor, position_embeddings: Any, attention_mask: Any, cache: Any,
                 position_ids: Any) -> Any:
        """The layer's output from its backend for this call's role, or None (the reference forward computes it):
        a layer whose ``o_proj`` has hooks runs the reference (the fast paths apply o_proj's weights directly)."""
        if layer.o_proj._forward_pre_hooks or layer.o_proj._forward_hooks:
            return None
        role = "train" if (torch.is_grad_enabled() and cache is None and position_embeddings is not None
                           and self.fn(layer, "train") is not None) else None
        if role is None and inference_call(layer, x):
            role = "decode" if cache is not None and x.shape[1] == 1 else "prefill"
        fn = self.fn(layer, role) if role is not None else None
        if fn is None or (attention_mask is not None and not own_mask(layer, attention_mask, cache)):
            return None  # the reference; a mask the layer would apply itself (own_mask) is left to the backend
        if role == "train":
            return fn(layer, x, *position_embeddings, position_ids)
        return fn(layer, x, position_embeddings, position_ids, cache)


def own_mask(layer: Any, mask: torch.Tensor, cache: Any) -> bool:
    """Whether ``mask`` is the causal mask the layer applies without one — a 4-D bool [batch, 1, time, past + time]
    that is causal and, for a sliding layer, its window (transformers builds it for a sliding layer's prompt longer
    than the window), no padding — so a backend computes the call from ``LayerSpec.window`` (one comparison, a sync)."""
    T, past = mask.shape[-2] if mask.dim() == 4 else 0, cache.length if cache is not None else 0
    if mask.dim() != 4 or mask.dtype != torch.bool or mask.shape[1] != 1 or mask.shape[-1] != past + T:
        return False
    i = torch.arange(past, past + T, device=mask.device)[:, None]
    j = torch.arange(past + T, device=mask.device)[None]
    w, m = layer.spec.window, (mask[:1] if mask.stride(0) == 0 else mask)
    want = (j <= i) & (i - j < w if w is not None else True)
    return all(bool(want.eq(r).all()) for r in ([m] if m.numel() <= 1 << 24 else m.unbind(0)))  # bounded temporaries


def inference_call(layer: Any, x: torch.Tensor) -> bool:
    """Whether a call can take an inference backend: no gradient needed (for x or any parameter), [batch, time,
    hidden] input in the weights' dtype and device, no autocast."""
    w = layer.q_proj.weight
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters())):
        return False  # gradients for any parameter: the inference backends build their weights without autograd
    if x.dim() != 3 or w.dtype != x.dtype or w.device != x.device:
        return False
    return not torch.is_autocast_enabled(x.device.type)


class ModelBackends:
    """A hybrid causal LM's ``captured_decode`` backend (``model.backends``, set by :func:`use_inference`)."""

    def __init__(self, config: InferenceConfig, features: frozenset):
        self.config, self.features = config, features
        self._chosen: dict = {}

    def backend(self, w: torch.Tensor) -> Backend:
        key = (w.device.type, w.dtype)
        if key not in self._chosen:
            self._chosen[key] = select("captured_decode", self.config.captured_decode,
                                                _needs(self.features, w), " to this model")
        return self._chosen[key]

    def __call__(self, model: Any, input_ids: Any, cache: Any, kwargs: dict) -> Any:
        fn = self.backend(next(model.parameters())).fn()
        return None if fn is None else fn(model, input_ids, cache, kwargs)


def inference_config(module: Any) -> InferenceConfig:
    """The :class:`InferenceConfig` a model or hybrid layer runs with (:data:`DEFAULT` where none is attached)."""
    b = getattr(module, "backends", None)
    return b.config if isinstance(b, (LayerBackends, ModelBackends)) else DEFAULT


def _partial_rotary(config: Any) -> bool:
    return any(float(getattr(config, k, None) or 1.0) < 1.0 for k in ("rotary_pct", "partial_rotary_factor"))


# the decoder layers whose function StaticDecoder computes (decoder._post): Llama's form, Gemma 3's, GPT-NeoX's
_STEP_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer",
                "Gemma3DecoderLayer", "GPTNeoXLayer")


def _step_layers(model: Any) -> bool:
    """Whether every decoder layer of the model is one of :data:`_STEP_LAYERS` around a hybrid attention layer."""
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    return layers is not None and hasattr(base, "rotary_emb") and all(type(l).__name__ in _STEP_LAYERS and any(
        hasattr(getattr(l, n, None), "new_decode_cache") for n in ("self_attn", "attention")) for l in layers)


def runnable_options(options: Any, warned: Optional[set] = None) -> Any:
    """``options`` (a layer's HybridOptions) with kernels that are not installed replaced by the PyTorch ones, with a
    warning (once per swap in ``warned``): ``gdn_kernel="fla"`` → ``"torch"`` without flash-linear-attention,
    ``fa_kernel="flash_attn"`` → ``"sdpa"`` without flash-attn. Other options are returned unchanged (the model's
    config keeps the saved choice)."""
    swap: dict[str, str] = {}
    if options.gdn_kernel == "fla" and not fla_available():
        swap["gdn_kernel"] = "torch"
    if options.fa_kernel == "flash_attn" and not flash_attn_available():
        swap["fa_kernel"] = "sdpa"
    if not swap:
        return options
    msg = ("the hybrid asks for kernels that are not installed " + ", ".join(f"{k}={getattr(options, k)!r}" for k in swap)
           + "; using " + ", ".join(f"{k}={v!r}" for k, v in swap.items())
           + " (PyTorch). Install flash-linear-attention / flash-attn for the fast kernels.")
    if warned is None or msg not in warned:
        warnings.warn(msg, stacklevel=3)
        if warned is not None:
            warned.add(msg)
    return dataclasses.replace(options, **swap)


def use_inference(model: Any, config: InferenceConfig = DEFAULT) -> InferenceConfig:
    """Attach the backends ``config`` chooses to ``model`` (a hybrid model, or one hybrid layer): a
    :class:`LayerBackends` on every hybrid layer, a :class:`ModelBackends` on a hybrid causal LM. Every role is
    resolved once for the parameters' current device and dtype, so a backend that does not apply is refused here.
    Returns ``config``.

    Raises:
        TypeError: ``config`` is not an InferenceConfig.
        HeadscopeInputError: a role names a backend that is not registered or does not apply (named, with the fix).
    """
    if not isinstance(config, InferenceConfig):
        raise TypeError(f"want an InferenceConfig, got {type(config).__name__}; build one with "
                        "dataclasses.replace(InferenceConfig(), ...)")
    partial, warned = _partial_rotary(getattr(model, "config", None)), set()
    layers = [m for m in model.modules() if hasattr(m, "new_decode_cache")]
    attached = [LayerBackends(config, layer_needs(m, partial)) for m in layers]
    for m, b in zip(layers, attached):
        for role in ("train", "prefill", "decode"):
            b.backend(m, role, m.q_proj.weight)
    step = None
    if "backends" in getattr(model, "__dict__", {}) and not hasattr(model, "new_decode_cache"):
        feats = frozenset().union(*(b.features for b in attached)) | (
            frozenset() if _step_layers(model) else {"other_decoder_layer"})
        step = ModelBackends(config, feats)
        step.backend(next(model.parameters()))
    for m, b in zip(layers, attached):
        m.backends = b
        m.options = runnable_options(m.options, warned)
    if step is not None:
        model.backends = step
    return config
