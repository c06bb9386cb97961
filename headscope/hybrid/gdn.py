"""Gated delta rule (GDN, HydraHead eq. 7–8) in the form the saved modeling code runs. Per head, state S_t [d_k, d_v]::

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,     y_t = scale · S_tᵀ q_t        (eq. 7–8)

with α_t = exp(g_t), β_t ∈ (0, 1), in fla's layout ``[batch, time, head, dim]``. The other forms (the brute-force
recurrence, fla's kernels, their dispatch) are headscope's: ``headscope/hybrid/gdn_kernels.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .shapes import GdnGate, GdnOut, GdnQK, GdnState, GdnV

GROUP_TOKENS = 1024  # gdn_chunked_torch: tokens whose chunk matrices are built at once (bounds memory)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor]) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [batch, time, head, d_k]; got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [batch, time, head, d_v] matching q's first 3 dims; got {tuple(v.shape)}")
    if g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"g and beta must be [batch, time, head] = {tuple(q.shape[:3])}; got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    if initial_state is not None:
        want = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [batch, head, d_k, d_v] = {want}; got {tuple(initial_state.shape)}")


def gdn_chunked_torch(q: GdnQK, k: GdnQK, v: GdnV, g: GdnGate, beta: GdnGate, scale: float | None = None,
                      initial_state: Optional[GdnState] = None, chunk_size: int = 64) -> GdnOut:
    """Exact chunked gated delta rule in PyTorch (fp32): what a saved hybrid runs with torch alone.

    Inside a chunk of C tokens with cumulative log decay G_t = Σ_{j≤t} g_j and Γ_t = exp(G_t), write
    S_t = α_t S_{t−1} + k_t δ_tᵀ with δ_t = β_t (v_t − α_t S_{t−1}ᵀ k_t). Unrolling gives the triangular system
    (I + A) Δ = diag(β) V − diag(β Γ) K S_0 with A_{ti} = β_t e^{G_t − G_i} k_tᵀ k_i (i < t), solved exactly; then
    y = scale·(diag(Γ) Q S_0 + (M ⊙ Q Kᵀ) Δ) with M_{ti} = e^{G_t − G_i} (i ≤ t), and S_C = Γ_C S_0 +
    Kᵀ diag(e^{G_C − G}) Δ: eq. 7–8 reorganized, equal to the token recurrence (``gdn_kernels.gdn_naive``) up to
    fp32 round-off. A length that is not a multiple of ``chunk_size`` is padded with β = 0, g = 0 tokens (the state
    unchanged); chunks go in groups of ``GROUP_TOKENS`` tokens (the [C, C] matrices held at once).

    Args:
        q, k: queries and keys (normalized beforehand if the model does); v: values; g: log decay (α_t = exp(g_t));
            beta: write strength; scale: read-out factor (default d_k^-½); initial_state: S_0 (zeros when None).
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
    scale = dk**-0.5 if scale is None else scale
    f = torch.float32
    S = torch.zeros(B, H, dk, dv, dtype=f, device=q.device) if initial_state is None else initial_state.to(f).clone()
    if T == 0:
        return v.new_zeros(B, 0, H, dv), S
    C = min(chunk_size, T)
    n = -(-T // C)
    per_group = max(1, GROUP_TOKENS // C)  # chunks whose [C, C] matrices are in memory at once
    y_out = v.new_empty(B, T, H, dv, dtype=v.dtype)

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
        y, S = _chunk_group(*(prep(x, t0, t1, nc) for x in (q, k, v, g, beta)), S, scale)
        y_out[:, t0:t1] = y[:, :, : t1 - t0].transpose(1, 2)  # B,t,H,dv
    return y_out, S


def _chunk_group(qc: Tensor, kc: Tensor, vc: Tensor, gc: Tensor, bc: Tensor, S: Tensor,
                 scale: float) -> tuple[Tensor, Tensor]:
    """nc chunks of C tokens ([B,H,nc,C,...] fp32) from the state S [B,H,dk,dv] -> (y [B,H,nc·C,dv], S after them)."""
    nc, C = qc.shape[2], qc.shape[3]
    idx = torch.arange(C, device=qc.device)
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
    Kt = ((G[..., -1:] - G).exp()[..., None] * kc).transpose(-1, -2)  # e^{G_C - G_i} k_i: B,H,nc,dk,C
    ys = []
    for c in range(nc):
        delta = U[:, :, c] - W[:, :, c] @ S  # B,H,C,dv
        ys.append(scale * (Qg[:, :, c] @ S + QK[:, :, c] @ delta))
        S = Gam[:, :, c, -1, None, None] * S + Kt[:, :, c] @ delta
    return torch.cat(ys, dim=2), S
