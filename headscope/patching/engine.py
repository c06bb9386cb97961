"""The patching engine: one forward pass over a :class:`~headscope.patching.plan.Plan`, for every
architecture an adapter describes (:mod:`headscope.arch`).

Patched passes reuse everything a patch cannot change (the reuse that makes exact patching cheap):

* a patch of head ``h`` in layer ``l`` leaves layers ``< l`` and the attention pattern of layer ``l``
  as they were, so a patched row joins the batch at layer ``l`` from the cached residual stream,
  with its hook_z given (:class:`~headscope.patching.plan.Entry`);
* where clean and corrupted prompts agree up to position ``p``, every activation at positions
  ``< p`` is identical in every run (causal attention), so patched runs compute positions ``>= p``
  only, attending to the cached keys/values of positions ``< p``;
* the last layer computes the read positions only, and logits are read there;
* many patches run at once, one per batch row, rows of several layers sharing later layers' matmuls.

The engine computes with the transformers modules themselves (looked up through TransformerBridge
wrappers) or with views of their weights; a module that carries hooks is called, so hooks run.
The activation patched is TransformerLens ``hook_z`` (``[batch, pos, n_heads * d_head]``).

Every engine checks itself against the model's own forward (:mod:`headscope.patching.check`), in the
model's dtype and on its device: a short prompt when it is built, then the first prompt of every
length beyond the longest checked (the first calibration pair's own clean sequence, through
:meth:`Engine.run`), so that whatever acts only on longer inputs (a sliding window, a length-switched
RoPE table) is seen at the length the ranking uses. Every layer must agree to
:func:`~headscope.patching.check.tolerance` (1e-3 in fp32, 8·eps in 16-bit types: 6.25e-2 in bf16),
or the engine refuses, naming the layer and the first part that disagrees. In 16-bit types each layer
is computed from the model's own input to it (teacher-forced), so the two forwards' rounding does not
accumulate over the stack. The sliding windows are read from the
masks the model passes to its layers in that forward. :func:`~headscope.patching.check.check_patches`
compares a few patched rows with one hooked forward each (what reusing the prefix could get wrong).

A model spread over several devices (``device_map``) runs too: every layer computes on the device of
its weights and keeps its caches there (:class:`~headscope.patching.plan.LayerStack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from ..arch import Arch, LayerParts, Proj, UnsupportedArchitecture, adapt, rotate, softcap, unwrap
from ..models import LoadedModel
from . import attention, check as _check
from .check import EngineMismatch, tolerance
from .linear import linear
from .mlp import mlp_blocks, mlp_linears
from .plan import Entry, LayerCtx, LayerStack, PassResult, Plan, RunCache, stack_layers

__all__ = ["Engine", "EngineMismatch", "Entry", "LayerStack", "Plan", "Precision", "RunCache",
           "UnsupportedArchitecture", "head_slice", "tolerance"]

MLP_BLOCK = 1024  # tokens per block of the gradient-free MLP on a CPU (intermediates stay in cache)
MLP_BLOCK_CUDA = 16384  # on a GPU: blocks bound the intermediates' memory; bigger GEMMs run nearer peak
LOW_PRECISION = (torch.bfloat16, torch.float16)
SELF_CHECK_TOL = 1e-3  # float32 (see check.tolerance for other dtypes)


@dataclass(frozen=True)
class Precision:
    """How the engine keeps a bf16/fp16 model's activations (recorded with results and in stores).

    Attributes:
        residual: ``"model"`` (default): the residual stream in the model's dtype, every add rounded to it,
            as the model's own forward computes. ``"float32"``: the residual stream, the norms, RoPE and
            every residual add in float32; the projections, the MLP and attention still run in the model's
            dtype (float32 accumulation inside the kernels, inputs rounded once to the model's dtype), and
            the cached residual streams are float32 (2x their memory). Closer to a float32 forward of the
            same weights than the model's own low-precision forward. For a float32 model both are the same
            computation.

    Raises:
        ValueError: another ``residual``.
    """

    residual: Literal["model", "float32"] = "model"

    def __post_init__(self) -> None:
        if self.residual not in ("model", "float32"):
            raise ValueError(f"Precision.residual={self.residual!r}: use 'model' or 'float32'")

    def to_dict(self) -> dict[str, Any]:
        """``{"residual": ...}`` (JSON-able)."""
        return {"residual": self.residual}


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


class Engine:
    """Runs a LoadedModel layer by layer from its architecture's parts (:func:`headscope.arch.adapt`).

    Args:
        model: the model.
        matmul_dtype: e.g. ``torch.bfloat16``: the projections and attention run in that dtype
            (weights copied once; residual stream, norms and unembedding stay in the model's dtype).
            An approximation for screening only: exact patching uses the default (None).
        check: check against the model's own forward (default True): :meth:`self_check` on a short prompt
            now, and again on the first prompt of every longer length (engines with ``matmul_dtype``,
            an approximation by design, are not checked).
        precision: :class:`Precision` (default: the residual stream in the model's dtype); with
            ``Precision("float32")`` a bf16/fp16 model's residual stream, norms and RoPE run in float32.

    Raises:
        ValueError: ``matmul_dtype`` together with a float32 residual of a low-precision model.
        UnsupportedArchitecture: no adapter for the model's family (use ``path="generic"``).
        EngineMismatch: the self-check failed (the message names the layer and part).
    """

    path = "fast"

    def __init__(self, model: LoadedModel, matmul_dtype: torch.dtype | None = None, check: bool = True,
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
        self.check = check and matmul_dtype is None
        self.checked_len = 0  # prompts up to this length were checked against the model's own forward
        self.patch_checked_len = 0  # patched rows up to this length were (check.check_patches)
        self._checking = False
        if self.check:
            self.self_check()

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

    def _one_device(self, what: str) -> None:
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
        a = self._o(layer, z)
        a = self.norm(L.post_attn_norm, a)
        return a * L.residual_multiplier if L.residual_multiplier != 1.0 else a

    def _o(self, layer: int, z: Tensor, residual: Tensor | None = None) -> Tensor:
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
        h = self._o(layer, z, residual=h)  # float32 residual + the model-dtype projection: a float32 add
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

    # ---- the one pass -----------------------------------------------------------------------
    def forward(self, plan: Plan) -> PassResult:
        """Run one :class:`~headscope.patching.plan.Plan` (see there for what each field does).

        Raises:
            ValueError: a plan without rows, ``start`` > 0 without ``base``, a read position before
                ``start``, entries out of layer order or not covering ``start..``.
        """
        read = [int(r) for r in plan.read]
        start = plan.start
        enter = list(plan.enter)
        if plan.ids is not None:
            T = int(plan.ids.numel())
        elif plan.base is not None:
            T = int(plan.base.resid.shape[1])
        else:
            raise ValueError("a plan needs ids or a base pass")
        if start > 0 and plan.base is None:
            raise ValueError("start > 0 needs a base pass for the prefix")
        if plan.ids is not None and not self._checking and self.needs_check(T):
            self.self_check(ids=plan.ids)
        if not read or min(read) < start or max(read) >= T:
            raise ValueError(f"read positions {read[:3]}... must lie in start={start}..{T - 1}")
        layers_in = [e.layer for e in enter]
        if layers_in != sorted(layers_in):
            raise ValueError(f"entries must be in ascending layer order, got layers {layers_in}")
        S = T - start
        for e in enter:
            if e.z.shape[1] != S:
                raise ValueError(f"z rows of layer {e.layer} cover {e.z.shape[1]} positions; the suffix has {S}")
        if plan.ids is None and plan.resid_at is None and not enter:
            raise ValueError("a plan needs rows: ids, resid_at or enter")
        n_layers = self.g.n_layers
        trim = not (plan.keep or plan.grad)
        first = 0 if plan.ids is not None else min([e.layer for e in enter] + (
            [plan.resid_at[0]] if plan.resid_at is not None else []))
        dev0 = self.layers[first].device
        positions = torch.arange(start, T, device=dev0)
        ridx = {}  # read offsets into the suffix, per device

        def offsets(dev: torch.device) -> Tensor:
            if dev not in ridx:
                ridx[dev] = torch.as_tensor([r - start for r in read], device=dev)
            return ridx[dev]

        h: Tensor | None = None
        tags: list = []
        zs: list[Tensor] = []
        kept: dict[str, list[Tensor]] = {"resid": [], "z": [], "k": [], "v": []}
        with torch.set_grad_enabled(plan.grad):
            if plan.ids is not None:
                ids = plan.ids.to(dev0)[None, start:]
                h = self.embed(ids, positions)
                if plan.rows > 1:
                    h = h.expand(plan.rows, -1, -1)
                tags = [None] * plan.rows
            pos = self.positions(positions, h if h is not None else plan.base.resid[first])  # type: ignore[union-attr]
            for lay in range(first, n_layers):
                L = self.layers[lay]
                dev = L.device
                last = trim and lay == n_layers - 1
                if plan.resid_at is not None and plan.resid_at[0] == lay:
                    hr = plan.resid_at[1].to(dev, self.resid_dtype)
                    h = hr if h is None else torch.cat([h.to(dev), hr])
                    tags += [None] * hr.shape[0]
                z = None
                if h is not None:
                    h = h.to(dev)
                    if plan.keep:
                        kept["resid"].append(h[0])
                    B = h.shape[0]
                    x = self.ln1(lay, h)
                    qr = offsets(dev) if last else None
                    q, k, v = self.qkv(lay, x, pos, q_rows=qr)
                    if plan.keep:
                        kept["k"].append(k[0])
                        kept["v"].append(v[0])
                    if start > 0:
                        kp = plan.base.k[lay, :, :start][None].to(k.dtype)  # type: ignore[union-attr]
                        vp = plan.base.v[lay, :, :start][None].to(v.dtype)  # type: ignore[union-attr]
                        k = torch.cat([kp.expand(B, -1, -1, -1), k if k.shape[0] == B else k.expand(B, -1, -1, -1)], 2)
                        v = torch.cat([vp.expand(B, -1, -1, -1), v if v.shape[0] == B else v.expand(B, -1, -1, -1)], 2)
                    qpos = positions.to(dev)[qr] if last else positions.to(dev)
                    z = plan.attn(lay, q, k, v) if plan.attn is not None else self.attend(lay, q, k, v, qpos)
                    if last:
                        h = h[:, qr]
                    if plan.edit is not None:
                        z = plan.edit(lay, z, LayerCtx(lay, tags, qpos, x, q, k, v, pos))
                    if plan.grad:
                        if not z.requires_grad:
                            z.requires_grad_(True)
                        z.retain_grad()
                        zs.append(z)
                    if plan.keep:
                        kept["z"].append(z[0])
                new = [e for e in enter if e.layer == lay]
                if new:
                    zn = torch.cat([e.z.to(dev) for e in new]) if len(new) > 1 else new[0].z.to(dev)
                    hn = plan.base.resid[lay, start:].to(dev)[None].expand(zn.shape[0], S, -1)  # type: ignore[union-attr]
                    if last:
                        zn, hn = zn[:, offsets(dev)], hn[:, offsets(dev)]
                    h = hn if h is None else torch.cat([h, hn.to(h.dtype)])
                    z = zn if z is None else torch.cat([z, zn.to(z.dtype)])
                    for e in new:
                        tags += list(e.tag) if isinstance(e.tag, list) else [e.tag] * e.z.shape[0]
                assert h is not None and z is not None
                h = self.post_attn(lay, h, z)
            assert h is not None
            if not trim:
                h = h[:, offsets(h.device)]
            out = self.unembed(h) if plan.logits else h
        cache = None
        if plan.keep:
            cache = self._cache(plan, kept, start, out[0])
        return PassResult(out, zs, cache, tags)

    def _cache(self, plan: Plan, kept: dict[str, list[Tensor]], start: int, logits: Tensor) -> RunCache:
        md = self.multi_device
        resid = [t.detach() for t in kept["resid"]]
        z = [t.detach() for t in kept["z"]]
        k, v = [t.detach() for t in kept["k"]], [t.detach() for t in kept["v"]]
        if start > 0:
            b = plan.base
            assert b is not None
            resid = [torch.cat([b.resid[i, :start], t.to(b.resid[i].dtype)]) for i, t in enumerate(resid)]
            z = [torch.cat([b.z[i, :start], t.to(b.z[i].dtype)]) for i, t in enumerate(z)]
            k = [torch.cat([b.k[i, :, :start], t.to(b.k[i].dtype)], 1) for i, t in enumerate(k)]
            v = [torch.cat([b.v[i, :, :start], t.to(b.v[i].dtype)], 1) for i, t in enumerate(v)]
        return RunCache(stack_layers(resid, md), stack_layers(z, md), stack_layers(k, md), stack_layers(v, md),
                        logits.detach())

    # ---- plans everyone uses ----------------------------------------------------------------
    @torch.no_grad()
    def run(self, ids: Int[Tensor, "pos"], read: Sequence[int],
            z_override: Callable[[int, Tensor], Tensor] | None = None) -> RunCache:
        """One full pass of a prompt, caching resid, hook_z, K and V of every layer (logits at ``read``).
        ``z_override(layer, z) -> z`` may replace a layer's hook_z."""
        edit = None if z_override is None else (lambda lay, z, ctx: z_override(lay, z))
        if edit is not None or not self.needs_check(int(ids.numel())):
            res = self.forward(Plan(read=read, ids=ids, keep=True, edit=edit))
            assert res.cache is not None
            return res.cache
        # the first prompt of a new length: this pass is also the self-check's engine side
        ref = _check.model_reference(self, ids, first=min(int(r) for r in read))
        self._checking = True
        try:
            res = self.forward(Plan(read=read, ids=ids, keep=True))
        finally:
            self._checking = False
        assert res.cache is not None
        if _check.teacher_forced(self.dtype):
            _check.compare_teacher_forced(self, ids, ref, read)
        else:
            _check.compare(self, res.cache, res.out[0], ref, read)
        self.checked_len = max(self.checked_len, int(ids.numel()))
        return res.cache

    def needs_check(self, n_tokens: int) -> bool:
        """Whether a prompt of ``n_tokens`` is longer than every prompt checked so far (and checks are on)."""
        return self.check and n_tokens > self.checked_len

    def check_patches(self, ids: Int[Tensor, "pos"], base: RunCache, src: RunCache, start: int,
                      read: Sequence[int]) -> float:
        """A few patched rows against the model's forward with a hook_z patch each
        (:func:`~headscope.patching.check.check_patches`), once per new prompt length; 0.0 when checked
        before or checks are off. Raises EngineMismatch naming the layer, head and fix."""
        T = int(ids.numel())
        if not self.check or T <= self.patch_checked_len:
            return 0.0
        d = _check.check_patches(self, ids, base, src, start, read)
        self.patch_checked_len = T
        return d

    def run_with_grad_cache(self, ids: Int[Tensor, "pos"], read: Sequence[int], keep_cache: bool = True
                            ) -> tuple[Tensor, list[Tensor], RunCache | None]:
        """A differentiable full pass: (logits at ``read`` [read, vocab], every layer's hook_z [1, T, H·dh]
        with grad retained, the detached :class:`RunCache` or None with ``keep_cache=False``)."""
        self._one_device("attribution patching (run_with_grad)")
        res = self.forward(Plan(read=read, ids=ids, grad=True, keep=keep_cache))
        return res.out[0], res.z, res.cache

    def run_with_grad(self, ids: Int[Tensor, "pos"], read: Sequence[int]) -> tuple[Tensor, list[Tensor]]:
        """:meth:`run_with_grad_cache` without the cache."""
        logits, zs, _ = self.run_with_grad_cache(ids, read, keep_cache=False)
        return logits, zs

    def run_suffix(self, base: RunCache, ids: Int[Tensor, "pos"], start: int, read: Sequence[int],
                   grad: bool = False) -> tuple[Tensor, list[Tensor], RunCache | None]:
        """A pass of ``ids`` that shares its first ``start`` tokens with ``base``'s prompt: only positions
        ``start..`` are computed. Returns (logits at read, hook_z of every layer at start.. when ``grad``,
        the joined :class:`RunCache` when not ``grad``).

        Raises:
            ValueError: ``start`` outside 0..len(ids)-1 or a read position before ``start``.
        """
        self._one_device("suffix passes (run_suffix)")
        T = ids.numel()
        if not 0 <= start < T or min(read) < start:
            raise ValueError(f"start={start} must be in 0..{T - 1} and at most the first read position {min(read)}")
        res = self.forward(Plan(read=read, ids=ids, base=base, start=start, grad=grad, keep=not grad))
        return res.out[0], res.z, res.cache

    @torch.no_grad()
    def patched_logits_multi(self, base: RunCache, entries: Sequence[tuple[int, Float[Tensor, "rows suffix hd"]]],
                             start: int, read: Sequence[int]) -> Float[Tensor, "batch read vocab"]:
        """Patched passes of several layers in one batch: each row of ``entries`` ``(layer, z_rows)``
        (ascending layers) is one run of ``base``'s prompt whose layer-``layer`` hook_z at ``start..`` is
        that row. Output rows follow the order of ``entries``.

        Raises:
            ValueError: no entries, layers not ascending, rows that do not cover ``start..``.
        """
        if not entries:
            raise ValueError("no patched rows given")
        return self.forward(Plan(read=read, base=base, start=start,
                                 enter=[Entry(int(lay), z) for lay, z in entries])).out

    def patched_logits(self, base: RunCache, layer: int, z_rows: Float[Tensor, "batch suffix hd"], start: int,
                       read: Sequence[int]) -> Float[Tensor, "batch read vocab"]:
        """:meth:`patched_logits_multi` for rows of one layer."""
        return self.patched_logits_multi(base, [(layer, z_rows)], start, read)

    @torch.no_grad()
    def attention_mass(self, ids: Int[Tensor, "pos"], rows: Sequence[int], span: tuple[int, int]
                       ) -> Float[Tensor, "layer head"]:
        """Mean attention probability that each head puts on key positions ``span`` (end exclusive),
        averaged over the query positions ``rows``, in a clean pass of ``ids``."""
        self._one_device("attention_mass")
        out = torch.empty(self.g.n_layers, self.g.n_heads, dtype=torch.float64)
        rows_t = torch.as_tensor(sorted(rows), device=self.device)

        def grab(lay: int, z: Tensor, ctx: LayerCtx) -> Tensor:
            L = self.layers[lay]
            sel = torch.searchsorted(ctx.positions, rows_t)
            p = attention.probs(ctx.q[:, :, sel], ctx.k, rows_t, L.scaling, L.window, L.softcap)
            out[lay] = p[0, :, :, span[0]:span[1]].sum(-1).mean(-1).double().cpu()
            return z

        self.forward(Plan(read=list(rows_t.tolist()), ids=ids, edit=grab))
        return out

    # ---- the self-check ---------------------------------------------------------------------
    @torch.no_grad()
    def self_check(self, n_tokens: int = 12, tol: float | None = None, ids: Tensor | None = None) -> float:
        """A prompt through the engine and through the model's own forward (in the model's dtype, on
        its device; dynamic RoPE as freshly built); every layer's attention output, layer output and the
        logits must agree to ``tol`` (default :func:`~headscope.patching.check.tolerance` of the dtype),
        relative to the activations' scale. The engine's sliding windows are first set from the masks
        the model passes to its layers (:func:`~headscope.patching.check.model_reference`). In float32 and
        float64 the engine's own pass is compared (:func:`~headscope.patching.check.compare`); in bfloat16
        and float16 each layer is computed from the model's own input to it
        (:func:`~headscope.patching.check.compare_teacher_forced`), so the two forwards' rounding does
        not accumulate over depth and length.

        Args:
            n_tokens: length of the synthetic prompt (when ``ids`` is None; capped at the context).
            ids: Int[Tensor, "pos"]: check on this prompt instead (e.g. a calibration pair's clean sequence).

        Returns the largest relative difference. Raises:
            EngineMismatch: naming the first layer and part (attention or MLP branch) that disagrees,
                and the fix (``path="generic"``).
        """
        if ids is None:
            T = min(n_tokens, max(2, int(self.g.n_ctx or n_tokens)))
            vocab = int(self.arch.lm_head.weight.shape[0])
            ids = (torch.arange(T) * 7919 + 11) % max(vocab - 1, 1) + 1
        ids = ids.detach().reshape(-1)
        T = int(ids.numel())
        ref = _check.model_reference(self, ids)
        if _check.teacher_forced(self.dtype):
            worst = _check.compare_teacher_forced(self, ids, ref, range(T), tol)
        else:
            self._checking = True
            try:
                res = self.forward(Plan(read=list(range(T)), ids=ids, keep=True))
            finally:
                self._checking = False
            assert res.cache is not None
            worst = _check.compare(self, res.cache, res.out[0], ref, range(T), tol)
        self.checked_len = max(self.checked_len, T)
        return worst
