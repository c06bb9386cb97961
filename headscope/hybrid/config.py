"""Options of the head-wise hybrid (SPEC.md §8); stored in the hybrid model's config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

_CHOICES = {"fa_pos": ("rope", "nope"), "fusion": ("rmsnorm", "none"), "gdn_kernel": ("auto", "torch", "fla"),
            "fa_kernel": ("auto", "sdpa", "flash_attn")}


def _from_dict(cls: Any, d: dict[str, Any], what: str) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown {what} {sorted(unknown)}; known: {sorted(names)}")
    return cls(**d)


@dataclass(frozen=True)
class HybridOptions:
    """How :class:`~headscope.hybrid.HeadwiseHybridAttention` computes its two branches.

    Attributes:
        fa_pos: the FA heads' positions: ``"rope"`` (the teacher's) or ``"nope"`` — the query times
            s_t = log(t + a) / log(a) at position t (0-based), HypeNet's coefficient; ``nope_a``: a (tokens, > 1).
        fa_gate: per-channel output gate sigmoid(W_g x + b_g) on the FA heads (W_g = 0, b_g = 0 at start).
        gdn_rope: the teacher's rotary embedding on GDN q/k before their L2 normalization.
        gdn_conv: kernel size of a depthwise causal short convolution on GDN q/k/v (identity at start), 0 = off.
        fusion: ``"rmsnorm"`` — eq. 13–14, each head's output RMS-normalized and scaled by a learnable γ_h;
            ``"none"`` — heads concatenated as they are (teacher parity). ``norm_eps``: its ε.
        gdn_kernel: ``"auto"`` (fla on CUDA when installed), ``"torch"``, ``"fla"``; ``fa_kernel``: ``"auto"``
            (flash-attn where it applies), ``"sdpa"``, ``"flash_attn"``. Picked by headscope's backends; the saved
            code runs PyTorch alone. ``chunk_size``: chunk length of the PyTorch GDN form (tokens).
        gdn_span: (min, max) initial memory span 1 / (1 − α_h) of the GDN heads in tokens, log-spaced over a
            layer's GDN heads (sets dt_bias with A_log = 0, a_proj = 0).
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
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not self.nope_a > 1:
            raise ValueError(f"nope_a must be > 1 (s_t = log(t + a) / log(a)), got {self.nope_a}")
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
        return _from_dict(cls, {k: tuple(v) if k == "gdn_span" else v for k, v in d.items()}, "hybrid option(s)")


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerSpec":
        return _from_dict(cls, d, "layer spec field(s)")
