"""A hybrid layer's inference plan and elementwise glue, shared by the prefill and decode paths.

- :class:`Plan` / :func:`plan`: the rows of every projection of the layer — q (FA heads, then GDN heads), the kept
  K/V groups, the FA gate, GDN K/V, decay (``a_proj``) and β (``b_proj``) — stacked into one weight, o_proj's input
  columns and γ's rows permuted to the (FA, GDN) head order (no head permutation of activations), built once and
  rebuilt only when a parameter changes (its version counter);
- the glue: per-head QK-RMSNorm, RoPE / NoPE scale, L2 norm of GDN q/k, decay g and β in one pass over the projection
  output; FA gate, the per-head RMSNorm and γ (eq. 13–14) in one pass over the heads' outputs. ``torch.compile`` on
  CUDA when ``InferenceConfig.compile_glue`` (eager elsewhere, the same code); fp32 lives in registers only: every
  [time, heads, d] tensor in memory is in the layer's dtype.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..fa_kernels import flash_attn_available
from ..gdn_kernels import fla_available
from ..rope import apply_rope
from .kernels.gdn_step import gdn_decode_step_torch, l2_normalize, rms_norm
from .projections import stack_projections

if TYPE_CHECKING:  # pragma: no cover
    from ..layer import HeadwiseHybridAttention

_compiled: dict[tuple, Callable] = {}
_compile_failed: list[str] = []


class Plan:
    """Per-layer fused weights, rebuilt when a parameter's identity, version, device or dtype changes."""

    def __init__(self, layer: "HeadwiseHybridAttention", key: tuple):
        self.key = key
        d = layer.head_dim
        fa, gdn = list(layer.fa_heads), list(layer.gdn_heads)
        self.nf, self.ng, self.nk, self.d = len(fa), len(gdn), len(layer.kv_keep), d
        W = layer.q_proj.weight
        dev = W.device

        def qrows(heads):
            return torch.tensor([h * d + i for h in heads for i in range(d)], dtype=torch.long, device=dev)

        fa_parts, g_parts = [], []
        if self.nf:
            fa_parts = [(layer.q_proj, qrows(fa), 1), (layer.k_proj, None, 1), (layer.v_proj, None, 1)]
            if layer.g_proj is not None:
                fa_parts.append((layer.g_proj, None, 1))
        if self.ng:  # a and b padded with zero rows to a multiple of 8: every column slice starts 16-byte aligned
            self.ng8 = -(-self.ng // 8) * 8
            g_parts = [(layer.q_proj, qrows(gdn), 1), (layer.gdn_k_proj, None, 1), (layer.gdn_v_proj, None, 1),
                       (layer.a_proj, None, 8), (layer.b_proj, None, 8)]
        self.W, self.b, sizes = stack_projections(fa_parts + g_parts)
        self.W = self.W.contiguous()
        self.fa_sizes, self.g_sizes = sizes[: len(fa_parts)], sizes[len(fa_parts):]
        self.n_fa_rows = sum(self.fa_sizes)
        order = fa + gdn
        self.Wo = layer.o_proj.weight.index_select(1, qrows(order)).contiguous()
        self.bo = layer.o_proj.bias
        self.gamma = layer.gamma.index_select(0, torch.tensor(order, device=dev)).float() if layer.gamma is not None else None
        self.qk_eps = float(getattr(layer.q_norm, "eps", getattr(layer.q_norm, "variance_epsilon", 0.0)))
        self.qn, self.kn = (None if n is None else _rms_weight(n, d, self.qk_eps, layer.spec.qk_norm == "teacher")
                            for n in (layer.q_norm, layer.k_norm))
        self.window, self.softcap = layer.spec.window, layer.spec.softcap
        if self.ng:
            self.A_neg = -layer.A_log.float().exp()
            self.dtb = layer.dt_bias.float()
        self.fa_kv = torch.tensor(layer._index_lists["fa_kv"] or [0], dtype=torch.long, device=dev)
        opts = layer.options
        self.fa_rope = opts.fa_pos == "rope"
        self.gdn_rope = bool(opts.gdn_rope)
        self.gate = layer.g_proj is not None
        self.eps = float(opts.norm_eps)
        fk = opts.fa_kernel
        self.fa_kernel = "sdpa" if fk == "auto" and not flash_attn_available() else fk
        gk = opts.gdn_kernel
        self.gdn_kernel = ("fla" if dev.type == "cuda" and fla_available() else "torch") if gk == "auto" else gk


def _rms_weight(norm: Any, d: int, eps: float, teacher: bool) -> Tensor:
    """The fp32 weight w with which the per-head norm module computes x / RMS(x) · w: the hybrid's own weight (Qwen3's
    form), or a teacher's (Gemma's (1 + w)) read off its output on a row of ones, then checked on random rows.

    Raises:
        ValueError: the module is not an RMSNorm over head_dim (the fix: prefill / decode ``"reference"``)."""
    w = norm.weight
    if teacher:
        one = torch.ones(1, d, device=w.device)
        w = norm(one).float().view(d) * math.sqrt(1.0 + eps)
        x = torch.randn(4, d, device=w.device, generator=torch.Generator(w.device).manual_seed(0))
        if not torch.allclose(norm(x).float(), rms_norm(x, w.float(), eps), rtol=1e-3, atol=1e-5):
            raise ValueError(f"the layer's QK-norm {type(norm).__name__} is not x / RMS(x) · w over head_dim; use "
                             "InferenceConfig(prefill='reference', decode='reference')")
    return w.float()


def plan(layer: "HeadwiseHybridAttention") -> Plan:
    """The layer's :class:`Plan` (kept in its ``backends`` when attached; a changed parameter rebuilds it)."""
    ps = list(layer.parameters())
    key = (ps[0].device, ps[0].dtype) + tuple((id(p), p._version) for p in ps)
    held = layer.backends
    pl = held.plan if held is not None else None
    if pl is None or pl.key != key:
        with torch.no_grad():
            pl = Plan(layer, key)
        if held is not None:
            held.plan = pl
    return pl


def _qk_fp32(q, k, cos, sin, qn, kn, eps: float, rope: bool) -> tuple[Tensor, Tensor]:
    """q, k [B,T,h,d] -> fp32, QK-RMSNorm (when the teacher has it), then RoPE (half-split) if ``rope``."""
    qf, kf = q.float(), k.float()
    if qn is not None:
        qf, kf = rms_norm(qf, qn, eps), rms_norm(kf, kn, eps)
    if rope:
        c, s_ = cos.float(), sin.float()
        qf, kf = apply_rope(qf, c, s_), apply_rope(kf, c, s_)
    return qf, kf


def _glue_fa(q, k, cos, sin, pos, qn, kn, *, eps: float, rope: bool, nope_a: float = 0.0):
    """FA q, k [B,T,h,d] (views of the projection): QK-RMSNorm, then RoPE or the NoPE query scale
    s_t = log(t + a) / log(a) of the positions ``pos`` [B,T] (computed here: no separate kernels)."""
    qf, kf = _qk_fp32(q, k, cos, sin, qn, kn, eps, rope)
    if not rope:
        s_t = torch.log(pos.float() + nope_a) / math.log(nope_a)
        qf = qf * s_t[:, :, None, None]
    return qf.to(q.dtype), kf.to(k.dtype)


def _glue_gdn(q, k, v, a, b, cos, sin, valid, A_neg, dtb, qn, kn, *, eps: float, rope: bool):
    """GDN q, k, v [B,T,n,d], a, b [B,T,n] (views of the projection) -> L2-normalized q, k (after
    QK-RMSNorm and RoPE), contiguous v, g = −exp(A_log)·softplus(a + dt_bias) (fp32), β = σ(b).
    ``valid`` [1,T] (1 / 0, or None: all valid): rows of 0 get k = 0, g = 0 and β = 0, so they leave the
    recurrent state as it was (eq. 7: decay 1, no write) — a fixed-shape block padded past its last token."""
    dt = q.dtype
    qf, kf = _qk_fp32(q, k, cos, sin, qn, kn, eps, rope)
    qf, kf = l2_normalize(qf), l2_normalize(kf)
    g = A_neg * F.softplus(a.float() + dtb)
    beta = torch.sigmoid(b.float())
    if valid is not None:
        m = valid[:, :, None]
        g, beta, kf = g * m, beta * m, kf * m[..., None]
    return qf.to(dt), kf.to(dt), v.clone(memory_format=torch.contiguous_format), g, beta.to(dt)


def _glue_out(o_fa, gate, y_g, gamma, *, eps: float):
    """[B,T,H·d] in the layer's dtype: FA outputs (× σ(gate)) and GDN outputs side by side, then
    γ_h · y / RMS(y) per head (eq. 13–14) when γ is given."""
    parts = []
    if o_fa is not None:
        o = o_fa.float()
        if gate is not None:
            o = o * torch.sigmoid(gate.float())
        parts.append(o)
    if y_g is not None:
        parts.append(y_g.float())
    y = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    if gamma is not None:
        y = rms_norm(y, gamma, eps)
    dt = (o_fa if o_fa is not None else y_g).dtype
    return y.to(dt).flatten(2)


def _glue_dec_gdn(q, k, v, a, b, cos, sin, S, A_neg, dtb, qn, kn, *, eps: float, rope: bool, scale: float):
    """One decode token of every GDN head in one pass (q, k, v [B,1,n,d], a, b [B,1,n], cos/sin [B,1,d]):
    the glue of :func:`_glue_gdn` and the gated delta rule step (eq. 7–8) in fp32, the new state written
    into ``S`` [B,n,d,d] in place — :func:`~headscope.hybrid.inference.kernels.gdn_step.gdn_decode_step_torch`, the Triton
    kernel's reference. Returns y [B,1,n,d] in v's dtype."""
    c, s_ = (cos[:, 0], sin[:, 0]) if rope else (None, None)
    return gdn_decode_step_torch(q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], S, A_neg, dtb, scale, cos=c, sin=s_,
                                 q_norm=qn, k_norm=kn, qk_eps=eps)[:, None]


_GLUE = {"fa": _glue_fa, "gdn": _glue_gdn, "out": _glue_out, "dec_gdn": _glue_dec_gdn}


def glue(name: str, acts: tuple, weights: tuple = (), compiled: bool = True, **static: Any) -> Any:
    """Run a glue function on activations ``acts`` (batch and time leading) and ``weights``: compiled
    on CUDA when ``compiled`` (InferenceConfig.compile_glue; one graph per static configuration, batch and time
    dynamic), eager elsewhere or after a compile failure (warned once)."""
    fn = _GLUE[name]
    t0 = next(a for a in acts if isinstance(a, Tensor))
    if not (compiled and t0.device.type == "cuda") or name in _compile_failed:
        return fn(*acts, *weights, **static)
    key = (name,) + tuple(sorted(static.items()))
    cf = _compiled.get(key)
    if cf is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

        def bound(*a: Any) -> Any:
            return fn(*a, **static)

        cf = _compiled[key] = torch.compile(bound, fullgraph=True)
    for a in acts:
        if isinstance(a, Tensor):
            torch._dynamo.maybe_mark_dynamic(a, 0)
            torch._dynamo.maybe_mark_dynamic(a, 1)
    try:
        return cf(*acts, *weights)
    except Exception as e:  # pragma: no cover - depends on the GPU toolchain
        _compile_failed.append(name)
        warnings.warn(f"headscope lean path: torch.compile of the {name} glue failed ({type(e).__name__}: {e}); "
                      "running it eagerly", stacklevel=2)
        return fn(*acts, *weights, **static)
