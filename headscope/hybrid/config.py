"""Options of the head-wise hybrid (SPEC.md §8); stored in the hybrid model's config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

_FA_POS = ("rope", "nope")
_FUSION = ("rmsnorm", "none")
_KERNELS = ("auto", "torch", "fla")
_FA_KERNELS = ("auto", "sdpa", "flash_attn")


@dataclass(frozen=True)
class HybridOptions:
    """How :class:`~headscope.hybrid.HeadwiseHybridAttention` computes its two branches.

    Attributes:
        fa_pos: position encoding of the FA heads: ``"rope"`` (the teacher's; parity with the teacher) or
            ``"nope"`` — no rotary, the query is multiplied by s_t = log(t + a) / log(a) at position t
            (0-based; s_0 = 1), the log-scale coefficient of HypeNet. (default ``"rope"``)
        nope_a: the constant a of s_t (tokens, > 1). (default 512)
        fa_gate: per-head, per-channel output gate sigmoid(W_g x + b_g) on the FA heads. W_g = 0, b_g = 0
            at initialization (gate 0.5, which the per-head RMSNorm of the fusion cancels exactly).
        gdn_rope: apply the teacher's rotary embedding to GDN q/k before L2 normalization. (default True)
        gdn_conv: kernel size of the optional depthwise causal short convolution on GDN q/k/v, 0 = off.
            Initialized to the identity (last tap 1, others 0), no activation. (default 0)
        fusion: ``"rmsnorm"`` — eq. 13–14, every head's output RMS-normalized on its own and scaled by a
            learnable γ_h ∈ R^{d_head}; ``"none"`` — heads concatenated as they are (teacher parity).
        norm_eps: ε of the fusion RMSNorm.
        gdn_kernel: ``"auto"`` (fla on CUDA when installed, else the PyTorch chunked form), ``"torch"``,
            ``"fla"`` (CUDA only).
        chunk_size: chunk length of the PyTorch chunked path (tokens).
        fa_kernel: softmax attention of the FA heads: ``"auto"`` (flash-attn's ``flash_attn_func`` when
            importable, on CUDA in fp16/bf16, without a padding mask; else PyTorch SDPA), ``"sdpa"``,
            ``"flash_attn"``. Both are GQA-native (no K/V copy per query head). (default ``"auto"``)
        gdn_span: (min, max) initial memory span 1 / (1 − α_h) of the GDN heads in tokens, log-spaced
            over the GDN heads of a layer; sets dt_bias with A_log = 0 and a_proj = 0. (default (16, 1024))
    """

    fa_pos: str = "rope"
    nope_a: float = 512.0
    fa_gate: bool = False
    gdn_rope: bool = True
    gdn_conv: int = 0
    fusion: str = "rmsnorm"
    norm_eps: float = 1e-6
    gdn_kernel: str = "auto"
    chunk_size: int = 64
    gdn_span: tuple[float, float] = (16.0, 1024.0)
    fa_kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.fa_pos not in _FA_POS:
            raise ValueError(f"fa_pos must be one of {_FA_POS}, got {self.fa_pos!r}")
        if not self.nope_a > 1:
            raise ValueError(f"nope_a must be > 1 (s_t = log(t + a) / log(a)), got {self.nope_a}")
        if self.fusion not in _FUSION:
            raise ValueError(f"fusion must be one of {_FUSION}, got {self.fusion!r}")
        if self.gdn_kernel not in _KERNELS:
            raise ValueError(f"gdn_kernel must be one of {_KERNELS}, got {self.gdn_kernel!r}")
        if self.fa_kernel not in _FA_KERNELS:
            raise ValueError(f"fa_kernel must be one of {_FA_KERNELS}, got {self.fa_kernel!r}")
        if self.gdn_conv < 0 or int(self.gdn_conv) != self.gdn_conv:
            raise ValueError(f"gdn_conv is a kernel size >= 0 (0 = off), got {self.gdn_conv}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        lo, hi = self.gdn_span
        if not 1 < lo <= hi:
            raise ValueError(f"gdn_span must satisfy 1 < min <= max (tokens), got {self.gdn_span}")
        object.__setattr__(self, "gdn_span", (float(lo), float(hi)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gdn_span"] = list(self.gdn_span)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HybridOptions":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown hybrid option(s) {sorted(unknown)}; known: {sorted(names)}")
        d = dict(d)
        if "gdn_span" in d:
            d["gdn_span"] = tuple(d["gdn_span"])
        return cls(**d)


@dataclass(frozen=True)
class LayerSpec:
    """What one teacher attention layer applies, as the hybrid layer reproduces it (read by the
    architecture adapter at conversion, stored per layer in ``config.headscope_hybrid["layers"]``).

    Attributes:
        q_bias, k_bias, v_bias, o_bias: the projection has a bias (Qwen2: q/k/v; GPT-NeoX: all four).
        qk_norm: the teacher normalizes q and k per head: ``"rms"`` — x / RMS(x) · w computed as
            Qwen3 does (the hybrid's own module); ``"teacher"`` — another convention (e.g. Gemma's
            fp32 · (1 + w)): the hybrid holds a copy of the teacher's norm module; None: no QK-norm.
        rope: the layer rotates q/k with the ``position_embeddings`` its decoder layer passes (partial
            rotary: the first ``cos.shape[-1]`` features of a head); False: NoPE layer.
        scaling: attention logit scale of the FA heads (None: 1/√d_head; Gemma: query_pre_attn_scalar^-½).
        window: sliding window w of the layer (key j visible to query i iff 0 ≤ i − j < w), None: full.
            An FA head of a sliding layer keeps the window; GDN heads have no window.
        softcap: attention logit soft-capping c of the FA heads (c·tanh(s/c)), None: off.
    """

    q_bias: bool = False
    k_bias: bool = False
    v_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None
    rope: bool = True
    scaling: float | None = None
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and int(self.window) < 1:
            raise ValueError(f"window must be >= 1 token or None, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
        if self.qk_norm not in (None, "rms", "teacher"):
            raise ValueError(f"qk_norm must be None, 'rms' or 'teacher', got {self.qk_norm!r}")
        if self.scaling is not None and not self.scaling > 0:
            raise ValueError(f"scaling must be > 0 or None, got {self.scaling}")

    def plain(self, head_dim: int) -> bool:
        """A Llama/Qwen2/Qwen3 layer (any projection biases, RoPE, 1/√d scale, no window, no soft-cap, no
        teacher-convention QK-norm): what the fast inference and training paths compute (they stack the
        projections' biases with zero rows where a projection has none, and add o_proj's own)."""
        return (self.rope and self.qk_norm != "teacher" and self.window is None and self.softcap is None
                and (self.scaling is None or abs(self.scaling - head_dim ** -0.5) < 1e-12))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerSpec":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown layer spec field(s) {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)
