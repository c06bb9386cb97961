"""The conversion recipe of ``headscope convert``: the conversion study's settings as defaults, and the
rows of each stage they make (SPEC.md §9; ``experiments/conversion-generalization/``,
``docs/conversion.md`` gives the study figure behind each default).

* :class:`ConvertRecipe` — frozen, validated when built, saved as ``OUT/recipe.json`` and in every
  stage's ``training.json``.
* :func:`recipe_documents` — the training documents: sampled from the teacher in shards of
  ``sample_batch`` (shard k with seed 10,000 · seed + k, cached as it goes) or read from a corpus, then
  split into held-out and training documents (a seeded shuffle).
* :func:`recipe_rows` — a stage's rows: stage 1 packed text (``seq_len``); stage 2 the same text
  mixed with ``s2_retrieval`` of retrieval rows of the ``train`` template family (first
  ``s2_wordings`` wordings per task); stage 3 text packed at ``long_len`` mixed with ``s3_retrieval``
  of ``train``-family rows in ``s3_wordings`` wordings at ``long_len`` / 4, / 2 and ``long_len``, on a
  natural-text haystack of the training documents. The ``train`` family shares no word 3-gram with the
  evaluation's ``seen`` and ``unseen`` wordings (:mod:`headscope.tasks.formats`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..errors import HeadscopeInputError
from ..tasks.formats import FORMAT_TASKS

#: format_rows seeds of seed S: stage-2 retrieval rows 10·S + S2_SEED, stage-3 rows 10·S + S3_SEED (+ task index)
S2_SEED, S3_SEED = 5, 1
#: sampler seed of shard k of seed S's documents: DOC_SEED · S + k
DOC_SEED = 10_000
#: shortest row that holds a retrieval prompt of the recipe (prompts of >= 96 tokens plus the answer)
MIN_RETRIEVAL_LEN = 128


def parse_tokens(value: Any, name: str = "tokens") -> int:
    """'12.5M' / '200K' / '1.5e6' / '200000' / 200000 -> a token count.

    Raises:
        HeadscopeInputError: not a count (e.g. '12.5X', '-3', '0.5').
    """
    s = str(value).strip().replace("_", "").replace(",", "")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1:].upper(), 1)
    try:
        x = float(s[:-1] if mult != 1 else s) * mult
    except ValueError:
        raise HeadscopeInputError(f"{name}={value!r} is not a token count; write e.g. 12.5M, 200K or 200000") from None
    if not math.isfinite(x) or x < 1 or abs(x - round(x)) > 1e-6 * max(1.0, x):
        raise HeadscopeInputError(f"{name}={value!r} must be a whole number of tokens >= 1 (e.g. 12.5M, 200K)")
    return int(round(x))


def train_wordings() -> int:
    """Wordings per task of the ``train`` template family (the most ``s3_wordings`` can be)."""
    from ..tasks.formats import FAMILIES

    return min(len(FAMILIES["train"].wordings[t]) for t in FORMAT_TASKS)


@dataclass(frozen=True)
class ConvertRecipe:
    """What ``headscope convert`` trains: the conversion study's recipe (``experiments/conversion-generalization``,
    12.5M tokens, the two data levers; figures in ``docs/conversion.md``).

    Attributes:
        tokens: the total token budget of the three stages.
        shares: each stage's share of ``tokens``, rounded to whole steps.
        stage_tokens: per-stage budgets instead of the shares (None: the shares).
        seq_len / long_len: row length of stages 1-2 / of stage 3 (tokens).
        batch_size / batch_long: rows per step in stages 1-2 / in stage 3.
        lr: peak learning rate of each stage.
        docs / doc_len: documents sampled from the teacher and new tokens each (without ``corpus``).
        heldout_docs: documents held out of training (at most a quarter; ``OUT/data/heldout.pt``).
        sample_batch: documents per sampling shard (shard k samples with seed 10,000 · seed + k: the
            documents depend on it).
        sample_dtype: the teacher's precision while it samples: ``"auto"`` (a bfloat16 copy on CUDA, as the
            study sampled; float32 on a CPU), ``"float32"`` or ``"bfloat16"``.
        corpus: a UTF-8 text file (documents separated by blank lines) instead of sampled text.
        tasks: retrieval tasks of the template-family rows (:data:`headscope.tasks.formats.FORMAT_TASKS`).
        s2_retrieval: share of stage-2 rows that are ``train``-family retrieval rows (prompt seq_len − 8).
        s2_wordings: wordings per task of those rows.
        s3_retrieval: share of stage-3 rows that are retrieval rows.
        s3_wordings: wordings per task of the ``train``-family stage-3 rows.
        s3_seen_task: stage-3 retrieval rows from the evaluation's own templates instead
            (:mod:`headscope.tasks`, e.g. ``"niah_single"``): trains on the ``seen`` wording and so inflates
            any evaluation on it. None (default): the ``train`` family.
        fa_pos / fa_gate / gdn_rope: hybrid options of the student (:class:`headscope.hybrid.HybridOptions`;
            ``fa_pos="nope"``: FA heads without RoPE, queries scaled by log(t + a) / log(a)).
        seed: documents, row order, retrieval rows and the student's random initialization.
        ckpt_every: a checkpoint every N steps (and always when a stage stops).

    Raises (when built):
        HeadscopeInputError (a ValueError): any field out of range (:func:`check_recipe_fields`).
    """

    tokens: int = 12_500_000
    shares: tuple[float, float, float] = (0.15, 0.55, 0.30)
    stage_tokens: Optional[tuple[int, int, int]] = None
    seq_len: int = 512
    long_len: int = 2048
    batch_size: int = 64
    batch_long: int = 16
    lr: tuple[float, float, float] = (1e-3, 2e-4, 1e-4)
    docs: int = 12_288
    heldout_docs: int = 256
    doc_len: int = 512
    sample_batch: int = 2048
    sample_dtype: str = "auto"
    corpus: Optional[str] = None
    tasks: tuple[str, ...] = FORMAT_TASKS
    s2_retrieval: float = 0.25
    s2_wordings: int = 3
    s3_retrieval: float = 0.25
    s3_wordings: int = 6
    s3_seen_task: Optional[str] = None
    fa_pos: str = "nope"
    fa_gate: bool = True
    gdn_rope: bool = True
    seed: int = 0
    ckpt_every: int = 300

    def __post_init__(self) -> None:
        for f in ("shares", "stage_tokens", "lr", "tasks"):
            v = getattr(self, f)
            if isinstance(v, list):
                object.__setattr__(self, f, tuple(v))
        if self.corpus is not None:
            object.__setattr__(self, "corpus", str(self.corpus))
        check_recipe_fields(self)

    @classmethod
    def from_cli(cls, **values: Any) -> "ConvertRecipe":
        """The recipe of ``headscope convert``'s options, checked with the options' names in the messages.

        Raises:
            HeadscopeInputError: as :func:`check_recipe_fields` with ``cli=True``.
        """
        probe = object.__new__(cls)
        for f in dataclasses.fields(cls):
            v = values.get(f.name, f.default)
            object.__setattr__(probe, f.name, tuple(v) if isinstance(v, list) else v)
        check_recipe_fields(probe, cli=True)
        return cls(**values)

    # ------------------------------------------------------------------ the plan
    def row_len(self, stage: int) -> int:
        return self.long_len if stage == 3 else self.seq_len

    def rows_per_step(self, stage: int) -> int:
        return self.batch_long if stage == 3 else self.batch_size

    def stage_budget(self, stage: int) -> int:
        """Tokens of ``stage``: ``stage_tokens`` if given, else its share of ``tokens`` rounded to whole
        steps (at least one)."""
        step = self.rows_per_step(stage) * self.row_len(stage)
        if self.stage_tokens is not None:
            return int(self.stage_tokens[stage - 1])
        return int(max(1, round(self.tokens * self.shares[stage - 1] / step)) * step)

    def steps(self, stage: int) -> int:
        return max(1, math.ceil(self.stage_budget(stage) / (self.rows_per_step(stage) * self.row_len(stage))))

    def hybrid_options(self) -> dict[str, Any]:
        """The student's :class:`~headscope.hybrid.HybridOptions` fields set by the recipe."""
        return {"fa_pos": self.fa_pos, "fa_gate": self.fa_gate, "gdn_rope": self.gdn_rope}

    def train_config(self, stage: int, **overrides: Any) -> Any:
        """The stage's :class:`~headscope.train.TrainConfig` (``overrides``: its other fields, e.g. fast, progress)."""
        from .trainer import TrainConfig

        return TrainConfig(stage=stage, tokens=self.stage_budget(stage), batch_size=self.rows_per_step(stage),
                           lr=self.lr[stage - 1], ckpt_every=self.ckpt_every, seed=self.seed, **overrides)

    def plan(self) -> list[dict[str, Any]]:
        """Per stage: tokens, steps, rows per step, row length, lr."""
        return [{"stage": k, "tokens": self.stage_budget(k), "steps": self.steps(k), "rows_per_step": self.rows_per_step(k),
                 "row_len": self.row_len(k), "lr": self.lr[k - 1]} for k in (1, 2, 3)]

    def rounding_note(self, stages: Sequence[int] = (1, 2, 3), tolerance: float = 0.10) -> Optional[str]:
        """A one-line note when whole steps (rows per step x row length, at least one a stage) raise the tokens of
        ``stages`` more than ``tolerance`` above those asked for (``tokens`` x ``shares``, or ``stage_tokens``),
        else None; e.g. ``--tokens 1K`` at 4 x 128 and 2 x 256 trains 3 x 512 = 1,536 tokens."""
        asked = sum(self.stage_tokens[k - 1] if self.stage_tokens is not None else self.tokens * self.shares[k - 1]
                    for k in stages)
        trained = sum(self.steps(k) * self.rows_per_step(k) * self.row_len(k) for k in stages)
        if trained <= asked * (1 + tolerance):
            return None
        steps = ", ".join(f"stage {k}: {self.rows_per_step(k)} x {self.row_len(k)}" for k in stages)
        return (f"note: {trained:,} tokens will be trained, {trained / asked - 1:.0%} more than the {round(asked):,} "
                f"asked for: each stage trains whole steps of rows x row length, at least one ({steps}); lower "
                "--batch-size / --batch-long or --seq-len / --long-len for a finer budget")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ConvertRecipe":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise HeadscopeInputError(f"unknown recipe field(s) {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)

    def differences(self, other: "ConvertRecipe") -> dict[str, tuple[Any, Any]]:
        """{field: (other's value, this value)} where the two recipes differ."""
        a, b = other.to_dict(), self.to_dict()
        return {k: (a[k], b[k]) for k in b if a[k] != b[k]}


def flag(field: str) -> str:
    """The ``headscope convert`` option of a recipe field (``s3_wordings`` -> ``--s3-wordings``)."""
    return "--" + field.replace("_", "-")


def check_recipe_fields(r: ConvertRecipe, cli: bool = False) -> None:
    """Every field of ``r`` in range; names are the CLI's options when ``cli``.

    Raises:
        HeadscopeInputError (or InputFileNotFoundError): the first bad field, with its fix.
    """
    from ..tasks import TASKS
    from ..validate import check_choice, check_file, check_int, check_real

    n = flag if cli else (lambda f: f)
    check_int(n("tokens"), r.tokens, lo=1, fix="the total token budget of the three stages")
    if len(r.shares) != 3 or any(not isinstance(x, (int, float)) or x <= 0 for x in r.shares) \
            or abs(sum(r.shares) - 1) > 1e-6:
        raise HeadscopeInputError(f"{n('shares')}={list(r.shares)}: give three positive shares summing to 1 "
                                  "(stage 1, 2, 3; the study's 0.15,0.55,0.30)")
    if r.stage_tokens is not None:
        if len(r.stage_tokens) != 3:
            raise HeadscopeInputError(f"{n('stage_tokens')}={list(r.stage_tokens)}: give three budgets (stage 1, 2, 3)")
        for k, t in enumerate(r.stage_tokens, 1):
            check_int(f"{n('stage_tokens')} (stage {k})", t, lo=1)
    for f in ("seq_len", "long_len"):
        check_int(n(f), getattr(r, f), lo=2, fix="rows need at least 2 tokens")
    for f in ("batch_size", "batch_long", "docs", "doc_len", "sample_batch"):
        check_int(n(f), getattr(r, f), lo=1)
    check_int(n("heldout_docs"), r.heldout_docs, lo=0)
    check_int(n("ckpt_every"), r.ckpt_every, lo=0, fix="0 checkpoints only when a stage stops")
    check_int(n("seed"), r.seed, lo=0)
    if len(r.lr) != 3:
        raise HeadscopeInputError(f"{n('lr')}={list(r.lr)}: give three learning rates (stage 1, 2, 3)")
    for k, x in enumerate(r.lr, 1):
        check_real(f"{n('lr')} (stage {k})", x, 0.0, lo_open=True)
    if not r.tasks:
        raise HeadscopeInputError(f"{n('tasks')} is empty; use some of {', '.join(FORMAT_TASKS)}")
    for t in r.tasks:
        check_choice(n("tasks"), t, FORMAT_TASKS)
    for f in ("s2_retrieval", "s3_retrieval"):
        check_real(n(f), getattr(r, f), 0.0, 0.9, fix="a share of the stage's rows (the study's 0.25)")
    w = train_wordings()
    for f in ("s2_wordings", "s3_wordings"):
        check_int(n(f), getattr(r, f), lo=1, hi=w, fix=f"the train family has {w} wordings per task")
    if r.s3_seen_task is not None:
        check_choice(n("s3_seen_task"), r.s3_seen_task, sorted(TASKS))
    check_choice(n("fa_pos"), r.fa_pos, ("nope", "rope"))
    check_choice(n("sample_dtype"), r.sample_dtype, ("auto", "float32", "bfloat16"))
    if r.s2_retrieval > 0 and r.seq_len < MIN_RETRIEVAL_LEN:
        raise HeadscopeInputError(f"{n('seq_len')}={r.seq_len} is too short for the stage-2 retrieval rows (>= "
                                  f"{MIN_RETRIEVAL_LEN} tokens); raise it or set {n('s2_retrieval')} 0")
    if r.s3_retrieval > 0 and r.long_len < MIN_RETRIEVAL_LEN:
        raise HeadscopeInputError(f"{n('long_len')}={r.long_len} is too short for the stage-3 retrieval rows (>= "
                                  f"{MIN_RETRIEVAL_LEN} tokens); raise it or set {n('s3_retrieval')} 0")
    if r.corpus is not None:
        p = check_file(r.corpus, "corpus", "pass a UTF-8 text file (documents separated by blank lines), or leave --corpus out")
        if p.stat().st_size <= 1 << 20 and not p.read_text(encoding="utf-8", errors="replace").strip():
            raise HeadscopeInputError(f"corpus {p} is empty; pass a text file with documents separated by blank lines")
        return
    # sampled text: the rows are known in advance (BOS + doc_len tokens + EOS per document)
    train_docs = r.docs - min(r.heldout_docs, r.docs // 4)
    for k in (1, 3):
        L, b = r.row_len(k), r.rows_per_step(k)
        rows = train_docs * (r.doc_len + 2) // L
        if k == 3 and r.s3_retrieval > 0:
            rows += max(4, round(rows * r.s3_retrieval / (1 - r.s3_retrieval)))
        if rows < b:
            what = "--batch-long" if (cli and k == 3) else n("batch_long" if k == 3 else "batch_size")
            raise HeadscopeInputError(
                f"{train_docs} training document(s) of {r.doc_len} tokens make {rows} row(s) of {L} tokens for stage {k}, "
                f"fewer than {what}={b}; raise {n('docs')} / {n('doc_len')} or lower {what}")


def check_convert_dir(out: Any, recipe: Any, stages: tuple[int, ...], resume: bool, cli: bool = False) -> None:
    """The conversion folder ``out`` of :func:`headscope.train.convert_model` before any work.

    Raises:
        HeadscopeInputError (or a variant): ``out`` unusable; ``out/recipe.json`` of another recipe (the
            message names the fields); without ``resume``, a requested stage already finished or
            holding a checkpoint (InputFileExistsError); with ``resume``, nothing to continue
            (InputFileNotFoundError); the first stage to run needs a previous stage that is not
            finished and not requested (InputFileNotFoundError); a checkpoint of another plan.
    """
    import json

    from ..validate import check_out_dir
    from ..errors import InputFileExistsError, InputFileNotFoundError
    from .stage_checks import check_stage, check_stage_files
    from .model_folder import is_model_folder, stage_finished
    from .parallel import find_checkpoint

    o = "--out" if cli else "out_dir"
    out = check_out_dir(out, o)
    for k in stages:
        check_stage(k, "--stage" if cli else "stage")
    f = out / "recipe.json"
    if f.exists():
        try:
            stored = ConvertRecipe.from_dict(json.loads(f.read_text()))
        except (ValueError, TypeError) as e:
            raise HeadscopeInputError(f"{f} is not a recipe of this headscope ({e}); use another {o}") from None
        diff = recipe.differences(stored)
        if diff:
            name = flag if cli else (lambda x: x)
            what = "; ".join(f"{name(k)}: {a!r} stored, {b!r} now" for k, a, b in ((k, *v) for k, v in diff.items()))
            raise HeadscopeInputError(f"{out} was started with another recipe ({what}); pass the same options, or use "
                                      f"another {o}")
    state = {k: ("finished" if stage_finished(out, k) else
                 "checkpoint" if find_checkpoint(out / f"stage{k}" / "checkpoint") is not None else None) for k in stages}
    r = "--resume" if cli else "resume=True"
    if not resume:
        for k, st in state.items():
            if st is not None:
                what = "a finished stage" if st == "finished" else "a checkpoint"
                where = out / f"stage{k}"
                if st == "finished" and not is_model_folder(where):  # its folder deleted after a later stage finished
                    where, what = out, f"stage {k} finished (a later stage's folder is complete)"
                raise InputFileExistsError(f"{where} holds {what}: pass {r} to continue the conversion, or "
                                           f"use another {o}")
    elif not any(state.values()) and not f.exists():
        raise InputFileNotFoundError(f"{r}: {out} holds no conversion to continue; start without {r.split('=')[0]}")
    first = next((k for k in stages if state[k] != "finished"), None)
    if first is not None and first > 1 and not is_model_folder(out / f"stage{first - 1}"):
        raise InputFileNotFoundError(
            f"{out / f'stage{first - 1}'} is not a finished stage: stage {first} starts from stage {first - 1}'s model "
            f"folder; run the previous stage first (`headscope convert --stage {first - 1} --out {out}`, to the end)")
    for k, st in state.items():
        if st == "checkpoint":
            check_stage_files(out, k, True, need_student=False, total_steps=recipe.steps(k))


# ---------------------------------------------------------------------------------------------- data
def docs_sha256(docs: Sequence[Sequence[int]]) -> str:
    """SHA-256 of token documents (each as int32 bytes, then b'|'): the study's document hash."""
    import numpy as np

    h = hashlib.sha256()
    for d in docs:
        h.update(np.asarray(d, dtype=np.int32).tobytes())
        h.update(b"|")
    return h.hexdigest()


def rows_sha256(rows: Any) -> str:
    """SHA-256 of a :class:`~headscope.train.TokenRows` (ids as int64 bytes, then the mask as bytes)."""
    h = hashlib.sha256()
    h.update(rows.ids.to(torch.int64).contiguous().numpy().tobytes())
    h.update(rows.mask.to(torch.uint8).contiguous().numpy().tobytes())
    return h.hexdigest()


def split_docs(docs: Sequence[Sequence[int]], heldout: int, seed: int) -> tuple[list, list]:
    """(held-out, training) documents: a shuffle seeded with ``seed``, the first ``heldout`` (at most a
    quarter of the documents) held out."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_held = min(heldout, len(docs) // 4)
    return [docs[i] for i in order[:n_held]], [docs[i] for i in order[n_held:]]


def recipe_documents(teacher: Any, tokenizer: Any, recipe: ConvertRecipe, cache_dir: Path,
                     progress: bool = True) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """(training documents, held-out documents, info) of the recipe.

    Sampled text: ``recipe.docs`` documents in shards of ``sample_batch`` (shard k sampled with seed
    10,000 · seed + k; on CUDA with a static KV cache), each saved to ``cache_dir/docs/shard_K.pt`` as
    it finishes, so an interrupted run samples only what is missing. A corpus is read from its file.
    ``info``: counts and SHA-256 of the documents (:func:`docs_sha256`) and of the corpus file.
    """
    from ..runtime import atomic_torch_save
    from .data import corpus_documents, sample_teacher_text

    if recipe.corpus:
        docs = corpus_documents(recipe.corpus, tokenizer)
        info: dict[str, Any] = {"source": "corpus", "corpus": recipe.corpus,
                                "corpus_sha256": hashlib.sha256(Path(recipe.corpus).read_bytes()).hexdigest()}
    else:
        folder = Path(cache_dir) / "docs"
        folder.mkdir(parents=True, exist_ok=True)
        p0 = next(teacher.parameters())
        bf16 = recipe.sample_dtype == "bfloat16" or (recipe.sample_dtype == "auto" and p0.device.type == "cuda")
        dt = torch.bfloat16 if bf16 else torch.float32
        sampler = None  # the teacher, or a copy of it in the sampling precision, made once a shard is missing
        docs, k, sampled, t0 = [], 0, 0, time.perf_counter()
        while len(docs) < recipe.docs:
            f = folder / f"shard_{k}.pt"
            b = min(recipe.sample_batch, recipe.docs - len(docs))
            if f.exists():
                new = torch.load(f, weights_only=True)
            else:
                if sampler is None:
                    import copy

                    sampler = teacher if p0.dtype == dt else copy.deepcopy(teacher).to(dt)
                new = sample_teacher_text(sampler, tokenizer, b, recipe.doc_len, seed=DOC_SEED * recipe.seed + k,
                                          batch_size=b, progress=progress,
                                          cache_implementation="static" if p0.device.type == "cuda" else None)
                atomic_torch_save(f, new)
                sampled += 1
            docs += new
            k += 1
        docs = docs[: recipe.docs]
        del sampler
        info = {"source": "teacher samples", "shards": k, "sample_batch": recipe.sample_batch,
                "sample_dtype": str(dt).replace("torch.", ""), "shards_sampled_now": sampled,
                "sample_seconds_now": round(time.perf_counter() - t0, 2) if sampled else 0.0}
    held, train = split_docs(docs, recipe.heldout_docs, recipe.seed)
    if not train:
        raise HeadscopeInputError(f"no training documents ({len(docs)} in all, {len(held)} held out)")
    info.update({"docs": len(docs), "train_docs": len(train), "heldout_docs": len(held), "docs_sha256": docs_sha256(docs)})
    return train, held, info


def _texts(tokenizer: Any, docs: Sequence[Sequence[int]]) -> list[str]:
    return [tokenizer.decode(d, skip_special_tokens=True) for d in docs]


def recipe_rows(tokenizer: Any, recipe: ConvertRecipe, train_docs: Sequence[Sequence[int]], stage: int,
                texts: Optional[list[str]] = None) -> tuple[Any, dict[str, Any]]:
    """The rows of ``stage`` (see the module docstring) and their info (text / retrieval row counts,
    seeds, wordings, SHA-256 of the rows). ``texts``: the decoded training documents, if already at hand.

    Raises:
        HeadscopeInputError: too little text for a row; no usable haystack sentence in the documents.
    """
    from .data import format_rows, mix, pack, retrieval_rows

    t0 = time.perf_counter()
    eos = tokenizer.eos_token_id
    s = recipe.seed
    if stage in (1, 2):
        rows = pack(train_docs, recipe.seq_len, eos)
        info: dict[str, Any] = {"text_rows": len(rows), "retrieval_rows": 0, "row_len": recipe.seq_len}
        if stage == 2 and recipe.s2_retrieval > 0:
            f = recipe.s2_retrieval
            n = max(len(recipe.tasks), round(len(rows) * f / (1 - f)))
            texts = texts if texts is not None else _texts(tokenizer, train_docs)
            ret = format_rows(tokenizer, n, recipe.seq_len, texts, tasks=recipe.tasks, family="train",
                              seed=10 * s + S2_SEED, lengths=[recipe.seq_len], n_wordings=recipe.s2_wordings)
            rows = mix(rows, ret, seed=s)
            info.update(retrieval_rows=len(ret), retrieval="train family", wordings=recipe.s2_wordings,
                        retrieval_seed=10 * s + S2_SEED, mix_seed=s)
    elif stage == 3:
        L = recipe.long_len
        rows = pack(train_docs, L, eos)
        info = {"text_rows": len(rows), "retrieval_rows": 0, "row_len": L}
        if recipe.s3_retrieval > 0:
            f = recipe.s3_retrieval
            n = max(4, round(len(rows) * f / (1 - f)))
            if recipe.s3_seen_task is not None:
                ret = retrieval_rows(tokenizer, n, L, recipe.s3_seen_task, seed=10 * s + S3_SEED,
                                     lengths=[max(96, L // 4), max(96, L // 2), L])
                info.update(retrieval=f"seen templates ({recipe.s3_seen_task}, headscope.tasks)")
            else:
                texts = texts if texts is not None else _texts(tokenizer, train_docs)
                ret = format_rows(tokenizer, n, L, texts, tasks=recipe.tasks, family="train", seed=10 * s + S3_SEED,
                                  lengths=[max(MIN_RETRIEVAL_LEN, L // 4), max(MIN_RETRIEVAL_LEN, L // 2), L],
                                  n_wordings=recipe.s3_wordings)
                info.update(retrieval="train family", wordings=recipe.s3_wordings)
            rows = mix(rows, ret, seed=s)
            info.update(retrieval_rows=len(ret), retrieval_seed=10 * s + S3_SEED, mix_seed=s)
    else:
        raise HeadscopeInputError(f"stage {stage!r} does not exist; use 1, 2 or 3")
    info["rows"] = len(rows)
    info["rows_sha256"] = rows_sha256(rows)
    info["build_seconds"] = round(time.perf_counter() - t0, 2)
    return rows, info
