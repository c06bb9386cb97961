"""Models spread over devices (device_map): the engine's per-layer device path equals the one-device
run (CPU: a forced per-layer path and accelerate's {"": "cpu"} map; the real GPU split is in
benchmarks/scale_out.py)."""

from __future__ import annotations

import pytest
import torch

import headscope
from headscope.patching import receiver_patching
from headscope.patching.engine import Engine, LayerStack
from headscope.patching.receivers import sequences
from headscope.tasks import niah_single


def test_engine_reports_each_layers_device(tiny):
    e = Engine(tiny)
    assert [e.layer_device(i) for i in range(tiny.geometry.n_layers)] == [torch.device("cpu")] * 2
    assert not e.multi_device


@pytest.mark.slow
def test_per_layer_path_equals_stacked_path(tiny, smol_tokenizer, monkeypatch):
    pairs = niah_single(smol_tokenizer, n_pairs=2, seq_len=64, seed=4)
    want = receiver_patching(tiny, pairs, min_gap=0.0, progress=False)
    clean_seq, _, read = sequences(pairs[0])
    ref = Engine(tiny).run(clean_seq, read)

    init = Engine.__init__

    def forced(self, model, **kw):
        init(self, model, **kw)
        self.multi_device = True

    monkeypatch.setattr(Engine, "__init__", forced)
    e = Engine(tiny)
    got = e.run(clean_seq, read)
    assert isinstance(got.resid, LayerStack) and got.k.shape == ref.k.shape
    assert torch.equal(got.k.stacked("cpu"), ref.k) and torch.equal(got.logits, ref.logits)
    res = receiver_patching(tiny, pairs, min_gap=0.0, progress=False)
    assert torch.equal(res.patched, want.patched)
    with pytest.raises(NotImplementedError, match="one device"):
        e.run_with_grad(clean_seq, read)


@pytest.mark.slow
def test_rank_with_device_map_equals_plain_rank(tiny_dir, tmp_path):
    settings = dict(tasks=("niah_single",), n_pairs=2, seq_len=64, seed=2, min_gap=0.0, progress=False, device="cpu")
    plain = headscope.rank(str(tiny_dir), **settings)
    mapped = headscope.rank(str(tiny_dir), device_map={"": "cpu"}, out_dir=tmp_path / "m", **settings)
    assert torch.equal(plain.ie, mapped.ie)
    # an in-memory model dispatched by name: no GPU here, so "auto" places everything on the CPU
    lm = headscope.load_model(str(tiny_dir), device="cpu")
    auto = headscope.rank(lm, device_map="auto", **settings)
    assert lm.hf_model.hf_device_map == {"": "cpu"}
    assert torch.equal(plain.ie, auto.ie)
    with pytest.raises(NotImplementedError, match="device_map"):
        headscope.rank(lm, device_map="auto", mode="screen", **settings)
    with pytest.raises(ValueError, match="device_map='half'"):
        headscope.models.dispatch(lm.hf_model, "half")
