"""Calibration pairs (SPEC.md §2): clean prompt x, counterfactual x', answers a⁺ and a⁻."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from ..errors import HeadscopeInputError


class PairError(HeadscopeInputError):
    """A calibration pair violates the contract of SPEC.md §2 (a HeadscopeInputError, so a ValueError)."""


@dataclass(frozen=True)
class Pair:
    """One calibration pair; checked on construction (:func:`validate_pair`, raises :class:`PairError`).

    Attributes:
        clean: Int[Tensor, "pos"] token ids of the clean prompt x.
        corrupted: Int[Tensor, "pos"] token ids of the counterfactual x' (same length as ``clean``).
        answer: Int[Tensor, "ans"] clean answer span a⁺ (read under teacher forcing).
        counter_answer: Int[Tensor, "ans"] counterfactual answer a⁻ (same length as ``answer``).
        evidence: (start, end) token positions, end exclusive, of the evidence span in the prompt.
        task: capability name; meta: generator settings (seed, length, depth, values...).
    """

    clean: Int[Tensor, "pos"]
    corrupted: Int[Tensor, "pos"]
    answer: Int[Tensor, "ans"]
    counter_answer: Int[Tensor, "ans"]
    evidence: tuple[int, int]
    task: str = "custom"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("clean", "corrupted", "answer", "counter_answer"):
            v = torch.as_tensor(getattr(self, name), dtype=torch.long).flatten()
            object.__setattr__(self, name, v)
        validate_pair(self)

    @property
    def length(self) -> int:
        """Prompt length in tokens (without the answer)."""
        return int(self.clean.numel())

    @property
    def n_answer(self) -> int:
        return int(self.answer.numel())

    def first_diff(self) -> int:
        """First position where clean and corrupted prompts differ (== length if identical)."""
        diff = (self.clean != self.corrupted).nonzero()
        return int(diff[0]) if len(diff) else self.length

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "clean": self.clean.tolist(),
            "corrupted": self.corrupted.tolist(),
            "answer": self.answer.tolist(),
            "counter_answer": self.counter_answer.tolist(),
            "evidence": list(self.evidence),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Pair":
        return cls(
            torch.tensor(d["clean"]),
            torch.tensor(d["corrupted"]),
            torch.tensor(d["answer"]),
            torch.tensor(d["counter_answer"]),
            tuple(d["evidence"]),
            d.get("task", "custom"),
            dict(d.get("meta", {})),
        )


def validate_pair(p: Pair, decode: Callable[[Sequence[int]], str] | None = None) -> None:
    """Raise :class:`PairError` naming the fix when ``p`` breaks the pair contract: prompts or answers
    of different lengths, an empty answer, the same answer for a⁺ and a⁻ (its gap would be 0 by
    construction), or an evidence span outside the prompt."""

    def show(ids: Tensor) -> str:
        return repr(decode(ids.tolist())) if decode else str(ids.tolist()[:12]) + ("..." if ids.numel() > 12 else "")

    if p.clean.numel() != p.corrupted.numel():
        raise PairError(
            f"clean prompt has {p.clean.numel()} tokens but corrupted has {p.corrupted.numel()} "
            f"(clean={show(p.clean)}, corrupted={show(p.corrupted)}); x and x' must tokenize to the same "
            "length: change only the evidence, with values of equal token length"
        )
    if p.answer.numel() != p.counter_answer.numel():
        raise PairError(
            f"answer a+ has {p.answer.numel()} tokens but a- has {p.counter_answer.numel()} "
            f"(a+={show(p.answer)}, a-={show(p.counter_answer)}); re-draw values of equal token length"
        )
    if p.answer.numel() < 1:
        raise PairError("the answer span is empty; a pair needs at least one answer token")
    if torch.equal(p.answer, p.counter_answer):
        raise PairError(
            f"answer a+ and counter_answer a- are the same tokens ({show(p.answer)}), so the gap m(x) - m(x') "
            "is 0 by construction; give a counterfactual answer that differs from the clean one"
        )
    s, e = p.evidence
    if not 0 <= s < e <= p.clean.numel():
        raise PairError(f"evidence span {p.evidence} is not a non-empty range inside the prompt of {p.clean.numel()} tokens")
