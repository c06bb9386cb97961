"""The generic path (BridgeEngine) against the brute-force reference (one hook_z patch per full forward
through the TransformerLens bridge): with every shortcut on (cached prefix, rows joining at their layer,
logits at the read rows), in every fallback mode, and with its checks catching a shortcut that fails."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import fast_first
from families import FAMILIES, tiny_family
from headscope.patching import receiver_patching, reference_patched_metric
from headscope.patching.generic import BridgeEngine
from headscope.patching.receivers import PairState, patch_rows
from headscope.tasks import niah_single


@pytest.fixture(scope="module")
def pair(smol_tokenizer):
    # 64 tokens, needle at 0.4: the prefix (~25 tokens) and the suffix are longer than the sliding windows (8)
    return niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.4, seed=3)[0]


def _all_heads(eng, lm, pair, batch_size=5, direction="noising"):
    st = PairState(eng, pair, 0.9, direction)
    g = lm.geometry
    out = torch.full((g.n_layers, g.n_heads), float("nan"), dtype=torch.float64)
    rows = [(lay, h) for lay in range(g.n_layers) for h in range(g.n_heads)]
    for chunk, m in patch_rows(eng, st, rows, 0.9, batch_size):
        for (lay, h), v in zip(chunk, m.tolist()):
            out[lay, h] = v
    return out, st


@pytest.mark.parametrize("family", fast_first(["llama"] + sorted(set(FAMILIES) - {"llama"})))
def test_generic_every_family_equals_reference(family, smol_tokenizer, pair):
    lm = tiny_family(family, smol_tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no shortcut given up on any family
        eng = BridgeEngine(lm)
    assert (eng.mode, eng.prefix, eng.join) == ("plain", True, True), eng.why
    got, st = _all_heads(eng, lm, pair)
    assert st.start > 8  # a real cached prefix
    ref, m_c, m_x = reference_patched_metric(lm, pair)
    assert st.m_clean == pytest.approx(m_c, abs=1e-5) and st.m_corrupt == pytest.approx(m_x, abs=1e-5)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), float((got - ref).abs().max())
    assert float((ref - m_c).abs().max()) > 1e-4  # the patches matter


@pytest.mark.slow
def test_generic_rows_in_any_order_and_every_mode(smol_tokenizer, pair):
    """Entries out of layer order come back in entry order; the bridge mode and each shortcut alone
    give the same numbers as all shortcuts together."""
    lm = tiny_family("gemma3", smol_tokenizer)
    eng = BridgeEngine(lm)
    ref, _, _ = reference_patched_metric(lm, pair, lam=0.9, direction="denoising")
    st = PairState(eng, pair, 0.9, "denoising")
    d = lm.geometry.d_head

    def rows(layer, heads):
        z = st.base.z[layer, st.start:][None].repeat(len(heads), 1, 1)
        for r, h in enumerate(heads):
            z[r, :, h * d:(h + 1) * d] = st.src.z[layer, st.start:, h * d:(h + 1) * d]
        return z

    from headscope.readout import logit_diff

    for mode, prefix, join in [("plain", True, True), ("plain", True, False), ("plain", False, True),
                               ("plain", False, False), ("bridge", False, False)]:
        eng.mode, eng.prefix, eng.join = mode, prefix, join
        logits = eng.patched_logits_multi(st.base, [(2, rows(2, [1, 3])), (0, rows(0, [2])), (1, rows(1, [0]))],
                                          st.start, st.read)
        m = logit_diff(logits, pair.answer, pair.counter_answer, 0.9).double()
        want = torch.stack([ref[2, 1], ref[2, 3], ref[0, 2], ref[1, 0]])
        assert torch.allclose(m, want, atol=1e-5, rtol=0), (mode, prefix, join, m, want)


def test_generic_gives_up_a_shortcut_that_fails(smol_tokenizer, pair):
    """Through the bridge's own wrappers the model ignores the KV cache it is given (TransformerLens 4.3's
    attention reads a keyword transformers 5 no longer passes): the build-time check sees it, gives up the
    cached prefix with a warning, and the numbers stay exact. A join hook on the wrong modules (rows joining
    one layer late) is caught the same way."""
    lm = tiny_family("llama", smol_tokenizer)
    eng = BridgeEngine(lm, check=False)
    eng._swaps = []  # run through the bridge's wrappers
    with pytest.warns(UserWarning, match="prefix"):
        eng.self_check()
    assert eng.mode == "plain" and not eng.prefix
    got, _ = _all_heads(eng, lm, pair)
    ref, _, _ = reference_patched_metric(lm, pair)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)

    eng = BridgeEngine(lm, check=False)
    eng._blocks = eng._blocks[1:] + eng._blocks[:1]
    with pytest.warns(UserWarning, match="join"):
        eng.self_check()
    assert eng.prefix and not eng.join
    got, _ = _all_heads(eng, lm, pair)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_generic_prefix_checked_per_prompt(smol_tokenizer, pair, monkeypatch):
    """The cached prefix is checked on every new prompt (its real length), not only at build time."""
    lm = tiny_family("qwen3", smol_tokenizer)
    eng = BridgeEngine(lm)
    st = PairState(eng, pair, 0.9, "noising")
    real = eng._prefix_cache

    def stale(ids, start):  # a cache one token short: the suffix would sit at the wrong positions
        c = real(ids, start)
        c.crop(-1)
        return c

    monkeypatch.setattr(eng, "_prefix_cache", stale)
    with pytest.warns(UserWarning, match="KV cache of the first"):
        list(patch_rows(eng, st, [(0, 0), (1, 1)], 0.9, 2))
    assert not eng.prefix
    got, _ = _all_heads(eng, lm, pair)
    ref, _, _ = reference_patched_metric(lm, pair)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_generic_respects_user_hooks_on_the_bridge(smol_tokenizer, pair):
    """A hook a user put on a bridge hook point runs (the engine falls back to the bridge's own forward)."""
    lm = tiny_family("gpt2", smol_tokenizer)
    res0 = receiver_patching(lm, [pair], min_gap=0.0, progress=False, path="generic")
    hp = lm.bridge.hook_dict["blocks.0.hook_resid_pre"]
    hp.add_hook(lambda x, hook: x * 1.5)
    try:
        res1 = receiver_patching(lm, [pair], min_gap=0.0, progress=False, path="generic")
        ref, _, _ = reference_patched_metric(lm, pair)
    finally:
        hp.remove_hooks()
    assert torch.allclose(res1.patched[0], ref, atol=1e-5, rtol=0)
    assert float((res1.patched[0] - res0.patched[0]).abs().max()) > 1e-3
