"""The patching engine: one forward implementation that runs clean, corrupted and patched passes.

Patched passes reuse everything a patch cannot change (the reuse that makes exact patching cheap):

* a patch of head ``h`` in layer ``l`` leaves layers ``< l`` and the attention pattern of layer ``l``
  as they were, so a patched run starts from the cached residual stream and the cached ``hook_z``
  of layer ``l``;
* where clean and corrupted prompts agree up to position ``p``, every activation at positions
  ``< p`` is identical in every run (causal attention), so patched runs compute positions ``>= p``
  only, attending to the cached keys/values of positions ``< p``;
* logits are read at the answer positions only;
* many head patches run at once, one per batch row.

The fast path drives the Llama-family modules (Llama, SmolLM2, Mistral without sliding window,
Qwen2, Qwen3 with QK-norm) directly through the modules that the TransformerBridge wraps. The
activation patched is the input of the output projection, i.e. TransformerLens ``hook_z``
(``[batch, pos, n_heads, d_head]`` flattened over heads). Tests check every number against a plain
one-hook-at-a-time reference run through the bridge's ``blocks.{l}.attn.hook_z``.

A model spread over several devices (transformers/accelerate ``device_map``, e.g. a model that does
not fit one GPU) runs too: every layer computes on the device of its weights, the residual stream
moves to the next layer's device, and each layer's caches stay on its own device
(:class:`LayerStack`), so a patched suffix pass moves only the residual stream between devices.
Full passes and receiver patching support such models; the gradient, path-patching and
attention-mass methods need the model on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from jaxtyping import Float, Int
from torch import Tensor

from ..models import LoadedModel
from .linear import linear

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}

MLP_BLOCK = 1024  # tokens per block of the gradient-free fp32 MLP (intermediates stay in cache)

# scaled_dot_product_attention broadcasts grouped K/V heads itself from torch 2.5 on (no K/V copies)
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def _orig(m: torch.nn.Module | None) -> torch.nn.Module | None:
    """The HF module inside a TransformerBridge component (the module itself when not wrapped)."""
    return getattr(m, "original_component", m) if m is not None else None


def _plain_linear(m: torch.nn.Module) -> bool:
    """An ``nn.Linear`` without forward hooks: its weight may be used directly (see ``linear``).
    A module with hooks (e.g. a knockout's pre-hook on ``o_proj``) is called, so the hooks run."""
    return isinstance(m, torch.nn.Linear) and not (m._forward_hooks or m._forward_pre_hooks)


class UnsupportedArchitecture(NotImplementedError):
    pass


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


def _stack(items: list[Tensor], per_layer: bool) -> Tensor | LayerStack:
    return LayerStack(items) if per_layer else torch.stack(items)


@dataclass
class RunCache:
    """Activations of one full pass of a (pos,) prompt.

    resid: Float[Tensor, "layer pos d_model"], residual stream entering each layer.
    z: Float[Tensor, "layer pos n_heads*d_head"], hook_z of each layer (flattened heads).
    k, v: Float[Tensor, "layer n_kv pos d_head"], keys (after RoPE / QK-norm) and values.
    logits: Float[Tensor, "read vocab"], logits at the read positions.

    For a model spread over devices, resid/z/k/v are :class:`LayerStack` s (each layer's entry on its
    layer's device) with the same ``[layer, ...]`` indexing.
    """

    resid: Tensor
    z: Tensor
    k: Tensor
    v: Tensor
    logits: Tensor


class Engine:
    """Runs a LoadedModel layer by layer with caching, suffix-only passes and hook_z patches.

    Raises:
        UnsupportedArchitecture: the model is not of a Llama-family type (use the reference path).
    """

    def __init__(self, model: LoadedModel, matmul_dtype: torch.dtype | None = None):
        """``matmul_dtype`` (e.g. ``torch.bfloat16``): run the layers' linear maps and attention in that
        dtype (weights copied once; residual stream, norms, RoPE and unembedding stay in the model's
        dtype). An approximation for screening only: exact patching uses the default (None)."""
        hf = model.hf_model
        cfg = hf.config
        mtype = getattr(cfg, "model_type", "")
        if mtype not in SUPPORTED:
            raise UnsupportedArchitecture(
                f"the fast patching engine supports {sorted(SUPPORTED)}; {mtype!r} is not among them"
            )
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", mtype == "mistral"):
            raise UnsupportedArchitecture("sliding-window attention is not supported by the fast engine")
        self.model = model
        self.g = model.geometry
        self.hf = hf
        inner = hf.model
        # once the TransformerBridge has booted, the HF modules sit inside bridge components (with
        # hooks); the engine computes with the original modules
        self.embed = _orig(inner.embed_tokens)
        self.final_norm = _orig(inner.norm)
        self.lm_head = _orig(hf.lm_head)
        self.rotary = _orig(inner.rotary_emb)
        self.layers = []
        for blk in inner.layers:
            orig = _orig(blk)
            a = _orig(orig.self_attn)
            self.layers.append(
                dict(
                    ln1=_orig(orig.input_layernorm),
                    ln2=_orig(orig.post_attention_layernorm),
                    mlp=_orig(orig.mlp),
                    q=_orig(a.q_proj),
                    k=_orig(a.k_proj),
                    v=_orig(a.v_proj),
                    o=_orig(a.o_proj),
                    q_norm=_orig(getattr(a, "q_norm", None)),
                    k_norm=_orig(getattr(a, "k_norm", None)),
                    scaling=float(getattr(a, "scaling", self.g.d_head**-0.5)),
                    device=a.q_proj.weight.device,
                )
            )
        self.device = model.device
        self.dtype = model.dtype
        self.matmul_dtype = matmul_dtype
        self._low: dict[int, dict[str, tuple[Tensor, Tensor | None]]] = {}
        if matmul_dtype is not None:
            for L in self.layers:
                mlp = L["mlp"]
                L["act"] = _orig(mlp.act_fn)
                mods = dict(q=L["q"], k=L["k"], v=L["v"], o=L["o"], gate=_orig(mlp.gate_proj), up=_orig(mlp.up_proj),
                            down=_orig(mlp.down_proj))
                low = {
                    n: (m.weight.detach().to(matmul_dtype),
                        None if m.bias is None else m.bias.detach().to(matmul_dtype))
                    for n, m in mods.items()
                }
                # fused maps (one matmul instead of three / two): q|k|v and gate|up
                for fused, parts in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
                    ws = [low[n][0] for n in parts]
                    bs = [low[n][1] if low[n][1] is not None else torch.zeros(w.shape[0], dtype=matmul_dtype,
                          device=w.device) for n, w in zip(parts, ws)]
                    has_b = any(low[n][1] is not None for n in parts)
                    low[fused] = (torch.cat(ws), torch.cat(bs) if has_b else None)
                self._low[id(L)] = low
        self.head_device = self.final_norm.weight.device
        devs = {L["device"] for L in self.layers} | {self.device, self.head_device, self.lm_head.weight.device}
        self.multi_device = len(devs) > 1

    def layer_device(self, layer: int) -> torch.device:
        """The device of layer ``layer``'s weights (where its computation and caches live)."""
        return self.layers[layer]["device"]

    def _one_device(self, what: str) -> None:
        if self.multi_device:
            raise NotImplementedError(f"{what} needs the model on one device; load it without device_map")

    def _rope_by_device(self, positions: Tensor, like: Tensor) -> Callable[[torch.device], tuple[Tensor, Tensor]]:
        """cos/sin of ``positions`` computed once, copied to each device on first use."""
        cos, sin = self.rope(positions, like)
        per: dict[torch.device, tuple[Tensor, Tensor]] = {cos.device: (cos, sin)}

        def get(dev: torch.device) -> tuple[Tensor, Tensor]:
            if dev not in per:
                per[dev] = (cos.to(dev), sin.to(dev))
            return per[dev]

        return get

    # ---- pieces --------------------------------------------------------------------------------
    def rope(self, positions: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        if self.multi_device:  # the rotary embedding's buffers may sit on another device than `like`
            dev = self.rotary.inv_freq.device
            cos, sin = self.rotary(like.to(dev) if like.device != dev else like, positions[None].to(dev))
            return cos[0].to(like.device, like.dtype), sin[0].to(like.device, like.dtype)
        cos, sin = self.rotary(like, positions[None])
        return cos[0].to(like.dtype), sin[0].to(like.dtype)  # [pos, d_head]

    def ln1(self, layer: int, h: Tensor) -> Tensor:
        """Input RMSNorm of layer ``layer`` (in ``matmul_dtype`` for a low-precision engine)."""
        return self._norm(self.layers[layer]["ln1"], h)

    def _norm(self, mod: torch.nn.Module, h: Tensor) -> Tensor:
        """An RMSNorm module applied with the fused ``F.rms_norm`` kernel where that is the same formula
        (float32 input and weight, Llama-style ``weight * x / rms(x)``); the module itself otherwise.
        A low-precision engine returns the result in ``matmul_dtype`` (the next op is a matmul)."""
        mod = getattr(mod, "original_component", mod)
        w = getattr(mod, "weight", None)
        eps = getattr(mod, "variance_epsilon", None)
        if (type(mod).__name__.endswith("RMSNorm") and eps is not None and w is not None
                and h.dtype == torch.float32 and w.dtype == torch.float32 and w.shape == h.shape[-1:]):
            x = F.rms_norm(h, (h.shape[-1],), w, eps)
        else:
            x = mod(h)
        return x if self.matmul_dtype is None else x.to(self.matmul_dtype)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE: x·cos + rotate_half(x)·sin with rotate_half(x) = (−x₂, x₁), as the HF Llama code.

        The halves are swapped by a flip of a (2, d_head/2) view and the sign moved onto sin (one copy
        instead of a negation plus a concatenation).
        """
        half = x.shape[-1] // 2
        if cos.dtype != x.dtype:  # low-precision engine: rotate in matmul_dtype
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
        sign = torch.ones(2, half, dtype=sin.dtype, device=sin.device)
        sign[0] = -1
        return (x * cos).addcmul_(swapped, sin * sign.flatten())

    def qkv(
        self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, q_rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x: [B, S, d_model] (already layer-normed) -> q [B,H,S,dh], k, v [B,KV,S,dh] after RoPE.

        ``q_rows`` (indices into S): compute queries at these positions only (q is [B,H,len,dh]).
        """
        L = self.layers[layer]
        B, S, _ = x.shape
        g = self.g
        if q_rows is not None:
            q, _, _ = self.qkv_q(layer, x[:, q_rows], cos[q_rows], sin[q_rows])
            k = self._lin(L, "k", x).view(B, S, g.n_kv_heads, g.d_head)
            v = self._lin(L, "v", x).view(B, S, g.n_kv_heads, g.d_head)
            if L["k_norm"] is not None:
                k = L["k_norm"](k)
            # RoPE on the projection's own (contiguous) [B, S, heads, dh] layout, then the head transpose
            k = self._rotate(k, cos[:, None], sin[:, None])
            return q, k.transpose(1, 2), v.transpose(1, 2)
        if self.matmul_dtype is not None and L["q_norm"] is None:
            # one fused q|k|v matmul; q, k, v stay in matmul_dtype (attention runs in it anyway)
            w, b = self._low[id(L)]["qkv"]
            qkv = F.linear(x.to(self.matmul_dtype), w, b)
            dq, dk = g.n_heads * g.d_head, g.n_kv_heads * g.d_head
            q = qkv[..., :dq].view(B, S, g.n_heads, g.d_head).transpose(1, 2)
            k = qkv[..., dq : dq + dk].view(B, S, g.n_kv_heads, g.d_head).transpose(1, 2)
            v = qkv[..., dq + dk :].view(B, S, g.n_kv_heads, g.d_head).transpose(1, 2)
            return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v
        q = self._lin(L, "q", x).view(B, S, g.n_heads, g.d_head)
        k = self._lin(L, "k", x).view(B, S, g.n_kv_heads, g.d_head)
        v = self._lin(L, "v", x).view(B, S, g.n_kv_heads, g.d_head)
        if L["q_norm"] is not None:
            q = L["q_norm"](q)
            k = L["k_norm"](k)
        # RoPE on the projections' own (contiguous) [B, S, heads, dh] layout, then the head transpose
        c, s_ = cos[:, None], sin[:, None]
        q, k = self._rotate(q, c, s_), self._rotate(k, c, s_)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def qkv_q(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, None, None]:
        """Queries only: x [B, S, d_model] (layer-normed) -> (q [B,H,S,dh] after RoPE, None, None)."""
        L = self.layers[layer]
        B, S, _ = x.shape
        q = self._lin(L, "q", x).view(B, S, self.g.n_heads, self.g.d_head)
        if L["q_norm"] is not None:
            q = L["q_norm"](q)
        return self._rotate(q, cos[:, None], sin[:, None]).transpose(1, 2), None, None

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, offset: int, q_pos: Tensor | None = None
    ) -> Float[Tensor, "batch pos hd"]:
        """Causal attention of queries at positions offset.. over all keys -> hook_z, flattened.

        q: [B, H, S, dh]; k, v: [B or 1, KV, T, dh] (grouped K/V heads are broadcast to their query
        heads). ``q_pos``: absolute positions of the S queries when they are not contiguous.
        """
        B, H, S, dh = q.shape
        T = k.shape[2]
        rep = H // k.shape[1]
        kw: dict = {}
        if rep > 1:
            if _SDPA_GQA:
                kw["enable_gqa"] = True
            else:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
        scale = self.layers[layer]["scaling"]
        if self.matmul_dtype is not None:
            dt = q.dtype if q.dtype == k.dtype else self.matmul_dtype
            q, k, v = q.to(self.matmul_dtype), k.to(self.matmul_dtype), v.to(self.matmul_dtype)
        if rep > 1 and q.device.type == "cpu" and k.shape[0] == B:
            # CPU: the query heads of one KV group become one longer query sequence over that group's
            # K/V (the same dot products; fewer, larger attention problems for the CPU kernel)
            qi = (torch.arange(S, device=q.device) + offset) if q_pos is None else q_pos
            mask = (torch.arange(T, device=q.device)[None, :] <= qi[:, None]).repeat(rep, 1)
            out = F.scaled_dot_product_attention(q.reshape(B, k.shape[1], rep * S, dh), k, v, attn_mask=mask,
                                                 scale=scale)
            out = out.view(B, H, S, dh)
        elif q_pos is None and offset == 0 and S == T:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **kw)
        elif q_pos is None and offset + S == T:
            # queries are the last S positions: causal mask aligned to the lower right (flash/mem-efficient
            # kernels support it without materializing a mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(S, T), scale=scale, **kw)
        else:
            qi = (torch.arange(S, device=q.device) + offset) if q_pos is None else q_pos
            mask = torch.arange(T, device=q.device)[None, :] <= qi[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **kw)
        if self.matmul_dtype is not None:
            out = out.to(dt)
        return out.transpose(1, 2).reshape(B, S, H * dh)

    def post_attn(self, layer: int, h: Tensor, z: Tensor) -> Tensor:
        """Residual after layer ``layer`` given its input ``h`` and its hook_z ``z``."""
        L = self.layers[layer]
        h = self._lin(L, "o", z, residual=h)
        if self.matmul_dtype is None:
            mlp = L["mlp"]
            parts = ("gate_proj", "up_proj", "down_proj", "act_fn")
            blocked = (not (torch.is_grad_enabled() and h.requires_grad)
                       and all(hasattr(mlp, a) for a in parts) and not (mlp._forward_hooks or mlp._forward_pre_hooks)
                       and all(_plain_linear(_orig(getattr(mlp, a))) for a in parts[:3]))
            return self._mlp_blocks(L, mlp, h) if blocked else h + mlp(self._norm(L["ln2"], h))
        # low precision: gate|up in one matmul, activation and product in matmul_dtype, one cast back
        x = self._norm(L["ln2"], h)
        w, b = self._low[id(L)]["gate_up"]
        gu = F.linear(x, w, b)
        ffn = gu.shape[-1] // 2
        wd, bd = self._low[id(L)]["down"]
        return h + F.linear(L["act"](gu[..., :ffn]) * gu[..., ffn:], wd, bd).to(h.dtype)

    def _mlp_blocks(self, L: dict, mlp: torch.nn.Module, h: Tensor) -> Tensor:
        """h + down(act(gate(x)) · up(x)) with x = ln2(h) (the Llama MLP and its residual add), computed
        over blocks of ``MLP_BLOCK`` tokens, so that the [tokens, d_ffn] intermediates stay in the CPU's
        cache and are updated in place. Each token's numbers are those of one unblocked call. Without
        autograd only (``post_attn`` calls the module otherwise)."""
        flat = h.reshape(-1, h.shape[-1])
        out = torch.empty_like(flat)
        act = _orig(mlp.act_fn)
        silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
        gate, up, down = _orig(mlp.gate_proj), _orig(mlp.up_proj), _orig(mlp.down_proj)
        for s in range(0, flat.shape[0], MLP_BLOCK):
            hb = flat[s : s + MLP_BLOCK]
            x = self._norm(L["ln2"], hb)
            g = linear(x, gate.weight, gate.bias)
            u = linear(x, up.weight, up.bias)
            g = F.silu(g, inplace=True) if silu else act(g)
            out[s : s + MLP_BLOCK] = linear(g.mul_(u), down.weight, down.bias, residual=hb)
        return out.view(h.shape)

    def _lin(self, L: dict, name: str, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """The layer's linear map ``name`` (plus ``residual`` when given), in the engine's dtype or, for a
        low-precision engine, with inputs and weights cast to ``matmul_dtype`` and the output cast back."""
        if self.matmul_dtype is None:
            m = L[name]
            if _plain_linear(m):
                return linear(x, m.weight, m.bias, residual=residual)
            return m(x) if residual is None else residual + m(x)
        w, b = self._low[id(L)][name]
        y = F.linear(x.to(self.matmul_dtype), w, b).to(x.dtype)
        return y if residual is None else residual + y

    def unembed(self, h: Tensor) -> Tensor:
        if self.multi_device:
            x = self.final_norm(h.to(self.head_device))
            return self.lm_head(x.to(self.lm_head.weight.device))
        x = self.final_norm(h)
        if _plain_linear(self.lm_head):
            return linear(x, self.lm_head.weight, self.lm_head.bias)
        return self.lm_head(x)

    # ---- full pass with cache ----------------------------------------------------------------
    @torch.no_grad()
    def run(
        self,
        ids: Int[Tensor, "pos"],
        read: Sequence[int],
        z_override: Callable[[int, Tensor], Tensor] | None = None,
    ) -> RunCache:
        """One full pass of a single prompt, caching resid, hook_z, K and V of every layer.

        ``z_override(layer, z) -> z`` may replace hook_z of a layer (used for frozen/patched runs).
        """
        ids = ids.to(self.device)
        T = ids.numel()
        h = self.embed(ids[None]).to(self.dtype)
        rope = self._rope_by_device(torch.arange(T, device=self.device), h)
        resid, zs, ks, vs = [], [], [], []
        for layer in range(self.g.n_layers):
            dev = self.layers[layer]["device"]
            h = h.to(dev)
            cos, sin = rope(dev)
            resid.append(h[0])
            q, k, v = self.qkv(layer, self.ln1(layer, h), cos, sin)
            z = self.attend(layer, q, k, v, 0)
            if z_override is not None:
                z = z_override(layer, z)
            zs.append(z[0])
            ks.append(k[0])
            vs.append(v[0])
            h = self.post_attn(layer, h, z)
        logits = self.unembed(h[0, list(read)])
        md = self.multi_device
        return RunCache(_stack(resid, md), _stack(zs, md), _stack(ks, md), _stack(vs, md), logits)

    def run_with_grad(self, ids: Int[Tensor, "pos"], read: Sequence[int]) -> tuple[Tensor, list[Tensor]]:
        """A differentiable full pass: (logits at ``read``, hook_z of every layer with grad retained).

        Used by attribution patching; gradients w.r.t. the returned hook_z tensors are total
        derivatives (they flow through every later layer).
        """
        logits, zs, _ = self.run_with_grad_cache(ids, read, keep_cache=False)
        return logits, zs

    def run_with_grad_cache(
        self, ids: Int[Tensor, "pos"], read: Sequence[int], keep_cache: bool = True
    ) -> tuple[Tensor, list[Tensor], RunCache | None]:
        """:meth:`run_with_grad` that also returns the pass's (detached) :class:`RunCache`, so that
        exact patching can start from the same pass without running it again (None with
        ``keep_cache=False``: the stacking copies are skipped)."""
        self._one_device("attribution patching (run_with_grad)")
        ids = ids.to(self.device)
        T = ids.numel()
        resid, ks, vs = [], [], []
        with torch.enable_grad():
            h = self.embed(ids[None]).to(self.dtype)
            cos, sin = self.rope(torch.arange(T, device=self.device), h)
            zs = []
            for layer in range(self.g.n_layers):
                resid.append(h[0].detach())
                q, k, v = self.qkv(layer, self.ln1(layer, h), cos, sin)
                ks.append(k[0].detach())
                vs.append(v[0].detach())
                z = self.attend(layer, q, k, v, 0)
                if not z.requires_grad:
                    z.requires_grad_(True)
                z.retain_grad()
                zs.append(z)
                h = self.post_attn(layer, h, z)
            logits = self.unembed(h[0, list(read)])
        if not keep_cache:
            return logits, zs, None
        cache = RunCache(torch.stack(resid), torch.stack([z[0].detach() for z in zs]), torch.stack(ks),
                         torch.stack(vs), logits.detach())
        return logits, zs, cache

    def run_suffix(
        self,
        base: RunCache,
        ids: Int[Tensor, "pos"],
        start: int,
        read: Sequence[int],
        grad: bool = False,
    ) -> tuple[Tensor, list[Tensor], RunCache | None]:
        """A pass of ``ids`` that shares its first ``start`` tokens with ``base``'s prompt: positions
        < ``start`` are taken from ``base`` (causal: they cannot see the later tokens), only positions
        ``start..`` are computed.

        Returns ``(logits at read, hook_z of every layer at positions start.. [1, S, H·dh], cache)``.
        ``grad=False``: no autograd; ``cache`` is the full :class:`RunCache` (``base``'s prefix joined
        to the computed suffix), equal to :meth:`run` of ``ids`` up to float rounding.
        ``grad=True``: the hook_z tensors require grad (derivatives of the logits through every later
        layer at the suffix positions; the prefix is constant, as in the full pass since it does not
        depend on the suffix), and ``cache`` is None.

        Raises:
            ValueError: ``start`` outside 0..len(ids)-1 or a read position before ``start``.
        """
        self._one_device("suffix passes (run_suffix)")
        T = ids.numel()
        if not 0 <= start < T or min(read) < start:
            raise ValueError(f"start={start} must be in 0..{T - 1} and at most the first read position {min(read)}")
        ids = ids.to(self.device)
        resid, zs, ks, vs = [], [], [], []
        with torch.set_grad_enabled(grad):
            h = self.embed(ids[None, start:]).to(self.dtype)
            cos, sin = self.rope(torch.arange(start, T, device=self.device), h)
            for layer in range(self.g.n_layers):
                if not grad:
                    resid.append(h[0])
                x = self.ln1(layer, h)
                q, k, v = self.qkv(layer, x, cos, sin)
                kp, vp = base.k[layer, :, :start][None], base.v[layer, :, :start][None]
                if kp.dtype != k.dtype:
                    kp, vp = kp.to(k.dtype), vp.to(v.dtype)
                z = self.attend(layer, q, torch.cat([kp, k], 2), torch.cat([vp, v], 2), start)
                if grad and not z.requires_grad:
                    z.requires_grad_(True)
                zs.append(z)
                if not grad:
                    ks.append(k[0])
                    vs.append(v[0])
                h = self.post_attn(layer, h, z)
            logits = self.unembed(h[0, [r - start for r in read]])
        if grad:
            return logits, zs, None
        cache = RunCache(
            torch.cat([base.resid[:, :start], torch.stack(resid)], 1),
            torch.cat([base.z[:, :start], torch.stack([z[0] for z in zs]).to(base.z.dtype)], 1),
            torch.cat([base.k[:, :, :start], torch.stack(ks).to(base.k.dtype)], 2),
            torch.cat([base.v[:, :, :start], torch.stack(vs).to(base.v.dtype)], 2),
            logits,
        )
        return logits, zs, cache

    # ---- patched suffix passes -----------------------------------------------------------------
    @torch.no_grad()
    def patched_logits(
        self,
        base: RunCache,
        layer: int,
        z_rows: Float[Tensor, "batch suffix hd"],
        start: int,
        read: Sequence[int],
    ) -> Float[Tensor, "batch read vocab"]:
        """Logits at ``read`` when layer ``layer``'s hook_z at positions ``start..`` is ``z_rows``.

        Every row starts from ``base`` (a cached pass): layers < ``layer`` and positions < ``start``
        are taken from the cache, later layers run on positions >= ``start`` only.
        """
        return self.patched_logits_multi(base, [(layer, z_rows)], start, read)

    @torch.no_grad()
    def patched_logits_multi(
        self,
        base: RunCache,
        entries: Sequence[tuple[int, Float[Tensor, "rows suffix hd"]]],
        start: int,
        read: Sequence[int],
    ) -> Float[Tensor, "batch read vocab"]:
        """Patched passes of several layers in one batch: logits at ``read`` for every row of ``entries``.

        ``entries`` is a list of ``(layer, z_rows)`` in ascending layer order; each row is one independent
        run of ``base``'s prompt in which layer ``layer``'s hook_z at positions ``start..`` is that row.
        Rows join the batch at their own layer (starting from the cached residual there), so rows of
        several layers share the matmuls of the layers after. Output rows follow the order of ``entries``.

        Exactness (each row equals a full forward with the patch, up to float rounding):
        positions < ``start`` are untouched by the patch (causal), so their keys/values come from the
        cache; in the last layer only the queries, o_proj and MLP at ``read`` are computed, since no
        later layer reads the other positions.

        Raises:
            ValueError: layers not ascending, or rows that do not cover ``start..`` of the prompt.
        """
        if not entries:
            raise ValueError("no patched rows given")
        layers = [int(lay) for lay, _ in entries]
        if layers != sorted(layers):
            raise ValueError(f"entries must be in ascending layer order, got layers {layers}")
        T = base.resid.shape[1]
        S = T - start
        for lay, z in entries:
            if z.shape[1] != S:
                raise ValueError(f"z_rows of layer {lay} cover positions {start}..{start + z.shape[1]} "
                                 f"but the prompt has {T}")
        n_layers = self.g.n_layers
        rope = self._rope_by_device(torch.arange(start, T, device=entries[0][1].device), entries[0][1])
        ridx_by_dev: dict[torch.device, Tensor] = {}
        h: Tensor | None = None
        for lay in range(layers[0], n_layers):
            dev = self.layers[lay]["device"]
            cos, sin = rope(dev)
            if dev not in ridx_by_dev:  # read offsets, built once per device (not once per layer)
                ridx_by_dev[dev] = torch.as_tensor([r - start for r in read], device=dev)
            ridx = ridx_by_dev[dev]
            rpos = ridx + start
            last = lay == n_layers - 1
            z_run = None
            if h is not None:
                h = h.to(dev)
                B = h.shape[0]
                kp = base.k[lay, :, :start][None]
                vp = base.v[lay, :, :start][None]
                x = self.ln1(lay, h)
                if kp.dtype != x.dtype:  # low-precision engine: cached K/V once in matmul_dtype
                    kp, vp = kp.to(x.dtype), vp.to(x.dtype)
                kp, vp = kp.expand(B, -1, -1, -1), vp.expand(B, -1, -1, -1)
                if last:
                    q, k, v = self.qkv(lay, x, cos, sin, q_rows=ridx)
                    z_run = self.attend(lay, q, torch.cat([kp, k], 2), torch.cat([vp, v], 2), start, q_pos=rpos)
                    h = h[:, ridx]
                else:
                    q, k, v = self.qkv(lay, x, cos, sin)
                    z_run = self.attend(lay, q, torch.cat([kp, k], 2), torch.cat([vp, v], 2), start)
            new = [z.to(dev) for l2, z in entries if l2 == lay]
            if new:
                zn = torch.cat(new) if len(new) > 1 else new[0]
                hn = base.resid[lay, start:][None].expand(zn.shape[0], S, -1)
                if last:
                    zn, hn = zn[:, ridx], hn[:, ridx]
                h = hn if h is None else torch.cat([h, hn])
                z_run = zn if z_run is None else torch.cat([z_run, zn.to(z_run.dtype)])
            assert h is not None and z_run is not None
            h = self.post_attn(lay, h, z_run)
        assert h is not None
        return self.unembed(h)

    # ---- sender path patching and κ (SPEC.md §5, §6) -------------------------------------------
    @torch.no_grad()
    def path_patched_logits(
        self,
        base: RunCache,
        start: int,
        read: Sequence[int],
        x_in: dict[int, Float[Tensor, "batch suffix d_model"]],
        receivers: dict[int, Sequence[int]],
        mode: str = "qkv",
    ) -> Float[Tensor, "batch read vocab"]:
        """Logits at ``read`` of a run of ``base``'s prompt in which only the receivers' Q/K/V inputs change.

        For each receiver layer ``l`` in ``receivers``, the heads listed there compute their hook_z from
        queries (``"q"`` in ``mode``) and/or keys and values (``"k"``/``"v"`` in ``mode``) taken from
        ``x_in[l]`` (the layer-normed input, i.e. ln1 output, at positions ``start..``; earlier positions
        keep ``base``'s keys/values); every other input is the run's own. All other heads and layers run
        normally (nothing downstream is frozen). Each batch row is one independent run (path patching
        step 3, Wang et al. 2022; SPEC.md §5).
        """
        self._one_device("sender path patching")
        layers = sorted(receivers)
        if not layers:
            raise ValueError("no receivers given")
        l0 = layers[0]
        B = next(iter(x_in.values())).shape[0]
        T = base.resid.shape[1]
        S = T - start
        g = self.g
        dh = g.d_head
        rep = g.n_heads // g.n_kv_heads
        with torch.no_grad():
            cos, sin = self.rope(torch.arange(start, T, device=self.device), base.resid)
            h = base.resid[l0, start:][None].expand(B, S, -1)
            for lay in range(l0, g.n_layers):
                q, k, v = self.qkv(lay, self.ln1(lay, h), cos, sin)
                kp = base.k[lay, :, :start][None].expand(B, -1, -1, -1)
                vp = base.v[lay, :, :start][None].expand(B, -1, -1, -1)
                z = self.attend(lay, q, torch.cat([kp, k], 2), torch.cat([vp, v], 2), start)
                if lay in receivers:
                    q2, k2, v2 = self.qkv(lay, x_in[lay], cos, sin)
                    for hd in receivers[lay]:
                        grp = hd // rep
                        qh = q2[:, hd : hd + 1] if "q" in mode else q[:, hd : hd + 1]
                        kh = k2[:, grp : grp + 1] if "k" in mode else k[:, grp : grp + 1]
                        vh = v2[:, grp : grp + 1] if "v" in mode else v[:, grp : grp + 1]
                        zh = self.attend(lay, qh, torch.cat([kp[:, grp : grp + 1], kh], 2),
                                         torch.cat([vp[:, grp : grp + 1], vh], 2), start)
                        z[:, :, hd * dh : (hd + 1) * dh] = zh
                h = self.post_attn(lay, h, z)
            idx = torch.as_tensor([r - start for r in read], device=self.device)
            return self.unembed(h[:, idx])


    @torch.no_grad()
    def attention_mass(
        self, ids: Int[Tensor, "pos"], rows: Sequence[int], span: tuple[int, int]
    ) -> Float[Tensor, "layer head"]:
        """Mean attention probability that each head puts on key positions ``span`` (end exclusive),
        averaged over the query positions ``rows``, in a clean pass of ``ids``."""
        self._one_device("attention_mass")
        ids = ids.to(self.device)
        T = ids.numel()
        g = self.g
        rep = g.n_heads // g.n_kv_heads
        out = torch.empty(g.n_layers, g.n_heads, dtype=torch.float64)
        rows_t = torch.as_tensor(list(rows), device=self.device)
        with torch.no_grad():
            h = self.embed(ids[None]).to(self.dtype)
            cos, sin = self.rope(torch.arange(T, device=self.device), h)
            for layer in range(g.n_layers):
                q, k, v = self.qkv(layer, self.ln1(layer, h), cos, sin)
                kk = k.repeat_interleave(rep, dim=1) if rep > 1 else k
                sc = (q[0, :, rows_t] @ kk[0].transpose(-1, -2)).float() * self.layers[layer]["scaling"]
                causal = torch.arange(T, device=self.device)[None, :] <= rows_t[:, None]
                p = torch.softmax(sc.masked_fill(~causal, float("-inf")), dim=-1)  # [H, rows, T]
                out[layer] = p[:, :, span[0] : span[1]].sum(-1).mean(-1).double().cpu()
                z = self.attend(layer, q, k, v, 0)
                h = self.post_attn(layer, h, z)
        return out


def head_slice(head: int, d_head: int) -> slice:
    return slice(head * d_head, (head + 1) * d_head)

