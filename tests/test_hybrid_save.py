"""A saved hybrid carries its code (the reference model only): it loads in a process without headscope
(trust_remote_code=True), and with headscope's classes and backends through ``headscope.hybrid.load`` (or
``register_auto_classes`` + from_pretrained); missing kernels fall back to PyTorch."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from headscope.hybrid import (HybridOptions, fla_available, flash_attn_available, hybrid_spec, hybridize, load,
                              register_auto_classes)
from headscope.hybrid.inference.inference_config import LayerBackends, ModelBackends, runnable_options
from headscope.masks import HeadMask

L, H, KV, D = 2, 4, 2, 8
MIXED = HeadMask(L, H, KV, ((1,), (2, 3)))  # layer 0: 1 FA head; layer 1: KV group 1 only
FULL_OPTS = dict(gdn_conv=4, fa_pos="nope", fa_gate=True)
CODE_FILES = {"modeling_hybrid.py", "layer.py", "attn.py", "gdn.py", "config.py", "shapes.py"}
TOL = 1e-5


def _hybrid(family: str, **opts):
    torch.manual_seed(0 if family == "llama" else 1)
    kw = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=H,
              num_key_value_heads=KV, head_dim=D, max_position_embeddings=512, pad_token_id=0, eos_token_id=1)
    cfg, cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    hybrid = hybridize(cls(cfg(**kw)).eval(), MIXED, **opts).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-trivial new parameters, so that loading them is tested
        for name, p in hybrid.named_parameters():
            if any(s in name for s in ("a_proj", "b_proj", "g_proj", "gdn_conv", "gamma", "dt_bias", "A_log")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return hybrid


def _ids(B=2, T=13, seed=1):
    return torch.randint(2, 101, (B, T), generator=torch.Generator().manual_seed(seed))


def _run(model, ids):
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    return logits, gen


def test_save_writes_code_and_loads_without_trust_remote_code(tmp_path):
    hybrid = _hybrid("llama", **FULL_OPTS)
    hybrid.save_pretrained(tmp_path)
    assert CODE_FILES <= {p.name for p in tmp_path.iterdir()}
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "headscope_hybrid_llama"
    assert cfg["auto_map"] == {
        "AutoConfig": "modeling_hybrid.HybridLlamaConfig",
        "AutoModelForCausalLM": "modeling_hybrid.HybridLlamaForCausalLM",
    }
    ids = _ids()
    ref = hybrid(ids).logits.detach()
    loaded = load(tmp_path).eval()  # headscope's classes, its backends attached
    assert type(loaded).__module__ == "headscope.hybrid.modeling_hybrid" and isinstance(loaded.backends, ModelBackends)
    assert all(isinstance(l.self_attn.backends, LayerBackends) for l in loaded.model.layers)
    with torch.no_grad():
        assert (loaded(ids).logits - ref).abs().max().item() <= 1e-6
    # registered: transformers' auto classes load the directory with headscope's classes (no backends attached)
    for trust in (None, True):
        kw = {} if trust is None else {"trust_remote_code": True}
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, **kw).eval()
        assert type(loaded).__module__ == "headscope.hybrid.modeling_hybrid" and loaded.backends is None
        mask, opts = hybrid_spec(loaded)
        assert mask == MIXED and opts == HybridOptions(**FULL_OPTS)
        with torch.no_grad():
            assert (loaded(ids).logits - ref).abs().max().item() <= 1e-6


def test_missing_kernels_fall_back_to_torch(tmp_path):
    if fla_available() or flash_attn_available():
        pytest.skip("fla / flash-attn installed: nothing to fall back from")
    hybrid = _hybrid("qwen3")
    opts = hybrid.config.headscope_hybrid["options"]
    opts["gdn_kernel"], opts["fa_kernel"] = "fla", "flash_attn"  # as saved by a GPU run
    hybrid.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="gdn_kernel='fla'.*fa_kernel='flash_attn'.*using gdn_kernel='torch'"):
        loaded = load(tmp_path).eval()
    layer_opts = loaded.model.layers[0].self_attn.options
    assert (layer_opts.gdn_kernel, layer_opts.fa_kernel) == ("torch", "sdpa")
    assert hybrid_spec(loaded)[1].gdn_kernel == "fla"  # the config keeps the saved choice
    ids = _ids()
    with torch.no_grad():
        assert (loaded(ids).logits - hybrid(ids).logits).abs().max().item() <= 1e-6
    # installed kernels and other options are left alone
    same = HybridOptions(gdn_kernel="torch", fa_kernel="sdpa", gdn_conv=4)
    assert runnable_options(same) is same


# Runs with `python -I` in a temporary directory. It removes every way to import headscope (the
# editable-install finder, sys.path entries holding a headscope package) and blocks jaxtyping, fla and
# flash-attn, checks that headscope cannot be imported, then loads each saved directory with
# trust_remote_code=True, re-saves one and loads that copy too.
CHILD = textwrap.dedent(
    """
    import importlib.util, json, os, sys, warnings
    sys.meta_path = [f for f in sys.meta_path if "headscope" not in type(f).__module__ + repr(f)]
    sys.path = [p for p in sys.path if not os.path.exists(os.path.join(p or ".", "headscope", "__init__.py"))]
    for name in ("jaxtyping", "fla", "flash_attn"):
        sys.modules[name] = None  # not installed, as far as this process can tell
    assert importlib.util.find_spec("headscope") is None
    try:
        import headscope
        raise SystemExit("headscope is importable")
    except ImportError:
        pass

    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.load("ids.pt")
    out, info = {}, {}

    def load(d):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
        with torch.no_grad():
            logits = m(ids).logits
            gen = m.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
        info[d] = {"class": type(m).__module__ + "." + type(m).__name__,
                   "warnings": [str(x.message) for x in w if "kernels that are not installed" in str(x.message)],
                   "gdn_kernel": m.model.layers[0].self_attn.options.gdn_kernel}
        out[d] = (logits, gen)
        return m

    for d in sys.argv[1:]:
        m = load(d)
    m.save_pretrained("resaved")
    load("resaved")
    info["headscope_files"] = sorted(
        f for f in (getattr(mod, "__file__", None) for mod in list(sys.modules.values()) if mod is not None)
        if f and os.sep + "headscope" + os.sep in f
    )
    info["headscope_in_sys_modules"] = sys.modules.get("headscope") is not None
    torch.save(out, "out.pt")
    with open("info.json", "w") as f:
        json.dump(info, f)
    """
)


def test_fresh_process_without_headscope_loads_with_trust_remote_code(tmp_path):
    ids = _ids()
    torch.save(ids, tmp_path / "ids.pt")
    ref = {}
    for family in ("llama", "qwen3"):
        hybrid = _hybrid(family, **FULL_OPTS)
        if family == "llama":  # saved by a GPU run: the child has neither kernel and must fall back
            hybrid.config.headscope_hybrid["options"].update(gdn_kernel="fla", fa_kernel="flash_attn")
        hybrid.save_pretrained(tmp_path / family)
        ref[family] = _run(hybrid, ids)
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-I", "child.py", "llama", "qwen3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads((tmp_path / "info.json").read_text())
    out = torch.load(tmp_path / "out.pt")
    assert info["headscope_files"] == [] and not info["headscope_in_sys_modules"]
    for d, family, cls in (("llama", "llama", "HybridLlamaForCausalLM"), ("qwen3", "qwen3", "HybridQwen3ForCausalLM"),
                           ("resaved", "qwen3", "HybridQwen3ForCausalLM")):
        assert info[d]["class"].startswith("transformers_modules.") and info[d]["class"].endswith(
            "modeling_hybrid." + cls
        )
        logits, gen = out[d]
        diff = (logits - ref[family][0]).abs().max().item()
        print(f"{d}: max |Δ logits| in the fresh process = {diff:.3g}")
        assert diff <= TOL
        assert torch.equal(gen, ref[family][1])
    # the saved code runs torch alone whatever kernel the options name (nothing to fall back from, no warning)
    assert info["llama"]["warnings"] == [] and info["llama"]["gdn_kernel"] == "fla"
    assert info["qwen3"]["warnings"] == [] and info["qwen3"]["gdn_kernel"] == "auto"
