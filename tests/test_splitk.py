"""Split-K decode attention (headscope.hybrid.inference.kernels.splitk) against a brute-force softmax per head.

The Triton kernels run here through Triton's interpreter (``TRITON_INTERPRET=1``, CPU) when triton is
installed (the ``gdn`` extra); on a GPU the CUDA test runs them compiled. The interpreter's bf16 ``tl.dot``
is wrong in Triton 3.9 (it returns garbage for bf16 operands), so CPU cases use fp32 and fp16.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from headscope.hybrid.inference.kernels import splitk
from headscope.hybrid.inference.kernels.splitk import decode_attention, decode_attention_torch, n_splits_for

from conftest import fast_first

needs_triton = pytest.mark.skipif(
    not splitk.triton_available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton (pip install 'headscope[gdn]') and CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it)")


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels: compiled, or interpreted


def brute(q, k, v, length, scale, kv_index=None):
    """One head at a time, one valid slot at a time (python loops over heads, fp64)."""
    B, Hq, d = q.shape
    Hk = k.shape[1]
    kv = [h // (Hq // Hk) for h in range(Hq)] if kv_index is None else kv_index.tolist()
    out = torch.zeros(B, Hq, d, dtype=torch.float64)
    for b in range(B):
        n = k.shape[2] if length is None else int(length[b if length.numel() > 1 else 0])
        for h in range(Hq):
            kh = k[b, kv[h], :n].double()
            w = torch.softmax(kh @ q[b, h].double() * scale, 0)
            out[b, h] = w @ v[b, kv[h], :n].double()
    return out


def _case(B, Hq, Hk, L, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, d, generator=g).to(dtype)
    kb = torch.randn(B, L + 3, Hk, d, generator=g).to(dtype)  # a seq-major buffer: k, v are strided views
    vb = torch.randn(B, L + 3, Hk, d, generator=g).to(dtype)
    return q, kb.transpose(1, 2)[:, :, :L], vb.transpose(1, 2)[:, :, :L]


@pytest.mark.parametrize("length", [None, [1], [150, 3]])
def test_torch_reference_equals_brute_force(length):
    q, k, v = _case(2, 6, 2, 150, 16, torch.float32)
    ln = None if length is None else torch.tensor(length)
    got = decode_attention_torch(q, k, v, ln, 0.3)
    assert (got.double() - brute(q, k, v, ln, 0.3)).abs().max() < 1e-5


@pytest.mark.parametrize("triton_kernel", [False, pytest.param(True, marks=needs_triton)])
def test_uneven_kv_groups_by_kv_index(triton_kernel):
    """Query heads spread unevenly over the KV heads (3 FA heads over 2 kept groups: 2 + 1)."""
    q, k, v = _case(2, 3, 2, 90, 16, torch.float32)
    kvi = torch.tensor([0, 0, 1])
    ln = torch.tensor([90, 33])
    fn = decode_attention if triton_kernel else decode_attention_torch
    dev = KERNEL_DEVICE if triton_kernel else "cpu"
    got = fn(q.to(dev), k.to(dev), v.to(dev), ln.to(dev), 0.25, kv_index=kvi.to(dev))
    assert (got.cpu().double() - brute(q, k, v, ln, 0.25, kvi)).abs().max() < 1e-5


def test_bad_shapes_name_the_problem():
    q, k, v = _case(2, 6, 2, 40, 16, torch.float32)
    with pytest.raises(ValueError, match="kv_index"):
        decode_attention_torch(q[:, :5], k, v, None, 1.0)
    with pytest.raises(ValueError, match="kv_index"):
        decode_attention_torch(q, k, v, None, 1.0, kv_index=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="length"):
        decode_attention_torch(q, k, v, torch.tensor([[3]]), 1.0)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q[..., :12].contiguous(), k[..., :12], v[..., :12], None, 1.0)


@needs_triton
def test_kernel_off_cuda_names_the_fix(monkeypatch):
    q, k, v = _case(1, 2, 1, 64, 16, torch.float32)
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusals")
    with pytest.raises(ValueError, match="bf16"):
        decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 1.0)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        decode_attention(q, k, v, None, 1.0)


def test_split_rule():
    assert n_splits_for(1, 32768) == 128  # 4 x 132 = 528 wanted, 32768 / 256 = 128 at most
    assert n_splits_for(1, 1 << 17) == 256  # MAX_SPLITS
    assert n_splits_for(16, 1 << 15) == 33  # ceil(528 / 16)
    assert n_splits_for(300, 1 << 15) == 2  # ceil(528 / 300)
    assert n_splits_for(600, 1 << 15) == 1
    assert n_splits_for(1, 100) == 1
    # the launch knobs: 8 blocks per SM want 1056 splits of one pair, 32768 / 128 = 256 allowed (= MAX_SPLITS)
    assert n_splits_for(1, 32768, min_split=128, blocks_per_sm=8) == 256
    assert n_splits_for(16, 32768, blocks_per_sm=4) == 33  # ceil(4 * 132 / 16)
    assert n_splits_for(16, 32768, sms=78, blocks_per_sm=1) == 5  # ceil(78 / 16): another GPU's SM count
    assert n_splits_for(1, 32768, block=512, min_split=128) == 64  # a split holds at least one tile


@needs_triton
@pytest.mark.parametrize("block,num_warps,num_stages", [(16, 2, 2), (32, 8, 4), (128, 4, 3)])
def test_launch_settings_keep_the_result(block, num_warps, num_stages):
    """Tile size, warps and pipelining stages change the schedule, not the function (fp32: exact products)."""
    q, k, v = _case(2, 4, 2, 333, 32, torch.float32, seed=5)
    ln = torch.tensor([333, 129])
    dev = KERNEL_DEVICE
    got = decode_attention(q.to(dev), k.to(dev), v.to(dev), ln.to(dev), 0.2, n_splits=3, block=block,
                           num_warps=num_warps, num_stages=num_stages)
    assert (got.cpu().double() - brute(q, k, v, ln, 0.2)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="block"):
        decode_attention(q.to(dev), k.to(dev), v.to(dev), ln.to(dev), 0.2, block=48)


@needs_triton
@pytest.mark.slow
def test_bench_splitk_smoke_sweep_is_exact_for_every_setting():
    """benchmarks/bench_splitk.py's sweep on CPU (interpreter, fp32): every setting of the smoke grid matches
    the PyTorch reference, and the split counts are the rule's (hand-computed)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_splitk.py"
    spec = importlib.util.spec_from_file_location("bench_splitk", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.sweep(bench.SMOKE_SHAPES, bench.SMOKE_GRID, torch.float32, torch.device(KERNEL_DEVICE), 1, 4.8, 1e-5)
    for name, row in res["shapes"].items():
        assert row["bad_settings"] == [] and row["default_err"] < 1e-5, name
        assert all(r["ok"] and r["err"] < 1e-5 for r in row["runs"]), name
    # tiny_b2: batch 2 x 2 groups = 4 pairs, 300 slots; settings in grid order (block, ..., blocks_per_sm, min_split)
    splits = [r["n_splits"] for r in res["shapes"]["tiny_b2"]["runs"]]
    # block 16: bps 1 -> want 33: min 16 -> 300 // 16 = 18; min 64 -> 4; bps 8 -> want 264: 18, 4; block 32 the same
    # except min 16 -> 300 // 32 = 9
    assert splits == [18, 4, 18, 4, 9, 4, 9, 4]
    assert "best_overall" in res and res["best_overall"]["speedup_vs_default"] > 0


@needs_triton
@pytest.mark.parametrize("B,Hq,Hk,L,d,dtype,length,ns", fast_first([
    (1, 2, 1, 300, 64, torch.float32, None, 3),          # SmolLM2-like: one KV group, 2 query heads
    (1, 2, 1, 300, 64, torch.float32, [5], 3),           # later splits empty
    (3, 9, 3, 200, 64, torch.float16, [200, 1, 77], 4),  # per-sequence lengths, group of 3
    (2, 4, 2, 130, 128, torch.float32, [123], 2),        # head_dim 128, one shared length
    (2, 16, 1, 70, 32, torch.float32, None, None),       # group of 16 query heads, default splits
]))
def test_triton_split_k_equals_brute_force(B, Hq, Hk, L, d, dtype, length, ns):
    q, k, v = _case(B, Hq, Hk, L, d, dtype)
    ln = None if length is None else torch.tensor(length)
    scale = 1 / math.sqrt(d)
    dev = KERNEL_DEVICE
    got = decode_attention(q.to(dev), k.to(dev), v.to(dev), None if ln is None else ln.to(dev), scale, n_splits=ns)
    assert got.dtype == dtype and got.shape == (B, Hq, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (got.cpu().double() - brute(q, k, v, ln, scale)).abs().max() < tol


@pytest.mark.skipif(not (torch.cuda.is_available() and splitk.triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_split_k_equals_reference(dtype):
    q, k, v = (t.cuda() for t in _case(2, 16, 8, 40000, 128, dtype))
    ln = torch.tensor([40000, 17], device="cuda")
    got = decode_attention(q, k, v, ln, 128 ** -0.5)
    ref = decode_attention_torch(q, k, v, ln, 128 ** -0.5)
    assert (got.float() - ref.float()).abs().max() < 1e-2


def test_launch_defaults():
    assert splitk.launch_defaults() == {"block": 64, "num_warps": 4, "num_stages": 3, "blocks_per_sm": 4,
                                        "min_split": 256}
    assert n_splits_for(16, 32768) == 33  # ceil(4 * 132 / 16)
    assert n_splits_for(16, 32768, blocks_per_sm=2) == 17  # ceil(2 * 132 / 16)


def _glue_out_ref(o, gate, gamma, eps):
    """plan_mod._glue_out's arithmetic on the FA heads: o rounded to its dtype, × σ(gate), then γ_h · o / RMS(o)."""
    of = o.float()
    if gate is not None:
        of = of * torch.sigmoid(gate.float())
    if gamma is not None:
        of = gamma * of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return of.to(o.dtype)


@needs_triton
@pytest.mark.parametrize("Hq,Hk,kvi,ns,dtype,gate,norm,d", fast_first([
    (2, 1, None, 3, torch.float32, True, True, 32),        # a group of 2 FA heads, gate and norm
    (3, 2, [0, 0, 1], 5, torch.float32, False, True, 32),  # uneven groups (kv_index), norm only
    (6, 3, None, 19, torch.float16, True, False, 32),      # gate only
    (2, 1, None, 100, torch.float32, True, True, 128),     # 100 splits (most empty) > one chunk of 64 at d = 128
]))
def test_combination_folds_the_output_fusion(Hq, Hk, kvi, ns, dtype, gate, norm, d):
    """gate= / gamma=: the split-K combination applies the hybrid's FA output step (σ(gate), then eq. 13–14's
    per-head RMSNorm and γ_h) and writes into a strided slice of a layer-wide buffer; = attention then the glue."""
    B, L = 2, 300
    q, k, v = _case(B, Hq, Hk, L, d, dtype)
    g = torch.Generator().manual_seed(5)
    gt = torch.randn(B, Hq + 4, d, generator=g).to(dtype)[:, 1:Hq + 1] if gate else None  # a strided view
    gm = 1 + 0.5 * torch.randn(Hq, d, generator=g) if norm else None
    ln = torch.tensor([L, 41])
    kv_index = None if kvi is None else torch.tensor(kvi)
    ref = _glue_out_ref(decode_attention_torch(q, k, v, ln, 0.2, kv_index=kv_index), gt, gm, 1e-6)
    dev = KERNEL_DEVICE
    buf = torch.full((B, Hq + 2, d), 3.0, dtype=dtype, device=dev)  # the FA heads first, then 2 GDN heads' columns
    got = decode_attention(q.to(dev), k.to(dev), v.to(dev), ln.to(dev), 0.2, n_splits=ns,
                           kv_index=None if kv_index is None else kv_index.to(dev), out=buf[:, :Hq],
                           gate=None if gt is None else gt.to(dev), gamma=None if gm is None else gm.to(dev), eps=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert got.data_ptr() == buf.data_ptr() and (buf[:, :Hq].cpu().float() - ref.float()).abs().max() < tol
    assert (buf[:, Hq:] == 3.0).all()
    with pytest.raises(ValueError, match="gamma must have shape"):
        decode_attention(q.to(dev), k.to(dev), v.to(dev), ln.to(dev), 0.2, kv_index=None if kv_index is None
                         else kv_index.to(dev), gamma=torch.ones(Hq + 1, d, device=dev))
