"""``headscope generate`` on a saved converted folder: greedy tokens equal ``model.generate``'s, the prompt from an
argument, a file or stdin, sampling reproducible by seed, bad arguments refused before the model loads."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_llama
from headscope.cli import app
from headscope.generation import GenerateConfig, generate_text, stop_reason

PROMPT = "The lanterns were lit one by one, and the"


@pytest.fixture(scope="module")
def converted(smol_tokenizer, tmp_path_factory):
    from headscope import hybridize
    from headscope.masks import HeadMask

    d = tmp_path_factory.mktemp("gen") / "stage3"
    teacher = tiny_llama(smol_tokenizer, seed=5, n_layers=2, n_heads=4, n_kv=2, d_model=32)
    hybridize(teacher, HeadMask.from_heads([(0, 0), (1, 3)], n_layers=2, n_heads=4, n_kv_heads=2)).save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    return d


def test_generate_greedy_equals_model_generate(converted, tmp_path):
    from headscope.models import load_hf

    model, tok, _ = load_hf(converted, device="cpu")
    assert type(model).__name__ == "HybridLlamaForCausalLM"
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
    got = generate_text(model, tok, PROMPT, GenerateConfig(max_new_tokens=12))
    assert got["ids"] == ref.tolist() and got["new_tokens"] == len(ref) and got["prompt_tokens"] == ids.shape[1]
    assert got["tokens_per_s"] == pytest.approx(got["new_tokens"] / got["seconds"])
    want = tok.decode(ref.tolist(), skip_special_tokens=True)
    # the command: prompt as an argument, from --file and from stdin, the same greedy text
    (tmp_path / "p.txt").write_text(PROMPT)
    for argv, stdin in ([[str(converted), PROMPT], None], [[str(converted), "--file", str(tmp_path / "p.txt")], None],
                        [[str(converted)], PROMPT]):
        res = CliRunner().invoke(app, ["generate", *argv, "--max-new-tokens", "12", "--device", "cpu"], input=stdin)
        assert res.exit_code == 0, (res.output, res.exception)
        assert res.stdout == want + "\n"
        assert f"12 new tokens (--max-new-tokens reached) after {ids.shape[1]} prompt tokens in" in res.stderr
        assert "tokens/s (cpu, float32)" in res.stderr
    # sampling: the same seed gives the same tokens, another seed (almost surely) others
    cfg = GenerateConfig(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=3)
    a, b = generate_text(model, tok, PROMPT, cfg), generate_text(model, tok, PROMPT, cfg)
    c = generate_text(model, tok, PROMPT, GenerateConfig(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=4))
    assert a["ids"] == b["ids"] and a["ids"] != c["ids"]


def test_generate_says_why_it_stopped(converted, tmp_path):
    """A student whose first greedy token is its end-of-sequence token: one new token, and the line says so (it printed
    "1 new tokens after 37 prompt tokens" after an empty line)."""
    import json
    import shutil

    from headscope.models import load_hf

    model, tok, _ = load_hf(converted, device="cpu")
    first = generate_text(model, tok, PROMPT, GenerateConfig(max_new_tokens=1))
    assert first["new_tokens"] == 1 and first["stop"] == ("eos" if first["ids"][0] == tok.eos_token_id else "max_new_tokens")
    d = tmp_path / "stops_at_once"
    shutil.copytree(converted, d)
    gen = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() else {}
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": first["ids"][0]}))
    res = CliRunner().invoke(app, ["generate", str(d), PROMPT, "--max-new-tokens", "8", "--device", "cpu"])
    assert res.exit_code == 0, (res.output, res.exception)
    n_prompt = first["prompt_tokens"]
    assert res.stderr.startswith(f"1 new token (stopped at the end-of-sequence token) after {n_prompt} prompt tokens in ")


@pytest.mark.parametrize("extra, want", [
    (["x", "--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
    (["x", "--temperature", "-1"], "--temperature=-1.0 must lie in [0, inf)"),
    (["x", "--top-p", "1.5"], "--top-p=1.5 must lie in (0, 1]"),
    (["x", "--file", "/nonexistent/p.txt"], "give the prompt as an argument or with --file, not both"),
    (["--file", "/nonexistent/p.txt"], "--file /nonexistent/p.txt does not exist"),
    (["x", "--dtype", "int4"], "--dtype='int4' is not one of auto, float32, bfloat16, float16"),
])
def test_generate_refuses_bad_arguments_before_loading(converted, monkeypatch, extra, want):
    import headscope.models

    monkeypatch.setattr(headscope.models, "load_hf", lambda *a, **k: pytest.fail("a model was loaded"))
    res = CliRunner().invoke(app, ["generate", str(converted), *extra])
    assert res.exit_code == 2 and res.output.startswith("error: ") and want in res.output, res.output
    res = CliRunner().invoke(app, ["generate", "/nonexistent/model", "x"])
    assert res.exit_code == 2 and "/nonexistent/model does not exist (nor does its folder /nonexistent)" in res.output


def test_generate_dtype_auto_is_bfloat16_on_cuda_only():
    from headscope.generation import resolve_dtype

    assert resolve_dtype("auto", "cpu", cuda_available=True) == "float32"
    assert resolve_dtype("auto", "cuda:1", cuda_available=False) == "bfloat16"  # the device asked for decides
    assert resolve_dtype("auto", None, cuda_available=True) == "bfloat16"
    assert resolve_dtype("auto", None, cuda_available=False) == "float32"
    assert resolve_dtype("float16", "cuda", cuda_available=True) == "float16"



def test_stop_reason():
    assert stop_reason([5, 2], {2}, 8) == "eos" and stop_reason([5, 2], {2}, 2) == "eos"  # EOS as the last allowed token
    assert stop_reason([5, 6], {2}, 2) == "max_new_tokens" and stop_reason([5], {2}, 8) == "other"
    assert stop_reason([], {2}, 8) == "other"
