"""Gated delta rule (GDN, HydraHead eq. 7–8): kernels and references.

The recurrence, per head, with state S_t of shape [d_k, d_v]::

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,     y_t = scale · S_tᵀ q_t        (eq. 7–8)

with α_t = exp(g_t) (g_t ≤ 0 is the log decay) and β_t ∈ (0, 1). Three implementations share one
layout (fla's, ``[batch, time, head, dim]``):

- :func:`gdn_naive` — token-by-token recurrence; the brute-force reference for tests.
- :func:`gdn_chunked_torch` — exact chunked (WY) form in PyTorch, fp32; the CPU path.
- :func:`gdn_recurrent_torch` — the recurrence in PyTorch fp32 (matmuls and elementwise ops only, so
  it can be captured in a CUDA graph); the torch decode step (time = 1).
- :func:`gdn_fla` — flash-linear-attention's ``chunk_gated_delta_rule`` (prefill) and
  ``fused_recurrent_gated_delta_rule`` (decoding); CUDA only, needs the optional extra ``gdn``.

:func:`gated_delta_rule` dispatches between them.

:func:`gdn_naive` is the one reference of the recurrence (as fla keeps ``naive.py`` beside its
kernels): every other form — the chunked and recurrent PyTorch paths here, fla's kernels and the
decode-step kernels of the fast paths with their PyTorch twins — is tested against it, and no other
module writes the recurrence out as a reference of its own.
"""

from __future__ import annotations

import importlib.util
from typing import Literal, Optional

import torch
from torch import Tensor

from .shapes import Float

Kernel = Literal["auto", "torch", "fla"]


GROUP_TOKENS = 1024  # gdn_chunked_torch: tokens whose chunk matrices are built at once (bounds memory)
_found: dict[str, bool] = {}


def module_found(name: str) -> bool:
    """True when the top-level package ``name`` can be found (searched once per process and name)."""
    if name not in _found:
        try:
            _found[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            _found[name] = False
    return _found[name]


def fla_available() -> bool:
    """True when flash-linear-attention (``fla-core``) can be imported (searched once per process)."""
    return module_found("fla")


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor]) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [batch, time, head, d_k]; got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [batch, time, head, d_v] matching q's first 3 dims; got {tuple(v.shape)}")
    if g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(
            f"g and beta must be [batch, time, head] = {tuple(q.shape[:3])}; got {tuple(g.shape)}, {tuple(beta.shape)}"
        )
    if initial_state is not None:
        want = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [batch, head, d_k, d_v] = {want}; got {tuple(initial_state.shape)}")


def gdn_naive(
    q: Float[Tensor, "batch time head dk"],
    k: Float[Tensor, "batch time head dk"],
    v: Float[Tensor, "batch time head dv"],
    g: Float[Tensor, "batch time head"],
    beta: Float[Tensor, "batch time head"],
    scale: float | None = None,
    initial_state: Optional[Float[Tensor, "batch head dk dv"]] = None,
) -> tuple[Float[Tensor, "batch time head dv"], Float[Tensor, "batch head dk dv"]]:
    """Token-by-token gated delta rule (eq. 7–8), computed in fp64 as a brute-force reference.

    Args:
        q, k: queries and keys (normalize them beforehand if the model does; no normalization here).
        v: values.
        g: log decay, α_t = exp(g_t).
        beta: write strength β_t.
        scale: factor on the read-out; default ``d_k ** -0.5``.
        initial_state: S_0, zeros when None.

    Returns:
        (y, S_T) in the dtype of ``v``.

    Raises:
        ValueError: inconsistent shapes.
    """
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


def gdn_chunked_torch(
    q: Float[Tensor, "batch time head dk"],
    k: Float[Tensor, "batch time head dk"],
    v: Float[Tensor, "batch time head dv"],
    g: Float[Tensor, "batch time head"],
    beta: Float[Tensor, "batch time head"],
    scale: float | None = None,
    initial_state: Optional[Float[Tensor, "batch head dk dv"]] = None,
    chunk_size: int = 64,
) -> tuple[Float[Tensor, "batch time head dv"], Float[Tensor, "batch head dk dv"]]:
    """Exact chunked gated delta rule in PyTorch (fp32), the CPU path.

    Inside a chunk of C tokens with cumulative log decay G_t = Σ_{j≤t} g_j and Γ_t = exp(G_t), write
    S_t = α_t S_{t−1} + k_t δ_tᵀ with δ_t = β_t (v_t − α_t S_{t−1}ᵀ k_t). Unrolling gives the
    triangular system (I + A) Δ = diag(β) V − diag(β Γ) K S_0 with A_{ti} = β_t e^{G_t − G_i} k_tᵀ k_i
    (i < t), solved exactly; then y = scale·(diag(Γ) Q S_0 + (M ⊙ Q Kᵀ) Δ) with M_{ti} = e^{G_t − G_i}
    (i ≤ t), and S_C = Γ_C S_0 + Kᵀ diag(e^{G_C − G}) Δ. This is eq. 7–8 reorganized, not an
    approximation: it equals :func:`gdn_naive` up to fp32 round-off. A length that is not a multiple
    of ``chunk_size`` is padded with β = 0, g = 0 tokens, which leave the state unchanged. Chunks are
    processed in groups of ``GROUP_TOKENS`` tokens: the [C, C] matrices held at once cover at most that many.

    Args:
        q, k, v, g, beta, scale, initial_state: as in :func:`gdn_naive`.
        chunk_size: tokens per chunk (any positive int; 64 as in fla).

    Returns:
        (y, S_T): y in the dtype of ``v``; S_T in fp32.

    Raises:
        ValueError: inconsistent shapes or ``chunk_size < 1``.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    scale = dk**-0.5 if scale is None else scale
    f = torch.float32
    dev = q.device
    S = torch.zeros(B, H, dk, dv, dtype=f, device=dev) if initial_state is None else initial_state.to(f).clone()
    if T == 0:
        return v.new_zeros(B, 0, H, dv), S
    C = min(chunk_size, T)
    n = -(-T // C)
    idx = torch.arange(C, device=dev)
    per_group = max(1, GROUP_TOKENS // C)  # chunks whose [C, C] matrices are in memory at once
    y_out = v.new_empty(B, T, H, dv, dtype=out_dtype)

    def prep(x: Tensor, t0: int, t1: int, nc: int) -> Tensor:  # [B,T,H,...] -> [B,H,nc,C,...] fp32, zero-padded
        x = x[:, t0:t1].to(f)
        pad = nc * C - (t1 - t0)
        if pad:
            x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
        x = x.transpose(1, 2)  # B,H,T',...
        return x.reshape(B, H, nc, C, *x.shape[3:])

    for c0 in range(0, n, per_group):
        nc = min(per_group, n - c0)
        t0, t1 = c0 * C, min(T, (c0 + nc) * C)
        qc, kc, vc, gc, bc = (prep(x, t0, t1, nc) for x in (q, k, v, g, beta))
        G = gc.cumsum(-1)  # B,H,nc,C
        # the [B,H,nc,C,C] matrices are built in place (less memory; equal to the out-of-place form to 1 ulp)
        decay = (G[..., :, None] - G[..., None, :]).masked_fill_(idx[:, None] < idx[None, :], float("-inf")).exp_()
        L = decay.masked_fill(idx[:, None] == idx[None, :], 0.0)  # strictly lower part (exp(-inf) = 0 above)
        L.mul_(bc[..., :, None]).mul_(kc @ kc.transpose(-1, -2))  # A_ti = β_t e^{G_t - G_i} k_tᵀ k_i, i < t
        L.diagonal(dim1=-2, dim2=-1).add_(1.0)  # I + A
        # U = (I+A)^{-1} diag(β) V ; W = (I+A)^{-1} diag(β Γ) K -- independent of the state: a group at once
        U = torch.linalg.solve_triangular(L, bc[..., None] * vc, upper=False, unitriangular=True)
        Gam = G.exp()
        W = torch.linalg.solve_triangular(L, (bc * Gam)[..., None] * kc, upper=False, unitriangular=True)
        QK = (qc @ kc.transpose(-1, -2)).mul_(decay)  # B,H,nc,C,C  (M ⊙ Q Kᵀ)
        del decay, L
        Qg = Gam[..., None] * qc
        tail = (G[..., -1:] - G).exp()  # e^{G_C - G_i}
        Kt = (tail[..., None] * kc).transpose(-1, -2)  # B,H,nc,dk,C
        ys = []
        for c in range(nc):
            delta = U[:, :, c] - W[:, :, c] @ S  # B,H,C,dv
            ys.append(scale * (Qg[:, :, c] @ S + QK[:, :, c] @ delta))
            S = Gam[:, :, c, -1, None, None] * S + Kt[:, :, c] @ delta
        y_out[:, t0:t1] = torch.cat(ys, dim=2)[:, :, : t1 - t0].transpose(1, 2)  # B,t,H,dv
        del qc, kc, vc, gc, bc, U, W, QK, Qg, Kt, ys
    return y_out, S


def gdn_recurrent_torch(
    q: Float[Tensor, "batch time head dk"],
    k: Float[Tensor, "batch time head dk"],
    v: Float[Tensor, "batch time head dv"],
    g: Float[Tensor, "batch time head"],
    beta: Float[Tensor, "batch time head"],
    scale: float | None = None,
    initial_state: Optional[Float[Tensor, "batch head dk dv"]] = None,
) -> tuple[Float[Tensor, "batch time head dv"], Float[Tensor, "batch head dk dv"]]:
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
        raise ImportError(
            "gdn_kernel='fla' needs flash-linear-attention: pip install 'headscope[gdn]' "
            "(fla-core and triton), or use gdn_kernel='torch'"
        ) from e
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def gdn_fla(
    q: Float[Tensor, "batch time head dk"],
    k: Float[Tensor, "batch time head dk"],
    v: Float[Tensor, "batch time head dv"],
    g: Float[Tensor, "batch time head"],
    beta: Float[Tensor, "batch time head"],
    scale: float | None = None,
    initial_state: Optional[Float[Tensor, "batch head dk dv"]] = None,
    recurrent: bool | None = None,
) -> tuple[Float[Tensor, "batch time head dv"], Float[Tensor, "batch head dk dv"]]:
    """flash-linear-attention kernels: ``chunk_gated_delta_rule``, or ``fused_recurrent_gated_delta_rule``
    for decoding (``recurrent=None`` picks it when time ≤ 8).

    The state is kept in fp32. Raises ValueError on a non-CUDA tensor and ImportError when fla is
    missing (the message names ``pip install 'headscope[gdn]'`` and the ``gdn_kernel='torch'`` fix).
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    if q.device.type != "cuda":
        raise ValueError(
            f"gdn_kernel='fla' runs on CUDA only but the tensors are on {q.device}; "
            "use gdn_kernel='torch' (or 'auto') on this device"
        )
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


def gated_delta_rule(
    q: Float[Tensor, "batch time head dk"],
    k: Float[Tensor, "batch time head dk"],
    v: Float[Tensor, "batch time head dv"],
    g: Float[Tensor, "batch time head"],
    beta: Float[Tensor, "batch time head"],
    scale: float | None = None,
    initial_state: Optional[Float[Tensor, "batch head dk dv"]] = None,
    kernel: Kernel = "auto",
    chunk_size: int = 64,
) -> tuple[Float[Tensor, "batch time head dv"], Float[Tensor, "batch head dk dv"]]:
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
