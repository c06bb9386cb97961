"""The rest of the pipeline on non-Llama families (GPT-2: learned positions, LayerNorm, Conv1D; GPT-NeoX:
parallel blocks, partial rotary; Gemma 3: sandwich norms, sliding + full layers, two RoPE bases):
senders, the screen, the selectors and anatomy run, and their numbers check against brute force."""

from __future__ import annotations

import pytest
import torch

from conftest import fast_first
from families import tiny_family
from headscope.analysis import anatomy as an
from headscope.patching import receiver_patching
from headscope.patching.screen import screen_auto, screen_then_verify
from headscope.patching.senders import sender_patching
from headscope.selectors import select
from headscope.tasks import niah_single

FAMS = ["gpt2", "gpt_neox", "gemma3"]


@pytest.fixture(scope="module")
def pairs(small_tokenizer):
    return niah_single(small_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.6], seed=3)


@pytest.mark.parametrize("family", fast_first(FAMS))
def test_screen_auto_top_equals_exact(family, small_tokenizer, pairs):
    lm = tiny_family(family, small_tokenizer)
    exact = receiver_patching(lm, pairs, min_gap=0.0, progress=False)
    mean_ex = exact.ie[exact.used].mean(0).flatten()
    # fp32 probes: the matmul_dtype engine path with exact arithmetic, so the stopping rule's premise holds
    scr = screen_auto(lm, pairs, top_k=3, min_gap=0.0, progress=False, probe_dtype=torch.float32)
    mean_sc = scr.ie[scr.exact.used].mean(0).flatten()
    assert set(mean_ex.topk(3).indices.tolist()) == set(mean_sc.topk(3).indices.tolist())
    # the default bf16 screen runs too; every head it verified carries its exact IE
    scr16 = screen_then_verify(lm, pairs, verify="auto", top_k=3, min_gap=0.0, progress=False)
    g = lm.geometry
    for layer, head in scr16.verified:
        assert torch.allclose(scr16.ie[:, layer, head], exact.ie[:, layer, head], atol=1e-5)


@pytest.mark.parametrize("family", fast_first(FAMS))
def test_sender_patching_runs_and_no_path_is_zero(family, small_tokenizer, pairs):
    lm = tiny_family(family, small_tokenizer)
    g = lm.geometry
    top = g.n_layers - 1
    res = sender_patching(lm, pairs[:1], receivers=[(top, 0)], min_gap=0.0, progress=False)
    ie = res.ie[0]
    # heads at or above the receiver's layer have no path to it: exactly 0
    assert torch.all(ie[top:] == 0)
    assert float(ie[:top].abs().max()) > 0  # and below it, something moves


@pytest.mark.parametrize("family", fast_first(FAMS))
def test_dla_adds_up_and_cosine_runs(family, small_tokenizer, pairs):
    lm = tiny_family(family, small_tokenizer)
    d = an.direct_logit_attribution(lm, pairs, lam=0.9)
    parts = d.heads.sum((1, 2)) + d.other.sum(1)
    assert torch.allclose(parts, d.total, atol=1e-4)
    if family != "gemma3":  # Gemma 3's final soft-cap: DLA is of the logits before the cap
        assert torch.allclose(d.total.double(), d.m.double(), atol=1e-3)
    c = an.layer_cosine(lm, pairs)
    assert c.shape == (lm.geometry.n_layers, lm.geometry.n_layers)


@pytest.mark.parametrize("family", fast_first(FAMS))
@pytest.mark.parametrize("method", ["retrieval_score", "duo_gates", "flashmorph_gates", "rope_dependence"])
def test_selectors_run(family, method, small_tokenizer):
    lm = tiny_family(family, small_tokenizer)
    kw = dict(n_prompts=1, seq_lens=64)
    if method in ("duo_gates", "flashmorph_gates"):
        kw["steps"] = 2
    if method == "rope_dependence":
        kw["n_bands"] = 2  # GPT-NeoX's partial rotary leaves 2 rotary frequencies per head here
    if method == "rope_dependence" and family == "gpt2":
        with pytest.raises(ValueError, match="needs RoPE"):
            select(lm, method, **kw)
        return
    r = select(lm, method, **kw)
    assert len(r.scores) == lm.geometry.n_total
    assert r.scores["score"].notna().all()
