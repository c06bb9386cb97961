"""The head-wise hybrid attention layer (HydraHead, SPEC.md §8, section 4.2): the reference forward.

The query heads split into FA heads (softmax attention over their KV group) and GDN heads (gated delta rule, eq.
7–8); outputs go back into the heads' slots, are fused (eq. 13–14: per-head RMSNorm, learnable γ_h) and pass through
the teacher's output projection. Call signature of a transformers attention module:
``out, _ = hybrid_attn(h, position_embeddings=model.model.rotary_emb(h, position_ids))``. Cache: the model's
``HybridCache`` (this layer's slot of it) or a ``HybridDecodeCache`` (``new_decode_cache(batch, max_len)``); any other
is refused. Under ``torch.no_grad`` the elementwise stages run in place by blocks of ``BLOCK`` tokens (the same
numbers). Saved with the model, this module runs with torch alone (chunked PyTorch GDN, SDPA); inside headscope
``layer.backends`` (``headscope.hybrid.use_inference``) computes the calls its fast backends apply to and picks the
kernels the options name (fla, flash-attn). Per-layer variation comes from the layer's :class:`LayerSpec`.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attn import fa_attention
from .config import HybridOptions, LayerSpec
from .rope import apply_rope, nope_log_scale  # noqa: F401  (public here since the start)
from .cache import HybridCache, HybridDecodeCache, valid_tokens as _valid_tokens
from .gdn import gdn_chunked_torch
from .shapes import Float

BLOCK = 8192  # tokens per block of the in-place elementwise stages (no gradient needed)


def _inplace_ok(*ts: Tensor) -> bool:
    """The low-memory path may overwrite these fresh tensors: no autograd graph needs them."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def _by_blocks(fn: Any, x: Tensor, *per_time: Tensor) -> Tensor:
    """``fn(x, *per_time)`` written back into x block by block of ``BLOCK`` time steps (x: a fresh tensor no one else
    reads, time in dim 1), or out of place where autograd needs the inputs."""
    if not _inplace_ok(x, *per_time):
        return fn(x, *per_time)
    for s in range(0, x.shape[1], BLOCK):
        b = slice(s, min(s + BLOCK, x.shape[1]))
        x[:, b] = fn(x[:, b], *(t[:, b] for t in per_time))
    return x


def _rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rope, in place by time blocks when allowed."""
    if torch.promote_types(x.dtype, cos.dtype) != x.dtype:
        return apply_rope(x, cos, sin)
    return _by_blocks(apply_rope, x, cos, sin)


def _l2norm_(x: Tensor) -> Tensor:
    """F.normalize(x.float(), dim=-1, eps=1e-6) in x's dtype, in place by time blocks when allowed."""
    return _by_blocks(lambda t: F.normalize(t.float(), p=2, dim=-1, eps=1e-6).to(t.dtype), x)


def _fuse_(y: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """eq. 13–14 on y [batch, time, head, d]: γ_h · y / RMS(y) per head, fp32 inside, y's dtype out."""
    gf = gamma.float()

    def fuse(t: Tensor) -> Tensor:
        tf = t.float()
        return (gf * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps))).to(t.dtype)

    return _by_blocks(fuse, y) if _inplace_ok(gamma) else fuse(y)


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
        config: the transformers text config of the model: ``hidden_size``, ``num_attention_heads``,
            ``num_key_value_heads``, ``head_dim``, ``attention_bias``, ``rms_norm_eps``.
        layer_idx: index of the layer (for the cache).
        fa_heads: query heads that keep softmax attention; the others are GDN.
        options: :class:`HybridOptions`.
        qk_norm: the teacher normalizes q and k per head (Qwen3); ignored when ``spec`` is given.
        spec: what the teacher layer applies (:class:`LayerSpec`); default: the Llama/Qwen3 layer of ``config``.
        norms: (q_norm, k_norm) modules of the teacher's class, for ``spec.qk_norm == "teacher"``.

    Parameters (``n_keep`` = KV groups with ≥ 1 FA head, ``n_gdn`` = GDN heads, d = head_dim): q_proj [hidden →
    n_heads·d] (teacher order), k_proj / v_proj [hidden → n_keep·d], o_proj [n_heads·d → hidden]; gdn_k_proj /
    gdn_v_proj [hidden → n_gdn·d] (the KV group's K/V copied to every GDN head); a_proj [hidden → n_gdn], dt_bias,
    A_log [n_gdn], b_proj [hidden → n_gdn]; optional g_proj (FA gate), gdn_conv (short convolution); gamma
    [n_heads, d] (fusion γ_h). New parameters start at :meth:`reset_new_parameters`' values.

    Raises:
        ValueError: head indices outside the geometry or listed twice; ``spec.qk_norm == "teacher"`` without ``norms``.
    """

    def __init__(self, config: Any, layer_idx: int, fa_heads: Sequence[int], options: HybridOptions | None = None,
                 qk_norm: bool = False, spec: Optional[LayerSpec] = None,
                 norms: Optional[tuple[nn.Module, nn.Module]] = None):
        super().__init__()
        self.options = options = options or HybridOptions()
        self.layer_idx = layer_idx
        H = self.n_heads = int(config.num_attention_heads)
        self.n_kv_heads = int(getattr(config, "num_key_value_heads", None) or H)
        d = self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // H)
        if spec is None:
            bias = bool(getattr(config, "attention_bias", False))
            spec = LayerSpec(q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias, qk_norm="rms" if qk_norm else None)
        self.spec = spec
        self.backends: Any = None  # fast implementations attached by headscope (headscope.hybrid.use_inference)
        self._split_heads(fa_heads)
        self.scaling = float(spec.scaling) if spec.scaling is not None else d**-0.5  # FA heads
        self.gdn_scale = d**-0.5  # GDN read-out scale (q is L2-normalized)
        hidden, n_fa, n_gdn, n_keep = int(config.hidden_size), len(self.fa_heads), len(self.gdn_heads), len(self.kv_keep)
        self.q_proj = nn.Linear(hidden, H * d, bias=spec.q_bias)
        self.o_proj = nn.Linear(H * d, hidden, bias=spec.o_bias)
        self.q_norm = self.k_norm = None
        if spec.qk_norm == "teacher":
            if norms is None:
                raise ValueError(f"layer {layer_idx}: qk_norm='teacher' needs the teacher's (q_norm, k_norm) modules")
            self.q_norm, self.k_norm = norms
        elif spec.qk_norm == "rms":
            eps = float(getattr(config, "rms_norm_eps", 1e-6))
            self.q_norm, self.k_norm = _HeadRMSNorm(d, eps), _HeadRMSNorm(d, eps)
        self.k_proj = nn.Linear(hidden, n_keep * d, bias=spec.k_bias) if n_keep else None
        self.v_proj = nn.Linear(hidden, n_keep * d, bias=spec.v_bias) if n_keep else None
        self.g_proj = nn.Linear(hidden, n_fa * d, bias=True) if (options.fa_gate and n_fa) else None
        self.gdn_k_proj = self.gdn_v_proj = self.a_proj = self.b_proj = self.gdn_conv = self.A_log = self.dt_bias = None
        if n_gdn:
            self.gdn_k_proj = nn.Linear(hidden, n_gdn * d, bias=spec.k_bias)
            self.gdn_v_proj = nn.Linear(hidden, n_gdn * d, bias=spec.v_bias)
            self.a_proj, self.b_proj = nn.Linear(hidden, n_gdn, bias=False), nn.Linear(hidden, n_gdn, bias=True)
            self.A_log, self.dt_bias = nn.Parameter(torch.zeros(n_gdn)), nn.Parameter(torch.zeros(n_gdn))
            C = 3 * n_gdn * d
            self.gdn_conv = nn.Conv1d(C, C, options.gdn_conv, groups=C, bias=False) if options.gdn_conv else None
        self.gamma = nn.Parameter(torch.ones(H, d)) if options.fusion == "rmsnorm" else None
        self.reset_new_parameters()

    def _split_heads(self, fa_heads: Sequence[int]) -> None:
        """fa_heads, gdn_heads, kv_keep and the head index maps (plain lists; tensors built per device on use)."""
        H, i = self.n_heads, self.layer_idx
        if H % self.n_kv_heads:
            raise ValueError(f"num_attention_heads={H} is not a multiple of num_key_value_heads={self.n_kv_heads}")
        rep = H // self.n_kv_heads
        fa = [int(h) for h in fa_heads]
        if len(set(fa)) != len(fa):
            raise ValueError(f"layer {i}: FA head listed twice in {fa}")
        if any(not 0 <= h < H for h in fa):
            raise ValueError(f"layer {i}: FA heads {fa} outside 0..{H - 1}")
        self.fa_heads = tuple(sorted(fa))
        self.gdn_heads = tuple(h for h in range(H) if h not in self.fa_heads)
        self.kv_keep = tuple(sorted({h // rep for h in self.fa_heads}))
        order = list(self.fa_heads) + list(self.gdn_heads)
        self._index_lists = {"fa": list(self.fa_heads), "gdn": list(self.gdn_heads),
                             "fa_kv": [self.kv_keep.index(h // rep) for h in self.fa_heads],
                             "unperm": [order.index(h) for h in range(H)]}
        self._index_cache: dict[tuple[str, torch.device], Tensor] = {}
        # GQA-native FA (no K/V copy per FA head) when every kept group has the same number of FA heads
        per_group = [sum(1 for h in self.fa_heads if h // rep == g) for g in self.kv_keep]
        self._fa_gqa = bool(per_group) and len(set(per_group)) == 1

    def _idx(self, name: str, device: torch.device) -> Tensor:
        key = (name, device)
        t = self._index_cache.get(key)
        if t is None:
            t = self._index_cache[key] = torch.tensor(self._index_lists[name], dtype=torch.long, device=device)
        return t

    def new_decode_cache(self, batch: int, max_len: int, device: Optional[torch.device] = None,
                         dtype: Optional[torch.dtype] = None) -> HybridDecodeCache:
        """A :class:`HybridDecodeCache` for ``batch`` sequences of up to ``max_len`` tokens (K/V and the convolution
        tail in ``dtype``, default the layer's; GDN state in fp32), on the layer's device.

        Raises:
            ValueError: batch or max_len < 1.
        """
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch and max_len must be >= 1, got {batch}, {max_len}")
        p = self.q_proj.weight
        device, dtype = p.device if device is None else device, p.dtype if dtype is None else dtype
        d, n_keep, n_gdn = self.head_dim, len(self.kv_keep), len(self.gdn_heads)
        k = torch.zeros(batch, n_keep, max_len, d, device=device, dtype=dtype) if n_keep else None
        S = torch.zeros(batch, n_gdn, d, d, device=device, dtype=torch.float32) if n_gdn else None
        conv = None
        if n_gdn and self.options.gdn_conv:
            conv = torch.zeros(batch, self.options.gdn_conv - 1, 3 * n_gdn * d, device=device, dtype=dtype)
        return HybridDecodeCache(k, None if k is None else torch.zeros_like(k), S, conv, max_len)

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
            for t in (self.A_log, self.a_proj.weight, self.b_proj.weight, self.b_proj.bias):
                t.zero_()
            if self.gdn_conv is not None:
                self.gdn_conv.weight.zero_()
                self.gdn_conv.weight[:, 0, -1] = 1.0
        if self.g_proj is not None:
            self.g_proj.weight.zero_()
            self.g_proj.bias.zero_()
        if self.gamma is not None:
            self.gamma.fill_(1.0)

    def forward(self, hidden_states: Float[Tensor, "batch time hidden"],
                position_embeddings: Optional[tuple[Tensor, Tensor]] = None, attention_mask: Optional[Tensor] = None,
                cache: Any = None, past_key_values: Any = None, position_ids: Optional[Tensor] = None,
                layer_past: Any = None, **kwargs: Any) -> tuple[Float[Tensor, "batch time hidden"], None]:
        """Hybrid attention output (before the residual add), same contract as the teacher's module.

        Args:
            hidden_states: the layer's normalized input.
            position_embeddings: (cos, sin), each [batch, time, head_dim], from the model's rotary embedding;
                required when any branch uses RoPE.
            attention_mask: None (causal, no padding), a 4-D mask from transformers (bool or additive) or a 2-D
                padding mask; padded tokens do not change real tokens' outputs.
            cache / past_key_values / layer_past (GPT-NeoX's name): a :class:`HybridCache`, a
                :class:`HybridDecodeCache`, or None.
            position_ids: [batch, time] absolute positions (for the NoPE coefficient); default counts from the cache.

        Returns (output [batch, time, hidden], None); raises ValueError: missing position embeddings, another cache.
        """
        cache = next((c for c in (cache, past_key_values, layer_past) if c is not None), None)
        if isinstance(cache, HybridCache):  # the model's transformers Cache: this layer's preallocated slot
            cache = cache.reserve(self, hidden_states.shape[0], hidden_states.shape[1])
        elif cache is not None and not isinstance(cache, HybridDecodeCache):
            raise ValueError(f"a hybrid layer keeps its cache in a HybridCache, not a {type(cache).__name__}: call the "
                             "model's forward / generate (they make one), or pass HybridCache(model.config) or the "
                             "layer's new_decode_cache(batch, max_len)")
        if self.backends is not None:  # the fast backends headscope attached (None in a process without it)
            out = self.backends(self, hidden_states, position_embeddings, attention_mask, cache, position_ids)
            if out is not None:
                return out, None
        return self._reference(hidden_states, position_embeddings, attention_mask, cache, position_ids), None

    def _reference(self, x: Tensor, position_embeddings: Optional[tuple], attention_mask: Optional[Tensor],
                   cache: Optional[HybridDecodeCache], position_ids: Optional[Tensor]) -> Tensor:
        """The reference forward's output [batch, time, hidden]; ``cache`` filled / advanced in place."""
        B, T, _ = x.shape
        d, opts = self.head_dim, self.options
        past = cache.length if cache is not None else 0
        rope_on = (opts.fa_pos == "rope" and self.fa_heads) or (opts.gdn_rope and self.gdn_heads)
        if self.spec.rope and rope_on and position_embeddings is None:
            raise ValueError("position_embeddings=(cos, sin) is required (RoPE is on); compute it with "
                             "model.model.rotary_emb(hidden_states, position_ids)")
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        if cos is not None and cos.shape[0] != B:
            cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
        q = self.q_proj(x).view(B, T, self.n_heads, d)
        if self.q_norm is not None:
            q = self.q_norm(q)
        fa_idx, gdn_idx = self._idx("fa", x.device), self._idx("gdn", x.device)
        fa = lambda q_fa: self._fa(x, q_fa, cos, sin, attention_mask, cache, past, position_ids)  # noqa: E731
        gdn = lambda q_g: self._gdn(x, q_g, cos, sin, _valid_tokens(attention_mask, T), cache, past)  # noqa: E731
        if self.fa_heads and self.gdn_heads and _inplace_ok(q, x):
            # low-memory path: each branch writes its heads into one buffer and is freed before the next
            q_fa, q_gdn = q.index_select(2, fa_idx), q.index_select(2, gdn_idx)
            y = q.new_empty(B, T, self.n_heads, d)  # q's dtype: under autocast it is not x's (fp32 weights)
            del q
            y.index_copy_(2, fa_idx, fa(q_fa).to(y.dtype))
            del q_fa
            y.index_copy_(2, gdn_idx, gdn(q_gdn).to(y.dtype))
            del q_gdn
        else:
            outs = ([fa(q.index_select(2, fa_idx))] if self.fa_heads else []) + (
                [gdn(q.index_select(2, gdn_idx))] if self.gdn_heads else [])
            y = torch.cat(outs, dim=2).index_select(2, self._idx("unperm", x.device)) if len(outs) > 1 else outs[0]
        if cache is not None:
            cache.length = past + T
        if self.gamma is not None:  # eq. 13–14: per-head RMSNorm, then γ_h
            y = _fuse_(y, self.gamma, opts.norm_eps)
        return self.o_proj(y.reshape(B, T, self.n_heads * d))

    def _fa_mask(self, attention_mask: Optional[Tensor], T: int, S: int, dtype: torch.dtype) -> Optional[Tensor]:
        """The FA heads' mask [.., T, S] from a 4-D or 2-D attention mask (None: causal); rows with nothing to
        attend (padded queries) see everything, so they stay finite."""
        if attention_mask is None:
            return None
        if attention_mask.dim() == 4:
            mask = attention_mask[:, :, -T:, -S:]
            return mask | ~mask.any(-1, keepdim=True) if mask.dtype == torch.bool else mask.to(dtype)
        keep = attention_mask[:, -S:].bool()[:, None, None, :]
        tri = torch.ones(T, S, dtype=torch.bool, device=attention_mask.device).tril(S - T)
        if self.spec.window is not None:
            tri = tri & ~torch.ones(T, S, dtype=torch.bool, device=tri.device).tril(S - T - self.spec.window)
        mask = keep & tri
        return mask | ~mask.any(-1, keepdim=True)

    def _fa(self, x, q, cos, sin, attention_mask, cache, past, position_ids):
        B, T = x.shape[:2]
        d, opts, n_keep = self.head_dim, self.options, len(self.kv_keep)
        k, v = self.k_proj(x).view(B, T, n_keep, d), self.v_proj(x).view(B, T, n_keep, d)
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
        mask = self._fa_mask(attention_mask, T, k.shape[2], q.dtype)
        if self.backends is None:  # torch alone; headscope's backends pick the kernel (flash-attn) by the options
            o = fa_attention(q, k, v, self.scaling, True, mask, self.spec.window, self.spec.softcap)  # B, T, n_fa, d
        else:
            o = self.backends.attention(self, q, k, v, mask)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x)).view(B, T, len(self.fa_heads), d)
        return o

    def _gdn(self, x, q, cos, sin, valid, cache, past):
        B, T = x.shape[:2]
        d, opts, n = self.head_dim, self.options, len(self.gdn_heads)
        k, v = self.gdn_k_proj(x).view(B, T, n, d), self.gdn_v_proj(x).view(B, T, n, d)
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
            q, k, v = self.gdn_conv(full.transpose(1, 2)).transpose(1, 2).view(B, T, 3, n, d).unbind(2)
        if opts.gdn_rope and self.spec.rope:
            q, k = _rope_(q, cos, sin), _rope_(k, cos, sin)
        q, k = _l2norm_(q).to(x.dtype), _l2norm_(k).to(x.dtype)
        beta = torch.sigmoid(self.b_proj(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        if valid is not None:  # padded tokens: β = 0, α = 1 -> the state passes through unchanged
            vf = valid.to(beta.dtype)[..., None]
            beta, g = beta * vf, g * vf
        h0 = cache.S if carried else None
        beta = beta.to(x.dtype) if x.dtype != torch.float32 else beta
        if self.backends is None:  # torch alone; headscope's backends pick the kernel (fla on CUDA) by the options
            y, S = gdn_chunked_torch(q, k, v, g, beta, self.gdn_scale, h0, opts.chunk_size)
        else:
            y, S = self.backends.gdn(self, q, k, v, g, beta, h0)
        if cache is not None:
            cache.S.copy_(S.detach().float())
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, fa_heads={list(self.fa_heads)}, gdn_heads={len(self.gdn_heads)}, "
                f"kv_keep={list(self.kv_keep)}, fa_pos={self.options.fa_pos}, fusion={self.options.fusion}")
