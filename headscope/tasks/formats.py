"""Retrieval formats kept apart by construction: the template families of training and evaluation.

A *family* is a set of wordings (intro, needle, question; for variable tracking also the hop) per
retrieval task, with its own key words and variable names:

* ``seen``   — the RULER-style templates of :mod:`headscope.tasks.niah` / :mod:`headscope.tasks.ruler`
  with the built-in filler sentences (the in-distribution cells of earlier conversions, whose stage 3
  trained on them): the generators' own wordings (:data:`headscope.tasks.ruler.RULER_WORDINGS`; NIAH-single's
  from :mod:`headscope.tasks.niah`).
* ``unseen`` — three other wordings per task, evaluated on a natural-text haystack (held-out
  teacher-sampled documents or a user corpus).
* ``train``  — six more wordings per task, for stage-3 retrieval rows built on the training
  documents (:func:`headscope.train.data.format_rows`). Rows drawn from the first ``n_wordings`` of
  them (:func:`format_pairs`) vary the template diversity of training; the first three are the
  wordings of the original training family, so ``n_wordings=3`` gives the rows it gave.

No wording n-gram (:func:`wording_ngrams`: lower-cased word 3-grams of a template's fixed text, split
at the placeholders), key word or variable name of ``train`` occurs in ``seen`` or ``unseen``; and a
haystack built with :func:`natural_filler` drops every sentence that contains a 4-gram of any family's
wording, so the filler cannot carry a training phrase into an evaluation prompt or the reverse.

The families are data: every pair is drawn by the RULER generators' own draws
(:func:`~headscope.tasks.ruler.multikey_draw`, :func:`~headscope.tasks.ruler.multivalue_draw`,
:func:`~headscope.tasks.ruler.tracking_draw`; :func:`single_draw`) given the family's wordings, and built by
:func:`headscope.tasks.niah.build_pair` through the shared RULER loop: x and x'
of equal token length, answer a⁺ the queried value (n-digit number), the evidence span recorded;
``meta["family"]`` and ``meta["wording"]`` (index into the family's wordings, cycled over the pairs).

Wordings added to ``train`` put a rare word (dossier, voucher, ledger, docket, dispatch, beacon, ...) in
every 4-word window of their fixed text, so that the haystack filter (which drops sentences holding a
4-gram of any family's wording) has no common English phrase to match in natural text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..errors import HeadscopeInputError
from .base import Pair
from .filler import BUILTIN_SENTENCES, Filler
from .niah import INTRO, NEEDLE, QUESTION, draw_value
from .ruler import (
    KEY_WORDS, RULER_WORDINGS, VAR_NAMES, Draw, Wording, _check_common, _generate, _insert, multikey_draw,
    multivalue_draw, tracking_draw,
)

FORMAT_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")


@dataclass(frozen=True)
class Family:
    """A template family: wordings per task, key words (multi-key / multi-value) and variable names."""

    name: str
    wordings: Mapping[str, tuple[Wording, ...]]
    keys: tuple[str, ...]
    var_names: tuple[str, ...]


SEEN = Family(
    "seen",
    {
        "niah_single": (Wording(INTRO, NEEDLE, QUESTION),),
        **{task: (w,) for task, w in RULER_WORDINGS.items()},
    },
    KEY_WORDS,
    VAR_NAMES,
)

UNSEEN = Family(
    "unseen",
    {
        "niah_single": (
            Wording("Somewhere in the article below a secret code has been written down. Read carefully and remember it.",
                    "(Note: the secret code is {value}.)",
                    "Which secret code was written down in the article? Answer: the secret code is"),
            Wording("Below is a long passage. Hidden in it is an access key that you will need afterwards.",
                    "Write this down, the access key is {value}.",
                    "Question: what was the access key? Answer: the access key is"),
            Wording("Read the report that follows; one line of it records a PIN.",
                    "The PIN to remember is {value}.",
                    "Recall the PIN from the report. The PIN to remember is"),
        ),
        "niah_multikey": (
            Wording("The article below mentions several secret codes, each belonging to a city. Remember them all.",
                    "(Note: the secret code of {key} is {value}.)",
                    "Which secret code belongs to {key}? Answer: the secret code of {key} is"),
            Wording("Below is a long passage in which a few cities are each given an access key.",
                    "Write this down, {key} has the access key {value}.",
                    "Question: what access key does {key} have? Answer: {key} has the access key"),
            Wording("Read the report that follows; several lines of it record a PIN for a city.",
                    "The PIN assigned to {key} reads {value}.",
                    "Look back at the report. The PIN assigned to {key} reads"),
        ),
        "niah_multivalue": (
            Wording("The article below lists several secret codes of one city. Remember them all.",
                    "(Note: one secret code of {key} is {value}.)",
                    "List every secret code of {key}, in the order given. Answer: the secret codes of {key} are"),
            Wording("Below is a long passage in which one city is given several access keys.",
                    "Write this down, {key} also has the access key {value}.",
                    "Question: which access keys does {key} have? Answer: {key} has the access keys"),
            Wording("Read the report that follows; a few lines of it record PINs for one city.",
                    "One PIN assigned to {key} reads {value}.",
                    "Name all PINs assigned to {key}, first to last. The PINs assigned to {key} read"),
        ),
        "variable_tracking": (
            Wording("The article below fills a few numbered slots, some copied from others. Keep track of them.",
                    "(Note: slot {var} now holds {value}.)",
                    "Which number does slot {var} hold at the end? Answer: slot {var} holds",
                    hop="(Note: slot {var} now holds whatever slot {prev} holds.)"),
            Wording("Below is a long passage with register assignments scattered through it.",
                    "Write this down, register {var} is loaded with {value}.",
                    "Question: what is register {var} loaded with? Answer: register {var} is loaded with",
                    hop="Write this down, register {var} is loaded with the contents of register {prev}."),
            Wording("Read the report that follows; it moves numbers between labelled drawers.",
                    "Drawer {var} receives the number {value}.",
                    "Which number ends up in drawer {var}? Drawer {var} receives the number",
                    hop="Drawer {var} receives the number kept in drawer {prev}."),
        ),
    },
    ("Oslo", "Lima", "Cairo", "Dublin", "Madrid", "Vienna", "Prague", "Athens", "Berlin", "Paris",
     "Rome", "Tokyo", "Delhi", "Quito", "Seoul", "Warsaw", "Lisbon", "Nairobi", "Havana", "Manila"),
    ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "sigma"),
)

TRAIN = Family(
    "train",
    {
        "niah_single": (
            Wording("This document contains one hidden serial number among ordinary text. Keep it in mind.",
                    "[serial number: {value}]", "Now give the hidden serial number. Serial number:"),
            Wording("Pay attention to the following passage; a reference ID is tucked inside.",
                    "Reference ID {value} is mentioned here.", "Recall the reference ID that was mentioned. Reference ID"),
            Wording("An account number appears once in the notes below.",
                    "Account number on file: {value}.", "State the account number on file. Account number on file:"),
            Wording("Tucked into this dossier is one voucher code.",
                    "Voucher code logged: {value}.", "Quote the logged voucher code. Voucher code logged:"),
            Wording("This ledger excerpt hides a docket number.",
                    "Docket number {value} stamped.", "Which docket number was stamped? Docket number"),
            Wording("Skim this dispatch; somewhere sits one tracking code.",
                    "Tracking code: {value}.", "Report the buried tracking code. Tracking code:"),
        ),
        "niah_multikey": (
            Wording("This document contains hidden serial numbers for several animals among ordinary text.",
                    "[serial number for the {key}: {value}]",
                    "Now give the serial number for the {key}. Serial number for the {key}:"),
            Wording("Pay attention to the following passage; reference IDs of some animals are tucked inside.",
                    "Reference ID of the {key} is given as {value}.",
                    "Recall the reference ID of the {key}. Reference ID of the {key} is given as"),
            Wording("Account numbers of several animals appear in the notes below.",
                    "Account number on file for the {key}: {value}.",
                    "State the account number on file for the {key}. Account number on file for the {key}:"),
            Wording("Tucked into this dossier are voucher codes, one per animal.",
                    "Voucher code logged for the {key}: {value}.",
                    "Quote the voucher code logged for the {key}. Voucher code logged for the {key}:"),
            Wording("This ledger excerpt stamps docket numbers on several animals.",
                    "Docket number of the {key} stamped as {value}.",
                    "Which docket number did the {key} get? Docket number of the {key} stamped as"),
            Wording("Skim this dispatch; several animals carry tracking codes.",
                    "Tracking code for the {key} reads {value}.",
                    "Report which tracking code the {key} carries. Tracking code for the {key} reads"),
        ),
        "niah_multivalue": (
            Wording("This document contains several hidden serial numbers of one animal among ordinary text.",
                    "[one serial number for the {key}: {value}]",
                    "Now give each serial number for the {key}, earliest first. Serial numbers for the {key}:"),
            Wording("Pay attention to the following passage; several reference IDs of one animal are tucked inside.",
                    "A reference ID of the {key} is given as {value}.",
                    "Recall every reference ID of the {key} in order. Reference IDs of the {key} are given as"),
            Wording("Several account numbers of one animal appear in the notes below.",
                    "An account number on file for the {key}: {value}.",
                    "State each account number on file for the {key}, in order. Account numbers on file for the {key}:"),
            Wording("Tucked into this dossier are several voucher codes for one animal.",
                    "Another voucher code logged for the {key}: {value}.",
                    "Quote each voucher code logged for the {key}, oldest first. Voucher codes logged for the {key}:"),
            Wording("This ledger excerpt stamps several docket numbers on one animal.",
                    "A docket number of the {key} stamped as {value}.",
                    "Which docket numbers did the {key} get, in sequence? Docket numbers of the {key} stamped as"),
            Wording("Skim this dispatch; one animal carries several tracking codes.",
                    "One tracking code for the {key} reads {value}.",
                    "Report every tracking code the {key} carries, in turn. Tracking codes for the {key} read"),
        ),
        "variable_tracking": (
            Wording("This document contains hidden assignments among ordinary text; follow the chain.",
                    "[{var} := {value}]", "Now give the final number bound to {var}. {var} :=", hop="[{var} := {prev}]"),
            Wording("Pay attention to the following passage; tags are bound to numbers or to other tags.",
                    "The tag {var} is bound to {value}.", "Recall what the tag {var} is bound to. The tag {var} is bound to",
                    hop="The tag {var} is bound to tag {prev}."),
            Wording("The notes below move balances between accounts.",
                    "Account {var} holds a balance of {value}.",
                    "State the balance held by account {var}. Account {var} holds a balance of",
                    hop="Account {var} holds the same balance as account {prev}."),
            Wording("Tucked into this dossier: ledgers, some credited from other ledgers.",
                    "Ledger {var} credited with {value}.",
                    "Quote what ledger {var} ends up credited with. Ledger {var} credited with",
                    hop="Ledger {var} credited with ledger {prev}."),
            Wording("This docket excerpt routes parcels between bins; trace them.",
                    "Bin {var} stocks parcel {value}.",
                    "Which parcel does bin {var} stock at last? Bin {var} stocks parcel",
                    hop="Bin {var} stocks whatever bin {prev} stocks."),
            Wording("Skim this dispatch; beacons relay numbers onward, beacon to beacon.",
                    "Beacon {var} broadcasts {value}.",
                    "Report what beacon {var} finally broadcasts. Beacon {var} broadcasts",
                    hop="Beacon {var} relays beacon {prev}."),
        ),
    },
    ("otter", "badger", "heron", "walrus", "beaver", "ferret", "lizard", "pelican", "panda", "raven",
     "salmon", "turtle", "weasel", "jaguar", "koala", "lobster", "moose", "parrot", "rabbit", "squirrel"),
    ("amber", "olive", "teal", "coral", "ivory", "plum", "rust", "navy", "jade", "lilac", "ochre", "mauve"),
)

#: the template families by name
FAMILIES: Mapping[str, Family] = {f.name: f for f in (SEEN, UNSEEN, TRAIN)}
#: the families an evaluation uses; training rows must share nothing with them
EVAL_FAMILIES = ("seen", "unseen")

_PLACEHOLDER = re.compile(r"\{(?:value|key|var|prev)\}")
_WORD = re.compile(r"[a-z]+")


def words(text: str) -> list[str]:
    """Lower-cased alphabetic words of ``text`` (digits and punctuation dropped)."""
    return _WORD.findall(text.lower())


def ngrams(seq: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)}


def wording_ngrams(family: str | Family, n: int = 3, tasks: Iterable[str] = FORMAT_TASKS) -> set[tuple[str, ...]]:
    """Word n-grams of a family's fixed wording (intro, needle, question, hop of every task), each
    template split at its placeholders so that no n-gram spans a key or value."""
    fam = FAMILIES[family] if isinstance(family, str) else family
    out: set[tuple[str, ...]] = set()
    for t in tasks:
        for w in fam.wordings[t]:
            for text in w.texts():
                for seg in _PLACEHOLDER.split(text):
                    out |= ngrams(words(seg), n)
    return out


def filler_ngrams(n: int = 3) -> set[tuple[str, ...]]:
    """Word n-grams of the built-in filler sentences (the ``seen`` family's haystack)."""
    return ngrams(words(" ".join(BUILTIN_SENTENCES)), n)


def forbidden_ngrams(n: int = 4) -> set[tuple[str, ...]]:
    """The n-grams no natural haystack may contain: every family's wording and the built-in filler
    (a training haystack then carries no evaluation phrase, an evaluation haystack no training phrase,
    and no haystack quotes a needle or question of its own family as a distractor)."""
    out = filler_ngrams(n)
    for f in FAMILIES:
        out |= wording_ngrams(f, n)
    return out


def natural_filler(texts: Sequence[str], family: str, source: str, n: int = 4) -> Filler:
    """A natural-text haystack for ``family`` (sentences of ``texts``, e.g. decoded teacher documents),
    without any sentence that contains a :func:`forbidden_ngrams` n-gram or a digit.

    Raises:
        HeadscopeInputError (a ValueError): unknown family; no usable sentence.
    """
    if family not in FAMILIES or family == "seen":
        raise HeadscopeInputError(f"natural_filler: family {family!r} must be 'unseen' or 'train' (seen uses the built-in filler)")
    bad = forbidden_ngrams(n)
    return Filler.from_texts(texts, source, drop=lambda s: bool(ngrams(words(s), n) & bad))


def single_draw(wordings: Sequence[Wording], n_digits: int, family: str | None = None) -> Draw:
    """NIAH-single pairs in ``wordings`` (pair i: wording i mod len): one needle at the pair's depth; x' swaps
    its value. (The RULER-style :func:`headscope.tasks.niah.niah_single` has its own builder.)"""
    def draw(rng: random.Random, d: float, i: int) -> dict[str, Any]:
        k = i % len(wordings)
        w = wordings[k]

        def text(sentences: list[str], value: str) -> str:
            return _insert(w.intro, sentences, [(d, w.needle.format(value=value))], w.question)
        v = draw_value(rng, n_digits)
        return {"text": text, "value": v, "counter_value": draw_value(rng, n_digits, avoid=v),
                "answer_tokens": n_digits + 1, "meta": {} if family is None else {"family": family, "wording": k}}

    return draw


def format_pairs(
    tokenizer: Any,
    family: str,
    task: str,
    filler: Filler,
    n_pairs: int = 6,
    seq_len: int = 1024,
    depth: float | Sequence[float] = 0.5,
    seed: int = 0,
    n_digits: int = 4,
    n_keys: int = 4,
    n_values: int = 3,
    n_hops: int = 2,
    n_wordings: int | None = None,
) -> list[Pair]:
    """Pairs of ``task`` in the wordings of ``family`` (cycled over the pairs), on ``filler``.

    ``n_wordings``: draw from the family's first ``n_wordings`` wordings of the task only (None = all);
    pair i uses wording i mod n_wordings, so the pairs of a smaller count are those of the full family
    restricted to its first wordings (the random draws do not depend on it).

    * ``niah_single``: one needle at ``depth``; x' swaps its value (a⁺/a⁻ the two values).
    * ``niah_multikey``: ``n_keys`` key/value needles (the queried one at ``depth``, the others at random
      depths); x' asks for another key, a⁻ its value; evidence = the queried value's span.
    * ``niah_multivalue``: one key with ``n_values`` values, the first at ``depth`` (the answer read);
      x' swaps it.
    * ``variable_tracking``: a chain of ``n_hops`` hops from the root at ``depth`` plus a distractor
      chain; the question asks for the chain's last variable; x' swaps the root value.

    Raises:
        HeadscopeInputError (a ValueError): unknown family or task; n_pairs < 1; depth outside [0, 1];
            n_wordings outside 1..(the family's wordings of the task); seq_len too short.
            PairError: no equal-length counterfactual in the redraws.
    """
    if family not in FAMILIES:
        raise HeadscopeInputError(f"unknown template family {family!r}; available: {', '.join(FAMILIES)}")
    if task not in FORMAT_TASKS:
        raise HeadscopeInputError(f"unknown format task {task!r}; available: {', '.join(FORMAT_TASKS)}")
    fam = FAMILIES[family]
    wordings = fam.wordings[task]
    if n_wordings is not None:
        if not 1 <= n_wordings <= len(wordings):
            raise HeadscopeInputError(f"n_wordings={n_wordings} must lie in 1..{len(wordings)} ({family} wordings of {task})")
        wordings = wordings[:n_wordings]
    _check_common(n_pairs, depth)
    if task == "niah_multikey" and not 2 <= n_keys <= len(fam.keys):
        raise HeadscopeInputError(f"n_keys={n_keys} must lie in 2..{len(fam.keys)}")
    if task == "niah_multivalue" and n_values < 2:
        raise HeadscopeInputError(f"n_values={n_values} must be >= 2")
    if task == "variable_tracking" and not 1 <= n_hops <= len(fam.var_names) // 2 - 1:
        raise HeadscopeInputError(f"n_hops={n_hops} must lie in 1..{len(fam.var_names) // 2 - 1}")
    if task == "niah_multikey":
        draw = multikey_draw(wordings, fam.keys, n_keys, n_digits, family=family)
    elif task == "niah_multivalue":
        draw = multivalue_draw(wordings, fam.keys, n_values, n_digits, family=family)
    elif task == "variable_tracking":
        draw = tracking_draw(wordings, fam.var_names, n_hops, n_digits, family=family)
    else:
        draw = single_draw(wordings, n_digits, family=family)
    return _generate(task, tokenizer, n_pairs, seq_len, depth, seed, filler, draw)
