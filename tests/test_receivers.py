import json
import math
import subprocess
import sys

import pytest
import torch

from headscope.patching import (
    ConfigMismatch,
    GapError,
    Store,
    receiver_ie,
    receiver_patching,
    reference_patched_metric,
)
from headscope.patching.receivers import finish
from headscope.tasks import Pair, niah_single

from conftest import fast_first


@pytest.fixture(scope="module")
def pairs(smol_tokenizer):
    return niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=0)


@pytest.mark.parametrize("direction", fast_first(["noising", "denoising"]))
def test_matches_one_hook_at_a_time(tiny, pairs, direction):
    res = receiver_patching(tiny, pairs, direction=direction, min_gap=0.0, progress=False)
    for i, p in enumerate(pairs):
        ref, m_c, m_x = reference_patched_metric(tiny, p, direction=direction)
        assert torch.allclose(res.patched[i], ref, atol=1e-5, rtol=0)
        assert res.m_clean[i].item() == pytest.approx(m_c, abs=1e-5)
        assert res.m_corrupt[i].item() == pytest.approx(m_x, abs=1e-5)
        gap = m_c - m_x
        ref_ie = (m_c - ref) / gap if direction == "noising" else (ref - m_x) / gap
        assert torch.allclose(res.ie[i].double(), ref_ie, atol=1e-4)


def test_qwen3_qk_norm_matches_reference(tiny_qwen3, pairs):
    res = receiver_patching(tiny_qwen3, pairs[:1], min_gap=0.0, progress=False)
    ref, _, _ = reference_patched_metric(tiny_qwen3, pairs[0])
    assert torch.allclose(res.patched[0], ref, atol=1e-5, rtol=0)


def test_batching_does_not_change_numbers(tiny, pairs):
    a = receiver_patching(tiny, pairs, min_gap=0.0, batch_size=1, progress=False).patched
    b = receiver_patching(tiny, pairs, min_gap=0.0, batch_size=3, progress=False).patched
    assert torch.allclose(a, b, atol=1e-6)


def test_self_patch_is_zero(tiny, pairs):
    p = pairs[0]
    same = Pair(p.clean, p.clean, p.answer, p.counter_answer, p.evidence)
    res = receiver_patching(tiny, [same], min_gap=0.0, progress=False)
    # clean patched with itself: every patched metric equals m(x) exactly
    assert torch.allclose(res.patched[0], res.m_clean[0].expand_as(res.patched[0]), atol=1e-6)


def test_gap_check():
    patched = torch.zeros(2, 1, 2, dtype=torch.float64)
    with pytest.raises(GapError, match="below min_gap"):
        finish(patched, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 - 1e-9]), "noising", 0.9, 0.1)
    with pytest.warns(UserWarning, match="skipped 1 pair"):
        res = finish(patched, torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]), "noising", 0.9, 0.1)
    assert res.skipped.keys() == {0} and math.isnan(res.ie[0, 0, 0]) and res.used == [1]
    assert torch.allclose(res.ie[1], torch.full((1, 2), 1.5))  # (3 - 0) / (3 - 1)


def test_pairs_beyond_context_rejected(tiny, smol_tokenizer):
    long = niah_single(smol_tokenizer, n_pairs=1, seq_len=1100)
    with pytest.raises(ValueError, match="context is 1024"):
        receiver_ie(tiny, long)
    with pytest.raises(ValueError, match="at least one|no calibration pairs"):
        receiver_ie(tiny, [])


def test_hooks_removed_after_exception(tiny, pairs):
    b = tiny.bridge

    def boom(z, hook):
        raise RuntimeError("inside a hook")

    with pytest.raises(RuntimeError, match="inside a hook"):
        b.run_with_hooks(pairs[0].clean[None], fwd_hooks=[("blocks.0.attn.hook_z", boom)])
    assert all(len(hp._forward_hooks) == 0 for hp in b.hook_dict.values())
    # and the fast engine, which attaches no hooks at all, still agrees with the reference after it
    res = receiver_patching(tiny, pairs[:1], min_gap=0.0, progress=False)
    ref, _, _ = reference_patched_metric(tiny, pairs[0])
    assert torch.allclose(res.patched[0], ref, atol=1e-5)


def test_store_resume_and_config_guard(tiny, pairs, tmp_path):
    full = receiver_patching(tiny, pairs, min_gap=0.0, progress=False, store_dir=str(tmp_path))
    stored = sorted(p.name for p in (tmp_path / "receivers").glob("pair*"))
    assert stored == [f"pair0000{i}_{k}.json" for i in (0, 1) for k in ("L000", "L001", "base")]
    # poison one stored item: a resumed run must read it back instead of recomputing
    store = Store(tmp_path, json.loads((tmp_path / "receivers" / "config.json").read_text()), name="receivers")
    item = store.get("pair00001_L001")
    assert item == {h: float(full.patched[1, 1, h]) for h in range(tiny.geometry.n_heads)}  # exact round trip
    store.put("pair00001_L001", {h: v + 100.0 for h, v in item.items()})
    again = receiver_patching(tiny, pairs, min_gap=0.0, progress=False, store_dir=str(tmp_path))
    assert torch.allclose(again.patched[0], full.patched[0])
    assert torch.allclose(again.patched[1, 1], full.patched[1, 1] + 100.0)
    assert torch.allclose(again.patched[1, 0], full.patched[1, 0])
    with pytest.raises(ConfigMismatch, match="differs in: lam"):
        receiver_patching(tiny, pairs, lam=0.5, min_gap=0.0, progress=False, store_dir=str(tmp_path))


def test_head_subset(tiny, pairs):
    full = receiver_patching(tiny, pairs, min_gap=0.0, progress=False).patched
    sub = receiver_patching(tiny, pairs, min_gap=0.0, progress=False, heads=[(1, 2), (0, 3)]).patched
    assert torch.allclose(sub[:, 1, 2], full[:, 1, 2]) and torch.allclose(sub[:, 0, 3], full[:, 0, 3])
    assert torch.isnan(sub[:, 0, 0]).all()
    with pytest.raises(ValueError, match="outside the model"):
        receiver_patching(tiny, pairs, heads=[(2, 0)])
