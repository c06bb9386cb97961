"""The layer operations of the fast engine: what one layer computes, piece by piece, over the typed per-layer
parts an architecture adapter reads from the model (:mod:`headscope.arch`).

:class:`LayerOps` holds the model's parts (``arch``, ``layers``: the per-layer views) and computes each piece of a
layer as the model does: the pre-attention norm (:meth:`~LayerOps.ln1`), the projections and RoPE
(:meth:`~LayerOps.qkv`), attention with the layer's scale, window and soft-cap (:meth:`~LayerOps.attend`), the
output projection (:meth:`~LayerOps.attn_out`), the rest of the block (:meth:`~LayerOps.post_attn`), the
embedding and the unembedding. :class:`~headscope.patching.engine.Engine` runs them as one pass over a
:class:`~headscope.patching.pass_plan.Plan`; the self-check (:mod:`headscope.patching.self_check`) compares them with the
model's own forward, layer by layer.

The activation patched is TransformerLens ``hook_z`` (``[batch, pos, n_heads * d_head]``): the input of
:meth:`~LayerOps.attn_out`. A module that carries hooks is called, so hooks run. Every layer computes on the device
of its weights (a model spread over devices with ``device_map``).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from ..arch import Arch, LayerParts, Proj, adapt, rotate, softcap, unwrap
from ..models import LoadedModel
from . import attention
from .linear import linear
from .mlp import mlp_blocks, mlp_linears
from .pass_plan import Precision

__all__ = ["LOW_PRECISION", "LayerOps", "Positions", "Precision", "head_slice"]

MLP_BLOCK = 1024  # tokens per block of the gradient-free MLP on a CPU (intermediates stay in cache)
MLP_BLOCK_CUDA = 16384  # on a GPU: blocks bound the intermediates' memory; bigger GEMMs run nearer peak
LOW_PRECISION = (torch.bfloat16, torch.float16)


def head_slice(head: int, d_head: int) -> slice:
    return slice(head * d_head, (head + 1) * d_head)


class Positions:
    """cos/sin of a pass's computed positions, per RoPE kind and device, computed once each."""

    def __init__(self, arch: Arch, positions: Tensor, like: Tensor):
        self.arch, self.positions, self.like = arch, positions, like
        self._t: dict[tuple[str, torch.device], tuple[Tensor, Tensor]] = {}

    def cos_sin(self, L: LayerParts) -> tuple[Tensor, Tensor] | None:
        if L.rope is None or self.arch.rope_tables is None:
            return None
        key = (L.rope.kind, L.device)
        if key not in self._t:
            same = [v for (kind, _), v in self._t.items() if kind == L.rope.kind]
            self._t[key] = ((same[0][0].to(L.device), same[0][1].to(L.device)) if same
                            else self.arch.rope_tables(L.rope.kind, self.positions, self.like))
        return self._t[key]


def _plain_rmsnorm(mod: torch.nn.Module, h: Tensor, any_dtype: bool = False) -> bool:
    """A Llama-style RMSNorm (``weight * x / rms(x)``, float32) that ``F.rms_norm`` computes exactly.
    ``any_dtype``: the formula only (the caller computes it in float32 from weights of any dtype)."""
    w = getattr(mod, "weight", None)
    return (type(mod).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm",
                                   "SmolLM3RMSNorm", "GraniteRMSNorm", "Phi3RMSNorm")
            and getattr(mod, "variance_epsilon", None) is not None and w is not None
            and (any_dtype or (h.dtype == torch.float32 and w.dtype == torch.float32)) and w.shape == h.shape[-1:]
            and not (mod._forward_hooks or mod._forward_pre_hooks))


class LayerOps:
    """The pieces of one layer of a LoadedModel, from its architecture's parts (:func:`headscope.arch.adapt`).

    Args:
        model: the model.
        matmul_dtype: e.g. ``torch.bfloat16``: the projections and attention run in that dtype
            (weights copied once; residual stream, norms and unembedding stay in the model's dtype).
            An approximation for screening only: exact patching uses the default (None).
        precision: :class:`Precision` (default: the residual stream in the model's dtype); with
            ``Precision("float32")`` a bf16/fp16 model's residual stream, norms and RoPE run in float32.

    Attributes:
        arch: the adapter's :class:`~headscope.arch.Arch`; layers: its per-layer
            :class:`~headscope.arch.LayerParts` (projections, norms, RoPE kind, window, soft-cap, device).

    Raises:
        ValueError: ``matmul_dtype`` together with a float32 residual of a low-precision model.
        UnsupportedArchitecture: no adapter for the model's family (use ``path="generic"``).
    """

    def __init__(self, model: LoadedModel, matmul_dtype: torch.dtype | None = None,
                 precision: Precision | None = None):
        self.model = model
        self.g = model.geometry
        self.hf = model.hf_model
        self.arch: Arch = adapt(self.hf)
        self.layers = self.arch.layers
        self.device = model.device
        self.dtype = model.dtype
        self.matmul_dtype = matmul_dtype
        self.precision = precision or Precision()
        # resid32: a low-precision model whose residual stream the engine keeps in float32
        self.resid32 = self.precision.residual == "float32" and self.dtype in LOW_PRECISION
        self.resid_dtype = torch.float32 if self.resid32 else self.dtype
        if self.resid32 and matmul_dtype is not None:
            raise ValueError("matmul_dtype is for float32 models; a bf16/fp16 model with Precision('float32') "
                             "already runs its matmuls in its own dtype: drop matmul_dtype")
        self._low: dict[int, dict[str, tuple[Tensor, Tensor | None]]] = {}
        self._head32: tuple[Tensor, Tensor | None] | None = None
        if matmul_dtype is not None:
            for i, L in enumerate(self.layers):
                self._low[i] = self._low_weights(L, matmul_dtype)
        devs = {L.device for L in self.layers} | {torch.device(self.device), self.arch.lm_head.weight.device}
        self.multi_device = len(devs) > 1
        self.head_device = self.arch.lm_head.weight.device

    # ---- construction helpers ---------------------------------------------------------------
    @staticmethod
    def _low_weights(L: LayerParts, dt: torch.dtype) -> dict[str, tuple[Tensor, Tensor | None]]:
        def cast(p: Proj) -> tuple[Tensor, Tensor | None]:
            return p.weight.detach().to(dt), None if p.bias is None else p.bias.detach().to(dt)

        low = {n: cast(getattr(L, n)) for n in ("q", "k", "v", "o")}
        parts = [low[n] for n in ("q", "k", "v")]
        has_b = any(b is not None for _, b in parts)
        low["qkv"] = (torch.cat([w for w, _ in parts]),
                      torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts]) if has_b else None)
        mlp = L.mlp
        lins = [unwrap(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")]
        if L.plain_block and all(isinstance(m, torch.nn.Linear) for m in lins):
            gate, up, down = (cast(Proj(m.weight, m.bias)) for m in lins)
            low["gate_up"] = (torch.cat([gate[0], up[0]]),
                              None if gate[1] is None else torch.cat([gate[1], up[1]]))  # type: ignore[list-item]
            low["down"] = down
        return low

    def layer_device(self, layer: int) -> torch.device:
        """The device of layer ``layer``'s weights (where its computation and caches live)."""
        return self.layers[layer].device

    def require_one_device(self, what: str) -> None:
        """Raises NotImplementedError naming ``what`` when the model is spread over several devices."""
        if self.multi_device:
            raise NotImplementedError(f"{what} needs the model on one device; load it without device_map")

    def positions(self, positions: Tensor, like: Tensor) -> Positions:
        """The positional tables of a pass whose computed positions are ``positions``."""
        return Positions(self.arch, positions, like)

    # ---- the pieces of one layer -------------------------------------------------------------
    def norm(self, mod: torch.nn.Module | None, h: Tensor) -> Tensor:
        """A norm module (None: identity), with the fused ``F.rms_norm`` where it is the same formula."""
        if mod is None:
            return h
        if _plain_rmsnorm(mod, h):
            return F.rms_norm(h, (h.shape[-1],), mod.weight, mod.variance_epsilon)
        return mod(h)

    def norm_in(self, mod: torch.nn.Module | None, h: Tensor) -> Tensor:
        """A norm whose output feeds a matmul of a float32-residual engine: a plain RMSNorm in float32 from
        the float32 residual (rounded once, to the model's dtype), any other module on the residual
        rounded to the model's dtype (its own arithmetic)."""
        if mod is None:
            return h.to(self.dtype)
        if _plain_rmsnorm(mod, h, any_dtype=True) and h.dtype == torch.float32:
            return F.rms_norm(h, (h.shape[-1],), mod.weight.float(), mod.variance_epsilon).to(self.dtype)
        return mod(h.to(self.dtype))

    def ln1(self, layer: int, h: Tensor) -> Tensor:
        """The attention input of layer ``layer`` (its pre-attention norm; in ``matmul_dtype`` when set)."""
        if self.resid32:
            return self.norm_in(self.layers[layer].ln1, h)
        x = self.norm(self.layers[layer].ln1, h)
        return x if self.matmul_dtype is None else x.to(self.matmul_dtype)

    def lin(self, p: Proj, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """``x @ p.weight.T + p.bias`` (+ ``residual``): oneDNN on CPU without autograd; the module itself
        when it carries hooks."""
        if p.hooked:
            y = p.module(x)  # type: ignore[misc]
            return y if residual is None else residual + y
        return linear(x, p.weight, p.bias, residual=residual)

    def project(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Attention input x [B, S, d_model] -> q [B, S, H, dh], k, v [B, S, KV, dh] before RoPE
        (QK-norm applied)."""
        L, g = self.layers[layer], self.g
        B, S, _ = x.shape
        if self.matmul_dtype is not None:
            w, b = self._low[layer]["qkv"]
            qkv = F.linear(x.to(self.matmul_dtype), w, b)
            dq, dk = g.n_heads * g.d_head, g.n_kv_heads * g.d_head
            q, k, v = qkv[..., :dq], qkv[..., dq:dq + dk], qkv[..., dq + dk:]
            if L.q_norm is not None:
                q, k = q.to(self.dtype), k.to(self.dtype)
        else:
            q, k, v = self.lin(L.q, x), self.lin(L.k, x), self.lin(L.v, x)
        if L.q_norm is not None and not L.qk_norm_per_head:
            q, k = L.q_norm(q), L.k_norm(k)  # type: ignore[misc]
        q = q.reshape(B, S, g.n_heads, g.d_head)
        k = k.reshape(B, S, g.n_kv_heads, g.d_head)
        v = v.reshape(B, S, g.n_kv_heads, g.d_head)
        if L.q_norm is not None and L.qk_norm_per_head:
            # per head over d_head (Qwen3, Gemma 3): the fused F.rms_norm where it is the module's formula
            q, k = self.norm(L.q_norm, q), self.norm(L.k_norm, k)
        return q, k, v

    def rotate(self, layer: int, t: Tensor, cos_sin: tuple[Tensor, Tensor] | None) -> Tensor:
        """RoPE of layer ``layer`` on t [B, S, heads, dh] (cos/sin [S, rot]); t itself for NoPE layers."""
        if cos_sin is None or self.layers[layer].rope is None:
            return t
        if self.resid32:  # float32 tables and products (the model rounds cos/sin to its dtype), rounded once
            return rotate(t.float(), cos_sin[0][:, None], cos_sin[1][:, None]).to(t.dtype)
        return rotate(t, cos_sin[0][:, None], cos_sin[1][:, None])

    def qkv(self, layer: int, x: Tensor, pos: Positions, q_rows: Tensor | None = None
            ) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, S, d_model] (attention input) -> q [B, H, S', dh], k, v [B, KV, S, dh] after RoPE.
        ``q_rows`` (indices into S): queries at these positions only (S' = len(q_rows))."""
        cs = pos.cos_sin(self.layers[layer])
        q, k, v = self.project(layer, x)
        if q_rows is not None:
            q = q[:, q_rows]
            qcs = None if cs is None else (cs[0][q_rows], cs[1][q_rows])
        else:
            qcs = cs
        return (self.rotate(layer, q, qcs).transpose(1, 2), self.rotate(layer, k, cs).transpose(1, 2),
                v.transpose(1, 2))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor) -> Float[Tensor, "batch q hd"]:
        """Layer ``layer``'s attention (its scale, window and soft-cap) of queries at absolute positions
        ``q_pos`` over keys 0..T-1 -> hook_z [B, S, H·dh]."""
        L = self.layers[layer]
        return attention.attend(q, k, v, q_pos, L.scaling, L.window, L.softcap, self.matmul_dtype)

    def attn_write(self, layer: int, z: Tensor) -> Tensor:
        """What the attention branch of ``layer`` adds to the residual stream given hook_z ``z``
        (output projection, post-attention norm, residual multiplier)."""
        L = self.layers[layer]
        a = self.attn_out(layer, z)
        a = self.norm(L.post_attn_norm, a)
        return a * L.residual_multiplier if L.residual_multiplier != 1.0 else a

    def attn_out(self, layer: int, z: Float[Tensor, "batch pos hd"], residual: Tensor | None = None
                 ) -> Float[Tensor, "batch pos d_model"]:
        """Layer ``layer``'s output projection of its hook_z ``z`` (in ``matmul_dtype`` when set), plus ``residual``
        when given; :meth:`attn_write` adds the post-attention norm and the residual multiplier."""
        L = self.layers[layer]
        if self.matmul_dtype is None or L.o.hooked:
            return self.lin(L.o, z, residual)
        w, b = self._low[layer]["o"]
        y = F.linear(z.to(self.matmul_dtype), w, b).to(self.dtype)
        return y if residual is None else residual + y

    def mlp_write(self, layer: int, h: Tensor) -> Tensor:
        """What the MLP branch of ``layer`` adds to the residual, given the residual ``h`` it reads
        (pre-MLP norm, MLP, post-MLP norm, residual multiplier)."""
        L = self.layers[layer]
        m = L.mlp(self.norm_in(L.ln2, h) if self.resid32 else self.norm(L.ln2, h))
        m = self.norm(L.post_mlp_norm, m)
        return m * L.residual_multiplier if L.residual_multiplier != 1.0 else m

    def post_attn(self, layer: int, h: Tensor, z: Tensor) -> Tensor:
        """Residual after layer ``layer`` given its input ``h`` and its hook_z ``z``."""
        L = self.layers[layer]
        rd = self.resid_dtype
        if L.parallel:
            return h + self.attn_write(layer, z).to(rd) + self.mlp_write(layer, h).to(rd)
        if not L.plain_block:
            h = h + self.attn_write(layer, z).to(rd)
            return h + self.mlp_write(layer, h).to(rd)
        h = self.attn_out(layer, z, residual=h)  # float32 residual + the model-dtype projection: a float32 add
        if self.matmul_dtype is not None and "gate_up" in self._low[layer]:
            x = self.norm(L.ln2, h).to(self.matmul_dtype)
            w, b = self._low[layer]["gate_up"]
            gu = F.linear(x, w, b)
            ffn = gu.shape[-1] // 2
            wd, bd = self._low[layer]["down"]
            return h + F.linear(unwrap(L.mlp.act_fn)(gu[..., :ffn]) * gu[..., ffn:], wd, bd).to(h.dtype)
        # the blocked fp32 MLP (a booted TransformerBridge's wrappers looked through; hooked modules called)
        parts = (mlp_linears(L.mlp) if self.matmul_dtype is None and not (torch.is_grad_enabled() and h.requires_grad)
                 else None)
        norm = (lambda x: self.norm_in(L.ln2, x)) if self.resid32 else (lambda x: self.norm(L.ln2, x))
        if parts is None:
            return h + L.mlp(norm(h)).to(self.resid_dtype)
        return mlp_blocks(parts, norm, h, MLP_BLOCK_CUDA if h.is_cuda else MLP_BLOCK)

    def final(self, h: Tensor) -> Tensor:
        """The final norm of the residual stream (before the unembedding)."""
        if self.multi_device:
            h = h.to(self.head_device)
        if self.resid32:
            return self.norm_in(self.arch.final_norm, h)
        return self.norm(self.arch.final_norm, h)

    def unembed(self, h: Tensor) -> Tensor:
        """Logits of residual ``h`` (final norm, unembedding, logit divisor and soft-cap).

        For a bf16/fp16 model the readout accumulates in float32 (the residual upcast, the final
        RMSNorm and the unembedding in float32, weights upcast once): logits are not rounded to the
        model's dtype, whose step at a logit of 4 is 0.016 in bf16, above the gaps patching resolves.
        Returns float32 logits then; the model's dtype otherwise."""
        if self.dtype not in LOW_PRECISION or self.arch.lm_head.hooked:
            return self.head(self.final(h))
        if self.multi_device:
            h = h.to(self.head_device)
        mod = self.arch.final_norm
        if mod is not None and _plain_rmsnorm(mod, h.float(), any_dtype=True):
            x = F.rms_norm(h.float(), (h.shape[-1],), mod.weight.float(), mod.variance_epsilon)
        else:
            x = (self.norm(mod, h.to(self.dtype)) if self.resid32 else self.norm(mod, h)).float()
        w, b = self._head_fp32()
        y = F.linear(x, w, b)
        if self.arch.logit_divisor != 1.0:
            y = y / self.arch.logit_divisor
        return softcap(y, self.arch.final_softcap)

    def _head_fp32(self) -> tuple[Tensor, Tensor | None]:
        """The unembedding's weight and bias in float32 (copied once, on first use)."""
        if self._head32 is None:
            p = self.arch.lm_head
            self._head32 = (p.weight.detach().float(), None if p.bias is None else p.bias.detach().float())
        return self._head32

    def head(self, x: Tensor) -> Tensor:
        """Logits of final-normed hidden states ``x`` (unembedding, logit divisor and soft-cap)."""
        y = self.lin(self.arch.lm_head, x)
        if self.arch.logit_divisor != 1.0:
            y = y / self.arch.logit_divisor
        return softcap(y, self.arch.final_softcap)

    def embed(self, ids: Int[Tensor, "batch pos"], positions: Tensor) -> Tensor:
        """The residual stream entering layer 0 (embedding scales and learned positions included)."""
        return self.arch.embed(ids, positions).to(self.resid_dtype)
