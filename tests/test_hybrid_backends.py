"""The hybrid's backends as data (issue 61): a registry chosen by InferenceConfig, nothing switched on by import,
the saved code the reference model only (≤ 1,200 lines), small functions, an explicit warm-up."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from headscope import HeadscopeInputError
from headscope.hybrid import HybridOptions, backends, hybridize, use_inference, warm_up
from headscope.hybrid.inference import DEFAULT, InferenceConfig
from headscope.hybrid.backend_registry import ROLES, Backend, Needs, register, select
from headscope.masks import HeadMask

ROOT = Path(__file__).resolve().parent.parent
HYBRID = ROOT / "headscope" / "hybrid"
SAVED = {"modeling_hybrid.py", "layer.py", "cache.py", "attn.py", "gdn.py", "rope.py", "config.py", "shapes.py"}


def _tiny(seed=0):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(seed)
    return hybridize(LlamaForCausalLM(cfg).eval(), HeadMask(2, 2, 1, ((0,), (1,))), gdn_kernel="torch").eval()


# the child imports headscope.hybrid and compares every torch / transformers object that existed before with after
CHILD = textwrap.dedent("""
    import json, sys
    import torch, torch._dynamo, transformers
    from transformers import Cache, DynamicCache, GenerationMixin, PreTrainedModel, StaticCache
    from transformers.models.auto import configuration_auto, modeling_auto

    def snapshot():
        mods = {n: {k: id(v) for k, v in vars(m).items()} for n, m in list(sys.modules.items())
                if m is not None and n.split(".")[0] in ("torch", "transformers")}
        classes = {c.__name__: {k: id(v) for k, v in vars(c).items()} for c in
                   (torch.nn.Module, torch.Tensor, PreTrainedModel, GenerationMixin, Cache, DynamicCache, StaticCache)}
        extra = (sorted(map(str, configuration_auto.CONFIG_MAPPING._extra_content)),
                 sorted(map(str, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING._extra_content)))
        return mods, classes, extra, repr(sorted(torch._dynamo.config.get_config_copy().items()))

    mods0, classes0, extra0, dyn0 = snapshot()
    import headscope.hybrid
    mods1, classes1, extra1, dyn1 = snapshot()
    changed = sorted(f"{n}.{k}" for n, d in mods0.items() for k, v in d.items() if mods1[n].get(k) != v)
    changed += sorted(f"{c}.{k}" for c, d in classes0.items() for k in set(d) | set(classes1[c])
                      if classes1[c].get(k) != d.get(k))
    families = sorted(n for n in sys.modules if n.startswith("transformers.models.") and n.count(".") == 2
                      and n.split(".")[2] not in ("auto",))
    print(json.dumps({"changed": changed, "auto": extra0 == extra1, "dynamo": dyn0 == dyn1,
                      "auto_after": extra1, "families": families}))
""")


@pytest.mark.slow  # a fresh process (~40 s on the shared CPUs)
def test_importing_headscope_hybrid_changes_no_torch_or_transformers_object(tmp_path):
    """In a fresh process: no attribute of an already imported torch / transformers module or class changes, the auto
    classes gain no model type, Dynamo's config is untouched, and no transformers model family is imported (the
    saved code's family classes are built on first use)."""
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "child.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["changed"] == [] and got["auto"] and got["dynamo"], got
    assert not any("headscope" in t for t in got["auto_after"][0]), got["auto_after"]
    assert got["families"] == [], got["families"]


def test_no_sys_modules_lookup_and_no_fast_path_seam_in_hybrid():
    """The fast paths are found through data (layer.backends / model.backends), never through sys.modules."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in HYBRID.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if "sys.modules" in line]
    assert hits == []
    assert not (HYBRID / "inference" / "dispatch.py").exists()


def test_saved_code_is_the_reference_model_in_at_most_1200_lines(tmp_path):
    """save_pretrained copies the reference model only: the eight files, ≤ 1,200 lines, no fast path, no headscope
    import outside the folder, no fla / flash-attn / Triton."""
    _tiny().save_pretrained(tmp_path)
    files = {p.name: p.read_text() for p in tmp_path.glob("*.py")}
    assert set(files) == SAVED
    n = sum(len(t.splitlines()) for t in files.values())
    print(f"saved modeling code: {n} lines")
    assert n <= 1200
    for name, text in files.items():
        imports = [node for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.Import, ast.ImportFrom))]
        mods = {a.name for node in imports if isinstance(node, ast.Import) for a in node.names}
        mods |= {node.module or "" for node in imports if isinstance(node, ast.ImportFrom) and not node.level}
        assert not {m for m in mods if m.split(".")[0] in ("headscope", "fla", "flash_attn", "triton")}, (name, mods)
        assert "sys.modules" not in text and "inference" not in {node.module for node in imports
                                                                 if isinstance(node, ast.ImportFrom)}


def _own_lines(fn: ast.AST) -> int:
    """A function's lines without its docstring and without the functions it defines (counted on their own)."""
    lines = set(range(fn.lineno, fn.end_lineno + 1))
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str):
        lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    for n in ast.walk(fn):
        if n is not fn and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines -= set(range(n.lineno - len(n.decorator_list), n.end_lineno + 1))
    return len(lines)


def test_no_function_in_hybrid_over_80_lines():
    """Every function of headscope/hybrid (a Triton kernel factory's kernels counted each on its own) has at most 80
    lines besides its docstring; hybrid/ as a whole stays within its size before the backend registry."""
    long = [f"{p.relative_to(ROOT)}::{n.name} {_own_lines(n)}" for p in sorted(HYBRID.rglob("*.py"))
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _own_lines(n) > 80]
    assert long == []
    total = sum(len(p.read_text().splitlines()) for p in HYBRID.rglob("*.py"))
    print(f"headscope/hybrid: {total} lines")
    assert total <= 5917  # its size before the registry (issue 61)
    assert _own_lines(ast.parse("def f():\n    '''doc\n    more'''\n    x = 1\n    def g():\n        pass\n").body[0]) == 2


def test_registry_lists_backends_by_role_with_what_they_support():
    rows = backends()
    assert {r["role"] for r in rows} == set(ROLES)
    by = {(r["role"], r["name"]): r for r in rows}
    assert all((role, "reference") in by for role in ROLES)
    assert {k for k in by if k[1] != "reference"} == {("train", "fused"), ("prefill", "lean"), ("decode", "lean"),
                                                      ("captured_decode", "graph")}
    ref, lean = by[("prefill", "reference")], by[("prefill", "lean")]
    assert set(ref["features"]) >= {"window", "softcap", "partial_rotary", "biases", "qk_norm_teacher"}
    assert lean["features"] == ["biases", "logit_scale", "partial_rotary", "qk_norm_teacher", "softcap", "window"]
    assert lean["devices"] == ["cpu", "cuda"] and "softcap" not in by[("decode", "lean")]["features"]
    assert by[("captured_decode", "graph")]["features"] == by[("decode", "lean")]["features"]  # GPT-NeoX's rotary too
    json.dumps(rows)  # a result file can hold the listing


def test_auto_picks_the_fastest_that_applies_and_a_named_backend_that_does_not_is_refused():
    plain = Needs(frozenset({"biases"}), "bfloat16", "cuda")
    assert select("prefill", "auto", plain).name == "lean" and select("train", "auto", plain).name == "fused"
    assert select("prefill", "auto", replace(plain, device="cpu")).name == "reference"  # CPU: the reference
    for feature in ("softcap", "nope_layer", "short_conv"):  # window, Gemma's QK-norm, logit scale: supported
        needs = replace(plain, features=frozenset({feature}))
        assert select("decode", "auto", needs).name == "reference"
        with pytest.raises(HeadscopeInputError, match=f"decode='lean' does not apply to layer 3: .*{feature}.*"
                                                      "decode='auto'"):
            select("decode", "lean", needs, " to layer 3")
    with pytest.raises(HeadscopeInputError, match=r"not a prefill backend; registered: \['auto', 'lean', 'reference'\]"):
        select("prefill", "flash", plain)
    with pytest.raises(ValueError, match="not a backend name"):
        register(Backend("auto", "prefill", None))


def test_a_registered_backend_is_chosen_by_name_and_by_auto(monkeypatch):
    """A new backend is data: registered with what it supports, named by a config (or chosen by auto where it is
    the fastest), called with its role's signature."""
    from headscope.hybrid import backend_registry as registry

    calls = []
    mod = type(sys)("fake_backend")
    mod.prefill = lambda layer, x, pe, pos, cache: calls.append(x.shape) or torch.zeros(*x.shape[:2], 32)
    monkeypatch.setitem(sys.modules, "fake_backend", mod)
    zeros = Backend("zeros", "prefill", "fake_backend:prefill", registry.Supports(frozenset({"window"})), {"cpu": 5})
    monkeypatch.setitem(registry._REGISTRY, ("prefill", "zeros"), zeros)  # as register(zeros) does, undone after
    model = _tiny()
    ids = torch.randint(0, 64, (1, 5))
    use_inference(model, replace(DEFAULT, prefill="auto"))  # the fastest on CPU now; its layers have no feature
    with torch.no_grad():
        out = model(ids, use_cache=False).logits
    assert calls == [(1, 5, 32)] * 2 and torch.isfinite(out).all()
    assert registry.select("prefill", "auto", Needs(frozenset({"biases"}))).name == "reference"  # lacks biases
    with pytest.raises(HeadscopeInputError, match="train='zeros' is not a train backend"):
        use_inference(model, replace(DEFAULT, train="zeros"))


def test_the_model_records_its_config_and_a_new_device_or_dtype_is_resolved_on_first_use():
    model = _tiny()
    cfg = use_inference(model, replace(DEFAULT, prefill="lean", decode="lean"))
    layer = model.model.layers[0].self_attn
    assert layer.backends.config is cfg and model.backends.config is cfg
    assert layer.backends.backend(layer, "prefill", layer.q_proj.weight).name == "lean"
    assert layer.backends.backend(layer, "train", layer.q_proj.weight).name == "reference"  # auto on CPU
    model.to(torch.float64)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 4)), use_cache=False)
    assert (("prefill", "cpu", torch.float64) in layer.backends._chosen)
    assert json.loads(json.dumps(cfg.__dict__))["prefill"] == "lean"


def test_warm_up_runs_the_shapes_to_come_and_leaves_the_model_as_it_was():
    model = _tiny()
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    before = model.generate(ids, **kw)
    report = warm_up(model, batch=2, max_len=12, prompt_lens=[6, 9], static=(False, True), new_tokens=2)
    assert [(c["prompt_len"], c["static"]) for c in report["calls"]] == [(6, False), (6, True), (9, False), (9, True)]
    assert all(c["seconds"] > 0 for c in report["calls"]) and report["seconds"] >= sum(
        c["seconds"] for c in report["calls"])
    assert torch.equal(model.generate(ids, **kw), before)
    with pytest.raises(ValueError, match="must fit max_len=8"):
        warm_up(model, batch=1, max_len=8, prompt_lens=[7])
