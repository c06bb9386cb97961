"""The head-wise hybrid attention layer (HydraHead, SPEC.md §8, paper section 4.2).

Per layer the query heads split into FA heads H_F (softmax attention over their KV group) and GDN
heads H_L (gated delta rule, eq. 7–8). Outputs go back into the heads' original slots, are fused
(eq. 13–14: per-head RMSNorm and a learnable γ_h) and pass through the teacher's output projection.

The module has the call signature of a transformers Llama/Qwen3 attention module, so it can be
called on a teacher's hidden states for layer-wise alignment::

    cos_sin = model.model.rotary_emb(h, position_ids)          # h: [batch, time, hidden]
    out, _ = hybrid_attn(h, position_embeddings=cos_sin)        # out: [batch, time, hidden]

Caching: a hybrid model's forward and ``generate`` pass a :class:`~headscope.hybrid.cache.HybridCache` (a
transformers ``Cache``); the layer takes its own slot of it, a :class:`HybridDecodeCache` — preallocated K/V
buffers of its kept KV groups, GDN state and convolution tail, written in place (fixed shapes: CUDA graphs).
Any other cache is refused (the GDN state has no place in it). A layer can be driven with a HybridDecodeCache
directly::

    dc = hybrid_attn.new_decode_cache(batch=1, max_len=T + 64)
    hybrid_attn(h, position_embeddings=cos_sin, cache=dc)          # prefill: fills dc, dc.length = T
    out, _ = hybrid_attn(h1, position_embeddings=cos_sin1, cache=dc)  # one decode step at length T

Memory: under ``torch.no_grad`` (or on tensors that need no gradient) the elementwise stages — RoPE,
the L2 normalization of GDN q/k, the fusion RMSNorm — run in place in blocks of ``BLOCK`` tokens and
the head outputs are written straight into one output buffer, so no full-length fp32 temporaries are
kept; the numbers are the same as out of place.

This module is the reference forward (what a saved checkpoint ships) and imports no fast path.
Inside headscope, a layer whose :class:`LayerSpec` is plain (Llama, Qwen2/3, GPT-NeoX: RoPE, 1/√d scale, no window,
no soft-cap) hands the calls the fast paths compute (CUDA inference with no mask, the prepared training
step) to ``inference/dispatch.py``; every other layer and call, and every call in a process without
headscope (remote code), runs here.

Per-layer variation (biases, QK-norm convention, NoPE layers, partial rotary, the teacher's logit
scale, sliding windows, soft-capping) comes from the layer's :class:`LayerSpec`, read by the
architecture adapter at conversion (:func:`headscope.hybrid.hybridize`).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attn import fa_attention
from .config import HybridOptions, LayerSpec
from .rope import apply_rope, nope_log_scale  # noqa: F401  (public here since the start)
from .cache import HybridCache, HybridDecodeCache, valid_tokens as _valid_tokens
from .gdn import gated_delta_rule
from .shapes import Float

BLOCK = 8192  # tokens per block of the in-place elementwise stages (no gradient needed)


def _inplace_ok(*ts: Tensor) -> bool:
    """The low-memory path may overwrite these fresh tensors: no autograd graph needs them."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def _blocks(T: int):
    for s in range(0, T, BLOCK):
        yield slice(s, min(s + BLOCK, T))


def _rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rope, written back into x block by block (x must be a fresh tensor no one else reads)."""
    if not _inplace_ok(x, cos) or torch.promote_types(x.dtype, cos.dtype) != x.dtype:
        return apply_rope(x, cos, sin)
    for b in _blocks(x.shape[1]):
        x[:, b] = apply_rope(x[:, b], cos[:, b], sin[:, b])
    return x


def _l2norm_(x: Tensor) -> Tensor:
    """F.normalize(x.float(), dim=-1, eps=1e-6).to(x.dtype), in place by time blocks when allowed."""
    if not _inplace_ok(x):
        return F.normalize(x.float(), p=2, dim=-1, eps=1e-6).to(x.dtype)
    for b in _blocks(x.shape[1]):
        x[:, b] = F.normalize(x[:, b].float(), p=2, dim=-1, eps=1e-6)
    return x


def _fuse_(y: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """eq. 13–14 on y [batch, time, head, d]: γ_h · y / RMS(y) per head, fp32 inside, y's dtype out."""
    if not _inplace_ok(y, gamma):
        yf = y.float()
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + eps)
        return (gamma.float() * yf).to(y.dtype)
    gf = gamma.float()
    for b in _blocks(y.shape[1]):
        yf = y[:, b].float()
        y[:, b] = gf * (yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + eps))
    return y


class _HeadRMSNorm(nn.Module):
    """RMSNorm over the head dimension with one weight vector shared by all heads (Qwen3 q_norm/k_norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class HeadwiseHybridAttention(nn.Module):
    """FA heads + GDN heads in one attention layer, with scale-normalized fusion (eq. 7–8, 13–14).

    Args:
        config: the transformers text config of the model (Llama / Qwen3 family): ``hidden_size``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``attention_bias``,
            ``rms_norm_eps``.
        layer_idx: index of the layer (for the cache).
        fa_heads: query heads that keep softmax attention; the others are GDN.
        options: :class:`HybridOptions`.
        qk_norm: the teacher normalizes q and k per head (Qwen3); creates ``q_norm``/``k_norm``
            (ignored when ``spec`` is given).
        spec: what the teacher layer applies (:class:`LayerSpec`); default: the Llama/Qwen3 layer
            of ``config`` (``attention_bias`` on all four projections, ``qk_norm``).
        norms: (q_norm, k_norm) modules of the teacher's class, for ``spec.qk_norm == "teacher"``.

    Parameters (shapes; ``n_keep`` = KV groups with ≥ 1 FA head, ``n_gdn`` = GDN heads, d = head_dim):
        q_proj [hidden → n_heads·d] (all heads, teacher order), k_proj / v_proj [hidden → n_keep·d]
        (kept KV groups only), o_proj [n_heads·d → hidden]; gdn_k_proj / gdn_v_proj [hidden → n_gdn·d]
        (the KV group's K/V copied to every GDN head: MHA); a_proj [hidden → n_gdn] (W = 0),
        dt_bias [n_gdn], A_log [n_gdn] (= 0), b_proj [hidden → n_gdn] (W = 0, b = 0, so β = 0.5);
        optional g_proj (FA gate), gdn_conv (short convolution); gamma [n_heads, d] (fusion γ_h, = 1
        unless calibrated by :func:`headscope.hybrid.hybridize`).

    Raises:
        ValueError: head indices outside the geometry or listed twice; ``spec.qk_norm == "teacher"``
            without ``norms``.
    """

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        fa_heads: Sequence[int],
        options: HybridOptions | None = None,
        qk_norm: bool = False,
        spec: Optional[LayerSpec] = None,
        norms: Optional[tuple[nn.Module, nn.Module]] = None,
    ):
        super().__init__()
        self.options = options = options or HybridOptions()
        self.layer_idx = layer_idx
        H = self.n_heads = int(config.num_attention_heads)
        self.n_kv_heads = int(getattr(config, "num_key_value_heads", None) or H)
        d = self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // H)
        hidden = int(config.hidden_size)
        if spec is None:
            bias = bool(getattr(config, "attention_bias", False))
            spec = LayerSpec(q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias, qk_norm="rms" if qk_norm else None)
        self.spec = spec
        self.plain = spec.plain(d)
        if H % self.n_kv_heads:
            raise ValueError(f"num_attention_heads={H} is not a multiple of num_key_value_heads={self.n_kv_heads}")
        rep = H // self.n_kv_heads
        fa = [int(h) for h in fa_heads]
        if len(set(fa)) != len(fa):
            raise ValueError(f"layer {layer_idx}: FA head listed twice in {fa}")
        if any(not 0 <= h < H for h in fa):
            raise ValueError(f"layer {layer_idx}: FA heads {fa} outside 0..{H - 1}")
        self.fa_heads = tuple(sorted(fa))
        self.gdn_heads = tuple(h for h in range(H) if h not in self.fa_heads)
        self.kv_keep = tuple(sorted({h // rep for h in self.fa_heads}))
        n_fa, n_gdn, n_keep = len(self.fa_heads), len(self.gdn_heads), len(self.kv_keep)
        self.scaling = float(spec.scaling) if spec.scaling is not None else d**-0.5  # FA heads
        self.gdn_scale = d**-0.5  # GDN read-out scale (q is L2-normalized)
        # head index maps (plain tensors built per device on use: not parameters, not saved)
        order = list(self.fa_heads) + list(self.gdn_heads)
        self._index_lists = {
            "fa": list(self.fa_heads),
            "gdn": list(self.gdn_heads),
            "fa_kv": [self.kv_keep.index(h // rep) for h in self.fa_heads],
            "unperm": [order.index(h) for h in range(H)],
        }
        self._index_cache: dict[tuple[str, torch.device], Tensor] = {}
        # GQA-native FA (no K/V copy per FA head) when every kept group has the same number of FA heads
        per_group = [sum(1 for h in self.fa_heads if h // rep == g) for g in self.kv_keep]
        self._fa_gqa = bool(per_group) and len(set(per_group)) == 1

        self.q_proj = nn.Linear(hidden, H * d, bias=spec.q_bias)
        self.o_proj = nn.Linear(H * d, hidden, bias=spec.o_bias)
        if spec.qk_norm == "teacher":
            if norms is None:
                raise ValueError(f"layer {layer_idx}: qk_norm='teacher' needs the teacher's (q_norm, k_norm) modules")
            self.q_norm, self.k_norm = norms
        elif spec.qk_norm == "rms":
            eps = float(getattr(config, "rms_norm_eps", 1e-6))
            self.q_norm, self.k_norm = _HeadRMSNorm(d, eps), _HeadRMSNorm(d, eps)
        else:
            self.q_norm = self.k_norm = None
        # FA branch
        self.k_proj = nn.Linear(hidden, n_keep * d, bias=spec.k_bias) if n_keep else None
        self.v_proj = nn.Linear(hidden, n_keep * d, bias=spec.v_bias) if n_keep else None
        self.g_proj = nn.Linear(hidden, n_fa * d, bias=True) if (options.fa_gate and n_fa) else None
        # GDN branch
        if n_gdn:
            self.gdn_k_proj = nn.Linear(hidden, n_gdn * d, bias=spec.k_bias)
            self.gdn_v_proj = nn.Linear(hidden, n_gdn * d, bias=spec.v_bias)
            self.a_proj = nn.Linear(hidden, n_gdn, bias=False)
            self.b_proj = nn.Linear(hidden, n_gdn, bias=True)
            self.A_log = nn.Parameter(torch.zeros(n_gdn))
            self.dt_bias = nn.Parameter(torch.zeros(n_gdn))
            self.gdn_conv = (
                nn.Conv1d(3 * n_gdn * d, 3 * n_gdn * d, options.gdn_conv, groups=3 * n_gdn * d, bias=False)
                if options.gdn_conv
                else None
            )
        else:
            self.gdn_k_proj = self.gdn_v_proj = self.a_proj = self.b_proj = self.gdn_conv = None
            self.A_log = self.dt_bias = None
        self.gamma = nn.Parameter(torch.ones(H, d)) if options.fusion == "rmsnorm" else None
        self.reset_new_parameters()

    def _idx(self, name: str, device: torch.device) -> Tensor:
        key = (name, device)
        t = self._index_cache.get(key)
        if t is None:
            t = self._index_cache[key] = torch.tensor(self._index_lists[name], dtype=torch.long, device=device)
        return t

    def new_decode_cache(
        self, batch: int, max_len: int, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None
    ) -> HybridDecodeCache:
        """A :class:`HybridDecodeCache` for ``batch`` sequences of up to ``max_len`` tokens (K/V and the
        convolution tail in ``dtype``, default the layer's; GDN state in fp32), on the layer's device.

        Raises:
            ValueError: batch or max_len < 1.
        """
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch and max_len must be >= 1, got {batch}, {max_len}")
        p = self.q_proj.weight
        device = p.device if device is None else device
        dtype = p.dtype if dtype is None else dtype
        d, n_keep, n_gdn = self.head_dim, len(self.kv_keep), len(self.gdn_heads)
        k = v = S = conv = None
        if n_keep:
            k = torch.zeros(batch, n_keep, max_len, d, device=device, dtype=dtype)
            v = torch.zeros_like(k)
        if n_gdn:
            S = torch.zeros(batch, n_gdn, d, d, device=device, dtype=torch.float32)
            if self.options.gdn_conv:
                conv = torch.zeros(batch, self.options.gdn_conv - 1, 3 * n_gdn * d, device=device, dtype=dtype)
        return HybridDecodeCache(k, v, S, conv, max_len)

    # ------------------------------------------------------------------ initialization / migration
    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        """Set the parameters the teacher does not have to their documented initial values.

        a_proj.W = 0, A_log = 0 and dt_bias_h = softplus⁻¹(−log α_h) with α_h = 1 − 1/span_h, spans
        log-spaced over ``options.gdn_span`` (so g = −softplus(dt_bias) = log α_h at start);
        b_proj W = 0, b = 0 (β = 0.5); FA gate W = 0, b = 0 (gate 0.5); short conv = identity; γ = 1.
        """
        if self.gdn_heads:
            n = len(self.gdn_heads)
            lo, hi = self.options.gdn_span
            spans = torch.logspace(math.log10(lo), math.log10(hi), n) if n > 1 else torch.tensor([lo])
            dt = -torch.log1p(-1.0 / spans)  # = -log(alpha) > 0
            self.dt_bias.copy_(torch.log(torch.expm1(dt)))
            self.A_log.zero_()
            self.a_proj.weight.zero_()
            self.b_proj.weight.zero_()
            self.b_proj.bias.zero_()
            if self.gdn_conv is not None:
                self.gdn_conv.weight.zero_()
                self.gdn_conv.weight[:, 0, -1] = 1.0
        if self.g_proj is not None:
            self.g_proj.weight.zero_()
            self.g_proj.bias.zero_()
        if self.gamma is not None:
            self.gamma.fill_(1.0)

    @torch.no_grad()
    def migrate_from(self, teacher: nn.Module) -> None:
        """Copy Q/K/V/O (and q_norm/k_norm) from a Llama-style transformers attention module
        (``q_proj``/``k_proj``/``v_proj``/``o_proj``) of the same geometry; see :meth:`migrate`.

        Raises:
            ValueError: the teacher has no such projections, or not this layer's shapes.
        """
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(teacher, name):
                raise ValueError(f"teacher attention has no {name}; pass its projections to migrate()")
        self.migrate(teacher.q_proj, teacher.k_proj, teacher.v_proj, teacher.o_proj,
                     getattr(teacher, "q_norm", None), getattr(teacher, "k_norm", None))

    @torch.no_grad()
    def migrate(self, q: Any, k: Any, v: Any, o: Any, q_norm: Optional[nn.Module] = None,
                k_norm: Optional[nn.Module] = None) -> None:
        """Copy the teacher's projections: each of q, k, v, o has ``weight`` [out, in] and ``bias``
        [out] or None (an ``nn.Linear`` or an adapter's ``Proj``); q_norm/k_norm: its QK-norm modules.

        K/V of kept KV groups go to ``k_proj``/``v_proj``; each GDN head gets a copy of its KV group's
        K/V rows (MHA expansion, h → group h // (n_heads / n_kv_heads)).

        Raises:
            ValueError: shapes that are not this layer's, a bias the layer has and the teacher lacks
                (or the reverse), QK-norm on one side only.
        """
        d, rep = self.head_dim, self.n_heads // self.n_kv_heads
        if tuple(q.weight.shape) != tuple(self.q_proj.weight.shape) or k.weight.shape[0] != self.n_kv_heads * d:
            raise ValueError(
                f"teacher attention shapes q {tuple(q.weight.shape)}, k {tuple(k.weight.shape)} "
                f"do not match the hybrid layer ({self.n_heads} heads, {self.n_kv_heads} KV heads, head_dim {d})"
            )

        def rows(p: Any, groups: Sequence[int]) -> tuple[Tensor, Optional[Tensor]]:
            idx = torch.cat([torch.arange(g * d, (g + 1) * d) for g in groups]).to(p.weight.device)
            return p.weight[idx], (p.bias[idx] if p.bias is not None else None)

        def put(dst: nn.Linear, w: Tensor, b: Optional[Tensor], name: str) -> None:
            if (dst.bias is None) != (b is None):
                raise ValueError(f"layer {self.layer_idx}: {name} bias is {'missing' if b is None else 'unexpected'} "
                                 f"in the teacher (spec {self.spec})")
            dst.weight.copy_(w)
            if b is not None:
                dst.bias.copy_(b)

        put(self.q_proj, q.weight, q.bias, "q")
        put(self.o_proj, o.weight, o.bias, "o")
        if self.kv_keep:
            put(self.k_proj, *rows(k, self.kv_keep), "k")
            put(self.v_proj, *rows(v, self.kv_keep), "v")
        if self.gdn_heads:
            groups = [h // rep for h in self.gdn_heads]
            put(self.gdn_k_proj, *rows(k, groups), "k")
            put(self.gdn_v_proj, *rows(v, groups), "v")
        if (self.q_norm is None) != (q_norm is None):
            raise ValueError(f"layer {self.layer_idx}: QK-norm in {'the teacher' if q_norm is not None else 'the hybrid'} "
                             "only; build the layer from the teacher's LayerSpec")
        if self.q_norm is not None:
            self.q_norm.load_state_dict(q_norm.state_dict())
            self.k_norm.load_state_dict(k_norm.state_dict())

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: Float[Tensor, "batch time hidden"],
        position_embeddings: Optional[tuple[Tensor, Tensor]] = None,
        attention_mask: Optional[Tensor] = None,
        cache: Any = None,
        past_key_values: Any = None,
        position_ids: Optional[Tensor] = None,
        layer_past: Any = None,
        defer_out: bool = False,
        projected: Optional[Tensor] = None,
        **kwargs: Any,
    ) -> tuple[Float[Tensor, "batch time hidden"], None]:
        """Hybrid attention output (before the residual add), same contract as the teacher's module.

        Args:
            hidden_states: the layer's normalized input.
            position_embeddings: (cos, sin), each [batch, time, head_dim], from the model's rotary
                embedding; required when any branch uses RoPE.
            attention_mask: None (causal, no padding), a 4-D mask from transformers (bool or additive)
                or a 2-D padding mask; padded tokens do not change real tokens' outputs.
            cache / past_key_values / layer_past (GPT-NeoX's name): the model's :class:`HybridCache` (what
                ``model(ids)`` and ``generate`` pass), a :class:`HybridDecodeCache`, or None.
            position_ids: [batch, time] absolute positions (for the NoPE coefficient); default counts
                from the cache length.
            defer_out: a decode step on the lean path's one-launch step returns a
                :class:`~headscope.hybrid.inference.decode.DeferredOutput` in place of the output (its o_proj — and, for rows
                the launch does not combine, the split-K combination — left to
                :func:`~headscope.hybrid.inference.kernels.layer_tail.layer_tail`; ``StaticDecoder``'s tail kernel); other paths ignore
                it.
            projected: the lean path's input projection of the (normalized) hidden states, already computed
                ([batch, time, rows of ``inference.plan.plan(self).W``]; the layer tail before computes it); hidden_states then
                give only shape, dtype and device.

        Returns:
            (output [batch, time, hidden], None) — no attention weights are returned.

        Raises:
            ValueError: missing position embeddings, ``gdn_kernel='fla'`` on a non-CUDA device, ``projected``
                where the lean path does not run or of the wrong shape, a cache of another type.
        """
        cache = next((c for c in (cache, past_key_values, layer_past) if c is not None), None)
        if isinstance(cache, HybridCache):  # the model's transformers Cache: this layer's preallocated slot
            cache = cache.reserve(self, hidden_states.shape[0], hidden_states.shape[1])
        elif cache is not None and not isinstance(cache, HybridDecodeCache):
            raise ValueError(f"a hybrid layer keeps its cache in a HybridCache, not a {type(cache).__name__}: call the "
                             "model's forward / generate (they make one), or pass HybridCache(model.config) or the "
                             "layer's new_decode_cache(batch, max_len)")
        # the fast paths, once headscope is imported; only for a plain layer (LayerSpec.plain) they compute
        fast = sys.modules.get("headscope.hybrid.inference.dispatch") if self.plain else None
        out = None if fast is None else fast.fast_forward(self, hidden_states, position_embeddings, attention_mask,
                                                           cache, position_ids, defer_out, projected)
        if out is not None:
            return out, None
        if projected is not None:
            raise ValueError("projected= needs the lean path (no gradient, no attention mask, a decode cache or none, "
                             "weights in the input's dtype): pass the normalized hidden states instead")
        if getattr(cache, "pos", None) is not None:
            raise ValueError("device-position decoding (cache.pos) runs on the lean path only: no gradient, no "
                             "attention mask, weights in the input's dtype, InferenceConfig.fast_path not \"never\" (CPU: \"always\")")
        B, T, _ = hidden_states.shape
        d, x = self.head_dim, hidden_states
        opts = self.options
        past = cache.length if cache is not None else 0
        valid = _valid_tokens(attention_mask, T)
        need_rope = self.spec.rope and ((opts.fa_pos == "rope" and self.fa_heads) or (opts.gdn_rope and self.gdn_heads))
        if need_rope and position_embeddings is None:
            raise ValueError(
                "position_embeddings=(cos, sin) is required (RoPE is on); compute it with "
                "model.model.rotary_emb(hidden_states, position_ids)"
            )
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        if cos is not None and cos.shape[0] != B:
            cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)

        q = self.q_proj(x).view(B, T, self.n_heads, d)
        if self.q_norm is not None:
            q = self.q_norm(q)
        fa_idx, gdn_idx = self._idx("fa", x.device), self._idx("gdn", x.device)
        if self.fa_heads and self.gdn_heads and _inplace_ok(q, x):
            # low-memory path: each branch writes its heads into one buffer and is freed before the next
            q_fa, q_gdn = q.index_select(2, fa_idx), q.index_select(2, gdn_idx)
            y = q.new_empty(B, T, self.n_heads, d)  # q's dtype: under autocast it is not x's (fp32 weights)
            del q
            y.index_copy_(2, fa_idx, self._fa(x, q_fa, cos, sin, attention_mask, cache, past, position_ids).to(y.dtype))
            del q_fa
            y.index_copy_(2, gdn_idx, self._gdn(x, q_gdn, cos, sin, valid, cache, past).to(y.dtype))
            del q_gdn
        else:
            outs = []
            if self.fa_heads:
                outs.append(self._fa(x, q.index_select(2, fa_idx), cos, sin, attention_mask, cache, past, position_ids))
            if self.gdn_heads:
                outs.append(self._gdn(x, q.index_select(2, gdn_idx), cos, sin, valid, cache, past))
            y = torch.cat(outs, dim=2).index_select(2, self._idx("unperm", x.device)) if len(outs) > 1 else outs[0]
        if cache is not None:
            cache.length = past + T
        if self.gamma is not None:  # eq. 13–14: per-head RMSNorm, then γ_h
            y = _fuse_(y, self.gamma, opts.norm_eps)
        return self.o_proj(y.reshape(B, T, self.n_heads * d)), None

    def _fa(self, x, q, cos, sin, attention_mask, cache, past, position_ids):
        B, T = x.shape[:2]
        d, opts = self.head_dim, self.options
        n_keep = len(self.kv_keep)
        k = self.k_proj(x).view(B, T, n_keep, d)
        v = self.v_proj(x).view(B, T, n_keep, d)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if opts.fa_pos == "rope":
            if self.spec.rope:  # a NoPE layer of the teacher stays without positions
                q, k = _rope_(q, cos, sin), _rope_(k, cos, sin)
        else:
            pos = position_ids if position_ids is not None else torch.arange(past, past + T, device=x.device)[None]
            q = q * nope_log_scale(pos.expand(B, T), opts.nope_a)[..., None, None].to(q.dtype)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # B, n_keep, T, d
        if cache is not None:
            k, v = cache._write(k, v, past)
        if not self._fa_gqa:  # FA heads spread unevenly over the kept groups: one K/V per FA head
            fkv = self._idx("fa_kv", x.device)
            k, v = k.index_select(1, fkv), v.index_select(1, fkv)
        S = k.shape[2]
        mask = None
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = attention_mask[:, :, -T:, -S:]
            if mask.dtype == torch.bool:  # rows with nothing to attend (padded queries): let them see all, finite
                mask = mask | ~mask.any(-1, keepdim=True)
            else:
                mask = mask.to(q.dtype)
        elif attention_mask is not None and attention_mask.dim() == 2:
            keep = attention_mask[:, -S:].bool()[:, None, None, :]
            tri = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
            if self.spec.window is not None:
                tri = tri & ~torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T - self.spec.window)
            mask = keep & tri
            mask = mask | ~mask.any(-1, keepdim=True)
        o = fa_attention(q, k, v, self.scaling, causal=True, mask=mask, kernel=opts.fa_kernel,
                         window=self.spec.window, softcap=self.spec.softcap)  # B, T, n_fa, d
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x)).view(B, T, len(self.fa_heads), d)
        return o

    def _gdn(self, x, q, cos, sin, valid, cache, past):
        B, T = x.shape[:2]
        d, opts = self.head_dim, self.options
        n = len(self.gdn_heads)
        k = self.gdn_k_proj(x).view(B, T, n, d)
        v = self.gdn_v_proj(x).view(B, T, n, d)
        if self.k_norm is not None:
            k = self.k_norm(k)
        carried = cache is not None and past > 0  # a fresh sequence starts from a zero state and conv tail
        if self.gdn_conv is not None:
            qkv = torch.cat([q, k, v], dim=2).reshape(B, T, 3 * n * d)
            if valid is not None:
                qkv = qkv * valid[..., None].to(qkv.dtype)
            K = opts.gdn_conv
            tail = cache.conv if carried else qkv.new_zeros(B, K - 1, qkv.shape[-1])
            full = torch.cat([tail.to(qkv.dtype), qkv], dim=1)  # B, K-1+T, C
            if cache is not None:  # in place: a captured graph keeps the buffers
                cache.conv.copy_(full[:, full.shape[1] - (K - 1):].detach())
            qkv = self.gdn_conv(full.transpose(1, 2)).transpose(1, 2)  # B, T, C
            q, k, v = qkv.view(B, T, 3, n, d).unbind(2)
        if opts.gdn_rope and self.spec.rope:
            q, k = _rope_(q, cos, sin), _rope_(k, cos, sin)
        q, k = _l2norm_(q).to(x.dtype), _l2norm_(k).to(x.dtype)
        beta = torch.sigmoid(self.b_proj(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        if valid is not None:  # padded tokens: β = 0, α = 1 -> the state passes through unchanged
            vf = valid.to(beta.dtype)[..., None]
            beta, g = beta * vf, g * vf
        h0 = cache.S if carried else None
        y, S = gated_delta_rule(
            q, k, v, g, beta.to(x.dtype) if x.dtype != torch.float32 else beta, scale=self.gdn_scale,
            initial_state=h0, kernel=opts.gdn_kernel, chunk_size=opts.chunk_size,
        )
        if cache is not None:
            cache.S.copy_(S.detach().float())
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, fa_heads={list(self.fa_heads)}, gdn_heads={len(self.gdn_heads)}, "
            f"kv_keep={list(self.kv_keep)}, fa_pos={self.options.fa_pos}, fusion={self.options.fusion}"
        )

