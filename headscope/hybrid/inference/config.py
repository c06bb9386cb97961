"""One frozen configuration of the hybrid's fast inference paths, chosen once per model and passed down.

The layer's inference forward (``forward.py``: prefill and decode) and the whole-model decoder (``decoder.py``)
read every choice from an :class:`InferenceConfig` — none from a module-level switch — so two models in one
process can differ, and a benchmark records its choices as data (``dataclasses.asdict``). Variants are
``dataclasses.replace(cfg, ...)``. The defaults are the measured best (``docs/performance-variants.md`` lists
the variants that lost and were removed, and the measurements behind each default).

    from dataclasses import replace
    use_inference(model, replace(InferenceConfig(), fast_path="always"))   # e.g. the lean path on CPU (tests)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

_WHERE = ("cuda", "always", "never")
_DECODE_GRAPHS = ("all", "static", "never")


@dataclass(frozen=True)
class InferenceConfig:
    """The fast paths' choices (all validated on construction).

    Attributes:
        fast_path: where a hybrid layer takes the lean path (no gradient, no mask, no cache or a decode cache):
            ``"cuda"`` on CUDA tensors, ``"always"`` on every device (CPU tests), ``"never"``.
        compile_glue: ``torch.compile`` the lean path's elementwise glue on CUDA (eager elsewhere).
        gdn_block_tokens: batch × time tokens per GDN kernel call in a prefill; None: the automatic rule
            (``gdn_block_work`` eagerly, ``tokens // gdn_graph_block_divisor`` under a CUDA graph).
        gdn_block_work: automatic eager blocks: tokens × GDN heads × d² per call.
        gdn_graph_block_divisor: a prefill recorded for a CUDA graph takes GDN blocks of a 1/divisor of its tokens
            (at least ``gdn_graph_block_min``); 0: the eager rule.
        gdn_graph_block_min: the smallest such block (tokens).
        eager_gdn_graphs: an eager prefill without autograd replays its GDN heads as fixed-shape blocks from CUDA
            graphs: ``"cuda"`` where it applies (CUDA, fla), ``"always"`` also on CPU (the same padded static-buffer
            path without graphs: tests), ``"never"``.
        eager_graph_tokens: batch × time tokens per such block; a shorter prefill takes a power-of-two block of at
            least ``eager_graph_min`` tokens; at most ``eager_graph_max`` block shapes are held.
        flash_qla: FlashQLA's GDN chunk forward (head_dim 128, bf16/fp16, CUDA, when installed) instead of fla's.
        fused_out_max_d: a decode step folds the output fusion (FA gate, per-head RMSNorm, γ) into its kernels up
            to this head_dim.
        tail_backend, tail_mode: ``torch.compile`` backend and mode of StaticDecoder's compiled layer tails.
        fused_gate_up_max_bytes: StaticDecoder's fused tail concatenates a layer's gate and up weights into one
            GEMM up to this many bytes per layer (small, latency-bound GEMMs).
        tail_kernel: StaticDecoder's decode step (≤ 16 rows, compile_tail) runs each layer's split-K combination,
            o_proj, residual, norm, gated MLP, next norm and next input projection in one persistent Triton launch
            (``kernels/layer_tail.py``) where it applies; False: the compiled tail.
        decode_graphs: which decode steps of ``model(...)`` / ``generate`` (one token per sequence into a
            ``HybridCache``, on CUDA, unpadded) run as one replayed CUDA graph of the whole model step
            (``model_step.py``): ``"all"``; ``"static"`` only a static cache's (``cache_implementation="static"``),
            the others layer by layer; ``"never"``. A static cache's graph has compiled layer tails (a first-use
            compile), a growing cache's has eager ones (capture only).

    Raises:
        ValueError: a field outside its allowed values (named in the message).
    """

    fast_path: str = "cuda"
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
        for name in ("fast_path", "eager_gdn_graphs"):
            if getattr(self, name) not in _WHERE:
                raise ValueError(f"InferenceConfig.{name} must be one of {_WHERE}; got {getattr(self, name)!r}")
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
_ATTR = "_headscope_inference"


def inference_config(module: Any) -> InferenceConfig:
    """The :class:`InferenceConfig` a model or hybrid layer runs with (:data:`DEFAULT` unless set by
    :func:`use_inference`)."""
    return module.__dict__.get(_ATTR, DEFAULT)


def use_inference(model: Any, config: InferenceConfig) -> InferenceConfig:
    """Choose the fast paths' configuration of ``model`` (a hybrid model, or one hybrid layer): stored on the model
    and on every module with a hybrid layer's decode cache, which read it at run time. Returns ``config``.

    Raises:
        TypeError: ``config`` is not an InferenceConfig.
    """
    if not isinstance(config, InferenceConfig):
        raise TypeError(f"want an InferenceConfig, got {type(config).__name__}; build one with "
                        "dataclasses.replace(InferenceConfig(), ...)")
    for m in model.modules():
        if m is model or hasattr(m, "new_decode_cache"):
            m.__dict__[_ATTR] = config
    return config
