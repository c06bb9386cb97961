"""Training data for the three-stage transfer (SPEC.md §9), with no downloads.

Sources:

- :func:`sample_teacher_text` — text sampled from the teacher itself (ancestral sampling from BOS).
- :func:`corpus_documents` — any user text file (documents separated by blank lines).
- :func:`retrieval_rows` — synthetic retrieval prompts from :mod:`headscope.tasks` with their answers.

Text goes through :func:`pack` (fixed-length packing: documents joined with EOS, cut into rows of
``seq_len`` tokens, remainder dropped). A :class:`TokenRows` data set holds rows plus a loss mask;
:class:`Loader` walks it in a seeded order per epoch and has a ``state_dict`` so that a resumed run
sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from ..errors import HeadscopeInputError, InputFileNotFoundError


@dataclass
class TokenRows:
    """Fixed-length training rows.

    Attributes:
        ids: Int[Tensor, "row time"] token ids.
        mask: Bool[Tensor, "row time"] real tokens (False = right padding; padding never changes the
            outputs at real positions of a causal model, so no attention mask is needed).
    """

    ids: Int[Tensor, "row time"]
    mask: Bool[Tensor, "row time"]

    def __post_init__(self) -> None:
        if self.ids.dim() != 2 or self.ids.shape != self.mask.shape:
            raise ValueError(f"ids {tuple(self.ids.shape)} and mask {tuple(self.mask.shape)} must both be [row, time]")
        if len(self.ids) == 0:
            raise HeadscopeInputError("no training rows: give more text (or a shorter seq_len)")

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def seq_len(self) -> int:
        return int(self.ids.shape[1])

    @classmethod
    def concat(cls, parts: Sequence["TokenRows"]) -> "TokenRows":
        lens = {p.seq_len for p in parts}
        if len(lens) != 1:
            raise ValueError(f"cannot mix rows of lengths {sorted(lens)}; build every part at one seq_len")
        return cls(torch.cat([p.ids for p in parts]), torch.cat([p.mask for p in parts]))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save({"ids": self.ids, "mask": self.mask}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "TokenRows":
        d = torch.load(path, weights_only=True)
        return cls(d["ids"], d["mask"])


def pack(docs: Iterable[Sequence[int]], seq_len: int, eos_id: int) -> TokenRows:
    """Fixed-length packing: concatenate documents, each followed by ``eos_id``, and cut the stream
    into rows of ``seq_len`` tokens; the incomplete last row is dropped.

    Raises:
        HeadscopeInputError (a ValueError): ``seq_len < 2`` or fewer than ``seq_len`` tokens in total.
    """
    if seq_len < 2:
        raise HeadscopeInputError(f"seq_len={seq_len}: rows need at least 2 tokens")
    stream: list[int] = []
    for d in docs:
        stream.extend(int(t) for t in d)
        stream.append(int(eos_id))
    n = len(stream) // seq_len
    if n == 0:
        raise HeadscopeInputError(f"only {len(stream)} tokens of text, fewer than one row of seq_len={seq_len}")
    ids = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)
    return TokenRows(ids, torch.ones_like(ids, dtype=torch.bool))


@torch.no_grad()
def sample_teacher_text(
    model: Any,
    tokenizer: Any,
    n_docs: int,
    doc_len: int = 512,
    seed: int = 0,
    batch_size: int = 64,
    temperature: float = 1.0,
    progress: bool = True,
    cache_implementation: Optional[str] = None,
) -> list[list[int]]:
    """Documents sampled from the teacher (ancestral sampling from BOS, no prompt): the distillation
    data of SPEC.md §9 that needs no download.

    Args:
        model: a transformers causal LM (the teacher); runs on its own device.
        n_docs / doc_len: number of documents and new tokens per document (a document ends early at
            EOS; the EOS is dropped, :func:`pack` adds it back).
        seed: sampling seed (torch's global RNG is re-seeded with it and restored afterwards).
        temperature: sampling temperature (1.0 = the teacher's own distribution).
        cache_implementation: passed to ``generate`` (e.g. ``"static"``: a preallocated KV cache, which
            transformers compiles on CUDA; None = its default dynamic cache). The samples' distribution
            is the same either way.

    Returns:
        list of token-id lists, each starting with BOS when the tokenizer has one.
    """
    if n_docs < 1 or doc_len < 1:
        raise HeadscopeInputError(f"n_docs={n_docs} and doc_len={doc_len} must be >= 1")
    from tqdm.auto import tqdm

    dev = next(model.parameters()).device
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    torch.manual_seed(seed)
    docs: list[list[int]] = []
    try:
        for start in tqdm(range(0, n_docs, batch_size), desc="sampling teacher text", disable=not progress):
            b = min(batch_size, n_docs - start)
            prompt = torch.full((b, 1), bos, dtype=torch.long, device=dev)
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=doc_len,
                min_new_tokens=doc_len,  # a full document per row (EOS suppressed), as in the data of §9
                pad_token_id=eos,
                **({"cache_implementation": cache_implementation} if cache_implementation else {}),
            )
            for row in out.tolist():
                docs.append(row[: 1 + doc_len])
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
    return docs


def corpus_documents(path: str | Path, tokenizer: Any) -> list[list[int]]:
    """Token ids of a user text corpus; documents are separated by blank lines.

    Raises:
        InputFileNotFoundError (a FileNotFoundError): no such file. HeadscopeInputError: no text in it.
    """
    p = Path(path)
    if not p.is_file():
        raise InputFileNotFoundError(f"corpus {p} does not exist; pass a UTF-8 text file")
    parts = [s.strip() for s in p.read_text(encoding="utf-8", errors="replace").split("\n\n")]
    parts = [s for s in parts if s]
    if not parts:
        raise HeadscopeInputError(f"corpus {p} is empty")
    return [list(tokenizer(s, add_special_tokens=True)["input_ids"]) for s in parts]


def retrieval_rows(
    tokenizer: Any,
    n: int,
    seq_len: int,
    task: str = "niah_single",
    seed: int = 0,
    lengths: Optional[Sequence[int]] = None,
    pad_id: Optional[int] = None,
    **settings: Any,
) -> TokenRows:
    """Synthetic retrieval examples (prompt ⊕ answer) from :func:`headscope.tasks.make_pairs`,
    right-padded to ``seq_len``; the mask marks the real tokens.

    Args:
        n: number of examples.
        seq_len: row length; every prompt+answer must fit.
        task: a name in :data:`headscope.tasks.TASKS`.
        lengths: prompt lengths to cycle over (default: ``[seq_len]``); depths are drawn uniformly.
        settings: further task settings (``n_digits``, ``corpus``, ...).

    Raises:
        HeadscopeInputError (a ValueError): unknown task, or a prompt longer than ``seq_len``.
    """
    from ..tasks import make_pairs

    lengths = list(lengths or [seq_len])
    pad = pad_id if pad_id is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    rng = random.Random(seed)
    ids = torch.full((n, seq_len), int(pad), dtype=torch.long)
    mask = torch.zeros(n, seq_len, dtype=torch.bool)
    i = 0
    while i < n:
        L = lengths[i % len(lengths)]
        depths = [rng.random() for _ in range(min(8, n - i))]
        pairs = make_pairs(task, tokenizer, n_pairs=len(depths), seq_len=L - 8, depth=depths, seed=rng.randrange(2**31), **settings)
        for p in pairs:
            row = torch.cat([p.clean, p.answer])
            if len(row) > seq_len:
                raise HeadscopeInputError(f"{task} example of {len(row)} tokens does not fit seq_len={seq_len}; lower lengths")
            ids[i, : len(row)] = row
            mask[i, : len(row)] = True
            i += 1
    return TokenRows(ids, mask)


def format_rows(
    tokenizer: Any,
    n: int,
    seq_len: int,
    texts: Sequence[str],
    tasks: Sequence[str] = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking"),
    family: str = "train",
    seed: int = 0,
    lengths: Optional[Sequence[int]] = None,
    pad_id: Optional[int] = None,
    n_wordings: Optional[int] = None,
) -> TokenRows:
    """Stage-3 retrieval rows (prompt ⊕ answer, right-padded) in the wordings of template ``family``
    (default ``"train"``, disjoint from the evaluation's: :mod:`headscope.tasks.formats`) on a
    natural-text haystack of ``texts`` (e.g. the decoded training documents; sentences with any
    family's wording n-gram are dropped, :func:`headscope.tasks.formats.natural_filler`).

    Args:
        n: rows in all, split evenly over ``tasks`` (the first tasks get the remainder).
        seq_len: row length; lengths: prompt lengths cycled over (default ``[seq_len]``), each at
            least 96 tokens; depths uniform in [0, 1]; each task's wordings cycled.
        seed: RNG seed (rows of task k use seed + k).
        n_wordings: the rows draw from the family's first ``n_wordings`` wordings of each task (None =
            all; :func:`headscope.tasks.formats.format_pairs`): the template diversity of the rows.
            The haystack, the depths and the values do not depend on it.

    Raises:
        HeadscopeInputError (a ValueError): n < 1, no task, unknown family/task, a prompt longer than
            ``seq_len``, n_wordings outside 1..(the family's wordings of a task).
    """
    from ..tasks.formats import format_pairs, natural_filler

    if n < 1 or not tasks:
        raise HeadscopeInputError(f"format_rows needs n >= 1 ({n}) and at least one task ({list(tasks)})")
    lengths = list(lengths or [seq_len])
    pad = pad_id if pad_id is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    filler = natural_filler(texts, family, source=f"{family} documents ({len(texts)})")
    ids = torch.full((n, seq_len), int(pad), dtype=torch.long)
    mask = torch.zeros(n, seq_len, dtype=torch.bool)
    i = 0
    for k, task in enumerate(tasks):
        rng = random.Random(seed + k)
        want = n // len(tasks) + (1 if k < n % len(tasks) else 0)
        made = 0
        while made < want:
            L = lengths[made % len(lengths)]
            depths = [rng.random() for _ in range(min(8, want - made))]
            pairs = format_pairs(tokenizer, family, task, filler, n_pairs=len(depths), seq_len=max(96, L - 8),
                                 depth=depths, seed=rng.randrange(2**31), n_wordings=n_wordings)
            for p in pairs:
                row = torch.cat([p.clean, p.answer])
                if len(row) > seq_len:
                    raise HeadscopeInputError(f"{task} example of {len(row)} tokens does not fit seq_len={seq_len}; lower lengths")
                ids[i, : len(row)] = row
                mask[i, : len(row)] = True
                i += 1
                made += 1
    return TokenRows(ids, mask)


def mix(a: TokenRows, b: TokenRows, seed: int = 0) -> TokenRows:
    """Rows of ``a`` and ``b`` shuffled together (seeded)."""
    both = TokenRows.concat([a, b])
    perm = torch.randperm(len(both), generator=torch.Generator().manual_seed(seed))
    return TokenRows(both.ids[perm], both.mask[perm])


def stage_rows(
    docs: Sequence[Sequence[int]], tokenizer: Any, seq_len: int, long_len: int, tasks: Sequence[str],
    retrieval_frac: float = 0.25, seed: int = 0,
) -> tuple[TokenRows, TokenRows, dict[str, int]]:
    """The rows of the three stages from one set of documents (SPEC.md §9).

    Args:
        docs: token-id documents (e.g. :func:`sample_teacher_text`), packed with the tokenizer's EOS.
        seq_len: row length of stages 1 and 2. long_len: row length of stage 3.
        tasks: retrieval capabilities mixed into stage 3 in equal shares (:func:`retrieval_rows` at
            prompt lengths long_len/4, /2 and long_len, at least 96 tokens; seeds seed+1, seed+2, ...).
        retrieval_frac: share of retrieval rows among the stage-3 rows, in [0, 1); at least one
            retrieval row per task when it is > 0.

    Returns:
        (short rows [n, seq_len], long rows [m, long_len] shuffled with ``seed``, counts
        {short_rows, long_text_rows, long_retrieval_rows}).

    Raises:
        HeadscopeInputError (a ValueError): retrieval_frac outside [0, 1); too little text for a row.
    """
    if not 0 <= retrieval_frac < 1:
        raise HeadscopeInputError(f"retrieval_frac={retrieval_frac} must lie in [0, 1)")
    eos = tokenizer.eos_token_id
    short = pack(docs, seq_len, eos)
    long_text = pack(docs, long_len, eos)
    n_ret = max(1, round(len(long_text) * retrieval_frac / (1 - retrieval_frac))) if retrieval_frac > 0 else 0
    if n_ret and tasks:
        L = long_len
        ret = TokenRows.concat([
            retrieval_rows(tokenizer, max(1, n_ret // len(tasks)), L, t, seed=seed + 1 + i,
                           lengths=[max(96, L // 4), max(96, L // 2), L])
            for i, t in enumerate(tasks)
        ])
        long_rows, n_ret = mix(long_text, ret, seed=seed), len(ret)
    else:
        long_rows, n_ret = long_text, 0
    return short, long_rows, {"short_rows": len(short), "long_text_rows": len(long_text), "long_retrieval_rows": n_ret}


class Loader:
    """Batches of rows in a seeded random order per epoch, resumable.

    ``state_dict()`` = {epoch, cursor, seed}; after ``load_state_dict`` the next batch is exactly the
    one the interrupted run would have drawn next. Batches never straddle epochs (an epoch's tail
    shorter than ``batch_size`` is skipped), so every batch has ``batch_size`` rows.

    Raises:
        HeadscopeInputError (a ValueError): ``batch_size`` larger than the data set; a checkpoint
            position of another data set (``load_state_dict``).
    """

    def __init__(self, rows: TokenRows, batch_size: int, seed: int = 0):
        if batch_size < 1 or batch_size > len(rows):
            raise HeadscopeInputError(f"batch_size={batch_size} must lie in 1..{len(rows)} (rows in the data set)")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.cursor = 0, 0
        self._perm: Optional[Tensor] = None

    def _order(self) -> Tensor:
        if self._perm is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = torch.randperm(len(self.rows), generator=g)
        return self._perm

    def next(self) -> tuple[Int[Tensor, "batch time"], Bool[Tensor, "batch time"]]:
        if self.cursor + self.batch_size > len(self.rows):
            self.epoch, self.cursor, self._perm = self.epoch + 1, 0, None
        idx = self._order()[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return self.rows.ids[idx], self.rows.mask[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "n_rows": len(self.rows)}

    def load_state_dict(self, d: dict[str, int]) -> None:
        if d.get("n_rows", len(self.rows)) != len(self.rows) or d.get("seed", self.seed) != self.seed:
            raise HeadscopeInputError(
                f"checkpoint data position is for {d.get('n_rows')} rows / seed {d.get('seed')}, but this run has "
                f"{len(self.rows)} rows / seed {self.seed}; resume with the same data settings"
            )
        self.epoch, self.cursor, self._perm = int(d["epoch"]), int(d["cursor"]), None
