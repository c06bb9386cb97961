"""Readout (SPEC.md §3; paper eq. 1 and eq. 9): λ-decayed logit difference over the answer span."""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

DEFAULT_LAMBDA = 0.9


def span_weights(n: int, lam: float = DEFAULT_LAMBDA) -> Float[Tensor, "ans"]:
    """λ^j / Σ_j λ^j for j = 0..n-1 (the weights of eq. 9; they sum to 1)."""
    if not 0.0 < lam <= 1.0:
        raise ValueError(f"lambda={lam} must lie in (0, 1]")
    w = torch.tensor([lam**j for j in range(n)], dtype=torch.float64)
    return w / w.sum()


def read_positions(prompt_len: int, n_answer: int) -> list[int]:
    """Positions whose logits predict the answer tokens under teacher forcing.

    The model reads prompt ⊕ a⁺[:-1]; the logits at position ``prompt_len - 1 + j`` predict answer
    token j.
    """
    return [prompt_len - 1 + j for j in range(n_answer)]


def logit_diff(
    logits: Float[Tensor, "... ans vocab"],
    answer: Int[Tensor, "ans"],
    counter_answer: Int[Tensor, "ans"],
    lam: float = DEFAULT_LAMBDA,
) -> Float[Tensor, "..."]:
    """m = (1/Z) Σ_j λ^j (z_j[a⁺_j] − z_j[a⁻_j]), Z = Σ_j λ^j (eq. 9). Units: logits (nats).

    Args:
        logits: logits at the read positions (see :func:`read_positions`), any leading batch dims.
        answer / counter_answer: a⁺ and a⁻ token ids, equal length.
        lam: decay λ (default 0.9); for a single-token answer m is the plain logit difference.

    Raises:
        ValueError: a⁺ and a⁻ of different lengths, or logits not covering the span.
    """
    answer = torch.as_tensor(answer).flatten()
    counter_answer = torch.as_tensor(counter_answer).flatten()
    n = answer.numel()
    if counter_answer.numel() != n:
        raise ValueError(
            f"answer spans of unequal length: a+ has {n} tokens, a- has {counter_answer.numel()}; re-draw the pair"
        )
    if logits.shape[-2] != n:
        raise ValueError(f"logits cover {logits.shape[-2]} positions but the answer has {n} tokens")
    lp = logits.double()
    idx = torch.arange(n, device=logits.device)
    diff = lp[..., idx, answer.to(logits.device)] - lp[..., idx, counter_answer.to(logits.device)]
    return (diff * span_weights(n, lam).to(logits.device)).sum(-1)


def greedy_exact_match(logits: Float[Tensor, "... ans vocab"], answer: Int[Tensor, "ans"]) -> Tensor:
    """True where greedy decoding would emit exactly ``answer``.

    Under teacher forcing with the answer itself, greedy generation reproduces a⁺ iff the argmax at
    every read position equals the next answer token, so this equals generate-then-compare for the
    answer span (one forward instead of |a| decoding steps).
    """
    answer = torch.as_tensor(answer).to(logits.device)
    return (logits.argmax(-1) == answer).all(-1)
