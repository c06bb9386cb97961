"""Haystack filler: built-in plain sentences (passkey style) or a user corpus file. No downloads."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Callable, Sequence

from ..errors import HeadscopeInputError, InputFileNotFoundError

# Passkey-style haystack (Mohtashami & Jaggi 2023 use one repeated sentence; a few variants read
# less degenerate and keep every sentence free of digits, so they never collide with needles).
BUILTIN_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


class Filler:
    """Yields filler sentences; ``corpus`` (a text file path) replaces the built-in ones.

    Sentences containing digits are dropped from a corpus so that they cannot be mistaken for a
    needle value.
    """

    def __init__(self, corpus: str | Path | None = None):
        if corpus is None:
            self.sentences = list(BUILTIN_SENTENCES)
            self.source = "builtin"
        else:
            path = Path(corpus)
            if not path.is_file():
                raise InputFileNotFoundError(f"filler corpus {path} does not exist; pass a UTF-8 text file or None")
            text = path.read_text(encoding="utf-8", errors="replace")
            parts = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
            self.sentences = [s for s in parts if not re.search(r"\d", s) and len(s) < 400]
            if not self.sentences:
                raise HeadscopeInputError(f"filler corpus {path} has no usable sentences (need digit-free sentences)")
            self.source = str(path)

    @classmethod
    def from_texts(cls, texts: "Sequence[str]", source: str, drop: "Callable[[str], bool] | None" = None) -> "Filler":
        """Filler from in-memory documents (e.g. decoded teacher-sampled text), split into sentences as
        for a corpus file; sentences with digits, of 400+ characters or for which ``drop(sentence)`` is
        True are left out. ``source`` names the documents in each pair's ``meta["filler"]``.

        Raises:
            HeadscopeInputError (a ValueError): no usable sentence is left.
        """
        self = cls.__new__(cls)
        parts = [s.strip() for t in texts for s in re.split(r"(?<=[.!?])\s+", t) if s.strip()]
        self.sentences = [s for s in parts if not re.search(r"\d", s) and len(s) < 400 and not (drop and drop(s))]
        if not self.sentences:
            raise HeadscopeInputError(f"filler {source!r} has no usable sentences (need digit-free sentences)")
        self.source = source
        return self

    def take(self, n: int, rng: random.Random) -> list[str]:
        """``n`` consecutive sentences from a random start (cycling)."""
        if self.source == "builtin":
            return [self.sentences[i % len(self.sentences)] for i in range(n)]
        start = rng.randrange(len(self.sentences))
        return [self.sentences[(start + i) % len(self.sentences)] for i in range(n)]
