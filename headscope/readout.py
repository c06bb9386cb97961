"""Readout (SPEC.md §3; paper eq. 1 and eq. 9): λ-decayed logit difference over the answer span."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Literal, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

DEFAULT_LAMBDA = 0.9
#: pairs whose clean–corrupted gap |m(x) − m(x')| is below this (logits) are skipped
DEFAULT_MIN_GAP = 0.1
DIRECTIONS = ("noising", "denoising")
Direction = Literal["noising", "denoising"]


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


# ---- low precision: is a pair's clean–corrupted gap resolvable in this dtype? --------------------
#: IE error above which a pair's gap counts as too small for the dtype (see :func:`min_trusted_gap`).
IE_TOLERANCE = 0.1
#: Answer-logit magnitude assumed when a pair's is unknown (a run resumed from an older store);
#: SmolLM2-135M's answer logits are about 37.
DEFAULT_LOGIT_SCALE = 30.0


class LowPrecisionWarning(UserWarning):
    """A pair's clean–corrupted gap is too small for the model's dtype: its IE carries rounding noise."""


def answer_logit_scale(
    logits: Float[Tensor, "ans vocab"], answer: Int[Tensor, "ans"], counter_answer: Int[Tensor, "ans"]
) -> float:
    """max_j max(|z_j[a⁺_j]|, |z_j[a⁻_j]|): the magnitude of the logits that m is made of (logits)."""
    idx = torch.arange(answer.numel(), device=logits.device)
    z = torch.cat([logits[idx, answer.to(logits.device)], logits[idx, counter_answer.to(logits.device)]])
    return float(z.double().abs().max())


def min_trusted_gap(dtype: torch.dtype, logit_scale: float) -> float:
    """Smallest |m(x) − m(x')| (logits) whose IE the rounding of ``dtype`` moves by at most ~``IE_TOLERANCE``.

    Reasoning: a float format with machine epsilon ε (``torch.finfo(dtype).eps``: bf16 2^-7 ≈ 7.8e-3,
    about 2.4 significant digits; fp16 2^-10; fp32 2^-23) stores a logit of magnitude S to ~ε·S/2,
    and the forward pass adds rounding of the residual stream on top. Measured on SmolLM2-135M (bf16
    against fp32, 16 niah_single runs of 128 tokens, answer logits S ≈ 37): |δm| ≤ 0.4·ε·S. IE =
    (m(x) − m_patched) / gap holds two such errors, so |δIE| ≲ ε·S / |gap|; the gap is trusted when
    that is at most IE_TOLERANCE = 0.1: |gap| ≥ ε·S / 0.1 = 10·ε·S. That is 2.9 logits in bf16 and
    0.36 in fp16 for S = 37, and 4e-5 in fp32 (below the default min_gap: never binding). A 0.3-logit
    gap in bf16 gives ε·S/gap ≈ 1 (issue #15: IE moved by 0.4 against fp32 at such a gap).

    Args:
        dtype: the dtype the model computes in (a floating type).
        logit_scale: S, see :func:`answer_logit_scale` (logits).
    """
    return torch.finfo(dtype).eps * abs(logit_scale) / IE_TOLERANCE


def low_precision_pairs(
    gap: Float[Tensor, "pair"], dtype: torch.dtype, logit_scale: Sequence[float | None] | None = None,
    skip: Iterable[int] = (),
) -> dict[int, str]:
    """Pairs (not in ``skip``) whose |gap| is below :func:`min_trusted_gap` for ``dtype``, with the reason.

    ``logit_scale``: per pair S (None entries, or no list: :data:`DEFAULT_LOGIT_SCALE`).
    """
    out: dict[int, str] = {}
    skip = set(skip)
    for i, gp in enumerate(gap.tolist()):
        s = logit_scale[i] if logit_scale is not None and logit_scale[i] is not None else DEFAULT_LOGIT_SCALE
        floor = min_trusted_gap(dtype, s)
        if i not in skip and abs(gp) < floor:
            err = torch.finfo(dtype).eps * s / max(abs(gp), 1e-30)
            out[i] = (
                f"pair {i}: |m(x) - m(x')| = {abs(gp):.3g} logits is below {floor:.3g}, the smallest gap "
                f"{str(dtype).replace('torch.', '')} resolves for answer logits of magnitude {s:.3g}; its IE may be "
                f"off by ~{min(err, 99):.2g}"
            )
    return out


def normalized_ie(patched: Tensor, m_clean: Tensor | float, m_corrupt: Tensor | float, direction: str) -> Tensor:
    """Receiver IE of patched metrics (paper eq. 10), the one place it is written:

        noising:   IE = (m(x) − m_patched) / (m(x) − m(x'))
        denoising: IE = (m_patched − m(x')) / (m(x) − m(x'))

    ``patched``, ``m_clean``, ``m_corrupt`` broadcast (logits). 1 = the patch moves the whole gap.

    Raises:
        ValueError: a direction other than ``"noising"`` / ``"denoising"``.
    """
    gap = m_clean - m_corrupt
    if direction == "noising":
        return (m_clean - patched) / gap
    if direction == "denoising":
        return (patched - m_corrupt) / gap
    raise ValueError(f"direction must be 'noising' or 'denoising', not {direction!r}")


@dataclass(frozen=True)
class Readout:
    """The readout of a patching experiment as one value: the metric m (eq. 9), the patch direction and
    the normalization into IE (eq. 10), bound once into each pair's state
    (:class:`~headscope.patching.receivers.PairState`); the engine never sees λ.

    Attributes:
        lam: decay λ ∈ (0, 1] of the answer-span logit difference (eq. 9; default 0.9).
        direction: ``"noising"`` (clean run, patch from x'; default) or ``"denoising"``.
        min_gap: pairs with |m(x) − m(x')| below this (logits, ≥ 0; default 0.1) are skipped.

    Raises:
        HeadscopeInputError (a ValueError): λ outside (0, 1], an unknown direction, a negative
            or non-finite min_gap (checked once, when the value is made).
    """

    lam: float = DEFAULT_LAMBDA
    direction: Direction = "noising"
    min_gap: float = DEFAULT_MIN_GAP

    def __post_init__(self) -> None:
        from .validate import check_choice, check_real

        check_real("lam", self.lam, 0.0, 1.0, lo_open=True, fix="λ weighs answer token j by λ^j; 0.9 is the default")
        check_choice("direction", self.direction, DIRECTIONS)
        check_real("min_gap", self.min_gap, 0.0, fix="it is a logit difference; 0 keeps every pair")
        object.__setattr__(self, "lam", float(self.lam))
        object.__setattr__(self, "min_gap", float(self.min_gap))

    def metric(
        self, logits: Float[Tensor, "... ans vocab"], answer: Int[Tensor, "ans"], counter_answer: Int[Tensor, "ans"]
    ) -> Float[Tensor, "..."]:
        """m (eq. 9, logits) of ``logits`` at the read positions: :func:`logit_diff` with this λ."""
        return logit_diff(logits, answer, counter_answer, self.lam)

    def normalized_ie(self, patched: Tensor, m_clean: Tensor | float, m_corrupt: Tensor | float) -> Tensor:
        """IE (eq. 10) of patched metrics in this direction; see :func:`normalized_ie`."""
        return normalized_ie(patched, m_clean, m_corrupt, self.direction)

    def to_dict(self) -> dict[str, Any]:
        """``{"lam", "direction", "min_gap"}`` (JSON-able; what provenance and stores record)."""
        return asdict(self)

    @classmethod
    def resolve(
        cls, readout: "Readout | None" = None, lam: float | None = None, direction: str | None = None,
        min_gap: float | None = None,
    ) -> "Readout":
        """The readout of a call that takes ``readout=`` and the older ``lam=`` / ``direction=`` /
        ``min_gap=`` keywords: ``readout`` when given (the keywords must then be None or agree with it),
        else a Readout built from the keywords (defaults for those left None).

        Raises:
            HeadscopeInputError: a keyword that contradicts ``readout``; bad values (see the class).
        """
        kw = {k: v for k, v in (("lam", lam), ("direction", direction), ("min_gap", min_gap)) if v is not None}
        if readout is None:
            return cls(**kw)  # type: ignore[arg-type]
        if not isinstance(readout, Readout):
            from .errors import InputTypeError

            raise InputTypeError(f"readout must be a headscope.readout.Readout, not {type(readout).__name__}")
        clash = {k: v for k, v in kw.items() if getattr(readout, k) != v}
        if clash:
            from .errors import HeadscopeInputError

            raise HeadscopeInputError(
                f"{', '.join(f'{k}={v!r}' for k, v in clash.items())} contradicts readout={readout}; pass one of them"
            )
        return readout
