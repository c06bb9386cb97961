"""The fast paths of the patching engine against plain references (multi-layer batches, last-layer
read-only rows, grouped-query attention without K/V copies, RoPE)."""

import math

import pytest
import torch

from headscope.patching import reference_patched_metric
from headscope.arch import rotate
from headscope.patching.engine import Engine, head_slice
from headscope.patching.receivers import PairState, patch_rows, sequences
from headscope.readout import logit_diff
from headscope.tasks import niah_single

from conftest import fast_first


@pytest.fixture(scope="module")
def pair(smol_tokenizer):
    return niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.5, seed=3)[0]


def _rows(st, layer, heads, d_head):
    z = st.base.z[layer, st.start :][None].repeat(len(heads), 1, 1)
    for r, h in enumerate(heads):
        z[r, :, head_slice(h, d_head)] = st.src.z[layer, st.start :, head_slice(h, d_head)]
    return z


def test_multi_layer_batch_matches_bridge(tiny, pair):
    """Rows of layer 0 and of the last layer (read positions only) in one batch equal one-hook-at-a-time
    full forwards through the bridge."""
    e = Engine(tiny)
    st = PairState(e, pair, 1.0, "noising")
    dh = tiny.geometry.d_head
    entries = [(0, _rows(st, 0, [2, 0, 3], dh)), (1, _rows(st, 1, [1, 3], dh))]
    logits = e.patched_logits_multi(st.base, entries, st.start, st.read)
    m = logit_diff(logits, pair.answer, pair.counter_answer, 1.0).double()
    ref, _, _ = reference_patched_metric(tiny, pair, lam=1.0)
    want = torch.stack([ref[0, 2], ref[0, 0], ref[0, 3], ref[1, 1], ref[1, 3]])
    assert torch.allclose(m, want, atol=1e-5, rtol=0)
    # and each row alone gives the same logits
    for k, (layer, z) in enumerate(entries):
        off = sum(len(zz) for _, zz in entries[:k])
        alone = e.patched_logits(st.base, layer, z, st.start, st.read)
        assert torch.allclose(alone, logits[off : off + len(z)], atol=1e-5, rtol=0)


def test_patch_rows_chunking_invariant(tiny_qwen3, pair):
    """Chunks that cut through layers give the same m as one row per forward (QK-norm model)."""
    e = Engine(tiny_qwen3)
    st = PairState(e, pair, 1.0, "denoising")
    rows = [(layer, h) for layer in range(2) for h in range(tiny_qwen3.geometry.n_heads)]
    one = {r: float(v) for c, m in patch_rows(e, st, rows, 1.0, 1) for r, v in zip(c, m)}
    three = {r: float(v) for c, m in patch_rows(e, st, rows, 1.0, 3) for r, v in zip(c, m)}
    assert one.keys() == set(rows) == three.keys()
    for r in rows:
        assert three[r] == pytest.approx(one[r], abs=1e-5)


def test_entries_must_ascend(tiny, pair):
    e = Engine(tiny)
    st = PairState(e, pair, 1.0, "noising")
    z = st.base.z[0, st.start :][None]
    with pytest.raises(ValueError, match="ascending layer order"):
        e.patched_logits_multi(st.base, [(1, z), (0, z)], st.start, st.read)


def test_grouped_attention_matches_explicit_softmax(tiny):
    """attend() with grouped K/V heads (no repeat) equals softmax(q kᵀ·scale + causal mask) v written out,
    for contiguous suffix queries and for scattered query positions."""
    e = Engine(tiny)
    g = tiny.geometry
    torch.manual_seed(0)
    B, T, S = 2, 11, 5
    q = torch.randn(B, g.n_heads, S, g.d_head)
    k = torch.randn(B, g.n_kv_heads, T, g.d_head)
    v = torch.randn(B, g.n_kv_heads, T, g.d_head)
    rep = g.n_heads // g.n_kv_heads
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = e.layers[0].scaling

    def explicit(qpos):
        sc = q @ kk.transpose(-1, -2) * scale
        sc = sc.masked_fill(torch.arange(T)[None, :] > qpos[:, None], -math.inf)
        return (sc.softmax(-1) @ vv).transpose(1, 2).reshape(B, S, -1)

    suffix = torch.arange(T - S, T)
    assert torch.allclose(e.attend(0, q, k, v, suffix), explicit(suffix), atol=1e-6)
    scattered = torch.tensor([0, 3, 4, 8, 10])
    assert torch.allclose(e.attend(0, q, k, v, scattered), explicit(scattered), atol=1e-6)


def test_rope_matches_rotate_half(tiny):
    e = Engine(tiny)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 7, tiny.geometry.d_head)
    cos, sin = e.positions(torch.arange(7), x).cos_sin(e.layers[0])
    half = x.shape[-1] // 2
    want = x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin
    assert torch.allclose(rotate(x, cos, sin), want, atol=1e-6)
    # partial rotary: only the first r features turn
    r = 8
    got = rotate(x, cos[:, :r], sin[:, :r])
    assert torch.equal(got[..., r:], x[..., r:])
    xr, h2 = x[..., :r], r // 2
    assert torch.allclose(got[..., :r], xr * cos[:, :r] + torch.cat((-xr[..., h2:], xr[..., :h2]), -1) * sin[:, :r],
                          atol=1e-6)


def test_low_precision_engine_is_close_not_equal(tiny, pair):
    """matmul_dtype=bfloat16 runs the linear maps in bf16: close to, but not the same as, fp32."""
    e, lo = Engine(tiny), Engine(tiny, matmul_dtype=torch.bfloat16)
    st = PairState(e, pair, 1.0, "noising")
    z = _rows(st, 0, [0, 1, 2, 3], tiny.geometry.d_head)
    a = e.patched_logits(st.base, 0, z, st.start, st.read)
    b = lo.patched_logits(st.base, 0, z, st.start, st.read)
    assert not torch.equal(a, b)
    assert torch.allclose(a, b, atol=0.05 * float(a.abs().max()), rtol=0)


def test_probe_ie_matches_exact_and_brute_force(tiny, pair):
    """probe_ie with the exact engine: one-head groups equal receiver patching; a whole-layer group
    equals a full forward with that layer's hook_z replaced."""
    from headscope.patching import receiver_patching
    from headscope.patching.attribution import probe_ie

    e = Engine(tiny)
    st = PairState(e, pair, 1.0, "noising")
    g = tiny.geometry
    patches = [(0, [1]), (0, list(range(g.n_heads))), (1, [2])]
    got = probe_ie(e, {0: st}, [pair], patches, 1.0, "noising")[0]
    ex = receiver_patching(tiny, [pair], lam=1.0, min_gap=0.0, progress=False).ie[0]
    assert float(got[0]) == pytest.approx(float(ex[0, 1]), abs=1e-4)
    assert float(got[2]) == pytest.approx(float(ex[1, 2]), abs=1e-4)
    clean_seq, _, read = sequences(pair)
    full = e.run(clean_seq, read, z_override=lambda lay, z: st.src.z[0][None] if lay == 0 else z)
    m = float(logit_diff(full.logits, pair.answer, pair.counter_answer, 1.0))
    assert float(got[1]) == pytest.approx((st.m_clean - m) / (st.m_clean - st.m_corrupt), abs=1e-4)


@pytest.mark.slow
def test_screen_auto_verifies_exactly(tiny, smol_tokenizer):
    """verify='auto': verified heads carry the exact IE; when certified, the screen's top-k equals the
    exact top-k; unverified heads are never given an exact number."""
    import numpy as np

    from headscope.patching import receiver_patching
    from headscope.patching.attribution import recall_at_k
    from headscope.patching.screen import screen_then_verify

    pairs = niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=0)
    res = screen_then_verify(tiny, pairs, verify="auto", top_k=3, min_gap=0.0, progress=False)
    exact = receiver_patching(tiny, pairs, min_gap=0.0, progress=False).ie
    for layer, h in res.verified:
        assert torch.allclose(res.ie[:, layer, h], exact[:, layer, h])
    assert len(res.verified) >= 3 and res.details["n_unverified"] == 8 - len(res.verified)
    assert res.details["certified"]
    assert recall_at_k(exact.mean(0).numpy(), res.ie.mean(0).numpy(), 3) == 1.0
    verified = {(a, b) for a, b in res.verified}
    others = [(a, b) for a in range(2) for b in range(4) if (a, b) not in verified]
    assert all(not torch.allclose(res.ie[:, a, b], exact[:, a, b], atol=1e-7) for a, b in others)
    with pytest.raises(ValueError, match="'auto'"):
        screen_then_verify(tiny, pairs, verify="all", progress=False)


def test_probe_blocks_ie_matches_full_patched_run(tiny, smol_tokenizer):
    """A block probe equals a full forward with every head's hook_z of the block's layers set to the
    source run's; a one-layer block equals the whole-layer probe_ie."""
    from headscope.patching.attribution import probe_blocks_ie, probe_ie

    pair = niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.5, seed=0)[0]
    e = Engine(tiny)
    st = PairState(e, pair, 1.0, "noising")
    g = tiny.geometry
    got = probe_blocks_ie(e, {0: st}, [pair], [(0, 2), (1, 2)], 1.0, "noising")[0]
    lay = probe_ie(e, {0: st}, [pair], [(1, list(range(g.n_heads)))], 1.0, "noising")[0]
    assert float(got[1]) == pytest.approx(float(lay[0]), abs=1e-5)
    clean_seq, _, read = sequences(pair)
    full = e.run(clean_seq, read, z_override=lambda lay_, z: st.src.z[lay_][None] if lay_ == 0 else z)
    m = float(logit_diff(full.logits, pair.answer, pair.counter_answer, 1.0))
    got0 = probe_blocks_ie(e, {0: st}, [pair], [(0, 1)], 1.0, "noising")[0, 0]
    assert float(got0) == pytest.approx((st.m_clean - m) / (st.m_clean - st.m_corrupt), abs=1e-4)
    with pytest.raises(ValueError, match="ascending"):
        probe_blocks_ie(e, {0: st}, [pair], [(1, 2), (0, 1)], 1.0, "noising")


@pytest.mark.parametrize("block,verify_cost,atp_slack", fast_first([(1, 3.0, 2.0), (2, 0.25, 2.0), (2, 8.0, 2.0), (2, 3.0, 1.0)]))
def test_screen_auto_blocks_certify_exact_top_k(tiny, smol_tokenizer, block, verify_cost, atp_slack):
    """Block sizes and the refine-vs-verify cost switch change only the work done: when certified, the
    screen's top-k equals the exact top-k and verified heads carry the exact IE. Probes in float32 (exact
    probes, so probe + margin bounds the exact IE; in bfloat16 a probe of this random model is off by up
    to 0.03, more than the 0.01 margin, the limit of the bf16 screen)."""
    from headscope.patching import receiver_patching
    from headscope.patching.attribution import recall_at_k
    from headscope.patching.screen import screen_auto

    pairs = niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=0)
    res = screen_auto(tiny, pairs, top_k=3, min_gap=0.0, progress=False, block=block, verify_cost=verify_cost,
                      flag=0.0, probe_dtype=torch.float32, atp_slack=atp_slack)
    exact = receiver_patching(tiny, pairs, min_gap=0.0, progress=False).ie
    assert res.details["certified"]
    for layer, h in res.verified:
        assert torch.allclose(res.ie[:, layer, h], exact[:, layer, h])
    assert recall_at_k(exact.mean(0).numpy(), res.ie.mean(0).numpy(), 3) == 1.0


@pytest.mark.slow
def test_atp_slack_only_adds_verification(tiny, smol_tokenizer):
    """A larger AtP slack makes positive-AtP heads of unrefined units more competitive: more heads are
    probed alone or verified, and the top-k stays exact."""
    from headscope.patching import receiver_patching
    from headscope.patching.attribution import recall_at_k
    from headscope.patching.screen import screen_auto

    pairs = niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=1)
    kw = dict(top_k=2, min_gap=0.0, progress=False, block=2, probe_dtype=torch.float32)
    one = screen_auto(tiny, pairs, atp_slack=1.0, **kw)
    big = screen_auto(tiny, pairs, atp_slack=50.0, **kw)
    assert len(big.verified) + big.details["n_probed"] > len(one.verified) + one.details["n_probed"]
    exact = receiver_patching(tiny, pairs, min_gap=0.0, progress=False).ie
    assert recall_at_k(exact.mean(0).numpy(), big.ie.mean(0).numpy(), 2) == 1.0
