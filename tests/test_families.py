"""Every family with an adapter, against the brute-force reference (one hook_z patch per forward through
the TransformerLens bridge), and the paths for everything else."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import fast_first
from families import FAMILIES, tiny_family
from headscope.patching import receiver_patching, reference_patched_metric
from headscope.patching.engine import Engine, EngineMismatch
from headscope.patching.contract import make_engine
from headscope.patching.generic import BridgeEngine
from headscope.tasks import niah_single


@pytest.fixture(scope="module")
def pair(smol_tokenizer):
    # 64 tokens: longer than every sliding window (8) of the tiny models
    return niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.4, seed=3)[0]


@pytest.mark.parametrize("family", fast_first(["llama"] + sorted(set(FAMILIES) - {"llama"})))
def test_fast_engine_equals_one_hook_at_a_time(family, smol_tokenizer, pair):
    lm = tiny_family(family, smol_tokenizer)
    res = receiver_patching(lm, [pair], min_gap=0.0, progress=False)
    assert res.path == "fast"
    ref, m_c, m_x = reference_patched_metric(lm, pair)
    gap = m_c - m_x
    assert abs(gap) > 0.05  # a usable gap, so IE is well defined
    assert res.m_clean[0].item() == pytest.approx(m_c, abs=1e-5)
    assert res.m_corrupt[0].item() == pytest.approx(m_x, abs=1e-5)
    assert torch.allclose(res.patched[0], ref, atol=1e-5, rtol=0)
    ref_ie = (m_c - ref) / gap
    # IE = (m(x) - m_patched) / gap: float32 logit rounding (~1e-6) is divided by the gap
    assert torch.allclose(res.ie[0].double(), ref_ie, atol=1e-5 * max(1.0, 0.1 / abs(gap)), rtol=0)
    # the patch must matter somewhere (the comparison is not between two constants)
    assert float((ref - m_c).abs().max()) > 1e-4


@pytest.mark.parametrize("family", fast_first(["gpt2", "gemma3"]))
def test_generic_path_equals_reference(family, smol_tokenizer, pair):
    lm = tiny_family(family, smol_tokenizer)
    res = receiver_patching(lm, [pair], min_gap=0.0, progress=False, path="generic", batch_size=5)
    assert res.path == "generic"
    ref, m_c, _ = reference_patched_metric(lm, pair)
    assert torch.allclose(res.patched[0], ref, atol=1e-5, rtol=0)
    assert res.m_clean[0].item() == pytest.approx(m_c, abs=1e-5)


def test_unknown_family_runs_generic(smol_tokenizer, pair, monkeypatch):
    """A model type without an adapter (here: GPT-2 under another name) runs through the bridge, with a warning."""
    import headscope.arch.families as fam

    lm = tiny_family("gpt2", smol_tokenizer)
    monkeypatch.delitem(fam.ADAPTERS, "gpt2")
    import headscope.arch as arch

    monkeypatch.setattr(arch, "ADAPTERS", fam.ADAPTERS)
    with pytest.warns(UserWarning, match="generic bridge path"):
        eng = make_engine(lm)
    assert isinstance(eng, BridgeEngine)
    with pytest.raises(Exception, match="no fast-engine adapter"):
        make_engine(lm, "fast")


def test_self_check_refuses_an_unknown_variant(smol_tokenizer):
    """A Llama whose second layer is secretly a parallel-residual block: the adapter assumes sequential,
    the self-check sees the difference at layer 1 and refuses, naming the layer, the part and the fix."""
    lm = tiny_family("llama", smol_tokenizer)
    blk = lm.hf_model.model.layers[1]

    def parallel_forward(self, hidden_states, **kw):
        a, _ = self.self_attn(self.input_layernorm(hidden_states), **kw)
        return hidden_states + a + self.mlp(self.post_attention_layernorm(hidden_states))

    blk.forward = types.MethodType(parallel_forward, blk)
    with pytest.raises(EngineMismatch, match=r"layer 1, layer output .*path='generic'"):
        Engine(lm)
    with pytest.raises(EngineMismatch):
        make_engine(lm)  # auto never falls back silently on a mismatch
    # the generic path still runs it, exactly as the model computes
    pair = niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.5, seed=1)[0]
    res = receiver_patching(lm, [pair], min_gap=0.0, progress=False, path="generic")
    ref, _, _ = reference_patched_metric(lm, pair)
    assert torch.allclose(res.patched[0], ref, atol=1e-5, rtol=0)


def test_tl_sweep_equality_on_gpt2(smol_tokenizer, pair):
    """TransformerLens's own sweep (get_act_patch_attn_head_out_all_pos, denoising) equals the fast engine on GPT-2."""
    from transformer_lens import patching

    from headscope.patching.receivers import sequences
    from headscope.readout import logit_diff

    lm = tiny_family("gpt2", smol_tokenizer)
    b = lm.bridge
    clean, corr, read = sequences(pair)
    _, cache = b.run_with_cache(clean[None], names_filter=lambda n: n.endswith("hook_z"))

    def metric(logits):
        return logit_diff(logits[0, read], pair.answer, pair.counter_answer, 0.9)

    tl = patching.get_act_patch_attn_head_out_all_pos(b, corr[None], cache, metric)
    res = receiver_patching(lm, [pair], lam=0.9, direction="denoising", min_gap=0.0, progress=False)
    assert torch.allclose(res.patched[0].float(), tl.float(), atol=1e-4, rtol=0)


def test_cli_ranks_a_gpt2_directory_on_both_paths(smol_tokenizer, tmp_path):
    """`headscope rank --model DIR` on a saved GPT-2: the fast path (auto) and --path generic give the same table,
    and ranking.json and the printed summary record which path ran."""
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from headscope.cli import app

    d = tmp_path / "gpt2"
    lm = tiny_family("gpt2", smol_tokenizer, seed=3)  # a gap of 0.11 logits on the CLI's default pair
    lm.hf_model.save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    tables = {}
    for path in ("auto", "generic"):
        out = tmp_path / path
        r = CliRunner().invoke(app, ["rank", "--model", str(d), "--pairs", "1", "--seq-len", "64", "--min-gap", "0",
                                     "--budget", "4", "--out", str(out), "--device", "cpu", "--path", path])
        assert r.exit_code == 0, r.output
        prov = json.loads((out / "ranking.json").read_text())
        assert prov["provenance"]["path"] == ("fast" if path == "auto" else "generic")
        summary = [line for line in r.output.splitlines() if " pair(s) of " in line]
        assert len(summary) == 1 and summary[0].endswith(f"; {prov['provenance']['path']} path")  # the summary says it too
        tables[path] = pd.read_csv(out / "scores.csv").sort_values(["layer", "head"])
    a, b = tables["auto"]["ie_recv"].to_numpy(), tables["generic"]["ie_recv"].to_numpy()
    assert abs(a - b).max() < 1e-4 and abs(a).max() > 1e-3


def test_softcapped_model_is_switched_to_eager_attention(smol_tokenizer):
    tok = smol_tokenizer
    """transformers' SDPA does not soft-cap attention logits (5.17 dropped the cap silently, 5.24 raises):
    wrap() switches a Gemma 2 model loaded with SDPA to eager, with a warning, and the fast engine's
    self-check then passes against the model's own (now correct) forward."""
    import warnings as _w

    from headscope.arch.random_models import FAMILIES
    from headscope.models import wrap
    from headscope.patching.engine import Engine

    m = FAMILIES["gemma2"](len(tok), 1)
    m.config._attn_implementation = "sdpa"  # as 5.17 loads it (5.24's set_attn_implementation refuses)
    with _w.catch_warnings(record=True) as rec:
        _w.simplefilter("always")
        lm = wrap(m, tok, name="gemma2-sdpa")
    assert any("soft-caps attention logits" in str(r.message) for r in rec)
    assert m.config._attn_implementation == "eager"
    assert Engine(lm).self_check() < 1e-4
