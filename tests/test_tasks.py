import pytest
import torch

from headscope.tasks import Pair, PairError, make_pairs, niah_single


def test_niah_single_contract(smol_tokenizer):
    tok = smol_tokenizer
    pairs = niah_single(tok, n_pairs=4, seq_len=128, depth=[0.2, 0.8], seed=7)
    for p in pairs:
        assert p.length == p.corrupted.numel() <= 128
        diff = (p.clean != p.corrupted).nonzero().flatten().tolist()
        s, e = p.evidence
        assert diff and s == diff[0] and e == diff[-1] + 1
        # the evidence is exactly the needle value's digits, one token each for SmolLM2
        assert tok.decode(p.clean[s:e]) == p.meta["value"]
        assert tok.decode(p.corrupted[s:e]) == p.meta["counter_value"]
        # the space before the number is its own token and belongs to the prompt, not the answer
        assert tok.convert_ids_to_tokens(int(p.clean[-1])) == "Ġ"
        assert tok.convert_ids_to_tokens(p.answer.tolist()) == list(p.meta["value"])
        assert p.answer.numel() == p.counter_answer.numel() == 4
        assert (p.answer != p.counter_answer).all()
    # depth moves the needle
    assert pairs[0].evidence[0] < pairs[1].evidence[0]


def test_seeded(smol_tokenizer):
    a = niah_single(smol_tokenizer, n_pairs=2, seq_len=96, seed=3)
    b = niah_single(smol_tokenizer, n_pairs=2, seq_len=96, seed=3)
    c = niah_single(smol_tokenizer, n_pairs=2, seq_len=96, seed=4)
    assert all(torch.equal(x.clean, y.clean) for x, y in zip(a, b))
    assert not torch.equal(a[0].answer, c[0].answer)


def test_bad_input(smol_tokenizer):
    with pytest.raises(ValueError, match="at least one"):
        niah_single(smol_tokenizer, n_pairs=0)
    with pytest.raises(ValueError, match="depth"):
        niah_single(smol_tokenizer, n_pairs=1, depth=1.5)
    with pytest.raises(ValueError, match="raise seq_len"):
        niah_single(smol_tokenizer, n_pairs=1, seq_len=10)
    with pytest.raises(ValueError, match="unknown task"):
        make_pairs("niah_everything", smol_tokenizer)
    with pytest.raises(PairError, match=r"clean prompt has 3 tokens but corrupted has 2"):
        Pair(torch.tensor([1, 2, 3]), torch.tensor([1, 2]), torch.tensor([5]), torch.tensor([6]), (1, 2))
    with pytest.raises(PairError, match="a\\+ has 2 tokens but a- has 1"):
        Pair(torch.tensor([1, 2, 3]), torch.tensor([1, 4, 3]), torch.tensor([5, 6]), torch.tensor([6]), (1, 2))


def test_corpus_filler(smol_tokenizer, tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("Alpha beta gamma. Delta has 3 legs. Epsilon zeta eta. Theta iota kappa lambda.")
    p = niah_single(smol_tokenizer, n_pairs=1, seq_len=120, corpus=str(f))[0]
    text = smol_tokenizer.decode(p.clean)
    assert "Epsilon zeta eta." in text and "3 legs" not in text
    with pytest.raises(FileNotFoundError, match="does not exist"):
        niah_single(smol_tokenizer, n_pairs=1, corpus=str(tmp_path / "nope.txt"))
