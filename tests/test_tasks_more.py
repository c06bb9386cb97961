import pytest
import torch

from headscope.tasks import TASKS, induction, make_pairs, niah_multikey, niah_multivalue, variable_tracking


@pytest.mark.parametrize("task", ["niah_multikey", "niah_multivalue", "variable_tracking", "induction"])
def test_contract_and_seeding(smol_tokenizer, task):
    tok = smol_tokenizer
    pairs = make_pairs(task, tok, n_pairs=3, seq_len=160, seed=5, depth=0.4)
    again = make_pairs(task, tok, n_pairs=3, seq_len=160, seed=5, depth=0.4)
    other = make_pairs(task, tok, n_pairs=3, seq_len=160, seed=6, depth=0.4)
    assert all(torch.equal(a.clean, b.clean) and torch.equal(a.answer, b.answer) for a, b in zip(pairs, again))
    assert any(not torch.equal(a.clean, b.clean) for a, b in zip(pairs, other))
    for p in pairs:
        assert p.task == task and p.length == p.corrupted.numel() <= 160
        assert p.answer.numel() == p.counter_answer.numel() and (p.answer != p.counter_answer).all()
        s, e = p.evidence
        # the evidence span holds the clean answer's tokens: the value the model must copy
        assert p.clean[s:e].tolist()[-p.answer.numel():] == p.answer.tolist()
        diff = (p.clean != p.corrupted).nonzero().flatten().tolist()
        if task == "niah_multikey":
            # x' asks for another key: the tokens that differ are the query key, after the evidence,
            # and the counter answer is another needle's value present in x
            assert diff[0] >= e and p.meta["diff_span"] == [diff[0], diff[-1] + 1]
            assert tok.decode(p.clean[diff[0]:diff[-1] + 1]).strip().startswith(p.meta["query_key"])
            assert f"is: {tok.decode(p.counter_answer)}." in tok.decode(p.clean)
        else:
            assert (s, e) == (diff[0], diff[-1] + 1)


def test_values_and_structure(smol_tokenizer):
    tok = smol_tokenizer
    vt = variable_tracking(tok, n_pairs=1, seq_len=200, n_hops=2, seed=1)[0]
    text = tok.decode(vt.clean)
    a, b, c = vt.meta["chain"]
    assert f"VAR {a} = {vt.meta['value']}." in text and f"VAR {b} = {a}." in text and f"VAR {c} = {b}." in text
    assert text.rstrip().endswith(f"The value of {c} is")
    mv = niah_multivalue(tok, n_pairs=1, seq_len=200, n_values=3, seed=2)[0]
    assert tok.decode(mv.clean).count(f"numbers for {mv.meta['key']} is:") == 3
    ind = induction(tok, n_pairs=1, seq_len=101, n_answer=3, seed=0)[0]
    k = ind.meta["repeat_offset"]
    body = ind.clean[1:].tolist()
    n = len(body) - k
    assert ind.length == 101 and body[n:] == body[:k] and ind.answer.tolist() == body[k:k + 3]
    assert ind.corrupted[1:][k:k + 3].tolist() == ind.counter_answer.tolist()


def test_bad_input_more(smol_tokenizer):
    with pytest.raises(ValueError, match="n_keys"):
        niah_multikey(smol_tokenizer, n_pairs=1, n_keys=1)
    with pytest.raises(ValueError, match="depth"):
        variable_tracking(smol_tokenizer, n_pairs=1, depth=-0.1)
    with pytest.raises(ValueError, match="raise seq_len"):
        induction(smol_tokenizer, n_pairs=1, seq_len=5)
    with pytest.raises(ValueError, match="at least one"):
        niah_multivalue(smol_tokenizer, n_pairs=0)
    assert {"niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "induction"} <= set(TASKS)


def test_corpus_replaces_filler(smol_tokenizer, tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("Alpha beta gamma. Delta epsilon. Zeta eta theta. Iota kappa.")
    p = niah_multikey(smol_tokenizer, n_pairs=1, seq_len=150, corpus=str(f))[0]
    assert "Zeta eta theta." in smol_tokenizer.decode(p.clean) and "grass" not in smol_tokenizer.decode(p.clean)
