"""headscope/gguf_cache.py: a packaged GGUF model is de-quantized once into folders in the cache; later loads read
them, with the same weights bit for bit and the same token ids as transformers' direct GGUF load."""

from __future__ import annotations

import os

import pytest
import torch

from headscope import gguf_cache
from headscope.model_specs import packaged


def test_only_packaged_models_are_converted(tmp_path):
    assert all(packaged(s) for s in ("smollm2-135m", "SmolLM2", "gemma3-270m", "google/gemma-3-270m"))
    assert not any(packaged(s) for s in (str(tmp_path / "m.gguf"), str(tmp_path), "org/name", None, 3))


def test_folder_key_follows_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + bytes(12))
    first = gguf_cache.gguf_folder(g)
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("m-") and len(first.name) == 18
    assert gguf_cache.gguf_folder(g) == first  # stable
    os.utime(g, ns=(1, 1))
    second = gguf_cache.gguf_folder(g)
    g.write_bytes(b"GGUF" + bytes(13))
    os.utime(g, ns=(1, 1))
    assert len({first, second, gguf_cache.gguf_folder(g)}) == 3  # another mtime, another size: another folder


def test_folder_written_whole_once(tmp_path):
    target = tmp_path / "c" / "model"
    calls = []

    def write(tmp):
        calls.append(tmp)
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")

    assert gguf_cache._written(target, write) == target and (target / "config.json").exists()
    assert gguf_cache._written(target, write) == target and len(calls) == 1  # there: not written again
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]  # no temporary folder left

    def crash(tmp):
        tmp.mkdir()
        (tmp / "half").write_text("")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        gguf_cache._written(tmp_path / "d" / "model", crash)
    assert list((tmp_path / "d").iterdir()) == []  # nothing half-written stays

    def other_process_first(tmp):  # another process renamed its folder into place while this one wrote
        write(tmp)
        (tmp_path / "e" / "model").mkdir()
        (tmp_path / "e" / "model" / "theirs").write_text("")
        (tmp / "ours").write_text("")

    got = gguf_cache._written(tmp_path / "e" / "model", other_process_first)
    assert sorted(p.name for p in got.iterdir()) == ["theirs"] and [p.name for p in got.parent.iterdir()] == ["model"]


def test_unwritable_cache_reads_the_gguf_directly(tmp_path, monkeypatch):
    import transformers

    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    calls = []

    def unwritable(target, write):
        raise PermissionError(13, "Permission denied", str(target))

    def from_pretrained(path, **kw):
        calls.append((str(path), kw))
        return object()

    monkeypatch.setattr(gguf_cache, "_written", unwritable)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    gguf_cache.cached_tokenizer(g)
    gguf_cache.cached_model(g, dtype=torch.bfloat16)
    assert calls == [(str(tmp_path), {"gguf_file": "m.gguf"}), (str(tmp_path), {"gguf_file": "m.gguf", "dtype": torch.bfloat16})]


@pytest.mark.slow
def test_packaged_model_equals_the_direct_gguf_load(monkeypatch):
    """fp32 and bf16 weights equal transformers' direct GGUF load bit for bit, token ids and the chat template are
    the same, names point at the GGUF's folder; a load from the converted folders never reads the GGUF; the
    folders hold only JSON and safetensors (reading them runs no code)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from headscope.model_specs import default_gguf_path
    from headscope.models import load_hf, load_tokenizer
    from headscope.tasks import make_pairs

    g = default_gguf_path()
    load_hf("smollm2-135m", device="cpu")  # converts where the cache does not hold it yet
    ref_tok = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    direct = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32).eval()

    def no_gguf(*a, **k):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_gguf)  # transformers imports it where it reads one
    for dtype in (torch.float32, torch.bfloat16):
        model, tok, name = load_hf("smollm2-135m", device="cpu", dtype=dtype)
        want = {k: v.to(dtype) for k, v in direct.state_dict().items()}
        got = model.state_dict()
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want), dtype
        assert next(model.parameters()).dtype == dtype and name == "SmolLM2-135M-Instruct"
        assert model.config.name_or_path == tok.name_or_path == str(g.parent)
    tok = load_tokenizer("smollm2-135m")
    pair = make_pairs("niah_single", ref_tok, n_pairs=1, seq_len=128, seed=0)[0]
    text = ref_tok.decode(pair.clean) + " 4821 ünïcödé 日本\t\n  x"
    assert tok(text).input_ids == ref_tok(text).input_ids
    chat = [{"role": "user", "content": "What is the special magic number?"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (len(tok), tok.bos_token_id, tok.eos_token_id, tok.all_special_tokens) == \
        (len(ref_tok), ref_tok.bos_token_id, ref_tok.eos_token_id, ref_tok.all_special_tokens)
    files = {p.suffix for p in gguf_cache.gguf_folder(g).rglob("*") if p.is_file()}
    assert files <= {".json", ".safetensors", ".jinja", ".txt"}, files

