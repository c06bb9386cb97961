"""Low precision: pairs whose clean–corrupted gap a dtype cannot resolve are reported, by index and gap."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from headscope.patching.receivers import finish, receiver_patching
from headscope.readout import LowPrecisionWarning, answer_logit_scale, low_precision_pairs, min_trusted_gap
from headscope.tasks import niah_single


def test_min_trusted_gap_by_hand():
    # 10 * eps * S: bf16 eps = 2^-7, fp16 2^-10, fp32 2^-23
    assert min_trusted_gap(torch.bfloat16, 37.0) == pytest.approx(10 * 37 / 128)  # 2.890625
    assert min_trusted_gap(torch.float16, 37.0) == pytest.approx(10 * 37 / 1024)  # 0.361
    assert min_trusted_gap(torch.float32, 37.0) == pytest.approx(10 * 37 * 2**-23)  # 4.4e-5
    assert min_trusted_gap(torch.bfloat16, -8.0) == pytest.approx(0.625)


def test_answer_logit_scale_by_hand():
    lg = torch.zeros(2, 6)
    lg[0, 1], lg[0, 4], lg[1, 2], lg[1, 3], lg[1, 5] = 3.0, -7.5, 2.0, 1.0, 99.0  # 99 is no answer token
    assert answer_logit_scale(lg, torch.tensor([1, 2]), torch.tensor([4, 3])) == 7.5


def test_finish_warns_per_dtype():
    gap = torch.tensor([0.3, 3.0, -0.3, 0.05], dtype=torch.float64)
    m_clean = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    m_corr = m_clean - gap
    patched = torch.zeros(4, 1, 2, dtype=torch.float64)
    scale = [37.0, 37.0, None, 37.0]  # None: DEFAULT_LOGIT_SCALE = 30
    # bf16 floors: 2.89 (S = 37), 2.34 (S = 30): pairs 0 and 2 warned; 1 (gap 3.0) not; 3 skipped by min_gap
    with pytest.warns(LowPrecisionWarning) as rec:
        res = finish(patched, m_clean, m_corr, "noising", 0.9, 0.1, dtype=torch.bfloat16, logit_scale=scale)
    msg = " ".join(str(w.message) for w in rec if w.category is LowPrecisionWarning)
    assert "pair 0: |m(x) - m(x')| = 0.3 logits is below 2.89" in msg
    assert "pair 2: |m(x) - m(x')| = 0.3 logits is below 2.34" in msg
    assert "pair 1" not in msg and "pair 3" not in msg
    assert "off by ~0.96" in msg  # eps * S / gap = 37 / 128 / 0.3
    assert res.skipped.keys() == {3} and math.isnan(res.ie[3, 0, 0])
    assert low_precision_pairs(gap, torch.bfloat16, scale, skip=[3]).keys() == {0, 2}
    # fp16 floors: 0.361 (S = 37) catches pair 0 only; 0.293 (S = 30) lets pair 2's 0.3 through
    assert low_precision_pairs(gap, torch.float16, scale, skip=[3]).keys() == {0}
    # fp32 and no dtype (senders / older callers): nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", LowPrecisionWarning)
        finish(patched, m_clean, m_corr, "noising", 0.9, 0.1, dtype=torch.float32, logit_scale=scale)
        finish(patched, m_clean, m_corr, "noising", 0.9, 0.1)


def test_bf16_sweep_warns_and_ie_moves(smol_tokenizer):
    """A tiny random Llama separates a+ from a- by ~0.005 logits: bf16 cannot resolve that, and its
    IE indeed differs from the fp32 IE by more than IE_TOLERANCE, within the eps * S / gap bound."""
    from conftest import tiny_llama

    from headscope.models import wrap

    pairs = niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=0)
    m32 = wrap(tiny_llama(smol_tokenizer), smol_tokenizer)
    m16 = wrap(tiny_llama(smol_tokenizer).to(torch.bfloat16), smol_tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LowPrecisionWarning)
        a = receiver_patching(m32, pairs, min_gap=0.0, progress=False)
    with pytest.warns(LowPrecisionWarning) as rec:
        b = receiver_patching(m16, pairs, min_gap=0.0, progress=False)
    msg = " ".join(str(w.message) for w in rec if w.category is LowPrecisionWarning)
    eps = torch.finfo(torch.bfloat16).eps
    for i, p in enumerate(pairs):
        gap = abs(float(b.m_clean[i] - b.m_corrupt[i]))
        assert f"pair {i}: |m(x) - m(x')| = {gap:.3g} logits" in msg
        seq = torch.cat([p.clean, p.answer[:-1]])
        read = list(range(p.length - 1, p.length - 1 + p.n_answer))
        with torch.no_grad():
            s = answer_logit_scale(m16.hf_model(seq[None]).logits[0, read].float(), p.answer, p.counter_answer)
        d_ie = float((a.ie[i] - b.ie[i]).abs().max())
        assert 0.1 < d_ie <= eps * s / gap


def test_float32_residual_of_bf16_model_nearer_fp32(smol_tokenizer):
    """A bf16 model whose residual stream carries a large shared direction (every embedding row + a unit
    vector, as the planted benchmark model's and the massive activations of trained LLMs): with the residual
    stream, norms and RoPE in float32 (``Precision("float32")``) the patched metrics lie nearer the float32
    forward of the same (bf16) weights than the engine in plain bf16 (measured: max 4.9e-4 vs 1.6e-3 logits);
    on a float32 model the setting changes nothing."""
    from conftest import tiny_llama

    from headscope.models import wrap
    from headscope.patching import Precision
    from headscope.patching.contract import make_engine

    pairs = niah_single(smol_tokenizer, n_pairs=1, seq_len=96, depth=[0.4], seed=1)
    import copy

    hf16 = tiny_llama(smol_tokenizer, n_layers=4, d_model=128).to(torch.bfloat16)
    c = torch.randn(128, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf16.model.embed_tokens.weight.add_((c / c.norm()).to(torch.bfloat16))
    m32 = wrap(copy.deepcopy(hf16).float(), smol_tokenizer)  # the same weights, float32 arithmetic
    m16 = wrap(hf16, smol_tokenizer)
    kw = dict(min_gap=0.0, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LowPrecisionWarning)
        ref = receiver_patching(m32, pairs, **kw)  # float32 engine: self-checked against the model's forward
        same = receiver_patching(m32, pairs, precision=Precision("float32"), **kw)
        plain = receiver_patching(m16, pairs, **kw)
        r32 = receiver_patching(m16, pairs, precision=Precision("float32"), **kw)
    assert torch.equal(same.patched, ref.patched) and same.m_clean.equal(ref.m_clean)
    assert r32.precision == Precision("float32") and plain.precision == Precision()

    def err(r):
        return max(float((r.patched - ref.patched).abs().max()), float((r.m_clean - ref.m_clean).abs().max()),
                   float((r.m_corrupt - ref.m_corrupt).abs().max()))

    e_plain, e_r32 = err(plain), err(r32)
    assert e_r32 < 0.5 * e_plain, (e_r32, e_plain)
    with pytest.raises(ValueError, match="fast engine"):
        make_engine(m16, "generic", Precision("float32"))
    with pytest.raises(ValueError, match="residual"):
        Precision("float16")  # type: ignore[arg-type]
