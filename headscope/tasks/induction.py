"""Induction (in-context copying): a random token sequence, then its repetition (Olsson et al. 2022).

x = [BOS] R R[:k]; the answer a⁺ = R[k:k+m] is copied from the first occurrence. x' replaces the
m tokens R[k:k+m] of the first occurrence by other random tokens R'; a⁻ = R'. The evidence span is
those m tokens of the first occurrence (the only tokens that differ).
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from ..errors import HeadscopeInputError
from .base import Pair


def _token_pool(tokenizer: Any, lo: int = 1000, hi: int = 20000) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    hi = min(hi, len(tokenizer))
    lo = min(lo, max(0, hi - 100))
    pool = [t for t in range(lo, hi) if t not in special]
    if len(pool) < 64:
        raise HeadscopeInputError(f"the tokenizer's vocabulary ({len(tokenizer)}) is too small for induction pairs")
    return pool


def induction(
    tokenizer: Any,
    n_pairs: int = 6,
    seq_len: int = 512,
    depth: float | Sequence[float] = 0.5,
    seed: int = 0,
    n_answer: int = 4,
) -> list[Pair]:
    """Repeated-random-token pairs; the prompt is exactly ``seq_len`` tokens.

    Args:
        seq_len: prompt length (>= 2 * n_answer + 2).
        depth: accepted for a uniform interface and validated; the copied span sits where the
            repetition ends (the evidence position is fixed by ``seq_len``).
        n_answer: answer tokens m (a⁺ and a⁻ differ in every token).

    Raises:
        HeadscopeInputError (a ValueError): n_pairs < 1, n_answer < 1, depth outside [0, 1], seq_len too short.
    """
    if n_pairs < 1:
        raise HeadscopeInputError(f"n_pairs={n_pairs}: need at least one calibration pair")
    depths = [depth] if isinstance(depth, (int, float)) else list(depth)
    if not depths or any(not 0.0 <= float(d) <= 1.0 for d in depths):
        raise HeadscopeInputError(f"needle depth {depth} must lie in [0, 1]")
    if n_answer < 1:
        raise HeadscopeInputError(f"n_answer={n_answer} must be >= 1")
    if seq_len < 2 * n_answer + 2:
        raise HeadscopeInputError(f"seq_len={seq_len} is too short for induction with n_answer={n_answer}; raise seq_len")
    pool = _token_pool(tokenizer)
    bos = tokenizer.bos_token_id
    head = [bos] if bos is not None else []
    rng = random.Random(seed)
    body = seq_len - len(head)
    n = (body + 1) // 2  # first occurrence length
    k = body - n  # repeated prefix length, k <= n
    k = min(k, n - n_answer)
    n = body - k
    pairs = []
    for i in range(n_pairs):
        r = rng.sample(pool, n)
        # a different token at each answer position, none of them in R (so the copy is unambiguous)
        rs = set(r)
        repl: list[int] = []
        while len(repl) < n_answer:
            t = rng.choice(pool)
            if t not in rs and t not in repl:
                repl.append(t)
        r2 = r[:k] + repl + r[k + n_answer:]
        clean = head + r + r[:k]
        corr = head + r2 + r[:k]
        ev = (len(head) + k, len(head) + k + n_answer)
        pairs.append(
            Pair(
                torch.tensor(clean),
                torch.tensor(corr),
                torch.tensor(r[k:k + n_answer]),
                torch.tensor(repl),
                ev,
                "induction",
                {"seed": seed, "index": i, "seq_len": seq_len, "length": len(clean), "repeat_offset": k},
            )
        )
    return pairs
