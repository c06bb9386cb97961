import math

import pytest
import torch

from headscope.readout import greedy_exact_match, logit_diff, read_positions, span_weights


def test_three_token_answer_hand_computed():
    vocab = 5
    logits = torch.zeros(3, vocab)
    # a+ = [1, 2, 3], a- = [4, 0, 3]
    logits[0, 1], logits[0, 4] = 2.0, -1.0  # diff 3
    logits[1, 2], logits[1, 0] = 0.5, 1.5  # diff -1
    logits[2, 3] = 7.0  # same token: diff 0
    m = logit_diff(logits, torch.tensor([1, 2, 3]), torch.tensor([4, 0, 3]), lam=0.9)
    expected = (1.0 * 3 + 0.9 * -1 + 0.81 * 0) / (1 + 0.9 + 0.81)
    assert math.isclose(float(m), expected, rel_tol=1e-12)
    assert math.isclose(float(m), 0.7749077490774908, rel_tol=1e-12)


def test_single_token_is_plain_logit_difference():
    logits = torch.tensor([[0.0, 3.0, -2.0]])
    assert float(logit_diff(logits, torch.tensor([1]), torch.tensor([2]))) == 5.0


def test_batched_and_weights():
    torch.manual_seed(0)
    logits = torch.randn(4, 2, 3, 11)
    a, b = torch.tensor([1, 2, 3]), torch.tensor([0, 5, 6])
    m = logit_diff(logits, a, b, lam=0.5)
    assert m.shape == (4, 2)
    w = span_weights(3, 0.5)
    assert torch.allclose(w, torch.tensor([4 / 7, 2 / 7, 1 / 7], dtype=torch.float64))
    ref = sum(w[j] * (logits[1, 1, j, a[j]] - logits[1, 1, j, b[j]]) for j in range(3))
    assert torch.isclose(m[1, 1], ref.double())


def test_errors_and_positions():
    with pytest.raises(ValueError, match="unequal length"):
        logit_diff(torch.zeros(2, 4), torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="lambda"):
        span_weights(2, 0.0)
    assert read_positions(10, 3) == [9, 10, 11]
    logits = torch.zeros(2, 4)
    logits[0, 3] = logits[1, 1] = 1
    assert bool(greedy_exact_match(logits, torch.tensor([3, 1])))
    assert not bool(greedy_exact_match(logits, torch.tensor([3, 2])))
