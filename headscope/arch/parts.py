"""Typed per-layer parts of a decoder-only transformer, as the patching engine computes with them.

An architecture adapter (:mod:`headscope.arch.families`) reads a transformers model and its config
and returns an :class:`Arch`: the embedding, one :class:`LayerParts` per decoder layer and the
unembedding. Everything a model varies from layer to layer is a field here, read from the config
or the modules, never assumed:

* attention: the per-head projections (split, fused or GPT-2 ``Conv1D``, as ``[out, in]`` weight
  views), QK-norm (per head or over the whole projection), the positional scheme (:class:`Rope`:
  RoPE of a given kind with partial rotary, or ``None`` for NoPE / learned absolute positions),
  the logit scale, a sliding window and logit soft-capping;
* the block: pre-norms, post-norms (Gemma's sandwich, OLMo 2's post-only), parallel attention+MLP
  (GPT-NeoX) or sequential, and a residual multiplier (Granite);
* the ends: embedding scale (Granite; Gemma scales inside its embedding module), learned positions
  (GPT-2), final norm, logit division (Granite) and final soft-capping (Gemma 2/3).

The activation patched is TransformerLens ``hook_z``: the input of the attention output projection,
``[batch, pos, n_heads * d_head]`` (heads flattened).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn


_VIEWS: dict[tuple[int, str], tuple["weakref.ref[Tensor]", Tensor]] = {}


def weight_view(weight: Tensor, key: str, make: Callable[[Tensor], Tensor]) -> Tensor:
    """``make(weight.detach())`` (a view: transposed, rows), made once per weight tensor and ``key``, so
    that every engine built on the model gets the same view object (the oneDNN prepacked copies in
    :mod:`headscope.patching.linear` are cached per tensor object: a new view each time would repack)."""
    k = (id(weight), key)
    hit = _VIEWS.get(k)
    if hit is not None and hit[0]() is weight:
        return hit[1]
    view = make(weight.detach())
    _VIEWS[k] = (weakref.ref(weight, lambda _r, k=k, d=_VIEWS: d.pop(k, None)), view)
    return view


def unwrap(m: nn.Module | None) -> nn.Module | None:
    """The transformers module inside a TransformerBridge component (the module itself otherwise)."""
    return getattr(m, "original_component", m) if m is not None else None


@dataclass
class Proj:
    """A linear map ``y = x @ weight.T + bias`` given as tensors (views of the model's own weights
    where the layout allows, so in-place weight edits are seen), plus the module it came from.

    weight: Float[Tensor, "out in"]; bias: Float[Tensor, "out"] or None.
    ``module`` is called instead of the tensors when it carries hooks (e.g. a knockout's pre-hook on
    the output projection), so that hooks keep working.
    """

    weight: Tensor
    bias: Tensor | None
    module: nn.Module | None = None

    @property
    def hooked(self) -> bool:
        m = self.module
        return m is not None and bool(m._forward_hooks or m._forward_pre_hooks)


@dataclass(frozen=True)
class Rope:
    """The rotary positional scheme of one layer.

    ``kind``: a key of :attr:`Arch.rope_tables` (layers of one kind share their cos/sin, e.g. Gemma 3's
    ``"sliding_attention"`` and ``"full_attention"`` with their own bases). The rotation is the
    "rotate half" convention of Llama/GPT-NeoX applied to the first ``cos.shape[-1]`` dimensions of
    each head (partial rotary: the rest pass through).
    """

    kind: str


@dataclass
class LayerParts:
    """One decoder layer, in the engine's terms.

    Attributes:
        q, k, v: projections to ``n_heads * d_head`` / ``n_kv_heads * d_head`` features.
        o: the output projection (its input is hook_z).
        ln1: norm before attention (None: identity, OLMo 2).
        q_norm, k_norm: QK-norm modules; ``qk_norm_per_head`` True: applied to [.., heads, d_head]
            (Qwen3, Gemma 3), False: to the whole projection before the head split (OLMo 2).
        rope: positional scheme of this layer (None: no rotation — NoPE layers, learned positions).
        scaling: attention logit scale (1/sqrt(d_head), Gemma's query_pre_attn_scalar^-1/2,
            Granite's attention_multiplier, GPT-2's 1/(layer+1) option).
        window: sliding window w (key j visible to query i iff 0 <= i - j < w), None: full causal.
        softcap: attention logit soft-capping c (logits -> c·tanh(logits/c)), None: off.
        post_attn_norm: norm of the attention output before the residual add (Gemma, OLMo 2).
        ln2: norm before the MLP (None: identity).
        post_mlp_norm: norm of the MLP output before the residual add (Gemma, OLMo 2).
        mlp: the MLP module.
        parallel: attention and MLP both read the layer input (GPT-NeoX ``use_parallel_residual``).
        residual_multiplier: scale of each branch before its residual add (Granite).
        device: where the layer's weights live.
    """

    q: Proj
    k: Proj
    v: Proj
    o: Proj
    ln1: nn.Module | None
    ln2: nn.Module | None
    mlp: nn.Module
    scaling: float
    rope: Rope | None = None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    qk_norm_per_head: bool = True
    window: int | None = None
    softcap: float | None = None
    post_attn_norm: nn.Module | None = None
    post_mlp_norm: nn.Module | None = None
    parallel: bool = False
    residual_multiplier: float = 1.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def plain_block(self) -> bool:
        """Llama's sequential pre-norm block (what the blocked fast MLP path assumes)."""
        return (not self.parallel and self.post_attn_norm is None and self.post_mlp_norm is None
                and self.residual_multiplier == 1.0 and self.ln2 is not None)


RopeFn = Callable[[str, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass
class Arch:
    """A model's parts: what :class:`~headscope.patching.engine.Engine` runs.

    Attributes:
        family: the adapter's name (e.g. ``"llama"``, ``"gpt2"``).
        layers: one :class:`LayerParts` per decoder layer.
        embed: ``embed(ids [B, S], positions [S]) -> h [B, S, d_model]`` (scales and learned
            positions included).
        final_norm: the final norm module (None: identity).
        lm_head: the unembedding.
        rope_tables: ``rope(kind, positions [S], like) -> (cos, sin)`` each ``[S, rotary_dim]``
            (None for a model without RoPE).
        logit_divisor: logits are divided by this (Granite ``logits_scaling``).
        final_softcap: final logit soft-capping (Gemma 2/3), None: off.
        notes: what the adapter read from the config, for provenance.
    """

    family: str
    layers: list[LayerParts]
    embed: Callable[[Tensor, Tensor], Tensor]
    final_norm: nn.Module | None
    lm_head: Proj
    rope_tables: RopeFn | None = None
    logit_divisor: float = 1.0
    final_softcap: float | None = None
    notes: dict = field(default_factory=dict)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the "rotate half" convention on the first ``cos.shape[-1]`` features of ``x``.

    x: [..., d_head]; cos, sin: broadcastable to [..., rotary_dim] (rotary_dim <= d_head, even).
    Returns x with its first rotary_dim features rotated, x₁·cos + (−x₂, x₁)·sin, the rest unchanged.
    """
    r = cos.shape[-1]
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if r < x.shape[-1]:
        return torch.cat([rotate(x[..., :r], cos, sin), x[..., r:]], -1)
    half = r // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    sign = torch.ones(2, half, dtype=sin.dtype, device=sin.device)
    sign[0] = -1
    return (x * cos).addcmul_(swapped, sin * sign.flatten())


def softcap(x: Tensor, cap: float | None) -> Tensor:
    """c·tanh(x/c) (Gemma 2's logit soft-capping); x itself when ``cap`` is None."""
    return x if cap is None else torch.tanh(x / cap) * cap
