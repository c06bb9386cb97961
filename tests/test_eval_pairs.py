"""Evaluation prompts: the filler fit (gallop + bisection) against the one-sentence-at-a-time search,
and the prompt cache of :func:`headscope.evaluation.accuracy.eval_pairs`."""

from __future__ import annotations

import gzip
import json
import random

import pytest
import torch

from headscope.tasks import make_pairs
from headscope.tasks.filler import Filler
from headscope.tasks.niah import _ids, _fit_filler
from headscope.evaluation.accuracy import eval_pairs


def _fit_linear(tok, make_text, filler, seq_len, seed):
    """The reference: the longest prefix of the (over-long) draw that fits, found one sentence at a time."""
    base = len(_ids(tok, make_text([])))
    probe = filler.take(20, random.Random(seed))
    per = max(1.0, (len(_ids(tok, make_text(probe))) - base) / 20)
    n = int((seq_len - base) / per) + 2
    sentences = filler.take(n, random.Random(seed))
    while n > 0 and len(_ids(tok, make_text(sentences[:n]))) > seq_len:
        n -= 1
    return sentences[:n]


@pytest.mark.parametrize("seq_len", [64, 200, 777, 1500])
def test_fit_filler_equals_linear_search(smol_tokenizer, seq_len):
    filler = Filler(None)
    for seed in range(4):
        # a prompt whose per-sentence estimate overshoots by a varying amount (long fixed text, odd spacing)
        def make_text(s, k=seed):
            return "Intro. " * (3 * k) + " ".join(s) + "\nQuestion?"

        got = _fit_filler(smol_tokenizer, make_text, filler, seq_len, seed)
        ref = _fit_linear(smol_tokenizer, make_text, filler, seq_len, seed)
        assert got == ref
        assert len(_ids(smol_tokenizer, make_text(got))) <= seq_len
        assert len(_ids(smol_tokenizer, make_text(filler.take(len(got) + 1, random.Random(seed))))) > seq_len


def test_eval_pairs_cache_round_trip(smol_tokenizer, tmp_path, monkeypatch):
    fresh = make_pairs("niah_single", smol_tokenizer, n_pairs=3, seq_len=160, depth=[0.0, 0.5, 1.0], seed=7)
    a = eval_pairs(smol_tokenizer, "niah_single", 160, 3, seed=7, cache_dir=tmp_path)
    assert [p.clean.tolist() for p in a] == [p.clean.tolist() for p in fresh]
    assert [p.answer.tolist() for p in a] == [p.answer.tolist() for p in fresh]
    f = tmp_path / "niah_single@160_n3_s7.json.gz"
    assert f.exists() and not list(tmp_path.glob("*.tmp"))
    # the second call reads the file: building is not called again
    import headscope.tasks as tasks

    monkeypatch.setattr(tasks, "make_pairs", lambda *a, **k: pytest.fail("rebuilt despite the cache"))
    b = eval_pairs(smol_tokenizer, "niah_single", 160, 3, seed=7, cache_dir=tmp_path)
    assert [p.clean.tolist() for p in b] == [p.clean.tolist() for p in a]
    # a file of another tokenizer is rebuilt, not trusted
    monkeypatch.undo()
    d = json.loads(gzip.decompress(f.read_bytes()))
    d["ident"]["vocab"] += 1
    d["pairs"] = d["pairs"][:1]
    f.write_bytes(gzip.compress(json.dumps(d).encode()))
    c = eval_pairs(smol_tokenizer, "niah_single", 160, 3, seed=7, cache_dir=tmp_path)
    assert len(c) == 3 and json.loads(gzip.decompress(f.read_bytes()))["ident"]["vocab"] == len(smol_tokenizer)


def test_evaluate_saves_each_cell_and_resumes(smol_tokenizer, tmp_path, monkeypatch):
    """With ``partial``, every finished cell is on disk at once; a second call after a crash reads the
    finished cells back (never recomputed) and computes only the missing ones, equal to a fresh run."""
    import json

    import headscope.evaluation.accuracy as ev_mod
    from conftest import tiny_llama

    model = tiny_llama(smol_tokenizer, seed=0, n_layers=1, n_heads=2, n_kv=2, d_model=32)
    kw = dict(tasks=["niah_single"], lengths=[96, 128], n=2, batch_size=4, cache_dir=tmp_path / "pairs")
    fresh = ev_mod.evaluate(model, smol_tokenizer, None, **kw)
    pf = tmp_path / "eval.partial.json"
    real = ev_mod.retrieval_accuracy
    calls = []

    def crash_on_second(*a, **k):
        calls.append(a[3])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies in the middle of the second cell
        return real(*a, **k)

    monkeypatch.setattr(ev_mod, "retrieval_accuracy", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        ev_mod.evaluate(model, smol_tokenizer, None, partial=pf, **kw)
    saved = json.loads(pf.read_text())
    assert list(saved) == ["_meta", "niah_single@96"] and saved["niah_single@96"] == fresh["niah_single@96"]
    # mark the saved cell so that a recomputation would show; resume: only the second cell is computed
    saved["niah_single@96"]["hits"] = -7
    pf.write_text(json.dumps(saved))
    calls.clear()
    monkeypatch.setattr(ev_mod, "retrieval_accuracy", lambda *a, **k: (calls.append(a[3]), real(*a, **k))[1])
    got = ev_mod.evaluate(model, smol_tokenizer, None, partial=pf, **kw)
    assert calls == [128]
    assert got["niah_single@96"]["hits"] == -7 and got["niah_single@128"] == fresh["niah_single@128"]
    assert json.loads(pf.read_text()) == {"_meta": {"n": 2, "seed": 1234}, **got}
    # only the requested cells come back; a file of other settings (n) is not trusted
    assert list(ev_mod.evaluate(model, smol_tokenizer, None, **{**kw, "lengths": [128]}, partial=pf)) == ["niah_single@128"]
    calls.clear()
    with pytest.warns(UserWarning, match="other settings"):
        again = ev_mod.evaluate(model, smol_tokenizer, None, **{**kw, "n": 3}, partial=pf)
    assert calls == [96, 128] and again["niah_single@96"]["n"] == 3


@pytest.mark.parametrize("seq_len", [700, 1500])
def test_fit_filler_fills_when_the_first_guess_is_short(smol_tokenizer, seq_len):
    """The first 20 sentences of the draw are long, the rest short: the guess from them undershoots (the conversion
    study's haystack gave 56,177 tokens asked 65,536 that way). The fit must still be the longest prefix that fits,
    found here one sentence at a time from none."""
    seed, n_sent = 3, 400
    start = random.Random(seed).randrange(n_sent)
    long_s = "The old harbour keeper walked along the grey wall and counted every boat that came back in the evening."
    short = ["Rain fell.", "Birds sang.", "Wind rose."]
    ring = [long_s if i < 20 else short[i % 3] for i in range(n_sent)]
    filler = Filler.from_texts([" ".join(ring[(i - start) % n_sent] for i in range(n_sent))], source="test")
    assert filler.take(21, random.Random(seed))[19:] == [long_s, short[20 % 3]]

    def make_text(s):
        return "Story: " + " ".join(s) + "\nWhat is the code?"

    got = _fit_filler(smol_tokenizer, make_text, filler, seq_len, seed)
    k = 0
    while len(_ids(smol_tokenizer, make_text(filler.take(k + 1, random.Random(seed))))) <= seq_len:
        k += 1
    assert got == filler.take(k, random.Random(seed)) and k > 20
    per_long = (len(_ids(smol_tokenizer, make_text(filler.take(20, random.Random(seed)))))
                - len(_ids(smol_tokenizer, make_text([])))) / 20
    assert k > int(seq_len / per_long) + 2  # the first guess alone would have been short
    assert seq_len - len(_ids(smol_tokenizer, make_text(got))) < 10
