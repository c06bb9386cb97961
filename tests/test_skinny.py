"""The decode-sized linear kernel (headscope.hybrid.skinny) and programmatic dependent launch (splitk.PDL).

On this machine the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py); on a GPU
the same tests run it compiled, and on a Hopper GPU the last one chains it with PDL inside a CUDA graph.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from headscope.hybrid import skinny, splitk

needs_kernel = pytest.mark.skipif(
    not splitk.triton_available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(M, K, N, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + 5, generator=g)[:, 2:K + 2].to(dtype)  # rows with a stride of K + 5
    W = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, W, b


@needs_kernel
@pytest.mark.parametrize("M,K,N,dtype,bias", [
    (1, 100, 40, torch.float32, True),     # one row; K and N not multiples of the tiles
    (16, 576, 70, torch.float32, False),   # 16 rows (the limit), K over three 256-chunks
    (5, 300, 17, torch.float16, True),     # fp16: one rounding of the fp32 sum
])
def test_rows_kernel_equals_f_linear(M, K, N, dtype, bias):
    x, W, b = _case(M, K, N, dtype, bias)
    ref = (x.double() @ W.double().T + (b.double() if bias else 0)).float()  # float64 reference
    got = skinny.linear_rows(x.to(DEV), W.to(DEV), None if b is None else b.to(DEV)).cpu()
    assert got.shape == (M, N) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16: half an ulp at |y| ~ 2-4
    assert (got.float() - ref).abs().max() < tol
    if dtype == torch.float32:
        assert (got - F.linear(x, W, b)).abs().max() < 1e-5


@needs_kernel
def test_rows_kernel_keeps_leading_dimensions_and_the_custom_op_matches():
    """[batch, 1, K] in -> [batch, 1, N] out; the custom op headscope::linear_rows gives the same numbers."""
    x, W, b = _case(6, 64, 24, torch.float32, True)
    x3 = x.reshape(6, 1, 64).to(DEV)
    got = skinny.linear_rows(x3, W.to(DEV), b.to(DEV))
    assert got.shape == (6, 1, 24)
    op = torch.ops.headscope.linear_rows(x3, W.to(DEV), b.to(DEV))
    assert torch.equal(got, op) and (got.cpu()[:, 0] - F.linear(x, W, b)).abs().max() < 1e-5


@needs_kernel
def test_rows_kernel_into_a_given_buffer_with_other_tiles():
    """out= (a strided [rows, N] view of a wider buffer) and tiles=(32, 64, 4): the same numbers, other columns kept."""
    x, W, b = _case(3, 200, 40, torch.float32, True)
    buf = torch.full((3, 50), 7.0).to(DEV)
    got = skinny.linear_rows(x.to(DEV), W.to(DEV), b.to(DEV), out=buf[:, 5:45], tiles=(32, 64, 4))
    assert got.data_ptr() == buf[:, 5:45].data_ptr()
    assert (buf[:, 5:45].cpu() - F.linear(x, W, b)).abs().max() < 1e-5 and (buf[:, :5] == 7).all()
    with pytest.raises(ValueError, match="tiles"):
        skinny.linear_rows(x.to(DEV), W.to(DEV), tiles=(24, 64, 4))
    with pytest.raises(ValueError, match="out must be"):
        skinny.linear_rows(x.to(DEV), W.to(DEV), out=buf[:, :39])


@needs_kernel
def test_rows_kernel_refuses_what_it_cannot_take():
    x, W, b = _case(17, 64, 8, torch.float32, True)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny.linear_rows(x.to(DEV), W.to(DEV))
    with pytest.raises(ValueError, match=r"want W \[N, 64\]"):
        skinny.linear_rows(x[:4].to(DEV), W[:, :32].to(DEV))
    with pytest.raises(ValueError, match="one dtype"):
        skinny.linear_rows(x[:4].to(DEV), W.half().to(DEV))
    with pytest.raises(ValueError, match="one dtype"):  # a bias of another dtype (F.linear refuses it too)
        skinny.linear_rows(x[:4].to(DEV), W.to(DEV), b.double().to(DEV))
    with pytest.raises(ValueError, match="b unit stride"):  # a strided bias: the kernel reads it contiguously
        skinny.linear_rows(x[:4].to(DEV), W.to(DEV), torch.randn(16).to(DEV)[::2])


def test_linear_dispatch_off_the_gpu_is_f_linear(monkeypatch):
    """skinny.linear: F.linear itself on CPU tensors (and by default: ENABLE off); the custom op where ``applies``."""
    assert skinny.ENABLE is False and splitk.PDL is False
    x, W, b = _case(4, 64, 8, torch.float32, True)
    assert not skinny.applies(x, W)  # CPU
    assert torch.equal(skinny.linear(x, W, b), F.linear(x, W, b))
    calls = []
    monkeypatch.setattr(torch.ops.headscope, "linear_rows", lambda *a: calls.append(1) or F.linear(*a), raising=False)
    monkeypatch.setattr(skinny, "applies", lambda x, W, b=None: True)
    skinny.linear(x, W, b)
    assert calls == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_applies_on_a_gpu_and_not_above_the_row_limit(monkeypatch):
    x, W, _ = _case(16, 64, 8, torch.bfloat16, False)
    x, W = x.cuda(), W.cuda()
    monkeypatch.setattr(skinny, "ENABLE", True)  # opt-in
    assert skinny.applies(x, W) and not skinny.applies(torch.cat([x, x[:1]]), W)
    assert not skinny.applies(x, W.T.contiguous().T)  # a weight without unit stride in K
    assert not skinny.applies(x, W, torch.zeros(16, device="cuda", dtype=torch.bfloat16)[::2])  # strided bias
    assert not skinny.applies(x, W.clone().requires_grad_())  # a gradient to record: the kernel has no backward
    with torch.no_grad():
        assert skinny.applies(x, W.clone().requires_grad_())
    monkeypatch.setattr(skinny, "ENABLE", False)
    assert not skinny.applies(x, W)


def test_pdl_only_on_cuda_hopper_outside_the_interpreter(monkeypatch):
    """pdl_applies: never on CPU or with PDL off; per-kernel opt-out through PDL_SKIP; unknown names refused."""
    monkeypatch.setattr(splitk, "PDL", True)
    assert not splitk.pdl_applies(torch.zeros(1)) and not splitk.pdl_applies(torch.zeros(1), "partial")
    assert splitk.launch_kw(False) == {} and splitk.launch_kw(True) == {"launch_pdl": True}
    with pytest.raises(ValueError, match="want one of"):
        splitk.pdl_applies(torch.zeros(1), "parital")
    monkeypatch.setattr(splitk, "PDL_SKIP", "partial+bogus")
    with pytest.raises(ValueError, match="'bogus'"):
        splitk.pdl_applies(torch.zeros(1), "rows")
    if torch.cuda.is_available():
        t = torch.zeros(1, device="cuda")
        monkeypatch.setattr(splitk, "PDL_SKIP", "partial+combine")
        hopper = torch.cuda.get_device_capability()[0] >= 9 and splitk.gdc_ops()[0] is not None
        assert not splitk.pdl_applies(t, "partial") and not splitk.pdl_applies(t, "combine")
        assert splitk.pdl_applies(t, "rows") == hopper
        monkeypatch.setattr(splitk, "PDL", False)
        assert not splitk.pdl_applies(t, "rows")


def _pdl_gpu() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
            and splitk.triton_available() and splitk.gdc_ops()[0] is not None)


@pytest.mark.skipif(not _pdl_gpu(), reason="PDL needs a Hopper (or newer) GPU and a Triton with gdc_wait")
def test_a_pdl_chain_in_a_cuda_graph_equals_plain_launches(monkeypatch):
    """Eight dependent projections (each reads the previous output) plus split-K attention, captured in a CUDA graph
    with PDL and without: bit-identical results (PDL only overlaps launches; every kernel waits for its input)."""
    from headscope.hybrid.graphs import capture

    g = torch.Generator().manual_seed(1)
    Ws = [(torch.randn(64, 64, generator=g) / 8).to("cuda", torch.bfloat16) for _ in range(8)]
    x0 = torch.randn(16, 64, generator=g).to("cuda", torch.bfloat16)
    q = torch.randn(16, 2, 64, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(16, 1, 4096, 64, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(16, 1, 4096, 64, generator=g).to("cuda", torch.bfloat16)

    def chain():
        h = x0
        for W in Ws:
            h = skinny.linear_rows(h, W)
        o = splitk.decode_attention(q * h[:, None, :1], k, v, None, 0.125)
        return skinny.linear_rows(o.reshape(16, -1)[:, :64], Ws[0])

    outs = {}
    for pdl, skip in ((True, ""), (True, "partial+rows"), (False, "")):
        monkeypatch.setattr(splitk, "PDL", pdl)
        monkeypatch.setattr(splitk, "PDL_SKIP", skip)
        splitk._caps.clear()
        assert splitk.pdl_applies(x0, "partial") == (pdl and "partial" not in skip)  # PDL really used
        graph, out = capture(chain, warmup=2)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs[pdl, skip] = out.clone()
    ref = chain()  # eager, PDL off
    assert all(torch.equal(o, ref) for o in outs.values())
