"""The conversion pipeline around :class:`~headscope.train.trainer.Trainer` (SPEC.md §9): the data of a
stage (teacher samples or a corpus, retrieval rows), the student of a stage (hybridized teacher, or the
previous stage's model folder), one stage end to end ending in a model folder, the three stages of a
:class:`~headscope.train.recipe.ConvertRecipe` (:func:`convert_model`), and either spread over N local
processes.
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
            docs = torch.load(path, weights_only=True)
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
    teacher: nn.Module, mask: Any, init: Optional[str | Path] = None, calibration_ids: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None, **options: Any
) -> nn.Module:
    """A hybrid student: :func:`headscope.hybridize` (γ calibrated on ``calibration_ids``; in ``dtype``, default the
    teacher's), then the weights of ``init`` if given: a finished stage's model folder (``OUT/stage{k}/``, its
    weights) or a bare state-dict file of an earlier format (read with ``weights_only=True``).

    Raises:
        InputFileNotFoundError (a FileNotFoundError and HeadscopeInputError): ``init`` does not exist.
    """
    from ..hybrid import hybridize

    student = hybridize(teacher, mask, calibration_ids=calibration_ids if init is None else None, dtype=dtype, **options)
    if init is not None:
        p = Path(init)
        if not p.exists():
            raise InputFileNotFoundError(f"{p} does not exist: run the previous stage first (headscope convert --stage N-1)")
        dev = next(student.parameters()).device
        if p.is_dir():
            from safetensors.torch import load_file

            from .model_folder import is_model_folder

            if not is_model_folder(p):
                raise InputFileNotFoundError(f"{p} is not a finished conversion stage (no training.json): run that stage to the end")
            sd = {}
            for f in sorted(p.glob("*.safetensors")):
                sd.update(load_file(str(f), device=str(dev)))
            missing, unexpected = student.load_state_dict(sd, strict=False)
            tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(student.config, "tie_word_embeddings", False) else set()
            if set(missing) - tied or unexpected:
                raise HeadscopeInputError(f"{p} holds the weights of another model (missing {sorted(set(missing) - tied)[:3]}, "
                                          f"unexpected {sorted(unexpected)[:3]}): the mask or the teacher differ")
        else:
            student.load_state_dict(torch.load(p, map_location=dev, weights_only=True))
    return student


def stage_record(stage: int, trainer: Trainer, summary: dict[str, Any], config: TrainConfig, rows: TokenRows,
                 hybrid_options: dict[str, Any], mask: Any, extra: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The training record of a finished stage (``training.json``): tokens, steps, seeds, the rows'
    SHA-256, the loss curve, seconds and peak memory over every run of the stage, package versions, the
    device and the whole configuration; ``extra`` (e.g. the recipe, the documents' hashes) is merged in."""
    from .model_folder import device_name, loss_curve, package_versions
    from .recipe import rows_sha256

    rec: dict[str, Any] = {
        "format": "headscope.convert/1",
        "stage": stage,
        "stage_name": {1: "layer-wise alignment", 2: "global distillation", 3: "long-context fine-tuning"}[stage],
        "tokens": summary["tokens"],
        "steps": summary["steps"],
        "seconds": summary.get("seconds_total", summary["seconds"]),
        "peak_memory": summary.get("peak_memory"),
        "final_loss": summary.get("final_loss"),
        "seeds": {"train": config.seed},
        "data": {"rows": len(rows), "row_len": rows.seq_len, "rows_sha256": rows_sha256(rows)},
        "loss_curve": {"columns": ["step", "tokens", "loss"], "rows": loss_curve(trainer.out / "log.jsonl")},
        "versions": package_versions(),
        "device": device_name(trainer.device),
        "data_parallel": summary.get("data_parallel"),
        "world_size": trainer.world if trainer.parallel else 1,
        "fast_step": summary.get("fast_step"),
        "graph_breaks": summary.get("graph_breaks"),
        "graph_error": summary.get("graph_error"),
        "step_plan": summary.get("step_plan"),
        "config": {"train": asdict(config), "hybrid": hybrid_options},
        "mask": {"n_fa": mask.n_fa, "n_heads": mask.n_layers * mask.n_heads,
                 "kv_cache_fraction": mask.kv_cache_fraction},
    }
    for k, v in (extra or {}).items():
        if isinstance(v, dict) and isinstance(rec.get(k), dict):
            rec[k] = {**rec[k], **v}
        else:
            rec[k] = v
    return rec


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
    on_step: Optional[Any] = None,
    record: Optional[dict[str, Any]] = None,
    save_folder: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """Run one stage of the conversion into ``out_dir/stage{stage}/``, which becomes a model folder
    (:mod:`headscope.train.model_folder`) when the stage finishes.

    The student is ``student`` if given, else built from the teacher and ``mask`` (stage 1; γ calibrated
    on the first 8 rows) or read from the previous stage's folder ``out_dir/stage{stage-1}/`` (stages 2,
    3), in float32 or the teacher's dtype where that is wider (fp32 master weights of a bf16 teacher). ``rows`` replaces the data built from ``data`` (sampled teacher text is then cached under
    ``out_dir/data/``). ``deadline`` (a ``time.time()`` value) stops the stage early, with a checkpoint,
    when reached; so does ``max_steps`` (steps in total); ``on_step`` goes to :meth:`Trainer.run`.
    ``record``: entries merged into the stage's ``training.json`` (:func:`stage_record`).
    ``save_folder``: write the model folder at the end (False: only the trainer's files). The
    checkpoint is removed once the folder is complete. Stage 3 trains without the teacher: a teacher on an
    accelerator waits in host memory during the stage and is moved back afterwards (also after an error).

    Data parallel (a process group of more than one rank, e.g. from :func:`spawn_convert`): every
    rank calls this with the same arguments; rank 0 builds the rows first (sampled text is cached),
    the student is replicated (the fast step on every rank through DistributedDataParallel;
    ``config.data_parallel="ddp"``, the default where the fast step works) or sharded with FSDP2 (``"fsdp"``; the returned student then
    holds this rank's shards).

    Returns:
        (student, summary of :meth:`Trainer.run`, plus ``folder`` when it was written).

    Raises:
        HeadscopeInputError (a ValueError), before any text is sampled or a student built (see
        :func:`headscope.train.stage_checks.check_stage_inputs`): a config of another stage; bad data
        settings (unknown retrieval task, a missing corpus, too little text for a batch); no finished
        ``out_dir/stage{stage-1}/`` for stages 2 and 3 (InputFileNotFoundError); ``resume`` without a
        checkpoint (InputFileNotFoundError), a checkpoint without ``resume`` (InputFileExistsError), a
        checkpoint of another plan.
    """
    import shutil

    from .stage_checks import check_stage_inputs
    from .model_folder import save_model_folder

    out = Path(out_dir)
    config = config or TrainConfig(stage=stage, tokens=100_000)
    data = data or DataConfig()
    rank, world = parallel.world_info()
    check_stage_inputs(out, stage, config, data, resume, need_student=student is None, world=world, rows=rows)
    from .trainer import hold_teacher

    hold_teacher(teacher, config.teacher_dtype)  # first: the teacher that samples, calibrates γ and trains
    # what the record says of the data: the caller's (e.g. the recipe's), else the DataConfig the rows came from
    extra = record if record is not None else ({} if rows is not None else {"config": {"data": asdict(data)}})
    if rows is None:
        # data parallel: rank 0 samples (and caches) the teacher text first, the others read the cache
        if rank == 0:
            rows = build_rows(teacher, tokenizer, data, cache_dir=out / "data")
        parallel.barrier()
        if rank != 0:
            rows = build_rows(teacher, tokenizer, data, cache_dir=out / "data")
    opts = dict(hybrid_options or {})
    if student is None:
        init = None if stage == 1 else out / f"stage{stage - 1}"
        t0 = next(teacher.parameters())
        student = load_student(teacher, mask, init=init, calibration_ids=rows.ids[:8].to(t0.device),
                               dtype=torch.promote_types(t0.dtype, torch.float32), **opts)
    sd = out / f"stage{stage}"
    if rank == 0:
        sd.mkdir(parents=True, exist_ok=True)
        if not resume:  # a stage started anew: no log of an earlier attempt that stopped before its first checkpoint
            for f in ("log.csv", "log.jsonl"):
                (sd / f).unlink(missing_ok=True)
        (sd / "stage_config.json").write_text(json.dumps({"train": asdict(config), "hybrid": opts, **extra}, indent=2,
                                                         default=str))
    parallel.barrier()
    dev = next(student.parameters()).device
    # stage 3 trains the student alone: an accelerator's copy of the teacher waits in host memory meanwhile
    # (6.4 GiB of GPU memory at Qwen3-1.7B in float32, which stage 3 at 8K needs on an 80 GB GPU)
    t_dev = next(teacher.parameters()).device if stage == 3 and teacher is not None else None
    parked = t_dev is not None and t_dev.type != "cpu"
    if parked:
        teacher.to("cpu")
    try:
        if dev.type == "cuda":
            if parked:
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)  # the stage's peak (the teacher's weights included in stages 1-2)
        tr = Trainer(student, None if stage == 3 else teacher, rows, config, sd, resume=resume)
        summary = tr.run(deadline=deadline, max_steps=max_steps, on_step=on_step)
    finally:
        if parked:
            teacher.to(t_dev)
    if summary["finished"] and save_folder:
        full = parallel.full_state_dict(student) if parallel.is_sharded(student) else None  # collective if sharded
        if rank == 0:
            from ..hybrid.convert import hybrid_spec

            saved_opts = hybrid_spec(student)[1].to_dict() if hasattr(student.config, "headscope_hybrid") else opts
            rec = stage_record(stage, tr, summary, config, rows, saved_opts, mask, extra)
            save_model_folder(student, tokenizer, mask, sd, rec, state_dict=full)
            shutil.rmtree(sd / "checkpoint", ignore_errors=True)
        parallel.barrier()
        summary["folder"] = str(sd)
    return student, summary


RECIPE_FILE = "recipe.json"


def convert_model(
    teacher: nn.Module,
    tokenizer: Any,
    mask: Any,
    out_dir: str | Path,
    recipe: Optional[Any] = None,
    stages: tuple[int, ...] = (1, 2, 3),
    resume: bool = False,
    hybrid_options: Optional[dict[str, Any]] = None,
    train_options: Optional[dict[str, Any]] = None,
    teacher_name: Optional[str] = None,
    on_step: Optional[Any] = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Convert ``teacher`` into a head-wise hybrid with ``recipe`` (default: :class:`ConvertRecipe`, the
    conversion study's): the ``stages`` in order, each ending in the model folder ``out_dir/stage{k}/``
    that the next one starts from. What ``headscope convert`` runs.

    ``out_dir`` also holds ``recipe.json`` (written by the first call; every later call must pass the
    same recipe) and ``data/`` (the sampled documents in shards, each stage's rows, the held-out rows
    ``heldout.pt``), so ``resume`` continues exactly where a run stopped: finished stages are skipped,
    a stage with a checkpoint continues from it, the next one starts from the last folder; the rows
    and the seeds are those of the first run.

    Args:
        mask: the FA heads (:class:`~headscope.masks.HeadMask`).
        hybrid_options: hybrid options beside the recipe's (e.g. ``gdn_kernel``).
        train_options: :class:`~headscope.train.TrainConfig` fields beside the recipe's (``fast``,
            ``data_parallel``, ``progress``, ``compile``, ``cuda_graph``, ``bf16``, ``activation_checkpointing``,
            ``grad_accum``, ``deterministic``: also the documents' sampling under PyTorch's deterministic settings,
            and on CUDA the FA heads trained with SDPA where flash-attn would run,
            :func:`~headscope.train.determinism.fa_kernel_override`; ``new_params_only``: stage 1's only, the later
            stages' configs do without it; ``teacher_dtype``: the teacher is cast to it in place before the documents
            are sampled, so every stage sees one teacher).
        teacher_name: the teacher's spec, for the record.
        on_step: called after every step (:meth:`Trainer.run`; raising :class:`StopTraining` stops the
            run with a checkpoint).

    Returns:
        {"stages": {k: summary}, "folder": the last stage's folder (None when it did not finish),
        "finished": bool}.

    Raises:
        HeadscopeInputError (or a variant), before any document is sampled or a student built
        (:func:`headscope.train.recipe.check_convert_dir`): a recipe other than ``recipe.json``'s, a
        stage folder or checkpoint without ``resume``, ``resume`` with nothing to continue, a stage
        whose previous stage is not finished, a checkpoint of another plan.
    """
    from .determinism import deterministic_mode, fa_kernel_override
    from .model_folder import is_model_folder, stage_finished
    from .recipe import ConvertRecipe, DOC_SEED, S2_SEED, S3_SEED, check_convert_dir, recipe_documents, recipe_rows

    recipe = recipe or ConvertRecipe()
    out = Path(out_dir)
    stages = tuple(sorted(stages))
    rank, _ = parallel.world_info()
    check_convert_dir(out, recipe, stages, resume)
    if rank == 0 and not (out / RECIPE_FILE).exists():
        from ..runtime import atomic_write_text

        atomic_write_text(out / RECIPE_FILE, json.dumps(recipe.to_dict(), indent=2))
    from .trainer import hold_teacher

    hold_teacher(teacher, (train_options or {}).get("teacher_dtype"))
    det = bool((train_options or {}).get("deterministic"))
    hybrid = fa_kernel_override(det, {**recipe.hybrid_options(), **(hybrid_options or {})},
                                next(teacher.parameters()).device)
    # the documents' sampling and every stage under the setting (headscope.train.determinism)
    with deterministic_mode(det):
        todo = [k for k in stages if not stage_finished(out, k)]
        data_dir = out / "data"
        docs_info: dict[str, Any] = {}
        train_docs: list = []
        texts: list = []
        if todo:
            # rank 0 samples (and caches) the documents and builds the rows first; the other ranks read them
            for turn in (0, 1):
                if (rank == 0) == (turn == 0):
                    train_docs, held, docs_info = recipe_documents(teacher, tokenizer, recipe, data_dir, progress=progress)
                    if rank == 0 and held and not (data_dir / "heldout.pt").exists():
                        from .data import pack

                        pack(held, recipe.seq_len, tokenizer.eos_token_id).save(data_dir / "heldout.pt")
                parallel.barrier()
        summaries: dict[int, Any] = {}
        seeds = {"documents": [DOC_SEED * recipe.seed + k for k in range(docs_info.get("shards", 0))],
                 "row_order": recipe.seed, "mix": recipe.seed, "student_init": recipe.seed,
                 "s2_retrieval": 10 * recipe.seed + S2_SEED, "s3_retrieval": 10 * recipe.seed + S3_SEED}
        for k in stages:
            sd = out / f"stage{k}"
            if stage_finished(out, k):
                summaries[k] = {"stage": k, "finished": True, "folder": str(sd), "skipped": "already finished"
                                if is_model_folder(sd) else "finished (its folder removed; a later stage is complete)"}
                continue
            f_rows, f_info = data_dir / f"stage{k}_rows.pt", data_dir / f"stage{k}_rows.json"
            for turn in (0, 1):
                if (rank == 0) == (turn == 0):
                    if f_rows.exists() and f_info.exists():
                        rows, row_info = TokenRows.load(f_rows), json.loads(f_info.read_text())
                    else:
                        if not texts and (k == 2 and recipe.s2_retrieval > 0 or k == 3 and recipe.s3_seen_task is None):
                            texts = [tokenizer.decode(d, skip_special_tokens=True) for d in train_docs]
                        rows, row_info = recipe_rows(tokenizer, recipe, train_docs, k, texts=texts or None)
                        rows.save(f_rows)
                        from ..runtime import atomic_write_text

                        atomic_write_text(f_info, json.dumps(row_info, indent=2))
                parallel.barrier()
            stage_options = {x: v for x, v in (train_options or {}).items() if k == 1 or x != "new_params_only"}
            cfg = recipe.train_config(k, **{"progress": progress, **stage_options})
            resume_k = parallel.find_checkpoint(sd / "checkpoint") is not None
            if k == 1:
                torch.manual_seed(recipe.seed)  # the GDN heads' random initialization
            record = {"recipe": recipe.to_dict(), "teacher": teacher_name, "seeds": {**seeds, "train": recipe.seed},
                      "data": {**docs_info, **row_info}, "previous": str(out / f"stage{k - 1}") if k > 1 else None,
                      "config": {"train_options": train_options or {}}}
            _, summ = convert_stage(teacher, tokenizer, mask, k, out, config=cfg, resume=resume_k, hybrid_options=hybrid,
                                    rows=rows, on_step=on_step, record=record)
            summaries[k] = summ
            if not summ["finished"]:
                break
    last = out / f"stage{stages[-1]}"
    done = is_model_folder(last)
    return {"stages": summaries, "folder": str(last) if done else None, "finished": done}


def _convert_worker(device: Optional[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One rank of :func:`spawn_convert` (inside a process group set up by :func:`headscope.runtime.launch`)."""
    from ..masks import HeadMask
    from ..models import load_hf
    from ..runtime import local_rank, rank_device

    kw = dict(kwargs)
    from .step_plan import TEACHER_DTYPES

    held = (kw.get("train_options") or {}).get("teacher_dtype") or getattr(kw.get("config"), "teacher_dtype", None)
    teacher, tok, _ = load_hf(kw.pop("model"), device=rank_device(device, local_rank()),
                              dtype=kw.pop("dtype", TEACHER_DTYPES[held or "fp32"]))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    mask = kw.pop("mask")
    mask = mask if isinstance(mask, HeadMask) else HeadMask.from_json(mask)
    if "stages" in kw:
        return convert_model(teacher, tok, mask, **kw)
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
    return _launch_convert(n, device, {**kwargs, "model": str(model), "mask": mask, "stage": stage}, out_dir)


def spawn_convert_model(n: int, model: str, mask: Any, out_dir: str | Path, device: Optional[str] = None,
                        **kwargs: Any) -> dict[str, Any]:
    """Run :func:`convert_model` data-parallel over ``n`` local processes (as :func:`spawn_convert` does
    for one stage); ``kwargs`` go to :func:`convert_model` (recipe, stages, resume, hybrid_options,
    train_options, teacher_name, progress).

    Returns:
        rank 0's result of :func:`convert_model`.

    Raises:
        HeadscopeInputError (a ValueError): ``n`` < 1.
    """
    return _launch_convert(n, device, {"stages": (1, 2, 3), **kwargs, "model": str(model), "mask": mask}, out_dir)


def _launch_convert(n: int, device: Optional[str], kw: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """:func:`_convert_worker` on ``n`` local processes (:func:`headscope.runtime.launch`), writing into ``out_dir``
    (made here) -> rank 0's result.

    Raises:
        HeadscopeInputError (a ValueError): ``n`` < 1.
    """
    if n < 1:
        raise HeadscopeInputError(f"--devices {n}: need at least one process")
    from ..runtime import launch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return launch(_convert_worker, n, (device, {**kw, "out_dir": str(out)}), device=device)
