"""Acceptance of the head-wise hybrid on every family hybridize converts (tiny random models).

Per family (Llama, Qwen2, Qwen3, Mistral with a sliding window, Gemma 3 with sliding and full layers,
GPT-NeoX): every head FA with ``fusion="none"`` equals the teacher at a prompt longer than any sliding
window; a mixed mask trains 50 stage-1 (layer-wise alignment) steps with falling loss; a saved hybrid
loads in a fresh process that never imports headscope (``trust_remote_code=True``) with the same
logits. The saved remote code is the reference core only (line count, no Triton, no fast path), and
the GDN decay parameters stay fp32, bitwise, when a saved hybrid is loaded in bf16.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from headscope.arch.random_models import hybrid_families
from headscope.hybrid import hybridize, load
from headscope.hybrid.modeling_hybrid import attention_name, decoder_layers
from headscope.masks import HeadMask

V = 128
T = 40  # longer than every sliding window of the tiny models (Mistral 24, Gemma 3 8)
BUILDERS = hybrid_families()
NAMES = sorted(BUILDERS)
WINDOWS = {"mistral_sw": [24, 24], "gemma3": [8, None, 8]}  # what each family's config states


def _teacher(name: str) -> torch.nn.Module:
    return BUILDERS[name](V, 0).float().eval()


def _geometry(m):
    c = m.config
    H = c.num_attention_heads
    return c.num_hidden_layers, H, getattr(c, "num_key_value_heads", None) or H


def _all_fa(m) -> HeadMask:
    L, H, KV = _geometry(m)
    return HeadMask(L, H, KV, (tuple(range(H)),) * L)


def _mixed(m) -> HeadMask:
    """Layer l keeps FA head l mod H (one KV group), plus head H-1 on odd layers: GDN heads everywhere."""
    L, H, KV = _geometry(m)
    return HeadMask(L, H, KV, tuple(tuple(sorted({l % H} | ({H - 1} if l % 2 else set()))) for l in range(L)))


def _ids(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(seed))


def _attn(model, i):
    layer = decoder_layers(model)[i]
    return getattr(layer, attention_name(layer))


@pytest.mark.parametrize("name", NAMES)
def test_all_fa_equals_teacher(name):
    teacher = _teacher(name)
    hybrid = hybridize(teacher, _all_fa(teacher), fusion="none").eval()
    specs = hybrid.config.headscope_hybrid["layers"]
    assert [s["window"] for s in specs] == WINDOWS.get(name, [None] * len(specs))
    assert (name == "qwen2") == (specs[0]["q_bias"] and not specs[0]["o_bias"])  # Qwen2: q/k/v biases only
    assert (name == "gpt_neox") == specs[0]["o_bias"]
    assert specs[0]["qk_norm"] == {"qwen3": "rms", "gemma3": "teacher"}.get(name)
    ids = _ids()
    with torch.no_grad():
        want, got = teacher(ids).logits, hybrid(ids).logits
    assert want.abs().max() > 0.5  # the models compute something
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["mistral_sw", "gemma3"])
def test_fa_head_of_sliding_layer_keeps_window_without_mask(name):
    """Called as in layer-wise alignment (no attention mask), an FA head of a sliding layer applies its
    window: equal to the teacher's attention with the window mask, not to full causal attention."""
    teacher = _teacher(name)
    hybrid = hybridize(teacher, _all_fa(teacher), fusion="none").eval()
    w = WINDOWS[name][0]
    h = torch.randn(1, T, teacher.config.hidden_size, generator=torch.Generator().manual_seed(1))
    rot = teacher.model.rotary_emb
    pe = rot(h, torch.arange(T)[None], "sliding_attention") if name == "gemma3" else rot(h, torch.arange(T)[None])
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    sliding = ((j <= i) & (i - j < w))[None, None]
    full = (j <= i)[None, None]
    with torch.no_grad():
        got = _attn(hybrid, 0)(h, position_embeddings=pe)[0]
        want = _attn(teacher, 0)(h, position_embeddings=pe, attention_mask=sliding)[0]
        causal = _attn(teacher, 0)(h, position_embeddings=pe, attention_mask=full)[0]
    assert (got - want).abs().max().item() <= 1e-5
    assert (got - causal).abs().max().item() > 1e-2


FAST = {"llama", "qwen2", "qwen3", "mistral_sw", "gemma3", "gpt_neox"}  # the lean backends apply to their layers


@pytest.mark.parametrize("name", NAMES)
def test_lean_path_equals_reference_forward_and_decode(name):
    """With the lean backends named (``prefill="lean"``, ``decode="lean"``; the decode kernels through Triton's interpreter, which
    tests/conftest.py turns on), a mixed hybrid's prefill and five decode steps through its HybridCache equal the
    reference forward's logits (fp32). GPT-NeoX rotates a quarter of each head (partial rotary): its decode steps
    take the PyTorch glue, as the kernels rotate all d features (they gave errors of ~2 in the logits before)."""
    from dataclasses import replace

    from headscope import HeadscopeInputError
    from headscope.hybrid.backend_registry import Needs, select
    from headscope.hybrid.inference import InferenceConfig, use_inference

    teacher = _teacher(name)
    hybrid = hybridize(teacher, _mixed(teacher), gdn_kernel="torch").eval()
    layers = [_attn(hybrid, i) for i in range(len(decoder_layers(hybrid)))]
    lean = [select("decode", "auto", Needs(a.backends.features, "float32", "cuda")).name == "lean" for a in layers]
    assert all(lean) == (name in FAST) and any(lean) == (name in FAST)
    if name not in FAST:  # a backend that does not apply is refused by name
        with pytest.raises(HeadscopeInputError, match="decode='lean' does not apply to layer"):
            use_inference(hybrid, replace(InferenceConfig(), decode="lean"))
    ids = _ids()
    got = {}
    modes = ("reference", "lean") if name in FAST else ("reference", "auto")
    for where in modes:
        use_inference(hybrid, replace(InferenceConfig(), prefill=where, decode=where, decode_graphs="never"))
        with torch.no_grad():
            full = hybrid(ids).logits
            out = hybrid(ids[:, :-5], use_cache=True)
            cache = out.past_key_values
            steps = [out.logits[:, -1]]
            for t in range(T - 5, T - 1):
                steps.append(hybrid(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        got[where] = torch.stack(steps, 1)
        assert (got[where] - full[:, T - 6 : T - 1]).abs().max().item() <= 2e-5, where
    assert (got[modes[1]] - got["reference"]).abs().max().item() <= 2e-5


@pytest.mark.slow  # 50 teacher + student steps: ~25 s per family on a shared 2-core CPU
@pytest.mark.parametrize("name", NAMES)
def test_mixed_mask_trains_stage1(name):
    from headscope.train.stages import stage_loss, trainable_parameters

    teacher = _teacher(name)
    student = hybridize(teacher, _mixed(teacher), gdn_kernel="torch").train()
    params = [p for _, p in trainable_parameters(student, 1)]
    assert params and all(p.requires_grad for p in params)
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    batches = [_ids(s, batch=4) for s in range(4)]
    mask = torch.ones(4, T, dtype=torch.bool)
    losses = []
    for step in range(50):
        loss, _ = stage_loss(1, student, teacher, batches[step % 4], mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4  # each over the 4 batches
    print(f"{name}: stage-1 loss {losses[0]:.4f} -> {losses[-1]:.4f} (mean of 4: {first:.4f} -> {last:.4f})")
    assert last < 0.8 * first, losses


@pytest.mark.slow  # three generate calls per family: 13-17 s on a shared 2-core CPU
@pytest.mark.parametrize("name", NAMES)
def test_generate_through_the_family_cache(name):
    """transformers' generate (its DynamicCache: sliding-window layers for Mistral / Gemma 3, prompt longer
    than the window): the all-FA hybrid gives the teacher's greedy tokens; the mixed hybrid gives its own
    cache-free greedy tokens (KV of the kept groups + GDN state carried correctly)."""
    teacher = _teacher(name)
    ids = _ids(5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        want = teacher.generate(ids, **kw)
        got = hybridize(teacher, _all_fa(teacher), fusion="none").eval().generate(ids, **kw)
        mixed = hybridize(teacher, _mixed(teacher), gdn_kernel="torch").eval()
        gen = mixed.generate(ids, **kw)
        ref = ids
        for _ in range(6):
            ref = torch.cat([ref, mixed(ref).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(got, want)
    assert torch.equal(gen, ref)


def _saved_code_files(d) -> dict[str, str]:
    return {f: open(os.path.join(d, f)).read() for f in os.listdir(d) if f.endswith(".py")}


def test_saved_remote_code_is_the_reference_core(tmp_path):
    teacher = _teacher("gemma3")
    hybridize(teacher, _mixed(teacher)).save_pretrained(tmp_path)
    code = _saved_code_files(tmp_path)
    lines = sum(len(src.splitlines()) for src in code.values())
    print(f"remote code: {len(code)} files, {lines} lines: {sorted(code)}")
    assert lines <= 2500
    assert set(code) == {"modeling_hybrid.py", "layer.py", "attn.py", "gdn.py", "config.py", "shapes.py", "rope.py",
                         "cache.py"}
    imports = re.compile(r"^\s*(?:from|import)\s+([\w.]+)", re.M)
    mods = {m for src in code.values() for m in imports.findall(src)}
    assert not any("triton" in m for m in mods), mods
    assert not any(m.startswith(".inference") or "headscope" in m for m in mods), mods  # no fast path


def test_decay_parameters_stay_fp32_in_bf16_load(tmp_path):
    teacher = _teacher("qwen2")
    hybrid = hybridize(teacher, _mixed(teacher))
    with torch.no_grad():  # values that bf16 cannot hold
        for i in range(len(decoder_layers(hybrid))):
            a = _attn(hybrid, i)
            a.A_log.copy_(torch.randn_like(a.A_log) * 0.3 + 1e-3)
            a.dt_bias.copy_(torch.randn_like(a.dt_bias) + 1e-3)
    hybrid.save_pretrained(tmp_path)
    loaded = load(tmp_path, dtype=torch.bfloat16)
    assert _attn(loaded, 0).q_proj.weight.dtype == torch.bfloat16
    n = 0
    for i in range(len(decoder_layers(hybrid))):
        for pname in ("A_log", "dt_bias"):
            want, got = getattr(_attn(hybrid, i), pname), getattr(_attn(loaded, i), pname)
            assert got.dtype == torch.float32, (i, pname, got.dtype)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (i, pname)  # bit for bit
            assert not torch.equal(want.bfloat16().float(), want)  # bf16 would have rounded them
            n += 1
    assert n == 2 * len(decoder_layers(hybrid))


CHILD = textwrap.dedent(
    """
    import importlib.util, json, os, sys
    sys.meta_path = [f for f in sys.meta_path if "headscope" not in type(f).__module__ + repr(f)]
    sys.path = [p for p in sys.path if not os.path.exists(os.path.join(p or ".", "headscope", "__init__.py"))]
    assert importlib.util.find_spec("headscope") is None
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.load("ids.pt")
    out, info = {}, {}
    for d in sys.argv[1:]:
        m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
        with torch.no_grad():
            out[d] = m(ids).logits
        mb = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, dtype=torch.bfloat16)
        a = [n for n, p in mb.named_parameters() if n.endswith("A_log") and p.dtype != torch.float32]
        info[d] = {"class": type(m).__module__ + "." + type(m).__name__, "A_log_not_fp32": a}
    info["headscope_loaded"] = sorted(n for n in sys.modules if n.split(".")[0] == "headscope")
    torch.save(out, "out.pt")
    with open("info.json", "w") as f:
        json.dump(info, f)
    """
)


@pytest.mark.slow
def test_fresh_process_without_headscope_reloads_every_family(tmp_path):
    ids = _ids(3)
    torch.save(ids, tmp_path / "ids.pt")
    ref = {}
    for name in NAMES:
        teacher = _teacher(name)
        hybrid = hybridize(teacher, _mixed(teacher), gdn_kernel="torch", gdn_conv=4).eval()
        with torch.no_grad():  # trained-looking values for the parameters a conversion sets to constants
            for p in hybrid.parameters():
                p.add_(torch.randn_like(p) * 0.02)
            ref[name] = hybrid(ids).logits
        hybrid.save_pretrained(tmp_path / name)
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-I", "child.py", *NAMES], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads((tmp_path / "info.json").read_text())
    out = torch.load(tmp_path / "out.pt")
    assert info["headscope_loaded"] == []
    for name in NAMES:
        assert info[name]["class"].startswith("transformers_modules."), info[name]
        assert info[name]["A_log_not_fp32"] == []
        diff = (out[name] - ref[name]).abs().max().item()
        print(f"{name}: reload max |Δ logits| = {diff:.2e}")
        assert diff <= 1e-5, (name, diff)


@pytest.mark.parametrize("name,missing", [("gpt2", "learned absolute positions"), ("olmo2", "QK-norm over the whole"),
                                          ("phi3", "acceptance test"), ("granite", "acceptance test")])
def test_other_families_refused_naming_what_is_missing(name, missing):
    from headscope.arch.random_models import FAMILIES
    from headscope.errors import HeadscopeInputError

    m = FAMILIES[name](V, 0)
    L, H, KV = _geometry(m)
    with pytest.raises(HeadscopeInputError) as ei:
        hybridize(m, HeadMask(L, H, KV, (tuple(range(H)),) * L))
    assert isinstance(ei.value, TypeError) and missing in str(ei.value) and "Qwen2ForCausalLM" in str(ei.value)


@pytest.mark.parametrize("name", ["gemma3", "gpt_neox"])
def test_calibrated_gamma_is_the_teacher_head_rms(name):
    """γ_h from calibration_ids = RMS of the teacher head's output (the input of its output projection)."""
    from headscope.arch import attention_out_module

    teacher = _teacher(name)
    ids = _ids(7)
    L, H, _ = _geometry(teacher)
    seen = {}
    hooks = [attention_out_module(teacher, i).register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, args[0].detach())) for i in range(L)]
    with torch.no_grad():
        teacher(ids)
    for h in hooks:
        h.remove()
    hybrid = hybridize(teacher, _mixed(teacher), calibration_ids=ids)
    for i in range(L):
        z = seen[i].view(*seen[i].shape[:-1], H, -1)
        want = z.pow(2).mean(dim=(0, 1, 3)).sqrt()
        assert torch.allclose(_attn(hybrid, i).gamma[:, 0], want, rtol=1e-5), i


def test_gguf_quantization_config_is_not_carried_over():
    """A teacher loaded from a GGUF file (de-quantized: plain weights) has ``quantization_config`` with
    ``quant_method="gguf"``; the hybrid's weights are plain tensors too, so its config drops it (kept, a bf16 reload
    warned that the weights stay quantized and loaded through a GGUF quantizer)."""
    teacher = _teacher("llama")
    teacher.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}
    hybrid = hybridize(teacher, _mixed(teacher))
    assert getattr(hybrid.config, "quantization_config", None) is None
    assert "quantization_config" not in hybrid.config.to_dict()
