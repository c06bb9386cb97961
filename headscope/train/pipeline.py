"""The conversion pipeline around :class:`~headscope.train.trainer.Trainer` (SPEC.md §9): the data of a
stage (teacher samples or a corpus, retrieval rows), the student of a stage (hybridized teacher, or the
previous stage's weights), one stage end to end, and a stage spread over N local processes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..errors import HeadscopeInputError, InputFileNotFoundError
from . import parallel
from .data import TokenRows
from .trainer import TrainConfig, Trainer

@dataclass
class DataConfig:
    """Where a stage's rows come from.

    Attributes:
        seq_len: row length in tokens (stage 3 uses a longer one).
        text_docs: documents sampled from the teacher (each ``doc_len`` new tokens) and cached under
            ``out/data/``; ignored when ``corpus`` is given.
        doc_len: tokens per sampled document.
        corpus: a user text file (documents separated by blank lines) used instead of sampled text.
        retrieval_frac: share of rows that are synthetic retrieval examples (stage 3 only).
        retrieval_task: task name in :data:`headscope.tasks.TASKS`.
        retrieval_lengths: prompt lengths of the retrieval rows (default: ``seq_len`` // 4, // 2, full).
        seed: sampling / task seed.
    """

    seq_len: int = 512
    text_docs: int = 256
    doc_len: int = 512
    corpus: Optional[str] = None
    retrieval_frac: float = 0.0
    retrieval_task: str = "niah_single"
    retrieval_lengths: Optional[list[int]] = None
    seed: int = 0
    sample_batch: int = 64


def build_rows(teacher: nn.Module, tokenizer: Any, data: DataConfig, cache_dir: Optional[Path] = None) -> TokenRows:
    """Packed text rows (teacher samples or the user corpus) plus, if ``retrieval_frac`` > 0, retrieval
    rows mixed in so that they make up that share of all rows."""
    from .data import corpus_documents, mix, pack, retrieval_rows, sample_teacher_text

    if data.corpus:
        docs = corpus_documents(data.corpus, tokenizer)
    else:
        path = cache_dir / f"teacher_text_s{data.seed}_{data.text_docs}x{data.doc_len}.pt" if cache_dir else None
        if path is not None and path.exists():
            docs = torch.load(path)
        else:
            docs = sample_teacher_text(teacher, tokenizer, data.text_docs, data.doc_len, seed=data.seed, batch_size=data.sample_batch)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(docs, path)
    rows = pack(docs, data.seq_len, tokenizer.eos_token_id)
    if data.retrieval_frac > 0:
        if not data.retrieval_frac < 1:
            raise HeadscopeInputError(f"retrieval_frac={data.retrieval_frac} must lie in [0, 1)")
        n = max(1, round(len(rows) * data.retrieval_frac / (1 - data.retrieval_frac)))
        lengths = data.retrieval_lengths or [max(96, data.seq_len // 4), max(96, data.seq_len // 2), data.seq_len]
        rows = mix(rows, retrieval_rows(tokenizer, n, data.seq_len, data.retrieval_task, seed=data.seed + 1, lengths=lengths), seed=data.seed)
    return rows


def load_student(
    teacher: nn.Module, mask: Any, init: Optional[str | Path] = None, calibration_ids: Optional[torch.Tensor] = None, **options: Any
) -> nn.Module:
    """A hybrid student: :func:`headscope.hybridize` (γ calibrated on ``calibration_ids``), then the weights
    of ``init`` (a ``student.pt`` of an earlier stage) if given.

    Raises:
        InputFileNotFoundError (a FileNotFoundError and HeadscopeInputError): ``init`` does not exist.
    """
    from ..hybrid import hybridize

    student = hybridize(teacher, mask, calibration_ids=calibration_ids if init is None else None, **options)
    if init is not None:
        p = Path(init)
        if not p.exists():
            raise InputFileNotFoundError(f"{p} does not exist: run the previous stage first (headscope convert --stage N-1)")
        student.load_state_dict(torch.load(p, map_location=next(student.parameters()).device))
    return student


def convert_stage(
    teacher: nn.Module,
    tokenizer: Any,
    mask: Any,
    stage: int,
    out_dir: str | Path,
    config: Optional[TrainConfig] = None,
    data: Optional[DataConfig] = None,
    resume: bool = False,
    student: Optional[nn.Module] = None,
    hybrid_options: Optional[dict[str, Any]] = None,
    deadline: Optional[float] = None,
    rows: Optional[TokenRows] = None,
    max_steps: Optional[int] = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Run one stage of the conversion into ``out_dir/stage{stage}/``.

    The student is ``student`` if given, else built from the teacher and ``mask`` (stage 1) or from
    ``out_dir/stage{stage-1}/student.pt`` (stages 2, 3). Sampled teacher text is cached under
    ``out_dir/data/`` so that a resumed or later stage reuses it; ``rows`` replaces the data built
    from ``data`` (e.g. rows shared by several conversions). ``deadline`` (a ``time.time()`` value)
    stops the stage early, with a checkpoint, when reached; so does ``max_steps`` (steps in total).

    Data parallel (a process group of more than one rank, e.g. from :func:`spawn_convert`): every
    rank calls this with the same arguments; rank 0 builds the rows first (sampled text is cached),
    the student is replicated (the fast step on every rank; ``config.data_parallel="replicate"``, the
    default where the fast step works) or sharded with FSDP2 (``"fsdp"``; the returned student then
    holds this rank's shards).

    Returns:
        (student, summary of :meth:`Trainer.run`).

    Raises:
        HeadscopeInputError (a ValueError), before any text is sampled or a student built (see
        :func:`headscope.train.checks.check_stage_inputs`): a config of another stage; bad data
        settings (unknown retrieval task, a missing corpus, too little text for a batch); no
        ``out_dir/stage{stage-1}/student.pt`` for stages 2 and 3 (InputFileNotFoundError);
        ``resume`` without a checkpoint (InputFileNotFoundError), a checkpoint without ``resume``
        (InputFileExistsError), a checkpoint of another plan.
    """
    from .checks import check_stage_inputs

    out = Path(out_dir)
    config = config or TrainConfig(stage=stage, tokens=100_000)
    data = data or DataConfig()
    rank, world = parallel.world_info()
    check_stage_inputs(out, stage, config, data, resume, need_student=student is None, world=world, rows=rows)
    if rows is None:
        # data parallel: rank 0 samples (and caches) the teacher text first, the others read the cache
        if rank == 0:
            rows = build_rows(teacher, tokenizer, data, cache_dir=out / "data")
        parallel.barrier()
        if rank != 0:
            rows = build_rows(teacher, tokenizer, data, cache_dir=out / "data")
    if student is None:
        init = None if stage == 1 else out / f"stage{stage - 1}" / "student.pt"
        student = load_student(teacher, mask, init=init, calibration_ids=rows.ids[:8].to(next(teacher.parameters()).device), **(hybrid_options or {}))
    sd = out / f"stage{stage}"
    sd.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (sd / "config.json").write_text(json.dumps({"train": asdict(config), "data": asdict(data), "hybrid": hybrid_options or {}}, indent=2, default=str))
    tr = Trainer(student, teacher, rows, config, sd, resume=resume)
    return student, tr.run(deadline=deadline, max_steps=max_steps)


def _convert_worker(device: Optional[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One rank of :func:`spawn_convert` (inside a process group set up by :func:`headscope.runtime.launch`)."""
    from ..masks import HeadMask
    from ..models import load_hf
    from ..runtime import local_rank, rank_device

    kw = dict(kwargs)
    teacher, tok, _ = load_hf(kw.pop("model"), device=rank_device(device, local_rank()),
                              dtype=kw.pop("dtype", torch.float32))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    mask = kw.pop("mask")
    mask = mask if isinstance(mask, HeadMask) else HeadMask.from_json(mask)
    _, summary = convert_stage(teacher, tok, mask, **kw)
    return summary


def spawn_convert(n: int, model: str, mask: Any, stage: int, out_dir: str | Path, device: Optional[str] = None, **kwargs: Any) -> dict[str, Any]:
    """Run :func:`convert_stage` data-parallel over ``n`` local processes (one per GPU, or CPU/gloo):
    each process loads the teacher ``model`` (a spec of :func:`headscope.models.load_hf`) on its
    device, the student is replicated or sharded with FSDP2 (``config.data_parallel``), and every rank
    takes its slice of each global batch.
    ``kwargs`` go to :func:`convert_stage` (config, data, resume, hybrid_options, deadline,
    max_steps) and ``dtype`` to the teacher's loading.

    Returns:
        the stage summary of :meth:`Trainer.run`.

    Raises:
        HeadscopeInputError (a ValueError): ``n`` < 1.
    """
    if n < 1:
        raise HeadscopeInputError(f"--devices {n}: need at least one process")
    from ..runtime import launch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kw = {**kwargs, "model": str(model), "mask": mask, "stage": stage, "out_dir": str(out)}
    summary = launch(_convert_worker, n, (device, kw), device=device)
    return summary
