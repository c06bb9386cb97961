"""A hybrid layer's prefill on the inference path: all GDN heads in one kernel call per time block.

- the chunk forward: FlashQLA (head_dim 128, an even number of heads or one, bf16/fp16, CUDA, when installed and
  ``InferenceConfig.flash_qla``: :func:`flash_qla_applies`),
  else fla's ``chunk_gated_delta_rule`` forward called below its autograd wrapper and stage by stage, each
  intermediate freed when no later stage reads it (the same kernels and output as fla's one call), else
  headscope's PyTorch forms (``gated_delta_rule``);
- the blocks: the GDN branch runs in time blocks (:func:`block_tokens`), so fla's per-chunk intermediates are bounded
  by the block, not the sequence; an eager prefill without autograd runs fixed-shape blocks replayed from CUDA graphs
  of the GDN glue and fla's stages (:func:`gdn_block_graphed`; the last block padded with rows that leave the state
  unchanged), so small blocks cost no host time per call (``InferenceConfig.eager_gdn_graphs``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from ..gdn_kernels import gated_delta_rule
from ..shapes import Float
from .inference_config import InferenceConfig, inference_config
from .graphs import ShapeGraphs, recording as _graph_recording
from .plan import Plan, glue, plan

if TYPE_CHECKING:  # pragma: no cover
    from ..layer import HeadwiseHybridAttention

@functools.cache
def _fla_chunk_fwd():
    """fla's chunk forward below its autograd wrapper (the public call costs ~0.3 ms of Python), or None."""
    try:
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    except ImportError:  # pragma: no cover - another fla version
        return None
    return chunk_gated_delta_rule_fwd


@functools.cache
def _flash_qla_fwd():
    """FlashQLA's chunk forward (``flash_qla.chunk_gated_delta_rule_fwd``) or None where not installed."""
    try:
        from flash_qla import chunk_gated_delta_rule_fwd
    except Exception:  # noqa: BLE001 - not installed, or its TileLang/CUDA stack does not import here
        return None
    return chunk_gated_delta_rule_fwd


def flash_qla_shape(n: int, d: int, dv: int) -> bool:
    """Whether FlashQLA 0.1.3 compiles a GDN call of ``n`` heads, head_dim d, values dv: d = dv = 128, n even or 1 (its
    gate cumsum fails tilelang 0.1.15's LayoutInference at every odd n ≥ 3: benchmarks/flash_qla_layouts.py)."""
    return d == dv == 128 and (n == 1 or n % 2 == 0)


def flash_qla_applies(q: Tensor, v: Tensor, on: bool = True) -> bool:
    """Whether a GDN call (q, v [B,T,n,d]) goes to FlashQLA: ``on``, CUDA, 16-bit, :func:`flash_qla_shape`, installed."""
    return (on and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and flash_qla_shape(q.shape[-2], q.shape[-1], v.shape[-1]) and _flash_qla_fwd() is not None)


@functools.cache
def _fla_chunk_parts():
    """fla's chunk-forward stages (gate cumsum, intra-chunk WY factors, state pass, output) or None."""
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except ImportError:  # pragma: no cover - another fla version
        return None
    return chunk_local_cumsum, chunk_gated_delta_rule_fwd_intra, chunk_gated_delta_rule_fwd_h, chunk_fwd_o, RCP_LN2


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
    d²) is ``cfg.gdn_block_work`` (at least 8192, a multiple of 64): each call's host time (glue + fla's launches) hides
    only behind that much GPU work. For a call
    recorded for a CUDA graph (``graphed``: :func:`headscope.hybrid.inference.graphs.recording`; no host time at replay):
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


def eager_blocks_apply(x: Tensor, p: Plan, T: int, cfg: InferenceConfig) -> bool:
    """Whether this prefill's GDN heads run as graph-replayed fixed-shape blocks (``cfg.eager_gdn_graphs``)."""
    if cfg.eager_gdn_graphs == "never" or T <= 8 or not p.ng or torch.is_grad_enabled():
        return False
    if cfg.eager_gdn_graphs == "cuda" and not (x.is_cuda and p.gdn_kernel == "fla"):
        return False
    return not (_graph_recording() or torch.compiler.is_compiling()
                or (x.is_cuda and torch.cuda.is_current_stream_capturing()))


def gdn_cfg(layer: "HeadwiseHybridAttention", p: Plan, rope: bool) -> tuple:
    """The static configuration of a layer's GDN block: (column sizes of its projection rows, heads, d, QK-norm eps,
    RoPE, scale, kernel, chunk size, compiled glue, FlashQLA)."""
    cfg = inference_config(layer)
    return (tuple(p.g_sizes), p.ng, p.d, p.qk_eps, p.gdn_rope and rope, float(layer.gdn_scale), p.gdn_kernel,
            int(layer.options.chunk_size), cfg.compile_glue, cfg.flash_qla)


def gdn_ops(cfg: tuple, zg, cos, sin, valid, A_neg, dtb, qn, kn) -> list:
    """[q, k, v, g, β] of the GDN heads from their rows ``zg`` [B,t,R] of the input projection (:func:`_glue_gdn`;
    padded rows masked by ``valid``, or None)."""
    sizes, ng, d, eps, rope = cfg[:5]
    qg, kg, vg, a, b = zg.split(sizes, dim=-1)
    return list(glue("gdn", (qg.unflatten(-1, (ng, d)), kg.unflatten(-1, (ng, d)), vg.unflatten(-1, (ng, d)),
                              a[..., :ng], b[..., :ng], cos, sin, valid), (A_neg, dtb, qn, kn), cfg[8], eps=eps,
                              rope=rope))


def _gdn_block(cfg: tuple, zg, cos, sin, h0, valid, A_neg, dtb, qn, kn) -> tuple[Tensor, Tensor]:
    """One fixed-shape GDN block: the glue (:func:`_gdn_ops`) and the chunk forward from ``h0`` [B,n,d,d] fp32, whose
    final state is written back into ``h0`` (returned as the state: the next block of the same graph starts from it
    without a copy)."""
    y, S = gdn_consume(gdn_ops(cfg, zg, cos, sin, valid, A_neg, dtb, qn, kn), cfg[5], h0, cfg[6], cfg[7], cfg[9])
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
    cfg = gdn_cfg(layer, p, rope)
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


def graph_blocks(x: Tensor) -> bool:
    """Whether this call is recorded for a CUDA graph by :mod:`headscope.hybrid.inference.graphs` (its warm-up or capture:
    both see the same block sizes, so nothing compiles or autotunes inside the capture). A capture made with
    ``torch.cuda.graph`` directly keeps the eager rule unless wrapped in ``graphs.for_graph()``."""
    return x.is_cuda and _graph_recording()
