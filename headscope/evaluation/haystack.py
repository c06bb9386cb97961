"""The haystack of the unseen-format cells: a user corpus, documents sampled from a model, or the built-in filler.

The ``unseen`` family's prompts (:func:`headscope.tasks.formats.format_pairs`) hide their needles in natural
text. :func:`unseen_haystack` gives that text, one of three ways (:class:`HaystackConfig`):

* ``corpus=PATH``: a user's text file, documents separated by blank lines;
* ``corpus=None`` (the default): ``docs`` documents of ``doc_len`` tokens sampled from a model (the teacher
  where there is one, in bfloat16 on CUDA as the study sampled; ancestral sampling from BOS,
  :func:`headscope.train.sample_teacher_text`) with the
  conversion study's haystack seed (:data:`HAYSTACK_SEED` + ``seed``): documents no training row was built
  from (the study's training documents use seeds 10,000·S + batch). They are kept in ``OUT/haystack/``
  (gzip JSON) and read back by a rerun;
* ``corpus="builtin"``: the package's filler sentences (the ``seen`` cells' haystack, "The grass is green."
  ...): no sampling, fast, but not natural text (use it for smoke runs, not to judge a model).

Sentences with digits or with a 4-gram of any template family's wording are dropped
(:func:`headscope.tasks.formats.natural_filler`), except from the built-in filler.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import HeadscopeInputError
from ..runtime import atomic_write_bytes

#: sampler seed of the haystack documents (the conversion study's ``SUITE_SAMPLE_SEED``)
HAYSTACK_SEED = 999_000_000
#: documents per ``generate`` call when sampling (the study's ``--sample-batch``)
SAMPLE_BATCH = 2048
BUILTIN = "builtin"


@dataclass(frozen=True)
class HaystackConfig:
    """Where the unseen cells' haystack comes from (recorded with every cell).

    Attributes:
        corpus: a text file (documents separated by blank lines), ``"builtin"`` (the package's filler
            sentences), or None: documents sampled from a model.
        docs: documents sampled (corpus None); the study's 1,024.
        doc_len: tokens per sampled document; the study's 512.
        seed: added to :data:`HAYSTACK_SEED` (0: the study's documents, on the same GPU and software).
    """

    corpus: Optional[str] = None
    docs: int = 1024
    doc_len: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.corpus is None and (self.docs < 1 or self.doc_len < 16):
            raise HeadscopeInputError(f"haystack of {self.docs} sampled documents of {self.doc_len} tokens: "
                                      "sample at least 1 document of at least 16 tokens (--haystack-docs, --doc-len)")
        if self.corpus not in (None, BUILTIN) and not Path(self.corpus).expanduser().is_file():
            raise HeadscopeInputError(f"--corpus {self.corpus}: no such file; pass a UTF-8 text file (documents "
                                      f"separated by blank lines) or '{BUILTIN}' for the package's filler sentences")

    def describe(self) -> str:
        if self.corpus == BUILTIN:
            return "the package's built-in filler sentences"
        if self.corpus is not None:
            return f"the corpus {self.corpus}"
        return f"{self.docs} documents of {self.doc_len} tokens sampled from the model (seed {HAYSTACK_SEED} + {self.seed})"


def corpus_texts(path: str | Path) -> list[str]:
    """A text file's documents (split at blank lines, stripped, empty ones dropped).

    Raises:
        HeadscopeInputError (a ValueError): the file holds no text.
    """
    p = Path(path).expanduser()
    parts = [s.strip() for s in p.read_text(encoding="utf-8", errors="replace").split("\n\n")]
    parts = [s for s in parts if s]
    if not parts:
        raise HeadscopeInputError(f"corpus {p} is empty; pass a text file with documents separated by blank lines")
    return parts


def sampled_documents(model: Any, tokenizer: Any, cfg: HaystackConfig, folder: str | Path, sampler: str,
                      log: Any = print) -> list[list[int]]:
    """``cfg.docs`` documents sampled from ``model`` (or the model a function returns; token ids, each from BOS), kept in ``folder``/docs.json.gz
    with the settings they were sampled with; a rerun with the same settings and ``sampler`` name reads them back.
    On CUDA the sampler uses a static KV cache (``generate(cache_implementation="static")``), as the study did."""
    from ..train import sample_teacher_text

    f = Path(folder) / "docs.json.gz"
    ident = {"sampler": sampler, "docs": cfg.docs, "doc_len": cfg.doc_len, "seed": HAYSTACK_SEED + cfg.seed,
             "batch": SAMPLE_BATCH, "vocab": len(tokenizer)}
    if f.exists():
        doc = json.loads(gzip.decompress(f.read_bytes()))
        if doc.get("ident") == ident:
            return doc["docs"]
        log(f"{f} was sampled with other settings {doc.get('ident')}: sampling again")
    if callable(model) and not isinstance(model, torch.nn.Module):
        model = model()
    dev = next(model.parameters()).device
    docs: list[list[int]] = []
    for k, start in enumerate(range(0, cfg.docs, SAMPLE_BATCH)):
        b = min(SAMPLE_BATCH, cfg.docs - start)
        docs += sample_teacher_text(model, tokenizer, b, cfg.doc_len, seed=HAYSTACK_SEED + cfg.seed + k, batch_size=b,
                                    progress=False, cache_implementation="static" if dev.type == "cuda" else None)
    atomic_write_bytes(f, gzip.compress(json.dumps({"ident": ident, "docs": docs}).encode(), mtime=0))
    return docs


def unseen_haystack(cfg: HaystackConfig, tokenizer: Any, folder: str | Path, sampler: Any = None,
                    sampler_name: str = "", log: Any = print) -> Any:
    """The :class:`headscope.tasks.filler.Filler` of the unseen cells (see the module docstring).

    Args:
        cfg: where the haystack comes from. tokenizer: decodes sampled documents.
        folder: where sampled documents are kept (OUT/haystack). sampler: the model that samples them, or a
            function that loads it (called only when documents must be sampled: ``cfg.corpus`` None and no kept
            documents of these settings). sampler_name: names it in the kept file and the filler's source.

    Raises:
        HeadscopeInputError (a ValueError): no usable sentence in the corpus or the samples; no sampler.
    """
    from ..tasks.filler import Filler
    from ..tasks.formats import natural_filler

    if cfg.corpus == BUILTIN:
        return Filler()
    if cfg.corpus is not None:
        return natural_filler(corpus_texts(cfg.corpus), "unseen", source=f"corpus {cfg.corpus}")
    if sampler is None:
        raise HeadscopeInputError("a sampled haystack needs a model to sample from; pass a corpus instead")
    docs = sampled_documents(sampler, tokenizer, cfg, folder, sampler_name, log)
    texts = [tokenizer.decode(d, skip_special_tokens=True) for d in docs]
    return natural_filler(texts, "unseen", source=f"{len(docs)} documents sampled from {sampler_name}")
