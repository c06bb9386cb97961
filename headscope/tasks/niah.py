"""Needle-in-a-haystack capabilities (RULER NIAH-single; passkey retrieval).

The pair builder here is shared by every capability: a prompt text with an evidence slot,
tokenized for the clean and the counterfactual value, checked for equal length, with the answer
span read from the tokenized prompt+answer so that tokenizers that split the space before a number
into its own token (SmolLM2) put that token in the prompt, not in the answer span.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import torch

from ..errors import HeadscopeInputError
from .base import Pair, PairError
from .filler import Filler

MAX_REDRAWS = 50

INTRO = (
    "There is a special magic number hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it later."
)
NEEDLE = "The special magic number is {value}."
QUESTION = "What is the special magic number? The special magic number is"


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def draw_value(rng: random.Random, n_digits: int, avoid: str | None = None) -> str:
    """A random n-digit number (no leading zero); with ``avoid``, differs from it in every digit."""
    while True:
        v = str(rng.randrange(10 ** (n_digits - 1), 10**n_digits))
        if avoid is None or all(a != b for a, b in zip(v, avoid)):
            return v


def build_pair(
    tokenizer: Any,
    render: Callable[[str, str], str],
    value: str,
    counter_value: str,
    query_value: str | None = None,
    answer_value: str | None = None,
    counter_answer_value: str | None = None,
    task: str = "custom",
    meta: dict[str, Any] | None = None,
) -> Pair:
    """Tokenize a clean/counterfactual prompt pair and its answer spans.

    Args:
        render: ``render(evidence_value, query_key) -> prompt text`` (the prompt ends right before
            the answer, without the trailing space).
        value / counter_value: evidence in x and in x'.
        answer_value / counter_answer_value: the answers a⁺ / a⁻ (default: ``value`` / ``counter_value``).

    Raises:
        PairError: unequal token lengths (the caller re-draws) or a tokenization in which the prompt
            is not a prefix of prompt+answer.
    """
    a_pos = answer_value if answer_value is not None else value
    a_neg = counter_answer_value if counter_answer_value is not None else counter_value
    text_x = render(value, query_value or "")
    text_cx = render(counter_value, query_value or "")
    full = _ids(tokenizer, text_x + " " + a_pos)
    alt = _ids(tokenizer, text_x + " " + a_neg)
    if len(full) != len(alt):
        raise PairError(f"answers {a_pos!r} and {a_neg!r} tokenize to different lengths")
    c = 0
    while c < len(full) and full[c] == alt[c]:
        c += 1
    if c == len(full):
        raise PairError(f"answers {a_pos!r} and {a_neg!r} tokenize identically")
    full_c = _ids(tokenizer, text_cx + " " + a_pos)
    if len(full_c) != len(full) or full_c[c:] != full[c:]:
        raise PairError(f"evidence values {value!r} and {counter_value!r} tokenize to different lengths")
    clean, corrupted = full[:c], full_c[:c]
    diff = [i for i, (u, v) in enumerate(zip(clean, corrupted)) if u != v]
    if not diff:
        raise PairError("clean and corrupted prompts are identical")
    evidence = (diff[0], diff[-1] + 1)
    m = dict(meta or {})
    m.update({"value": a_pos, "counter_value": a_neg, "evidence_value": value, "counter_evidence_value": counter_value})
    return Pair(
        torch.tensor(clean),
        torch.tensor(corrupted),
        torch.tensor(full[c:]),
        torch.tensor(alt[c:]),
        evidence,
        task,
        m,
    )


def _fit_filler(
    tokenizer: Any,
    make_text: Callable[[list[str]], str],
    filler: Filler,
    seq_len: int,
    rng_seed: int,
    max_sentences: int = 100_000,
) -> list[str]:
    """Most filler sentences such that ``make_text(sentences)`` stays within ``seq_len`` tokens: a first guess from
    20 sentences' tokens, then galloping up (a guess that fits: more sentences are drawn, the draw's prefix unchanged)
    or down, then bisection; the result fits and one sentence more would not."""
    base = len(_ids(tokenizer, make_text([])))
    if base > seq_len:
        raise HeadscopeInputError(f"seq_len={seq_len} is shorter than the task's fixed text ({base} tokens); raise seq_len")
    probe = filler.take(20, random.Random(rng_seed))
    per = max(1.0, (len(_ids(tokenizer, make_text(probe))) - base) / 20)
    n = min(max_sentences, int((seq_len - base) / per) + 2)
    sentences = filler.take(n, random.Random(rng_seed))

    def fits(k: int) -> bool:
        return len(_ids(tokenizer, make_text(sentences[:k]))) <= seq_len

    # the longest prefix that fits (the token count grows with the sentences): gallop from the estimate, up while
    # it fits or down while it does not, then bisect: ~2·log2(miss) tokenizations of the whole prompt instead of
    # one per sentence
    if fits(n):
        lo, step = n, max(1, n // 32)
        while True:  # fits(lo)
            if lo >= max_sentences:
                return sentences[:lo]
            hi = min(max_sentences, lo + step)
            sentences = filler.take(hi, random.Random(rng_seed))  # the same draw, longer
            if not fits(hi):
                break
            lo, step = hi, step * 2
    else:
        hi, step = n, 1  # not fits(hi)
        while hi - step > 0 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(0, hi - step)  # fits(lo): the last probe, or 0 (base <= seq_len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return sentences[:lo]


def niah_single(
    tokenizer: Any,
    n_pairs: int = 6,
    seq_len: int = 512,
    depth: float | Sequence[float] = 0.5,
    seed: int = 0,
    n_digits: int = 4,
    corpus: str | None = None,
) -> list[Pair]:
    """RULER NIAH-single pairs: one needle ("The special magic number is 4821."), query at the end.

    x' swaps the needle's value for one that differs in every digit; a⁺/a⁻ are the two values.

    Args:
        tokenizer: the model's tokenizer.
        n_pairs: number of pairs (>= 1).
        seq_len: target prompt length in tokens (prompts are as long as whole filler sentences
            allow, never longer; the actual length is in ``pair.meta["length"]``).
        depth: needle depth as a fraction of the haystack (0 = start, 1 = end), or a list of depths
            cycled over the pairs.
        seed: RNG seed; equal settings give identical pairs.
        n_digits: digits of the needle value.
        corpus: optional text file replacing the built-in filler.

    Raises:
        HeadscopeInputError (a ValueError): n_pairs < 1, depth outside [0, 1], seq_len too short.
        PairError: no equal-length counterfactual found in MAX_REDRAWS draws.
    """
    if n_pairs < 1:
        raise HeadscopeInputError(f"n_pairs={n_pairs}: need at least one calibration pair")
    depths = [depth] if isinstance(depth, (int, float)) else list(depth)
    if not depths or any(not 0.0 <= float(d) <= 1.0 for d in depths):
        raise HeadscopeInputError(f"needle depth {depth} must lie in [0, 1]")
    filler = Filler(corpus)
    rng = random.Random(seed)
    pairs: list[Pair] = []
    for i in range(n_pairs):
        d = float(depths[i % len(depths)])
        fill_seed = rng.randrange(2**31)

        def layout(sentences: list[str], d: float = d) -> tuple[str, str]:
            k = round(d * len(sentences))
            return " ".join([INTRO, *sentences[:k]]), " ".join(sentences[k:])

        def make_text(sentences: list[str], value: str = "0" * n_digits) -> str:
            before, after = layout(sentences)
            return f"{before} {NEEDLE.format(value=value)} {after}\n{QUESTION}".replace("  ", " ")

        try:
            sentences = _fit_filler(tokenizer, make_text, filler, seq_len - n_digits - 1, fill_seed)
        except ValueError:
            base = len(_ids(tokenizer, make_text([]))) + n_digits + 1
            raise HeadscopeInputError(
                f"seq_len={seq_len} is shorter than niah_single's fixed text and answer ({base} tokens); raise seq_len"
            ) from None
        for _ in range(MAX_REDRAWS):
            v = draw_value(rng, n_digits)
            cv = draw_value(rng, n_digits, avoid=v)
            try:
                pair = build_pair(
                    tokenizer,
                    lambda value, _q, s=sentences: make_text(s, value),
                    v,
                    cv,
                    task="niah_single",
                    meta={"seed": seed, "index": i, "depth": d, "seq_len": seq_len, "filler": filler.source},
                )
                break
            except PairError:
                continue
        else:
            raise PairError(f"no equal-length counterfactual in {MAX_REDRAWS} draws; try n_digits or another tokenizer")
        pair.meta["length"] = pair.length
        pairs.append(pair)
    return pairs
