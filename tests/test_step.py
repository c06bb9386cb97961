"""The one-launch decode step of a hybrid layer (headscope.hybrid.inference.kernels.one_launch): FA prep + split-K partials + GDN step.

The kernels run through Triton's interpreter here (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA),
compiled on a GPU; skipped without triton. The references are the PyTorch functions of the three separate
kernels (fa_decode_prep_torch → decode_attention_torch, gdn_decode_step_torch), and the separate Triton kernels.
"""

from __future__ import annotations

import pytest
import torch

from headscope.hybrid.inference.kernels import one_launch as step
from headscope.hybrid.inference.kernels.fa_prep import fa_decode_prep, fa_decode_prep_torch
from headscope.hybrid.inference.kernels.gdn_step import gdn_decode_step, gdn_decode_step_torch
from headscope.hybrid.inference.kernels.splitk import decode_attention, decode_attention_torch

from conftest import fast_first, rope_and_qk_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not step.applies(64, torch.device(DEV)),
                                  reason="needs triton and CUDA or TRITON_INTERPRET=1")


def _fa_inputs(B, nf, nk, d, L, dtype, g, rope, qkn):
    cols = (nf + 2 * nk) * d + 3  # one fused projection row: strided views, as the lean layer passes them
    z = torch.randn(B, cols, generator=g).to(dtype)
    q = z[:, : nf * d].unflatten(-1, (nf, d))
    k = z[:, nf * d:(nf + nk) * d].unflatten(-1, (nk, d))
    v = z[:, (nf + nk) * d:(nf + 2 * nk) * d].unflatten(-1, (nk, d))
    kc, vc = torch.randn(B, nk, L, d, generator=g).to(dtype), torch.randn(B, nk, L, d, generator=g).to(dtype)
    return (q, k, v, kc, vc), rope_and_qk_norm(B, d, dtype, g, rope, qkn)


def _gdn_inputs(B, N, d, dtype, g, kw):
    z = torch.randn(B, 3 * N * d + 2 * N + 5, generator=g).to(dtype)
    q, k, v = (z[:, i * N * d:(i + 1) * N * d].unflatten(-1, (N, d)) for i in range(3))
    a, b = z[:, 3 * N * d:3 * N * d + N], z[:, 3 * N * d + N:3 * N * d + 2 * N]
    return dict(q=q, k=k, v=v, a=a, b=b, S=torch.randn(B, N, d, d, generator=g) * 0.3,
                A_neg=-torch.rand(N, generator=g) * 2, dt_bias=torch.randn(N, generator=g), scale=d ** -0.5, **kw)


def _to(x):
    """A copy on the device (S is updated in place: each path gets its own)."""
    return {k: (t.to(DEV, copy=True) if isinstance(t, torch.Tensor) else t) for k, t in x.items()}


CASES = [  # Hq, Hk, kv_index, length kind, rope, qkn, nope, n_gdn, fused output (gate + γ), n_splits
    (3, 1, False, "B", True, True, False, 2, True, 2),
    (4, 2, False, "one", True, False, False, 0, False, None),
    (3, 2, True, "B", False, True, True, 3, False, 3),
    (2, 2, False, "none", False, False, False, 1, True, 1),
    (6, 2, False, "one", True, True, False, 4, True, 5),
]


@needs_kernel
@pytest.mark.parametrize("Hq,Hk,kvi,lkind,rope,qkn,nope,ng,fused,ns", fast_first(CASES))
def test_one_launch_equals_the_three_kernels_and_their_references(Hq, Hk, kvi, lkind, rope, qkn, nope, ng, fused, ns):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    B, d, L, dt = 3, 32, 300, torch.float32
    (q, k, v, kc, vc), kw = _fa_inputs(B, Hq, Hk, d, L, dt, g, rope, qkn)
    lengths = {"B": torch.tensor([290, 100, 1]), "one": torch.tensor([231]), "none": None}[lkind]
    kv_index = torch.tensor([0, 1, 1][:Hq]) if kvi else None
    pos = None
    if nope:
        kw, pos = {k_: w for k_, w in kw.items() if k_ not in ("cos", "sin")}, torch.tensor([7, 300, 12])
    fa_kw = dict(kw, positions=pos, nope_a=500.0 if nope else None)
    gate = torch.randn(B, Hq, d, generator=g) if fused else None
    gamma = 1 + 0.2 * torch.randn(Hq, d, generator=g) if fused else None
    gdn = _gdn_inputs(B, ng, d, dt, g, {"gamma": 1 + 0.2 * torch.randn(ng, d, generator=g)} if fused else {}) if ng else None

    # the reference: PyTorch prep at slot length - 1, then split-K attention over [0, length); the GDN step
    slot = lengths - 1 if lengths is not None else L - 1
    kc_r, vc_r = kc.clone(), vc.clone()
    qp = fa_decode_prep_torch(q, k, v, kc_r, vc_r, slot if isinstance(slot, int) else slot.clone(), **fa_kw)
    o_r = decode_attention_torch(qp, kc_r, vc_r, lengths, d ** -0.5, kv_index=kv_index)
    if fused:
        o_r = o_r.float() * torch.sigmoid(gate)
        o_r = o_r / torch.sqrt(o_r.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma

    # the three Triton kernels (same device and dtype)
    D = {k_: t.to(DEV) if isinstance(t, torch.Tensor) else t for k_, t in fa_kw.items()}
    kc3, vc3 = kc.to(DEV, copy=True), vc.to(DEV, copy=True)
    ln = lengths.to(DEV) if lengths is not None else None
    kvd = kv_index.to(DEV) if kv_index is not None else None
    qp3 = fa_decode_prep(q.to(DEV), k.to(DEV), v.to(DEV), kc3, vc3, ln - 1 if ln is not None else L - 1, **D)
    o3 = decode_attention(qp3, kc3, vc3, ln, d ** -0.5, kv_index=kvd, n_splits=ns,
                          gate=gate.to(DEV) if fused else None, gamma=gamma.to(DEV) if fused else None)
    g3 = _to(gdn) if gdn else None
    y3 = gdn_decode_step(**g3) if gdn else None
    S3 = g3["S"] if gdn else None

    # one launch
    kc1, vc1 = kc.to(DEV, copy=True), vc.to(DEV, copy=True)
    g1 = _to(gdn) if gdn else None
    o1, y1 = step.hybrid_decode_step(q.to(DEV), k.to(DEV), v.to(DEV), kc1, vc1, ln, d ** -0.5, kv_index=kvd,
                                     gate=gate.to(DEV) if fused else None, gamma=gamma.to(DEV) if fused else None,
                                     gdn=g1, n_splits=ns, **D)
    assert (o1.cpu().float() - o_r.float()).abs().max() < 2e-4
    assert (o1 - o3).abs().max() < 2e-5
    # the combination inside the launch (the default for rows of ≤ 2 heads) = the separate combination kernel, bit
    # for bit (one body)
    assert [step.combine_mode(g) for g in (1, 2, 3)] == ["launch", "launch", "kernel"]
    ok1, _ = step.hybrid_decode_step(q.to(DEV), k.to(DEV), v.to(DEV), kc.to(DEV, copy=True), vc.to(DEV, copy=True),
                                     ln, d ** -0.5, kv_index=kvd, gate=gate.to(DEV) if fused else None,
                                     gamma=gamma.to(DEV) if fused else None, gdn=_to(gdn) if gdn else None,
                                     n_splits=ns, combine="launch", **D)
    ok, _ = step.hybrid_decode_step(q.to(DEV), k.to(DEV), v.to(DEV), kc.to(DEV, copy=True), vc.to(DEV, copy=True), ln,
                                    d ** -0.5, kv_index=kvd, gate=gate.to(DEV) if fused else None,
                                    gamma=gamma.to(DEV) if fused else None, gdn=_to(gdn) if gdn else None, n_splits=ns,
                                    combine="kernel", **D)
    assert torch.equal(ok, o1) and torch.equal(ok1, o1)
    # "defer": combined in the launch for rows of ≤ 2 heads (the same bits), else the namespace for the caller
    od, _ = step.hybrid_decode_step(q.to(DEV), k.to(DEV), v.to(DEV), kc.to(DEV, copy=True), vc.to(DEV, copy=True), ln,
                                    d ** -0.5, kv_index=kvd, gate=gate.to(DEV) if fused else None,
                                    gamma=gamma.to(DEV) if fused else None, gdn=_to(gdn) if gdn else None, n_splits=ns,
                                    combine="defer", **D)
    if (1 if kvi else Hq // Hk) <= 2:
        assert torch.equal(od, o1)
    else:
        assert not isinstance(od, torch.Tensor) and od.NS == (ns or od.NS) and od.o.shape == o1.shape
    assert torch.allclose(kc1.cpu(), kc_r, atol=1e-5, rtol=0) and torch.equal(vc1.cpu(), vc_r)
    assert (kc1 - kc3).abs().max() < 1e-6 and torch.equal(vc1, vc3)  # the key's glue summed in another order
    other = torch.ones(B, 1, L, 1, dtype=torch.bool)  # no other slot touched
    other[torch.arange(B), :, (slot if isinstance(slot, int) else slot.expand(B))] = False
    assert torch.equal(kc1.cpu() * other, kc * other) and torch.equal(vc1.cpu() * other, vc * other)
    if gdn:  # the same Triton body (the same bits in the interpreter; compiled, other warps sum in another order)
        assert (y1 - y3).abs().max() < 1e-5 and (g1["S"] - S3).abs().max() < 1e-5
        if not fused:
            S_r = gdn["S"].clone()
            y_r = gdn_decode_step_torch(**dict(gdn, S=S_r))
            assert (y1.cpu() - y_r).abs().max() < 1e-5 and (g1["S"].cpu() - S_r).abs().max() < 1e-5
    else:
        assert y1 is None


def test_the_split_count_leaves_room_for_the_gdn_programs():
    from headscope.hybrid.inference.kernels.splitk import n_splits_for
    assert n_splits_for(16, 32768, sms=132, blocks_per_sm=4) == 33
    assert n_splits_for(16, 32768, sms=132, blocks_per_sm=4, reserved=96) == 27  # (528 - 96) / 16
    assert n_splits_for(1, 32768, sms=132, blocks_per_sm=4, reserved=6) == 128  # capped at 32768 / 256 slots


@needs_kernel
def test_bad_input_names_the_fix():
    g = torch.Generator().manual_seed(0)
    (q, k, v, kc, vc), _ = _fa_inputs(2, 3, 1, 32, 20, torch.float32, g, False, False)
    q, k, v, kc, vc = (t.to(DEV) for t in (q, k, v, kc, vc))
    gdn = _to(_gdn_inputs(2, 2, 16, torch.float32, g, {}))
    with pytest.raises(ValueError, match="head_dim 16 differs"):
        step.hybrid_decode_step(q, k, v, kc, vc, None, 0.1, gdn=gdn)
    gdn = _to(_gdn_inputs(2, 2, 32, torch.float32, g, {}))
    with pytest.raises(ValueError, match="except \\['block_v'\\]"):
        step.hybrid_decode_step(q, k, v, kc, vc, None, 0.1, gdn=dict(gdn, block_v=16))
    with pytest.raises(ValueError, match="positions"):
        step.hybrid_decode_step(q, k, v, kc, vc, None, 0.1, nope_a=100.0)
    with pytest.raises(ValueError, match="kv_group"):
        step.hybrid_decode_step(q, k[:, :0], v[:, :0], kc, vc, None, 0.1)
    with pytest.raises(ValueError, match="'launch', 'kernel' or 'defer'"):
        step.hybrid_decode_step(q, k, v, kc, vc, None, 0.1, combine="tail")


@pytest.mark.skipif(DEV != "cuda", reason="bf16 needs the compiled kernels (CUDA)")
@pytest.mark.parametrize("B,Hq,Hk,ng,L,length", [(16, 3, 1, 6, 32768, 30001), (1, 9, 3, 0, 8192, 8192), (2, 3, 1, 6, 4096, 77)])
def test_one_launch_at_decode_sizes_in_bf16(B, Hq, Hk, ng, L, length):
    """SmolLM2-sized heads (d = 64) in bf16 on the GPU, default split counts (GDN programs reserved): the one-launch
    step equals the three kernels (to bf16 rounding) and the references."""
    g = torch.Generator().manual_seed(0)
    d, dt = 64, torch.bfloat16
    (q, k, v, kc, vc), kw = _fa_inputs(B, Hq, Hk, d, L, dt, g, True, False)
    gdn = _gdn_inputs(B, ng, d, dt, g, {"gamma": 1 + 0.2 * torch.randn(ng, d, generator=g)}) if ng else None
    gate, gamma = torch.randn(B, Hq, d, generator=g).to(DEV, dt), (1 + 0.2 * torch.randn(Hq, d, generator=g)).to(DEV)
    ln = torch.tensor([length], device=DEV)
    fa_kw = {k_: t.to(DEV) for k_, t in kw.items()}
    q, k, v = q.to(DEV), k.to(DEV), v.to(DEV)
    kc3, vc3, kc1, vc1 = kc.to(DEV), vc.to(DEV), kc.to(DEV), vc.to(DEV)
    qp = fa_decode_prep(q, k, v, kc3, vc3, ln - 1, **fa_kw)
    o3 = decode_attention(qp, kc3, vc3, ln, d ** -0.5, gate=gate, gamma=gamma)
    g3, g1 = (_to(gdn), _to(gdn)) if gdn else (None, None)
    y3 = gdn_decode_step(**g3) if gdn else None
    o1, y1 = step.hybrid_decode_step(q, k, v, kc1, vc1, ln, d ** -0.5, gate=gate, gamma=gamma, gdn=g1, **fa_kw)
    # the combination in the launch, its per-row counters carried over launches: again (the same K/V write) and with
    # the separate combination kernel, the same FA output
    for mode in ("launch", "kernel", "launch"):
        o2, _ = step.hybrid_decode_step(q, k, v, kc1, vc1, ln, d ** -0.5, gate=gate, gamma=gamma, gdn=_to(gdn) if gdn
                                        else None, combine=mode, **fa_kw)
        if mode == "launch":
            assert torch.equal(o2, o1)
        else:
            assert (o2.float() - o1.float()).abs().max() <= 2 ** -7 * o1.float().abs().max()
    ref = decode_attention_torch(qp, kc3, vc3, ln, d ** -0.5).float() * torch.sigmoid(gate.float())
    ref = ref / torch.sqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
    # other split counts (GDN programs reserved): the P·V product takes p in bf16 (as flash attention does), so the
    # outputs differ by ~2^-9 of the head's scale, not of each element; the per-head RMSNorm scales the head to ~1
    assert ((o1.float() - o3.float()).abs() <= o3.float().abs() * 2 ** -5 + 1e-2).all()
    assert ((o1.float() - ref).abs() <= ref.abs() * 2 ** -5 + 1e-2).all()
    assert ((kc1.float() - kc3.float()).abs() <= kc3.float().abs() * 2 ** -7 + 1e-6).all()  # ≤ 1 ulp
    assert torch.equal(vc1, vc3)
    if gdn:  # the GDN output to 2 ulp (bf16; other warps sum in another order), its fp32 state to rounding
        assert ((y1.float() - y3.float()).abs() <= y3.float().abs() * 2 ** -6 + 1e-3).all()
        assert (g1["S"] - g3["S"]).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="the compiled kernels (CUDA): the shared memory of a 256-wide head")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_launch_at_gemma3_head_dim_256(dtype):
    """Gemma 3 270M's decode shapes (head_dim 256, one KV head, QK-norm, RoPE; B 2, an 8K cache, 3 GDN heads): the
    one-launch step loads on an H100 / H200 — fp32 asked 282,688 B of shared memory with 64-slot tiles, above the
    232,448 B limit (splitk.tile_slots now: 32) — and equals the separate kernels and the PyTorch references."""
    g = torch.Generator().manual_seed(3)
    B, Hq, d, L, ng = 2, 1, 256, 8192, 3
    (q, k, v, kc, vc), kw = _fa_inputs(B, Hq, 1, d, L, dtype, g, True, True)
    gdn = _gdn_inputs(B, ng, d, dtype, g, {k_: kw[k_] for k_ in ("cos", "sin", "q_norm", "k_norm", "qk_eps")})
    ln = torch.tensor([5001, 8192], device=DEV)
    fa_kw = {k_: (t.to(DEV) if isinstance(t, torch.Tensor) else t) for k_, t in kw.items()}
    q, k, v = q.to(DEV), k.to(DEV), v.to(DEV)
    kc3, vc3, kc1, vc1 = kc.to(DEV), vc.to(DEV), kc.to(DEV), vc.to(DEV)
    qp = fa_decode_prep(q, k, v, kc3, vc3, ln - 1, **fa_kw)
    o3 = decode_attention(qp, kc3, vc3, ln, d ** -0.5)
    g3, g1, gr = _to(gdn), _to(gdn), _to(gdn)
    y3 = gdn_decode_step(**g3)
    o1, y1 = step.hybrid_decode_step(q, k, v, kc1, vc1, ln, d ** -0.5, gdn=g1, **fa_kw)
    ref = decode_attention_torch(qp, kc3, vc3, ln, d ** -0.5).float()
    y_ref = gdn_decode_step_torch(**gr).float()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert (o1.float() - o3.float()).abs().max() <= tol * o3.float().abs().max()
    assert (o1.float() - ref).abs().max() <= tol * ref.abs().max()
    assert (y1.float() - y3.float()).abs().max() <= tol * y3.float().abs().max()
    assert (y1.float() - y_ref).abs().max() <= 2 * tol * y_ref.abs().max()
    assert torch.equal(vc1, vc3) and (kc1.float() - kc3.float()).abs().max() <= tol * kc3.float().abs().max()
