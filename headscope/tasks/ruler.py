"""RULER-style capabilities beyond NIAH-single: multi-key, multi-value and variable tracking.

RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?") defines these needle variants; the texts here are headscope's own. Every generator is
seeded, builds x and x' of equal token length through :func:`headscope.tasks.niah.build_pair`, and
records the evidence span:

* ``niah_multikey``: several key/value needles; x' asks for another key whose value is also in the
  context, so a⁻ is that value. The tokens that differ between x and x' are the query key (kept in
  ``meta["diff_span"]``); ``pair.evidence`` is the span of the queried needle's value in x, the
  tokens the model must retrieve from.
* ``niah_multivalue``: one key with several values; the question asks for the key's values and the
  answer read is the first one listed in the context; x' swaps that value (evidence = that value).
* ``variable_tracking``: chains ``VAR A = 4821 ... VAR B = A ... VAR C = B`` (multi-hop, with a
  distractor chain); the question asks for the last variable's value; x' swaps the root value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import HeadscopeInputError
from .base import Pair, PairError
from .filler import Filler
from .niah import MAX_REDRAWS, _fit_filler, _ids, build_pair, draw_value

# single-token words for SmolLM2-style BPE (each " word" is one token there; other tokenizers may
# split them, which build_pair tolerates as long as both keys of a pair have equal length)
KEY_WORDS = (
    "apple", "river", "castle", "violet", "garden", "falcon", "silver", "meadow", "copper", "lantern",
    "harbor", "orchard", "pepper", "candle", "forest", "marble", "rocket", "basket", "mirror", "tiger",
)
VAR_NAMES = tuple("ABCDEFGHJKLMNPQRSTUVWXYZ")

INTRO_MULTI = (
    "Some special magic numbers are hidden inside a lot of irrelevant text. "
    "Find them and memorize them. I will quiz you about them later."
)
INTRO_VARS = (
    "Memorize the variable assignments hidden inside the following text. "
    "I will ask you about the value of a variable later."
)


@dataclass(frozen=True)
class Wording:
    """One wording of a retrieval task. Placeholders: ``{value}`` (the n-digit number), ``{key}``
    (a key word: multi-key, multi-value), ``{var}`` / ``{prev}`` (variable names: variable tracking).

    Attributes:
        intro: text before the haystack.
        needle: the needle sentence (variable tracking: the chain's root, ``{var}`` = ``{value}``).
        question: text after the haystack; ends right before the answer (no trailing space).
        hop: variable tracking only: ``{var}`` takes the value of ``{prev}``.
    """

    intro: str
    needle: str
    question: str
    hop: str = ""

    def texts(self) -> tuple[str, ...]:
        return tuple(t for t in (self.intro, self.needle, self.question, self.hop) if t)


#: the RULER wording of each task (the ``seen`` family of :mod:`headscope.tasks.formats`)
RULER_WORDINGS = {
    "niah_multikey": Wording(INTRO_MULTI, "One of the special magic numbers for {key} is: {value}.",
                             "What is the special magic number for {key}? The special magic number for {key} is"),
    "niah_multivalue": Wording(INTRO_MULTI, "One of the special magic numbers for {key} is: {value}.",
                               "What are all the special magic numbers for {key}? The special magic numbers for {key} are"),
    "variable_tracking": Wording(INTRO_VARS, "VAR {var} = {value}.",
                                 "What is the value of the variable {var}? The value of {var} is", hop="VAR {var} = {prev}."),
}

#: a draw: ``draw(rng, depth, i)`` -> the pair's render and values (see :func:`_generate`)
Draw = Callable[[random.Random, float, int], dict[str, Any]]


def _check_common(n_pairs: int, depth: float | Sequence[float]) -> list[float]:
    if n_pairs < 1:
        raise HeadscopeInputError(f"n_pairs={n_pairs}: need at least one calibration pair")
    depths = [depth] if isinstance(depth, (int, float)) else list(depth)
    if not depths or any(not 0.0 <= float(d) <= 1.0 for d in depths):
        raise HeadscopeInputError(f"needle depth {depth} must lie in [0, 1]")
    return [float(d) for d in depths]


def _insert(intro: str, sentences: list[str], needles: list[tuple[float, str]], question: str) -> str:
    """Text with each needle (depth fraction, sentence) inserted among the filler sentences."""
    n = len(sentences)
    slots: dict[int, list[str]] = {}
    for d, s in needles:
        slots.setdefault(round(d * n), []).append(s)
    parts = [intro]
    for i in range(n + 1):
        parts.extend(slots.get(i, []))
        if i < n:
            parts.append(sentences[i])
    return (" ".join(parts) + "\n" + question).replace("  ", " ")


def _span_of(tokenizer: Any, pair: Pair, text_before: str, value: str) -> tuple[int, int]:
    """Token span of ``value`` written right after ``text_before`` in the clean prompt."""
    start = len(_ids(tokenizer, text_before))
    with_v = _ids(tokenizer, text_before + value)
    clean = pair.clean.tolist()
    # the tokenization of the prefix is a prefix of the prompt's tokenization (whole-sentence cuts)
    while start > 0 and with_v[:start] != clean[:start]:
        start -= 1
    end = len(with_v)
    while end > start and with_v[:end] != clean[:end]:
        end -= 1
    if end <= start:
        raise PairError(f"could not locate the evidence value {value!r} in the tokenized prompt")
    return start, end


def _generate(
    name: str,
    tokenizer: Any,
    n_pairs: int,
    seq_len: int,
    depth: float | Sequence[float],
    seed: int,
    corpus: str | Filler | None,
    draw: Draw,
) -> list[Pair]:
    """Shared loop: ``draw(rng, depth, i)`` returns the render and values of pair i; filler fitted to
    ``seq_len`` (``corpus``: a text file, a ready :class:`Filler`, or None for the built-in sentences)."""
    depths = _check_common(n_pairs, depth)
    filler = corpus if isinstance(corpus, Filler) else Filler(corpus)
    rng = random.Random(seed)
    pairs: list[Pair] = []
    for i in range(n_pairs):
        d = depths[i % len(depths)]
        fill_seed = rng.randrange(2**31)
        for _ in range(MAX_REDRAWS):
            spec = draw(rng, d, i)
            text: Callable[[list[str], str], str] = spec["text"]
            sentences = _fit_filler(
                tokenizer, lambda s: text(s, spec["value"]), filler, seq_len - spec["answer_tokens"], fill_seed
            )
            try:
                pair = build_pair(
                    tokenizer,
                    lambda v, _q, s=sentences: text(s, v),
                    spec["value"],
                    spec["counter_value"],
                    answer_value=spec.get("answer"),
                    counter_answer_value=spec.get("counter_answer"),
                    task=name,
                    meta={"seed": seed, "index": i, "depth": d, "seq_len": seq_len, "filler": filler.source,
                          **spec.get("meta", {})},
                )
            except PairError:
                continue
            diff = pair.evidence
            pair.meta["diff_span"] = list(diff)
            if "evidence_prefix" in spec:
                prefix_text: str = spec["evidence_prefix"](sentences)
                ev = _span_of(tokenizer, pair, prefix_text, spec["evidence_value"])
                pair = Pair(pair.clean, pair.corrupted, pair.answer, pair.counter_answer, ev, pair.task, pair.meta)
            pair.meta["length"] = pair.length
            pairs.append(pair)
            break
        else:
            raise PairError(f"{name}: no equal-length counterfactual in {MAX_REDRAWS} draws; try another n_digits")
    return pairs


def _picker(wordings: Sequence[Wording], family: str | None) -> Callable[[int], tuple[Wording, dict[str, Any]]]:
    """Pair i's wording (cycled) and the meta naming it (``family`` and ``wording`` index; none for RULER's own)."""
    def pick(i: int) -> tuple[Wording, dict[str, Any]]:
        k = i % len(wordings)
        return wordings[k], ({} if family is None else {"family": family, "wording": k})
    return pick


def multikey_draw(wordings: Sequence[Wording], keys: Sequence[str], n_keys: int, n_digits: int,
                  family: str | None = None) -> Draw:
    """NIAH-multikey pairs in ``wordings`` (pair i: wording i mod len) with key words ``keys``: ``n_keys``
    needles, the queried one at the pair's depth, the others at random depths; x' asks for another key."""
    pick = _picker(wordings, family)

    def draw(rng: random.Random, d: float, i: int) -> dict[str, Any]:
        w, meta = pick(i)
        ks = rng.sample(keys, n_keys)
        vals = [draw_value(rng, n_digits)]
        vals.append(draw_value(rng, n_digits, avoid=vals[0]))
        while len(vals) < n_keys:
            v = draw_value(rng, n_digits)
            if v not in vals:
                vals.append(v)
        depths_ = [d, *(rng.random() for _ in range(n_keys - 1))]
        needles = [(depths_[j], w.needle.format(key=ks[j], value=vals[j])) for j in range(n_keys)]

        def text(sentences: list[str], key: str) -> str:
            return _insert(w.intro, sentences, needles, w.question.format(key=key))

        def evidence_prefix(sentences: list[str]) -> str:
            full = text(sentences, ks[0])
            marker = w.needle.format(key=ks[0], value="\0").split("\0")[0]
            return full[: full.index(marker) + len(marker)]

        return {"text": text, "value": ks[0], "counter_value": ks[1], "answer": vals[0], "counter_answer": vals[1],
                "answer_tokens": n_digits + 1, "evidence_prefix": evidence_prefix, "evidence_value": vals[0],
                "meta": {**meta, "keys": ks, "values": vals, "query_key": ks[0], "counter_key": ks[1]}}

    return draw


def multivalue_draw(wordings: Sequence[Wording], keys: Sequence[str], n_values: int, n_digits: int,
                    family: str | None = None) -> Draw:
    """NIAH-multivalue pairs in ``wordings``: one key with ``n_values`` values, the first (the answer read)
    at the pair's depth, the others later; x' swaps the first."""
    pick = _picker(wordings, family)

    def draw(rng: random.Random, d: float, i: int) -> dict[str, Any]:
        w, meta = pick(i)
        key = rng.choice(keys)
        v = draw_value(rng, n_digits)
        cv = draw_value(rng, n_digits, avoid=v)
        rest = [draw_value(rng, n_digits) for _ in range(n_values - 1)]
        later = sorted(d + (1 - d) * (j + 1) / n_values for j in range(n_values - 1))

        def text(sentences: list[str], first: str) -> str:
            needles = [(d, w.needle.format(key=key, value=first))]
            needles += [(t, w.needle.format(key=key, value=r)) for t, r in zip(later, rest)]
            return _insert(w.intro, sentences, needles, w.question.format(key=key))

        return {"text": text, "value": v, "counter_value": cv, "answer_tokens": n_digits + 1,
                "meta": {**meta, "key": key, "other_values": rest}}

    return draw


def tracking_draw(wordings: Sequence[Wording], var_names: Sequence[str], n_hops: int, n_digits: int,
                  family: str | None = None) -> Draw:
    """Variable-tracking pairs in ``wordings``: a chain of ``n_hops`` hops from the root at the pair's
    depth plus an interleaved distractor chain; x' swaps the root value."""
    pick = _picker(wordings, family)

    def draw(rng: random.Random, d: float, i: int) -> dict[str, Any]:
        w, meta = pick(i)
        names = rng.sample(var_names, 2 * (n_hops + 1))
        chain, other = names[: n_hops + 1], names[n_hops + 1:]
        v = draw_value(rng, n_digits)
        cv = draw_value(rng, n_digits, avoid=v)
        dv = draw_value(rng, n_digits, avoid=v)
        spots = [d + (1 - d) * j / (n_hops + 1) for j in range(n_hops + 1)]
        dspots = sorted(rng.random() for _ in range(n_hops + 1))

        def text(sentences: list[str], root: str) -> str:
            needles = [(spots[0], w.needle.format(var=chain[0], value=root))]
            needles += [(spots[j], w.hop.format(var=chain[j], prev=chain[j - 1])) for j in range(1, n_hops + 1)]
            needles += [(dspots[0], w.needle.format(var=other[0], value=dv))]
            needles += [(dspots[j], w.hop.format(var=other[j], prev=other[j - 1])) for j in range(1, n_hops + 1)]
            return _insert(w.intro, sentences, needles, w.question.format(var=chain[-1]))

        return {"text": text, "value": v, "counter_value": cv, "answer_tokens": n_digits + 1,
                "meta": {**meta, "chain": chain, "distractor_chain": other, "distractor_value": dv}}

    return draw


def niah_multikey(
    tokenizer: Any,
    n_pairs: int = 6,
    seq_len: int = 512,
    depth: float | Sequence[float] = 0.5,
    seed: int = 0,
    n_keys: int = 4,
    n_digits: int = 4,
    corpus: str | None = None,
) -> list[Pair]:
    """RULER NIAH-multikey pairs: ``n_keys`` needles "One of the special magic numbers for KEY is: V.".

    x asks for one key (its needle sits at ``depth``), x' for another key whose value is also in the
    context; a⁺ / a⁻ are the two values (they differ in every digit). ``pair.evidence`` is the
    queried value's span in x; the tokens that differ (the query key) are ``meta["diff_span"]``.

    Args: as :func:`headscope.tasks.niah_single`, plus ``n_keys`` (>= 2) needles.

    Raises:
        HeadscopeInputError (a ValueError): n_pairs < 1, n_keys < 2, depth outside [0, 1], seq_len too short.
        PairError: no equal-length counterfactual found.
    """
    if not 2 <= n_keys <= len(KEY_WORDS):
        raise HeadscopeInputError(f"n_keys={n_keys} must lie in 2..{len(KEY_WORDS)}")

    return _generate("niah_multikey", tokenizer, n_pairs, seq_len, depth, seed, corpus,
                     multikey_draw((RULER_WORDINGS["niah_multikey"],), KEY_WORDS, n_keys, n_digits))


def niah_multivalue(
    tokenizer: Any,
    n_pairs: int = 6,
    seq_len: int = 512,
    depth: float | Sequence[float] = 0.5,
    seed: int = 0,
    n_values: int = 3,
    n_digits: int = 4,
    corpus: str | None = None,
) -> list[Pair]:
    """RULER NIAH-multivalue pairs: one key with ``n_values`` values spread through the context.

    The first value (at ``depth``; the others follow later in the context) is the answer read; x'
    swaps it for a value differing in every digit (evidence = that value).

    Raises:
        HeadscopeInputError (a ValueError): n_pairs < 1, n_values < 2, depth outside [0, 1], seq_len too short.
    """
    if n_values < 2:
        raise HeadscopeInputError(f"n_values={n_values} must be >= 2 (for one value use niah_single)")

    return _generate("niah_multivalue", tokenizer, n_pairs, seq_len, depth, seed, corpus,
                     multivalue_draw((RULER_WORDINGS["niah_multivalue"],), KEY_WORDS, n_values, n_digits))


def variable_tracking(
    tokenizer: Any,
    n_pairs: int = 6,
    seq_len: int = 512,
    depth: float | Sequence[float] = 0.5,
    seed: int = 0,
    n_hops: int = 3,
    n_digits: int = 4,
    corpus: str | None = None,
) -> list[Pair]:
    """RULER variable-tracking pairs: a chain ``VAR A = 4821``, ``VAR B = A``, ... of ``n_hops`` hops.

    The chain's root sits at ``depth``, later hops between it and the end; a distractor chain with
    another value is interleaved. The question asks for the value of the chain's last variable;
    x' swaps the root value (evidence = the root value).

    Raises:
        HeadscopeInputError (a ValueError): n_pairs < 1, n_hops < 1, depth outside [0, 1], seq_len too short.
    """
    if not 1 <= n_hops <= len(VAR_NAMES) // 2 - 1:
        raise HeadscopeInputError(f"n_hops={n_hops} must lie in 1..{len(VAR_NAMES) // 2 - 1}")

    return _generate("variable_tracking", tokenizer, n_pairs, seq_len, depth, seed, corpus,
                     tracking_draw((RULER_WORDINGS["variable_tracking"],), VAR_NAMES, n_hops, n_digits))
