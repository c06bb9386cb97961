"""The lean inference path of :class:`~headscope.hybrid.HeadwiseHybridAttention` (prefill and decode).

Taken when no gradient is needed, there is no attention mask, the cache is None or a
:class:`~headscope.hybrid.HybridDecodeCache`, the layer has no short convolution and its weights are in
the input's dtype (no autocast); by default on CUDA only (``InferenceConfig.fast_path``, read from the layer:
:func:`~headscope.hybrid.inference.use_inference`). It computes the plain forward's
function with:

- **one fused input projection**: the rows of every projection of the layer — q (FA heads, then GDN
  heads), the kept K/V groups, the FA gate, GDN K/V, decay (``a_proj``) and β (``b_proj``) — stacked
  into one weight, built once and rebuilt only when a parameter changes (its version counter). A long
  prefill runs the FA rows over all tokens and the GDN rows per block of ``InferenceConfig.gdn_block_tokens``;
- **no head permutation of activations**: outputs stay in (FA, GDN) order; γ's rows and ``o_proj``'s
  input columns are permuted instead;
- **fused elementwise glue** (``torch.compile`` on CUDA, eager elsewhere, the same code): per-head
  QK-RMSNorm, RoPE / NoPE scale, L2 norm of GDN q/k, decay g and β in one pass over the projection
  output; FA gate, the per-head RMSNorm and γ (eq. 13–14) in one pass over the heads' outputs. fp32
  lives in registers only: every [time, heads, d] tensor in memory is in the layer's dtype;
- **the FA heads' kept KV groups to SDPA** (flash backend, ``enable_gqa``; flash-attn when importable) and
  **all GDN heads in one kernel call** per block (fla's ``chunk_gated_delta_rule`` forward, called
  below its autograd wrapper; ``fused_recurrent_gated_delta_rule`` for ≤ 8 tokens; the PyTorch chunked
  form / recurrence without fla), the state carried from block to block;
- **memory**: the GDN branch runs in time blocks, so fla's per-chunk intermediates (states, WY
  factors) are bounded by the block, not the sequence, and fla's stages free each intermediate when done
  (called stage by stage). An eager prefill without autograd runs fixed-shape blocks of ``eager_graph_tokens``,
  each replayed from a CUDA graph of the GDN glue and fla's stages (:func:`gdn_block_graphed`; the last block
  padded with rows that leave the state unchanged), so small blocks cost no host time per call
  (``eager_gdn_graphs``); a call recorded for a CUDA graph of the caller's uses blocks of a quarter of the
  tokens, and with ``eager_gdn_graphs="never"`` eager blocks are sized to hide each call's host time
  (:func:`block_tokens`).

A decode step through a HybridDecodeCache writes the FA K/V into the cache slot in place and the new
GDN state into ``cache.S``, so it can be captured in a CUDA graph (after a warm-up call: the glue
compiles on first use). Where the Triton kernels apply (CUDA or Triton's interpreter, head_dim a power of two ≥ 16)
the FA heads' q/k glue and K/V cache write, their split-K attention over the kept KV groups and all GDN heads' step
(state updated in place in ``cache.S``) run in one Triton launch (``step.py``), then the split-K combination; the
separate kernels (``fa_step.py``, ``splitk.py``, ``gdn_step.py``) where only some apply, PyTorch (SDPA, the compiled
recurrence) elsewhere. Up to ``InferenceConfig.fused_out_max_d`` the output fusion (FA gate, per-head RMSNorm, γ)
runs inside the split-K combination and the GDN step, which write one buffer for ``o_proj``.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .attn import fa_attention, flash_attn_available
from .fused import stack_projections
from .gdn import fla_available, gated_delta_rule
from .graphs import ShapeGraphs, recording as _graph_recording
from .rope import apply_rope
from .shapes import Float
from .gdn_step import applies as gdn_step_applies, gdn_decode_step, gdn_decode_step_torch, l2_normalize, rms_norm
from .splitk import combine as _combine_partials, decode_attention, triton_available
from .fa_step import applies as fa_prep_applies, fa_decode_prep
from .inference.config import InferenceConfig, inference_config
from .step import applies as step_applies, hybrid_decode_step

if TYPE_CHECKING:  # pragma: no cover
    from .layer import HeadwiseHybridAttention

_compiled: dict[tuple, Callable] = {}
_compile_failed: list[str] = []


def applies(layer: "HeadwiseHybridAttention", x: Tensor, attention_mask: Any, decode_cache: bool, cache: Any) -> bool:
    """True when the lean path computes this call (see the module docstring)."""
    where = inference_config(layer).fast_path
    if where == "never" or (where == "cuda" and x.device.type != "cuda"):
        return False
    if attention_mask is not None or (cache is not None and not decode_cache) or layer.gdn_conv is not None:
        return False
    w = layer.q_proj.weight
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    if x.dim() != 3 or w.dtype != x.dtype or w.device != x.device:
        return False
    return not torch.is_autocast_enabled(x.device.type)


# ---------------------------------------------------------------------------------------- the plan
class _Plan:
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
        self.qn = layer.q_norm.weight.float() if layer.q_norm is not None else None
        self.kn = layer.k_norm.weight.float() if layer.k_norm is not None else None
        self.qk_eps = float(layer.q_norm.eps) if layer.q_norm is not None else 0.0
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


def plan(layer: "HeadwiseHybridAttention") -> _Plan:
    """The layer's :class:`_Plan` (cached on the layer; a changed parameter rebuilds it)."""
    ps = list(layer.parameters())
    key = (ps[0].device, ps[0].dtype) + tuple((id(p), p._version) for p in ps)
    pl = layer.__dict__.get("_lean_plan")
    if pl is None or pl.key != key:
        with torch.no_grad():
            pl = _Plan(layer, key)
        layer.__dict__["_lean_plan"] = pl
    return pl


# ---------------------------------------------------------------------------------------- the glue
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
    into ``S`` [B,n,d,d] in place — :func:`~headscope.hybrid.gdn_step.gdn_decode_step_torch`, the Triton
    kernel's reference. Returns y [B,1,n,d] in v's dtype."""
    c, s_ = (cos[:, 0], sin[:, 0]) if rope else (None, None)
    return gdn_decode_step_torch(q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], S, A_neg, dtb, scale, cos=c, sin=s_,
                                 q_norm=qn, k_norm=kn, qk_eps=eps)[:, None]


_GLUE = {"fa": _glue_fa, "gdn": _glue_gdn, "out": _glue_out, "dec_gdn": _glue_dec_gdn}


def _glue(name: str, acts: tuple, weights: tuple = (), compiled: bool = True, **static: Any) -> Any:
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


# ---------------------------------------------------------------------------------------- kernels
_fla_fwd: list = []


def _fla_chunk_fwd():
    """fla's chunk forward below its autograd wrapper (the public call costs ~0.3 ms of Python)."""
    if not _fla_fwd:
        try:
            from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

            _fla_fwd.append(chunk_gated_delta_rule_fwd)
        except ImportError:  # pragma: no cover - another fla version
            _fla_fwd.append(None)
    return _fla_fwd[0]


_fq_fwd: list = []


def _flash_qla_fwd():
    """FlashQLA's chunk forward (``flash_qla.chunk_gated_delta_rule_fwd``) or None where not installed."""
    if not _fq_fwd:
        try:
            from flash_qla import chunk_gated_delta_rule_fwd

            _fq_fwd.append(chunk_gated_delta_rule_fwd)
        except Exception:  # noqa: BLE001 - not installed, or its TileLang/CUDA stack does not import here
            _fq_fwd.append(None)
    return _fq_fwd[0]


def flash_qla_applies(q: Tensor, v: Tensor, on: bool = True) -> bool:
    """Whether a GDN call goes to FlashQLA (``on``: InferenceConfig.flash_qla; CUDA, bf16/fp16, head_dim 128,
    installed)."""
    return (on and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == 128
            and v.shape[-1] == 128 and _flash_qla_fwd() is not None)


_fla_parts: list = []


def _fla_chunk_parts():
    """fla's chunk-forward stages (gate cumsum, intra-chunk WY factors, state pass, output) or None."""
    if not _fla_parts:
        try:
            from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
            from fla.ops.common.chunk_o import chunk_fwd_o
            from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
            from fla.ops.utils import chunk_local_cumsum
            from fla.ops.utils.constant import RCP_LN2

            _fla_parts.append((chunk_local_cumsum, chunk_gated_delta_rule_fwd_intra, chunk_gated_delta_rule_fwd_h,
                               chunk_fwd_o, RCP_LN2))
        except ImportError:  # pragma: no cover - another fla version
            _fla_parts.append(None)
    return _fla_parts[0]


def _fla_chunk_low_memory(ops: list, scale: float, h0: Optional[Tensor], chunk_size: int) -> tuple[Tensor, Tensor]:
    """fla's chunk forward stage by stage (the stages of its ``chunk_gated_delta_rule_fwd``, called in its order
    with its arguments: the same kernels, the same output), each input and intermediate freed as soon as no later
    stage reads it: v, β and the intra-chunk matrix A after the WY factors, w and u after the state pass. ``ops``
    = [q, k, v, g, β] is emptied (the caller must hold no other reference for the memory to be freed)."""
    cumsum, intra, fwd_h, fwd_o, rcp_ln2 = _fla_chunk_parts()
    q, k, v, g, beta = ops
    ops.clear()
    g = cumsum(g, chunk_size=chunk_size, scale=rcp_ln2)
    w, u, A = intra(k=k, v=v, g=g, beta=beta, chunk_size=chunk_size)
    del v, beta, A
    h, v_new, final = fwd_h(k=k, w=w, u=u, g=g, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    del w, u
    o = fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, chunk_size=chunk_size)
    return o, final


def gdn_consume(ops: list, scale: float, h0: Optional[Tensor], kernel: str, chunk_size: int = 64,
                flash_qla: bool = True) -> tuple[Tensor, Tensor]:
    """:func:`gdn` on ``ops`` = [q, k, v, g, β], which the call empties: where fla's chunk forward runs, it runs
    stage by stage, each input freed when no later stage reads it (if the caller holds no other reference)."""
    if (kernel == "fla" and ops[0].shape[1] > 8 and not flash_qla_applies(ops[0], ops[2], flash_qla)
            and _fla_chunk_parts() is not None):
        with torch.cuda.device(ops[0].device):
            return _fla_chunk_low_memory(ops, scale, None if h0 is None else h0.float(), 64)
    args = tuple(ops)
    ops.clear()
    return gdn(*args, scale, h0, kernel, chunk_size, flash_qla)


def gdn(q, k, v, g, beta, scale: float, h0: Optional[Tensor], kernel: str, chunk_size: int = 64,
        flash_qla: bool = True) -> tuple[Tensor, Tensor]:
    """All GDN heads in one call: (y [B,T,n,d] in v's dtype, final state [B,n,d,d] fp32); FlashQLA where
    ``flash_qla`` and it applies, else fla's chunk forward, else headscope's PyTorch forms."""
    T = q.shape[1]
    if kernel == "fla" and T > 8 and flash_qla_applies(q, v, flash_qla):
        with torch.cuda.device(q.device):
            out = _flash_qla_fwd()(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                   initial_state=None if h0 is None else h0.float(), output_final_state=True)
        return out[2], out[4]  # (g, A, o, h, final_state, cp_cache)
    if kernel == "fla" and T > 8:
        fwd = _fla_chunk_fwd()
        if fwd is not None:
            with torch.cuda.device(q.device):
                out = fwd(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                          initial_state=None if h0 is None else h0.float(), output_final_state=True)
            return out[1], out[3]
    return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, kernel=kernel, chunk_size=chunk_size)


def block_tokens(n_gdn: int, d: int, tokens: int = 0, graphed: bool = False,
                 cfg: InferenceConfig = InferenceConfig()) -> int:
    """Tokens (batch x time) per GDN kernel call in a prefill of ``tokens`` (batch x time) tokens.

    ``cfg.gdn_block_tokens`` when set. Else, eager (``graphed`` False): enough that one call's work (tokens x heads x
    d²) is ``cfg.gdn_block_work`` (at least 8192, a multiple of 64) — each call costs ~1-1.5 ms of host time (glue +
    fla's launches) on the H200, hidden only behind that much GPU work, so smaller blocks are host-bound. For a call
    recorded for a CUDA graph (``graphed``: :func:`headscope.hybrid.graphs.recording`; no host time at replay):
    ``tokens // cfg.gdn_graph_block_divisor`` (at least ``cfg.gdn_graph_block_min``, a multiple of 64), which bounds
    fla's intermediates by a fraction of the sequence (the prefill's peak memory) at little cost in speed."""
    if cfg.gdn_block_tokens:
        return cfg.gdn_block_tokens
    if graphed and cfg.gdn_graph_block_divisor:
        return max(cfg.gdn_graph_block_min, tokens // cfg.gdn_graph_block_divisor // 64 * 64)
    return max(8192, (cfg.gdn_block_work // max(1, n_gdn * d * d)) // 64 * 64)


def eager_graph_block(B: int, T: int, cfg: InferenceConfig = InferenceConfig()) -> int:
    """Time steps per GDN block of an eager prefill through CUDA graphs (``cfg.eager_gdn_graphs``): blocks of
    ``cfg.eager_graph_tokens`` tokens (batch x time, a multiple of 64 time steps), or for a shorter prefill the
    smallest power of two ≥ T and ≥ ``cfg.eager_graph_min`` (a few graph shapes cover every length)."""
    full = max(64, cfg.eager_graph_tokens // max(1, B) // 64 * 64)
    if T >= full:
        return full
    return min(full, max(cfg.eager_graph_min, 1 << (T - 1).bit_length()))


def _eager_graphs(x: Tensor, p: _Plan, T: int, cfg: InferenceConfig) -> bool:
    """Whether this prefill's GDN heads run as graph-replayed fixed-shape blocks (``cfg.eager_gdn_graphs``)."""
    if cfg.eager_gdn_graphs == "never" or T <= 8 or not p.ng or torch.is_grad_enabled():
        return False
    if cfg.eager_gdn_graphs == "cuda" and not (x.is_cuda and p.gdn_kernel == "fla"):
        return False
    return not (_graph_recording() or torch.compiler.is_compiling()
                or (x.is_cuda and torch.cuda.is_current_stream_capturing()))


def _gdn_cfg(layer: "HeadwiseHybridAttention", p: _Plan, rope: bool) -> tuple:
    """The static configuration of a layer's GDN block: (column sizes of its projection rows, heads, d, QK-norm eps,
    RoPE, scale, kernel, chunk size, compiled glue, FlashQLA)."""
    cfg = inference_config(layer)
    return (tuple(p.g_sizes), p.ng, p.d, p.qk_eps, p.gdn_rope and rope, float(layer.scaling), p.gdn_kernel,
            int(layer.options.chunk_size), cfg.compile_glue, cfg.flash_qla)


def _gdn_ops(cfg: tuple, zg, cos, sin, valid, A_neg, dtb, qn, kn) -> list:
    """[q, k, v, g, β] of the GDN heads from their rows ``zg`` [B,t,R] of the input projection (:func:`_glue_gdn`;
    padded rows masked by ``valid``, or None)."""
    sizes, ng, d, eps, rope = cfg[:5]
    qg, kg, vg, a, b = zg.split(sizes, dim=-1)
    return list(_glue("gdn", (qg.unflatten(-1, (ng, d)), kg.unflatten(-1, (ng, d)), vg.unflatten(-1, (ng, d)),
                              a[..., :ng], b[..., :ng], cos, sin, valid), (A_neg, dtb, qn, kn), cfg[8], eps=eps,
                              rope=rope))


def _gdn_block(cfg: tuple, zg, cos, sin, h0, valid, A_neg, dtb, qn, kn) -> tuple[Tensor, Tensor]:
    """One fixed-shape GDN block: the glue (:func:`_gdn_ops`) and the chunk forward from ``h0`` [B,n,d,d] fp32, whose
    final state is written back into ``h0`` (returned as the state: the next block of the same graph starts from it
    without a copy)."""
    y, S = gdn_consume(_gdn_ops(cfg, zg, cos, sin, valid, A_neg, dtb, qn, kn), cfg[5], h0, cfg[6], cfg[7], cfg[9])
    h0.copy_(S)
    return y, h0


_block_graphs: dict = {}  # block configuration -> graphs.ShapeGraphs


def release_eager_graphs() -> None:
    """Free the CUDA graphs and static buffers of eager prefills' GDN blocks (InferenceConfig.eager_gdn_graphs)."""
    _block_graphs.clear()


def eager_graph_bytes() -> int:
    """Bytes held between calls by the eager GDN block graphs: their static inputs and their memory pool (outputs, one
    block's glue and fla intermediates)."""
    return sum(g.nbytes() for g in _block_graphs.values())


def gdn_block_graphed(layer: "HeadwiseHybridAttention", zg: Float[Tensor, "B t R"], cos: Optional[Tensor],
                      sin: Optional[Tensor], S: Optional[Float[Tensor, "B n d d"]],
                      tb: int) -> tuple[Float[Tensor, "B tb n d"], Float[Tensor, "B n d d"]]:
    """The GDN heads of ``t ≤ tb`` time steps as one block of ``tb``: ``zg`` (their rows of the input projection),
    cos/sin [B, t, d] (or None without RoPE) and the state S (None: zeros) are copied into the static inputs of a
    CUDA graph of :func:`_gdn_block` (one per shape, captured on first use), rows past t padded so that they leave
    the state as it was. Returns the block's output (rows ≥ t: padding) and the final state — static buffers that
    the next block call overwrites (read them first, on the same stream). On CPU the same path runs eagerly.

    Raises:
        ValueError: t > tb."""
    p = plan(layer)
    B, t, R = zg.shape
    if t > tb:
        raise ValueError(f"a block of {t} time steps does not fit the {tb}-step graph block")
    rope = cos is not None
    cfg = _gdn_cfg(layer, p, rope)
    sg = _block_graphs.get(cfg)
    if sg is None:
        sg = _block_graphs[cfg] = ShapeGraphs(functools.partial(_gdn_block, cfg),
                                                 max_graphs=inference_config(layer).eager_graph_max)
    opt = (p.qn, p.kn)
    key = (zg.device, zg.dtype, B, tb, R, None if not rope else (cos.dtype, cos.shape[-1]),
           tuple(w is not None for w in opt))

    @torch.inference_mode(False)  # ordinary tensors, so that calls outside inference mode can write them too
    def make() -> list:
        z0 = zg.new_zeros
        cs = [z0(B, tb, cos.shape[-1], dtype=cos.dtype), z0(B, tb, sin.shape[-1], dtype=sin.dtype)] if rope else [None, None]
        return [z0(B, tb, R), *cs, z0(B, p.ng, p.d, p.d, dtype=torch.float32), z0(1, tb, dtype=torch.float32),
                torch.empty_like(p.A_neg), torch.empty_like(p.dtb), *(None if w is None else torch.empty_like(w) for w in opt)]

    # the plan's tensors are never written in place (a changed parameter makes a new plan), so their identity says
    # whether the static copies are current; the memo keeps them referenced, so an id is not reused meanwhile
    wkey = tuple(id(w) for w in (p.A_neg, p.dtb, *opt) if w is not None)

    def fill(ins: list, memo: dict) -> None:
        # only what changed since this graph's last call (host time: each copy is a launch): the layer's small
        # weights, the padding mask, the state (already in place when S is this graph's own output)
        last_t, last_w = memo.get("t"), memo.get("w")
        ins[0][:, :t].copy_(zg)
        if rope:
            ins[1][:, :t].copy_(cos)
            ins[2][:, :t].copy_(sin)
        if S is None:
            ins[3].zero_()
        elif S is not ins[3]:
            ins[3].copy_(S)
        if t != last_t:
            ins[4][:, :t].fill_(1.0)
            ins[4][:, t:].fill_(0.0)
        if wkey != last_w:
            for dst, src in zip(ins[5:], (p.A_neg, p.dtb, *opt)):
                if src is not None:
                    dst.copy_(src)
        memo.update(t=t, w=wkey, refs=(p.A_neg, p.dtb, *opt))  # the refs keep the ids in wkey from being reused

    return sg.run(key, make, fill)


def _graph_blocks(x: Tensor) -> bool:
    """Whether this call is recorded for a CUDA graph by :mod:`headscope.hybrid.graphs` (its warm-up or capture:
    both see the same block sizes, so nothing compiles or autotunes inside the capture). A capture made with
    ``torch.cuda.graph`` directly keeps the eager rule unless wrapped in ``graphs.for_graph()``."""
    return x.is_cuda and _graph_recording()


def _as_long(slot: Any, dev: torch.device) -> Tensor:
    return slot if isinstance(slot, Tensor) else torch.full((1,), int(slot), dtype=torch.long, device=dev)


def _splitk_applies(q: Tensor, layer: "HeadwiseHybridAttention") -> bool:
    """Whether a decode step's FA heads go to :func:`~headscope.hybrid.splitk.decode_attention`."""
    d = q.shape[-1]
    return (d >= 16 and not d & (d - 1) and triton_available()
            and (q.is_cuda or (os.environ.get("TRITON_INTERPRET") == "1" and q.dtype != torch.bfloat16)))


def _fa_attend(layer: "HeadwiseHybridAttention", p: _Plan, q: Tensor, k: Optional[Tensor], v: Optional[Tensor],
               cache: Any, dpos: Optional[Tensor], past: int, prep: Optional[bool] = None, **out: Any) -> Tensor:
    """The FA heads' attention: q [B,T,nf,d], the new k, v [B,nk,T,d] (written into the cache when there is
    one) -> [B,T,nf,d]. A decode step goes to the split-K kernel where it applies; device-position steps
    write slot ``dpos`` and attend over the buffer up to it (the split-K length, or SDPA with a slot mask).
    ``prep``: q is already prepared and the token's K/V already in the cache (:func:`fa_decode_prep`); ``out``:
    the split-K kernel's ``out``/``gate``/``gamma``/``eps`` (the fused output)."""
    T = q.shape[1]
    splitk = T == 1 and cache is not None and _splitk_applies(q, layer)
    if splitk and prep:  # q prepared and K/V written into the cache by fa_decode_prep
        kc, vc, n_valid = cache.k, cache.v, None
        if dpos is None:
            kc, vc = kc[:, :, : past + 1], vc[:, :, : past + 1]
        else:
            n_valid = cache.n_valid if cache.n_valid is not None else dpos + 1
        return decode_attention(q[:, 0], kc, vc, n_valid, layer.scaling,
                                kv_index=None if layer._fa_gqa else p.fa_kv, **out)[:, None]
    amask = None
    if dpos is not None:
        cache.k.index_copy_(2, dpos, k)
        cache.v.index_copy_(2, dpos, v)
        k, v = cache.k, cache.v
        if not splitk:
            valid = cache.valid if cache.valid is not None else torch.arange(cache.max_len, device=q.device) <= dpos
            amask = valid[None, None, None]
    elif cache is not None:
        k, v = cache._write(k, v, past)
    if splitk:  # flash-decoding over the kept KV groups; the length from device memory with device positions
        n_valid = None if dpos is None else (cache.n_valid if cache.n_valid is not None else dpos + 1)
        return decode_attention(q[:, 0], k, v, n_valid, layer.scaling,
                                kv_index=None if layer._fa_gqa else p.fa_kv)[:, None]
    if not layer._fa_gqa:
        k, v = k.index_select(1, p.fa_kv), v.index_select(1, p.fa_kv)
    return fa_attention(q, k, v, layer.scaling, causal=True, mask=amask, kernel=p.fa_kernel)


def _gdn_decode(layer: "HeadwiseHybridAttention", p: _Plan, qg: Tensor, kg: Tensor, vg: Tensor, a: Tensor,
                b: Tensor, cs: tuple, S: Tensor, out: Optional[Tensor] = None, gamma: Optional[Tensor] = None) -> Tensor:
    """One token of every GDN head from the projection's views (q/k/v [B,1,n·d], a/b [B,1,n]), the state
    ``S`` (the cache's) updated in place -> y [B,1,n,d]: the Triton kernel where it applies (into ``out`` [B,n,d]
    when given, the output fusion folded in with ``gamma``), else the same function compiled from PyTorch."""
    ng, d = p.ng, p.d
    if gdn_step_applies(d, qg.device):
        return gdn_decode_step(**_gdn_step_kw(layer, p, qg, kg, vg, a, b, cs, S, out, gamma))[:, None]
    q3, k3, v3 = (t.unflatten(-1, (ng, d)) for t in (qg, kg, vg))
    return _glue("dec_gdn", (q3, k3, v3, a, b, *cs), (S, p.A_neg, p.dtb, p.qn, p.kn),
                 inference_config(layer).compile_glue, eps=p.qk_eps, rope=p.gdn_rope, scale=float(layer.scaling))


def _gdn_step_kw(layer: "HeadwiseHybridAttention", p: _Plan, qg: Tensor, kg: Tensor, vg: Tensor, a: Tensor,
                 b: Tensor, cs: tuple, S: Tensor, out: Optional[Tensor], gamma: Optional[Tensor]) -> dict:
    """:func:`gdn_decode_step`'s arguments for one token from the projection's views (q/k/v [B,1,n·d],
    a/b [B,1,n]) and the state ``S``; shared by the separate GDN step and the one-launch step."""
    ng, d = p.ng, p.d
    rope = p.gdn_rope and cs[0] is not None
    return dict(q=qg[:, 0].unflatten(-1, (ng, d)), k=kg[:, 0].unflatten(-1, (ng, d)), v=vg[:, 0].unflatten(-1, (ng, d)),
                a=a[:, 0], b=b[:, 0], S=S, A_neg=p.A_neg, dt_bias=p.dtb, scale=float(layer.scaling),
                cos=cs[0][:, 0] if rope else None, sin=cs[1][:, 0] if rope else None, q_norm=p.qn, k_norm=p.kn,
                qk_eps=p.qk_eps, out=out, gamma=gamma, out_eps=p.eps)


def _fa_glue_kw(layer: "HeadwiseHybridAttention", p: _Plan, cos: Optional[Tensor], sin: Optional[Tensor],
                position_ids: Optional[Tensor], slot: Any, dev: torch.device) -> dict:
    """The FA glue's arguments of a decode step's prep (:func:`fa_decode_prep`, :func:`hybrid_decode_step`): the
    token's rotary row, or the NoPE scale with its positions, and the QK-norm weights."""
    rope = p.fa_rope and cos is not None
    positions = None
    if not p.fa_rope:
        positions = position_ids[:, -1] if position_ids is not None else _as_long(slot, dev)
    return dict(cos=cos[:, 0] if rope else None, sin=sin[:, 0] if rope else None, positions=positions,
                nope_a=None if p.fa_rope else float(layer.options.nope_a), q_norm=p.qn, k_norm=p.kn, qk_eps=p.qk_eps)


def _fa_fused_out(p: _Plan, y_buf: Optional[Tensor], gate: Optional[Tensor]) -> dict:
    """The split-K combination's output fusion into the FA heads' columns of ``y_buf`` (none without a buffer)."""
    if y_buf is None:
        return {}
    return {"out": y_buf[:, : p.nf], "gate": gate[:, 0] if gate is not None else None,
            "gamma": p.gamma[: p.nf] if p.gamma is not None else None, "eps": p.eps}


def _prep_applies(layer: "HeadwiseHybridAttention", q: Tensor, T: int, cache: Any) -> bool:
    """Whether a decode step's FA glue and K/V write go to :func:`fa_decode_prep` (one Triton kernel)."""
    return (T == 1 and cache is not None and _splitk_applies(q, layer)
            and fa_prep_applies(q.shape[-1], q.device))


def _one_launch(layer: "HeadwiseHybridAttention", p: _Plan, q: Tensor, k: Tensor, v: Tensor, z: Tensor, cache: Any,
                dpos: Optional[Tensor], past: int, cos: Optional[Tensor], sin: Optional[Tensor],
                position_ids: Optional[Tensor], y_buf: Optional[Tensor], gate: Optional[Tensor],
                g_out: Optional[dict], combine: Any = True) -> tuple[Any, Optional[Tensor]]:
    """A decode step's FA prep + split-K attention and GDN step through :func:`hybrid_decode_step` (one launch, then
    the combination): q [B,1,nf,d], k, v [B,1,nk,d] and the GDN rows of the projection z -> (o_fa [B,1,nf,d],
    y [B,ng,d] or None); with ``y_buf`` both write their fused outputs there. ``combine``: as
    :func:`hybrid_decode_step`'s; where it leaves the combination to the caller (``tail_step.layer_tail``), the
    split-K namespace in place of o_fa."""
    ng = p.ng
    if dpos is None:
        kc, vc, n_valid = cache.k[:, :, : past + 1], cache.v[:, :, : past + 1], None
    else:
        kc, vc = cache.k, cache.v
        n_valid = cache.n_valid if cache.n_valid is not None else dpos + 1
    gdn = None
    if ng:
        qg, kg, vg, a, b = z[..., p.n_fa_rows:].split(p.g_sizes, dim=-1)
        gdn = _gdn_step_kw(layer, p, qg, kg, vg, a[..., :ng], b[..., :ng], (cos, sin), cache.S,
                           g_out["out"] if g_out else None, g_out["gamma"] if g_out else None)
    o, y = hybrid_decode_step(q[:, 0], k[:, 0], v[:, 0], kc, vc, n_valid, layer.scaling,
                              kv_index=None if layer._fa_gqa else p.fa_kv, gdn=gdn,
                              **_fa_glue_kw(layer, p, cos, sin, position_ids, dpos if dpos is not None else past,
                                            q.device), **_fa_fused_out(p, y_buf, gate), combine=combine)
    return (o[:, None] if isinstance(o, Tensor) else o), y


# ---------------------------------------------------------------------------------------- forward
class DeferredOutput:
    """A decode step's attention output left unfinished (:func:`forward` with ``defer=True``), for
    :func:`~headscope.hybrid.tail_step.layer_tail`, which combines the split-K partials and applies ``o_proj``
    inside the layer's tail launch.

    Attributes:
        y: o_proj's input [batch, heads·d] in the layer's dtype: the GDN heads' fused outputs written, the FA heads'
            columns still to come from ``attn``.
        attn: (the split-K launch's namespace, gate, gamma, eps) of :func:`~headscope.hybrid.splitk.combine`, or
            None where the FA heads' columns of y are written too (combined inside the attention's launch).
        w_o, b_o: o_proj's weight (input columns in (FA, GDN) order) and bias.
    """

    __slots__ = ("y", "attn", "w_o", "b_o")

    def __init__(self, y: Tensor, attn: Optional[tuple], w_o: Tensor, b_o: Optional[Tensor]):
        self.y, self.attn, self.w_o, self.b_o = y, attn, w_o, b_o

    def finish(self) -> Tensor:
        """The layer's output [batch, 1, hidden] through the separate kernels (the combination, then o_proj)."""
        if self.attn is not None:
            _combine_partials(*self.attn)
        return F.linear(self.y[:, None], self.w_o, self.b_o)


def forward(layer: "HeadwiseHybridAttention", x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]],
            position_ids: Optional[Tensor], cache: Any, defer: bool = False, z_in: Optional[Tensor] = None) -> Any:
    """The layer's output [B, T, hidden] (before the residual add); ``cache`` is None or a
    HybridDecodeCache (filled / advanced in place). ``defer``: a decode step that takes the one-launch path
    returns a :class:`DeferredOutput` instead (the combination and o_proj left to the caller's layer tail).
    ``z_in``: the input projection ``x @ plan(layer).Wᵀ + b`` [B, 1, rows of W], already computed (by the layer
    tail before: ``tail_step.layer_tail``'s ``w_in``); then only x's shape, dtype and device are read."""
    p = plan(layer)
    B, T, _ = x.shape
    d, nf, ng = p.d, p.nf, p.ng
    past = cache.length if cache is not None else 0
    # device-position decoding (cache.pos, a [1] long tensor on the device; StaticDecoder.generate): the
    # step reads its position from device memory, so one captured CUDA graph serves every length
    dpos = getattr(cache, "pos", None) if cache is not None else None
    if dpos is not None and (T != 1 or position_ids is None):
        raise ValueError("a HybridDecodeCache with a device position (cache.pos) takes one token per step "
                         "and explicit position_ids; set cache.pos = None for prefill")
    cos = sin = None
    if position_embeddings is not None:
        cos, sin = position_embeddings
        if cos.shape[0] != B:
            cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    need_rope = (p.fa_rope and nf) or (p.gdn_rope and ng)
    if need_rope and cos is None:
        raise ValueError("position_embeddings=(cos, sin) is required (RoPE is on); compute it with "
                         "model.model.rotary_emb(hidden_states, position_ids)")
    if cache is not None and dpos is None and past + T > cache.max_len:
        raise ValueError(f"HybridDecodeCache holds {cache.max_len} tokens but {past + T} are needed; "
                         "make it with a larger max_len")
    cfg = inference_config(layer)
    eg = _eager_graphs(x, p, T, cfg)  # the GDN heads as graph-replayed fixed-shape blocks (cfg.eager_gdn_graphs)
    tb = eager_graph_block(B, T, cfg) if eg else max(1, block_tokens(ng, d, B * T, T > 1 and _graph_blocks(x), cfg) // B)
    one_gemm = T <= tb
    if z_in is not None and (not one_gemm or z_in.shape != (B, T, p.W.shape[0])):
        raise ValueError(f"z_in must be the input projection [{B}, {T}, {p.W.shape[0]}] of a step that fits one "
                         f"GEMM; got {tuple(z_in.shape)}: pass hidden states instead")
    z = z_in if z_in is not None else (F.linear(x, p.W, p.b) if one_gemm else None)
    z_fa = z[..., : p.n_fa_rows] if one_gemm else (F.linear(x, p.W[: p.n_fa_rows], None if p.b is None else p.b[: p.n_fa_rows]) if nf else None)

    S_dec = cache.S if (cache is not None and (past or dpos is not None)) else None
    o_fa = gate = q = k = v = None
    if nf:
        parts = z_fa.split(p.fa_sizes, dim=-1)
        q, k, v = (t.unflatten(-1, (-1, d)) for t in parts[:3])
        gate = parts[3].unflatten(-1, (nf, d)) if p.gate else None
    prep = bool(nf) and _prep_applies(layer, q, T, cache)
    gdn_triton = not ng or (S_dec is not None and gdn_step_applies(d, x.device))
    # ---- the fused output of a decode step: every head writes its fused output here
    y_buf = g_out = None
    if (T == 1 and cache is not None and d <= cfg.fused_out_max_d and (p.gamma is not None or p.gate or (nf and ng))
            and (prep or not nf) and gdn_triton):
        y_buf = x.new_empty(B, nf + ng, d)
        g_out = {"out": y_buf[:, nf:], "gamma": p.gamma[nf:] if p.gamma is not None else None}

    # ---- one launch for the FA prep + split-K partials and the GDN step
    one = prep and step_applies(d, x.device) and gdn_triton
    # ---- the combination and o_proj left to the caller (defer: StaticDecoder's tail kernel)
    deferred = defer and one and T == 1 and (y_buf is not None or not ng)
    if deferred and y_buf is None:
        y_buf = x.new_empty(B, nf, d)
    y_one = None

    # ---- FA heads: softmax attention over the kept KV groups
    if nf:
        if one:
            # deferred: the partials go to the tail kernel unless the launch combines them (rows of few heads)
            o_fa, y_one = _one_launch(layer, p, q, k, v, z, cache, dpos, past, cos, sin, position_ids, y_buf, gate,
                                      g_out, combine="defer" if deferred else True)
            combined = isinstance(o_fa, Tensor)
        elif prep:  # one kernel: q/k glue + the K/V cache write
            slot = dpos if dpos is not None else past
            qp = fa_decode_prep(q[:, 0], k[:, 0], v[:, 0], cache.k, cache.v, slot,
                                **_fa_glue_kw(layer, p, cos, sin, position_ids, slot, x.device))
            o_fa = _fa_attend(layer, p, qp[:, None], None, None, cache, dpos, past, prep=True,
                              **_fa_fused_out(p, y_buf, gate))
            del qp
        else:
            pos = None
            if not p.fa_rope:
                pos = position_ids if position_ids is not None else torch.arange(past, past + T, device=x.device)[None]
                pos = pos.expand(B, T)
            q, k = _glue("fa", (q, k, cos, sin, pos), (p.qn, p.kn), cfg.compile_glue, eps=p.qk_eps, rope=p.fa_rope,
                         nope_a=float(layer.options.nope_a))
            o_fa = _fa_attend(layer, p, q, k.transpose(1, 2), v.transpose(1, 2), cache, dpos, past)  # B, T, nf, d
        del q, k, v

    # ---- GDN heads: all in one kernel call per time block, the state carried over
    y_g = None
    if y_one is not None:
        y_g = y_one[:, None]
    elif ng:
        S = S_dec
        fused_step = T == 1 and S is not None
        W_g = p.W[p.n_fa_rows:]
        b_g = None if p.b is None else p.b[p.n_fa_rows:]
        blocks = [(0, T)] if one_gemm else [(s, min(s + tb, T)) for s in range(0, T, tb)]
        if len(blocks) > 1:
            y_g = x.new_empty(B, T, ng, d)
        for t0, t1 in blocks:
            zg = z[..., p.n_fa_rows:] if one_gemm else F.linear(x[:, t0:t1], W_g, b_g)
            cs = (cos[:, t0:t1], sin[:, t0:t1]) if cos is not None and p.gdn_rope else (None, None)
            ops = None
            if eg:  # the glue and the chunk forward in a graph-replayed block (zg copied into its input)
                y, S = gdn_block_graphed(layer, zg, *cs, S, tb)
                y = y[:, : t1 - t0]
            elif fused_step:  # one token: glue + recurrence + state write in one call (the state stays in cache.S)
                qg, kg, vg, a, b = zg.split(p.g_sizes, dim=-1)
                y_g = _gdn_decode(layer, p, qg, kg, vg, a[..., :ng], b[..., :ng], cs, S, **(g_out or {}))
                S = None
                break
            else:
                ops = _gdn_ops(_gdn_cfg(layer, p, cs[0] is not None), zg, *cs, None, p.A_neg, p.dtb, p.qn, p.kn)
            del zg
            if one_gemm:  # the projection is no longer needed: free it before fla's intermediates
                gate = gate.clone() if gate is not None else None
                del z, z_fa
                z = z_fa = None
            if ops is not None:
                y, S = gdn_consume(ops, layer.scaling, S, p.gdn_kernel, layer.options.chunk_size, cfg.flash_qla)
            if len(blocks) > 1:
                y_g[:, t0:t1] = y
            else:
                y_g = y
        if cache is not None and S is not None:
            cache.S.copy_(S)
    del z, z_fa
    if cache is not None and dpos is None:
        cache.length = past + T

    # ---- fusion (eq. 13–14) in (FA, GDN) order, then o_proj with permuted input columns
    if deferred:  # o_fa is the split-K namespace, or the FA heads' output already in y_buf
        if combined:
            return DeferredOutput(y_buf.view(B, -1), None, p.Wo, p.bo)
        f = _fa_fused_out(p, y_buf, gate)
        return DeferredOutput(y_buf.view(B, -1), (o_fa, f["gate"], f["gamma"], f["eps"]), p.Wo, p.bo)
    if y_buf is not None:  # done by the kernels
        del o_fa, y_g, gate
        return F.linear(y_buf.view(B, 1, -1), p.Wo, p.bo)
    if p.gamma is None and gate is None and (o_fa is None or y_g is None):
        y = (o_fa if o_fa is not None else y_g).reshape(B, T, -1)
    else:
        y = _glue("out", (o_fa, gate, y_g), (p.gamma,), cfg.compile_glue, eps=p.eps)
    del o_fa, y_g, gate
    return F.linear(y, p.Wo, p.bo)
