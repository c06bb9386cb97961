"""A converted folder (``hybridize`` + ``save_pretrained`` + the tokenizer) as a model of its own: ``load_model`` loads
it, ``headscope rank`` ranks its FA and GDN heads on the hybrid path, ``headscope anatomy`` reads it (DLA adding up
to the model's own logit difference, the layer cosine from its layer outputs, the FA / GDN summary), and the
knockout API ablates its heads."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_llama
from headscope.cli import app
from headscope.masks import HeadMask

MASK = HeadMask.from_heads([(0, 1), (1, 2)], n_layers=2, n_heads=4, n_kv_heads=2)


@pytest.fixture(scope="module")
def converted(smol_tokenizer, tmp_path_factory):
    """(folder, the in-memory hybrid it was saved from)."""
    from headscope import hybridize

    d = tmp_path_factory.mktemp("converted") / "stage3"
    student = hybridize(tiny_llama(smol_tokenizer, seed=2, n_layers=2, n_heads=4, n_kv=2, d_model=32), MASK)
    student.save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    return d, student


def test_load_model_reads_a_converted_folder(converted):
    import headscope
    from headscope.models import is_hybrid

    d, student = converted
    assert is_hybrid(d) and not is_hybrid(d.parent / "missing")
    lm = headscope.load_model(d, device="cpu")
    assert type(lm.hf_model).__name__ == "HybridLlamaForCausalLM" and is_hybrid(lm)
    assert lm.hf_model.config.headscope_hybrid["mask"]["fa_heads"] == MASK.to_dict()["fa_heads"]
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lm.hf_model(ids).logits, student(ids).logits)


def test_rank_and_anatomy_of_a_converted_folder(converted, tmp_path):
    from headscope.models import load_model
    from headscope.patching.hybrid_engine import head_kinds
    from headscope.scores import Ranking
    from headscope.analysis.student_anatomy import kind_summary, rank_heads
    from headscope.tasks import make_pairs

    d, _ = converted
    out = tmp_path / "rank"
    res = CliRunner().invoke(app, ["rank", "--model", str(d), "--pairs", "2", "--seq-len", "64", "--min-gap", "0",
                                   "--budget", "2", "--out", str(out), "--device", "cpu"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert "hybrid path" in res.output and " kind " in res.output
    r = Ranking.load(out)
    kinds = {(int(a), int(b)): k for a, b, k in zip(r.scores["layer"], r.scores["head"], r.scores["kind"])}
    assert {h for h, k in kinds.items() if k == "fa"} == {(0, 1), (1, 2)} and len(kinds) == 8
    assert r.provenance["path"] == "hybrid" and r.provenance["hybrid"] is True
    # the same IE as the student anatomy's ranking of the loaded folder on the run's pairs
    lm = load_model(d, device="cpu")
    s = r.provenance["task_settings"]
    pairs = make_pairs("niah_single", lm.tokenizer, n_pairs=2, seq_len=s["seq_len"], depth=s["depth"], seed=s["seed"])
    ref = rank_heads(lm, pairs, readout=__import__("headscope").Readout(min_gap=0.0))
    assert torch.allclose(r.ie, ref.ie, atol=1e-5, rtol=1e-4)
    assert [k for row in head_kinds(lm.hf_model) for k in row] == ref.scores.sort_values(["layer", "head"])["kind"].tolist()

    res = CliRunner().invoke(app, ["anatomy", str(out), "--format", "html", "--boot", "10", "--device", "cpu"])
    assert res.exit_code == 0, (res.output, res.exception)
    got = json.loads((out / "anatomy" / "kinds.json").read_text())
    assert got == json.loads(json.dumps(kind_summary(r, threshold=0.1)))
    assert got["fa"]["n_heads"] == 2 and got["gdn"]["n_heads"] == 6 and "FA heads: 2" in res.output
    a = json.loads((out / "anatomy" / "anatomy.json").read_text())
    assert "dla" in a and "cosine" in a


def test_dla_and_cosine_of_a_converted_model_add_up(converted):
    """DLA: the heads and the other components add up to the total, which equals m from the model's own logits
    (the frozen final norm is exact at the run's residual); the cosine's entries are the cosines of the layers' outputs
    (``output_hidden_states``) at the read positions."""
    from headscope.analysis.dla import direct_logit_attribution, layer_cosine
    from headscope.models import load_model
    from headscope.patching.receivers import sequences
    from headscope.tasks import make_pairs

    d, _ = converted
    lm = load_model(d, device="cpu")
    pairs = make_pairs("niah_single", lm.tokenizer, n_pairs=2, seq_len=64, seed=1)
    dla = direct_logit_attribution(lm, pairs, lam=0.9)
    assert dla.heads.shape == (2, 2, 4)
    sums = dla.heads.sum((1, 2)) + dla.other.sum(1)
    assert torch.allclose(sums, dla.total, atol=1e-6) and torch.allclose(dla.total, dla.m.double(), atol=1e-4)
    assert dla.components == ["embed", "mlp.0", "mlp.1"]
    cos = layer_cosine(lm, pairs)
    want = np.zeros((2, 2))
    for p in pairs:
        clean, corr, read = sequences(p)
        with torch.no_grad():
            hc = lm.hf_model(clean[None], output_hidden_states=True).hidden_states
            hx = lm.hf_model(corr[None], output_hidden_states=True).hidden_states
        a = torch.nn.functional.normalize(hc[1][0, read].double(), dim=-1)
        b = torch.nn.functional.normalize(hx[1][0, read].double(), dim=-1)
        want[0, 0] += float((a * b).sum(-1).mean())
    assert cos[0, 0] == pytest.approx(want[0, 0] / len(pairs), abs=1e-6)
    assert np.all(np.abs(cos) <= 1 + 1e-9)


def test_knockout_api_on_a_converted_folder(converted):
    """headscope.ablate zeroes a head's columns of o_proj's input (checked against a forward with those columns zeroed
    by hand), and retrieval_accuracy under it equals a brute-force greedy check of the prompts."""
    import headscope
    from headscope.hybrid.modeling_hybrid import decoder_layers
    from headscope.tasks import make_pairs

    d, _ = converted
    lm = headscope.load_model(d, device="cpu")
    pairs = make_pairs("niah_single", lm.tokenizer, n_pairs=3, seq_len=64, seed=2)
    ids = torch.cat([pairs[0].clean, pairs[0].answer[:-1]])[None]
    o = decoder_layers(lm.hf_model)[1].self_attn.o_proj
    dh = lm.geometry.d_head

    def zero_head(m, args):
        x = args[0].clone()
        x[..., 2 * dh:3 * dh] = 0
        return (x,)

    h = o.register_forward_pre_hook(zero_head)
    with torch.no_grad():
        want = lm.hf_model(ids).logits
    h.remove()
    with torch.no_grad(), headscope.ablate(lm, [(1, 2)], "zero"):
        got = lm.hf_model(ids).logits
        acc = headscope.retrieval_accuracy(lm, pairs)
        brute = []
        for p in pairs:
            lg = lm.hf_model(torch.cat([p.clean, p.answer[:-1]])[None]).logits[0]
            brute.append(all(int(lg[p.length - 1 + j].argmax()) == int(p.answer[j]) for j in range(p.n_answer)))
    assert torch.allclose(got, want, atol=1e-6) and not torch.allclose(got, lm.hf_model(ids).logits, atol=1e-3)
    assert acc == pytest.approx(sum(brute) / 3)
