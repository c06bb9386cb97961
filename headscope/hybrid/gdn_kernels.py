"""The gated delta rule's kernels and references beside the saved form (:mod:`.gdn`), and their dispatch:
:func:`gdn_naive` (fp64 token recurrence: the one brute-force reference every other form is tested against),
:func:`gdn_recurrent_torch` (fp32, capturable; the torch decode step), :func:`gdn_fla` (flash-linear-attention,
CUDA, extra ``gdn``), :func:`gated_delta_rule` (``HybridOptions.gdn_kernel``: the reference forward's GDN call
once headscope attached its backends) and :func:`gdn_op` (it as one operator, for the compiled training step).
"""

from __future__ import annotations

import importlib.util
from typing import Literal, Optional

import torch
from torch import Tensor

from .gdn import _check_shapes, gdn_chunked_torch
from .shapes import GdnGate, GdnOut, GdnQK, GdnState, GdnV

Kernel = Literal["auto", "torch", "fla"]
_found: dict[str, bool] = {}


def module_found(name: str) -> bool:
    """True when the top-level package ``name`` can be found (searched once per process and name)."""
    if _found.get(name) is None:  # None: not searched yet (tests reset an entry so)
        try:
            _found[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            _found[name] = False
    return _found[name]


def fla_available() -> bool:
    """True when flash-linear-attention (``fla-core``) can be imported (searched once per process)."""
    return module_found("fla")


def gdn_naive(q: GdnQK, k: GdnQK, v: GdnV, g: GdnGate, beta: GdnGate, scale: float | None = None,
              initial_state: Optional[GdnState] = None) -> GdnOut:
    """Token-by-token gated delta rule (eq. 7–8) in fp64, the brute-force reference: q, k (normalized beforehand if
    the model does), v, g (log decay, α_t = exp(g_t)), beta, scale (default d_k^-½), initial_state (S_0, zeros when
    None) -> (y, S_T) in v's dtype. Raises ValueError: inconsistent shapes."""
    _check_shapes(q, k, v, g, beta, initial_state)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    f = torch.float64
    S = torch.zeros(B, H, dk, dv, dtype=f, device=q.device) if initial_state is None else initial_state.to(f)
    ys = []
    eye = torch.eye(dk, dtype=f, device=q.device)
    for t in range(T):
        qt, kt, vt = q[:, t].to(f), k[:, t].to(f), v[:, t].to(f)  # [B,H,d]
        a = g[:, t].to(f).exp()[..., None, None]
        b = beta[:, t].to(f)[..., None, None]
        kkT = kt[..., :, None] * kt[..., None, :]
        S = a * ((eye - b * kkT) @ S) + b * kt[..., :, None] * vt[..., None, :]
        ys.append(scale * torch.einsum("bhkv,bhk->bhv", S, qt))
    y = torch.stack(ys, dim=1) if ys else v.new_zeros(B, 0, H, dv, dtype=f)
    return y.to(v.dtype), S.to(v.dtype)


def gdn_recurrent_torch(q: GdnQK, k: GdnQK, v: GdnV, g: GdnGate, beta: GdnGate, scale: float | None = None,
                        initial_state: Optional[GdnState] = None) -> GdnOut:
    """Token-by-token gated delta rule (eq. 7–8) in fp32, for decoding a few tokens.

    Per token: S ← α S + k δᵀ with δ = β (v − α Sᵀ k) (= eq. 7: α (I − β k kᵀ) S + β k vᵀ), and
    y = scale · Sᵀ q — the same update as :func:`gdn_chunked_torch`, one token at a time.

    Args / Returns / Raises: as :func:`gdn_chunked_torch` (y in v's dtype, S_T in fp32).
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    f = torch.float32
    S = torch.zeros(B, H, dk, dv, dtype=f, device=q.device) if initial_state is None else initial_state.to(f)
    ys = []
    for t in range(T):
        qt, kt, vt = q[:, t].to(f), k[:, t].to(f), v[:, t].to(f)  # B,H,d
        a = g[:, t].to(f).exp()[..., None]  # B,H,1
        b = beta[:, t].to(f)[..., None]
        aS = a[..., None] * S  # B,H,dk,dv
        delta = b * (vt - (kt[..., None, :] @ aS)[..., 0, :])  # B,H,dv
        S = aS + kt[..., :, None] * delta[..., None, :]
        ys.append(scale * (qt[..., None, :] @ S)[..., 0, :])
    y = torch.stack(ys, dim=1) if ys else v.new_zeros(B, 0, H, dv, dtype=f)
    return y.to(v.dtype), S


def _import_fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("gdn_kernel='fla' needs flash-linear-attention: pip install 'headscope[gdn]' "
                          "(fla-core and triton), or use gdn_kernel='torch'") from e
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def gdn_fla(q: GdnQK, k: GdnQK, v: GdnV, g: GdnGate, beta: GdnGate, scale: float | None = None,
            initial_state: Optional[GdnState] = None, recurrent: bool | None = None) -> GdnOut:
    """flash-linear-attention kernels: ``chunk_gated_delta_rule``, or ``fused_recurrent_gated_delta_rule``
    for decoding (``recurrent=None`` picks it when time ≤ 8).

    The state is kept in fp32. Raises ValueError on a non-CUDA tensor and ImportError when fla is
    missing (the message names ``pip install 'headscope[gdn]'`` and the ``gdn_kernel='torch'`` fix).
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    if q.device.type != "cuda":
        raise ValueError(f"gdn_kernel='fla' runs on CUDA only but the tensors are on {q.device}; "
                         "use gdn_kernel='torch' (or 'auto') on this device")
    chunk_fn, rec_fn = _import_fla()
    if recurrent is None:
        recurrent = q.shape[1] <= 8
    h0 = None if initial_state is None else initial_state.float()
    fn = rec_fn if recurrent else chunk_fn
    # fla's Triton kernels need q, k, v and beta in one dtype (mixed fp32/bf16 fails to compile, as it
    # does under autocast with fp32 weights); g stays fp32 as in fla's own GatedDeltaNet layer.
    dt = v.dtype
    q, k, beta = q.to(dt), k.to(dt), beta.to(dt)
    y, S = fn(q, k, v, g=g.float(), beta=beta, scale=scale, initial_state=h0, output_final_state=True)
    return y, S


def gated_delta_rule(q: GdnQK, k: GdnQK, v: GdnV, g: GdnGate, beta: GdnGate, scale: float | None = None,
                     initial_state: Optional[GdnState] = None, kernel: Kernel = "auto",
                     chunk_size: int = 64) -> GdnOut:
    """Dispatch the gated delta rule (eq. 7–8).

    ``kernel``: ``"fla"`` (CUDA only, errors elsewhere), ``"torch"`` (:func:`gdn_chunked_torch`; a
    single token, i.e. a decode step, goes to :func:`gdn_recurrent_torch`), or ``"auto"`` (fla on CUDA
    when importable, else torch).

    Raises:
        ValueError: unknown kernel, bad shapes, or ``"fla"`` on a non-CUDA device.
        ImportError: ``"fla"`` without fla installed.
    """
    if kernel not in ("auto", "torch", "fla"):
        raise ValueError(f"gdn kernel must be 'auto', 'torch' or 'fla', got {kernel!r}")
    if kernel == "auto":
        kernel = "fla" if (q.device.type == "cuda" and fla_available()) else "torch"
    if kernel == "fla":
        return gdn_fla(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    if q.dim() == 4 and q.shape[1] == 1:
        return gdn_recurrent_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    return gdn_chunked_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size)


@torch.library.custom_op("headscope::gated_delta_rule", mutates_args=())
def gdn_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, kernel: str, chunk_size: int
           ) -> Tensor:
    """:func:`gated_delta_rule`'s y [B, T, H, dv] (contiguous, v's dtype; zero initial state, autocast off) from q, k
    [B, T, H, dk], v, g, beta [B, T, H] as one operator: torch.compile keeps the GDN call in its graph (fla's kernels
    cannot be traced) instead of breaking the graph there. Its backward (:func:`gdn_op_grads`) recomputes y under
    autograd: the kernel's own gradients for one more forward of it."""
    with torch.autocast(q.device.type, enabled=False):
        return gated_delta_rule(q, k, v, g, beta, scale=scale, kernel=kernel, chunk_size=chunk_size)[0].contiguous()


@torch.library.custom_op("headscope::gated_delta_rule_grads", mutates_args=())
def gdn_op_grads(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, dy: Tensor, scale: float, kernel: str,
                 chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (q, k, v, g, beta; contiguous) of ⟨dy, :func:`gdn_op`⟩: the kernel's forward differentiated."""
    xs = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
    # an operator's kernel runs below autograd (its dispatch keys excluded): autograd records here again
    below = torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False)
    with below, torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
        y = gated_delta_rule(*xs, scale=scale, kernel=kernel, chunk_size=chunk_size)[0]
        return tuple(d.contiguous() for d in torch.autograd.grad(y, xs, dy))


def _gdn_op_save(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.args = inputs[5:]


gdn_op.register_fake(lambda q, k, v, *_: v.new_empty(v.shape))
gdn_op_grads.register_fake(lambda *a: tuple(t.new_empty(t.shape) for t in a[:5]))
gdn_op.register_autograd(lambda ctx, dy: (*gdn_op_grads(*ctx.saved_tensors, dy, *ctx.args), None, None, None),
                         setup_context=_gdn_op_save)
