"""Prompt sets on disk: gzip-compressed JSON, read without running code.

A cell's prompts (:class:`headscope.tasks.Pair` objects) are built once and kept for every model
scored on them. The file holds ``{"format": "headscope.PairSet/1", "ident": {...}, "pairs":
[Pair.to_dict(), ...]}`` gzip-compressed (token ids as JSON integers); reading it parses JSON only, so
a file from elsewhere can carry no code (a pickle, which the unrestricted ``torch.load`` of the files this replaced
would have run, is refused as not a pair-set file).
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import HeadscopeInputError
from ..runtime import atomic_write_bytes

PAIRSET_FORMAT = "headscope.PairSet/1"


def save_pairs(path: str | Path, ident: dict[str, Any], pairs: Sequence[Any]) -> None:
    """Write ``pairs`` (Pair objects) with their ``ident`` (what they were built from: tokenizer, filler, ...)
    to ``path`` as gzip JSON, atomically (concurrent writers of one set leave one whole file)."""
    doc = {"format": PAIRSET_FORMAT, "ident": ident, "pairs": [p.to_dict() for p in pairs]}
    atomic_write_bytes(path, gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), compresslevel=6, mtime=0))


def load_pairs(path: str | Path, ident: Optional[dict[str, Any]] = None) -> Optional[list[Any]]:
    """The pairs stored in ``path`` (:func:`save_pairs`); None when ``ident`` is given and differs from the
    stored one (the caller rebuilds them). Only gzip JSON is parsed; nothing in the file is executed.

    Raises:
        HeadscopeInputError (a ValueError): the file is not a pair-set file (not gzip JSON, or no
            ``headscope.PairSet`` format tag): delete it, and it is built again.
    """
    from ..tasks.base import Pair

    p = Path(path)
    try:
        doc = json.loads(gzip.decompress(p.read_bytes()))
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
        raise HeadscopeInputError(f"{p} is not a headscope pair-set file (gzip JSON; {type(e).__name__}): "
                                  "delete it and it is built again") from None
    if not isinstance(doc, dict) or str(doc.get("format", "")).split("/")[0] != PAIRSET_FORMAT.split("/")[0]:
        raise HeadscopeInputError(f"{p} is not a headscope pair-set file (no '{PAIRSET_FORMAT}' format tag): "
                                  "delete it and it is built again")
    if ident is not None and doc.get("ident") != json.loads(json.dumps(ident)):
        return None
    return [Pair.from_dict(d) for d in doc["pairs"]]
