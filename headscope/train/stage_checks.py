"""Checks of a conversion stage before the teacher loads or any text is sampled (issue #19).

:func:`check_convert_args` covers ``headscope convert``; :func:`check_stage_inputs` the files and data
settings that :func:`headscope.train.convert_stage` needs (the previous stage's model folder, the
checkpoint to resume or not to overwrite, the corpus, enough rows for a batch); the conversion folder of
:func:`headscope.train.convert_model` is checked by :func:`headscope.train.recipe.check_convert_dir`. All raise
:class:`~headscope.errors.HeadscopeInputError` (or a variant) with a message that names the fix.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Optional

from ..errors import HeadscopeInputError, InputFileExistsError, InputFileNotFoundError
from ..masks import check_mask_layers
from ..models import check_model
from ..validate import check_choice, check_device, check_file, check_int, check_out_dir, check_real

GDN_KERNELS = ("auto", "torch", "fla")
STAGES = {1: "layer-wise alignment", 2: "global distillation", 3: "long-context fine-tuning"}
MIN_RETRIEVAL_SEQ_LEN = 96  # the shortest retrieval prompt build_rows makes


def check_stage(stage: Any, name: str = "stage") -> int:
    """Raises HeadscopeInputError unless ``stage`` is 1, 2 or 3 (the message says what each is)."""
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in STAGES:
        what = ", ".join(f"{k} ({v})" for k, v in STAGES.items())
        raise HeadscopeInputError(f"{name} {stage!r} does not exist; use {what}")
    return stage


def check_grad_accum(stage: int, grad_accum: int) -> int:
    """``grad_accum`` as an int after checking that it is >= 1 (``stage`` kept for the callers' symmetry).

    Raises:
        HeadscopeInputError: a count < 1.
    """
    k = int(grad_accum)
    if k < 1:
        raise HeadscopeInputError(f"grad_accum={grad_accum}: use 1 (no accumulation) or more micro-batches per step")
    return k


def _check_corpus(corpus: Any) -> None:
    p = check_file(corpus, "corpus", "pass a UTF-8 text file (documents separated by blank lines), or leave --corpus out")
    if p.stat().st_size <= 1 << 20 and not p.read_text(encoding="utf-8", errors="replace").strip():
        raise HeadscopeInputError(f"corpus {p} is empty; pass a text file with documents separated by blank lines")


def check_data(data: Any, stage: int, batch_size: int, world: int = 1, cli: bool = False) -> Optional[int]:
    """A stage's data settings -> the number of training rows when it is known in advance (sampled text).

    Raises:
        HeadscopeInputError: a bad length or count, an unknown retrieval task, a retrieval share
            outside [0, 1), a missing or empty corpus, too little text for one row or for one batch,
            a batch smaller than the number of processes.
    """
    from ..tasks import TASKS

    f = (lambda n: "--" + n.replace("_", "-")) if cli else (lambda n: n)
    L = check_int(f("seq_len"), data.seq_len, lo=2, fix="rows need at least 2 tokens")
    check_int(f("text_docs"), data.text_docs, lo=1)
    check_int(f("doc_len"), data.doc_len, lo=1)
    check_int(f("seed"), data.seed)
    check_choice(f("retrieval_task"), data.retrieval_task, sorted(TASKS))
    frac = check_real(f("retrieval_frac"), data.retrieval_frac, 0.0, 1.0, hi_open=True,
                      fix="it is the share of retrieval rows among all rows")
    if world > batch_size:
        raise HeadscopeInputError(
            f"{f('batch_size')}={batch_size} cannot feed {world} processes; use a batch size >= {world}"
        )
    if frac > 0 and L < MIN_RETRIEVAL_SEQ_LEN:
        raise HeadscopeInputError(
            f"{f('seq_len')}={L} is too short for retrieval rows (prompts of >= {MIN_RETRIEVAL_SEQ_LEN} tokens); "
            f"raise {f('seq_len')} or set {f('retrieval_frac')} 0"
        )
    if data.corpus:
        _check_corpus(data.corpus)
        return None
    n_tokens = data.text_docs * (data.doc_len + 2)  # BOS + doc_len sampled tokens + EOS per document
    n_rows = n_tokens // L
    if n_rows < 1:
        raise HeadscopeInputError(
            f"{data.text_docs} sampled document(s) of {data.doc_len} tokens give {n_tokens} tokens, fewer than one "
            f"row of {f('seq_len')}={L}; raise {f('text_docs')} / {f('doc_len')} or lower {f('seq_len')}"
        )
    if frac > 0:
        n_rows += max(1, round(n_rows * frac / (1 - frac)))
    if batch_size > n_rows:
        raise HeadscopeInputError(
            f"{f('batch_size')}={batch_size} is more than the {n_rows} training rows; lower the batch size or raise "
            f"{f('text_docs')}"
        )
    return n_rows


def check_stage_files(out: Any, stage: int, resume: bool, need_student: bool = True,
                      total_steps: Optional[int] = None) -> None:
    """The files a stage needs (the finished folder ``out/stage{k-1}/``; with ``resume`` a checkpoint of
    the same plan) and the one it must not overwrite (a checkpoint without ``resume``).

    Raises:
        InputFileNotFoundError: no finished previous stage, or ``resume`` without a checkpoint.
        InputFileExistsError: a checkpoint exists and ``resume`` is False.
        HeadscopeInputError: the checkpoint is of another stage or plans another number of steps.
    """
    from .parallel import TRAINER_STATE, find_checkpoint, read_trainer_state

    from .model_folder import RECORD, is_model_folder

    out = Path(out)
    if need_student and stage > 1:
        prev = out / f"stage{stage - 1}"
        if not is_model_folder(prev):
            raise InputFileNotFoundError(
                f"{prev / RECORD} does not exist: stage {stage} starts from stage {stage - 1}'s model folder; run the "
                f"previous stage first (`headscope convert --stage {stage - 1} --out {out}`, to the end)"
            )
    sd = out / f"stage{stage}"
    found = find_checkpoint(sd / "checkpoint")
    if resume and found is None:
        raise InputFileNotFoundError(f"--resume: no checkpoint at {sd / 'checkpoint'}; start without --resume")
    if not resume and found is not None:
        raise InputFileExistsError(
            f"{sd / 'checkpoint'} exists: pass resume=True (--resume) to continue it, or use another output directory"
        )
    if resume and total_steps is not None and found is not None:
        path = found / TRAINER_STATE
        st = read_trainer_state(found)
        if st.get("stage") != stage:
            raise HeadscopeInputError(f"{path} is a stage-{st.get('stage')} checkpoint, this is stage {stage}")
        if st.get("total_steps") != total_steps:
            raise HeadscopeInputError(
                f"checkpoint planned {st.get('total_steps')} steps, this run {total_steps}: resume with the same "
                "--tokens, batch size and sequence length"
            )


def total_steps(tokens: int, batch_size: int, seq_len: int) -> int:
    """Optimizer steps of a stage (as :class:`~headscope.train.Trainer` plans them)."""
    return max(1, math.ceil(tokens / (batch_size * seq_len)))


def check_stage_inputs(out: Any, stage: int, config: Any, data: Any, resume: bool, need_student: bool = True,
                       world: int = 1, cli: bool = False, rows: Any = None) -> None:
    """Everything :func:`headscope.train.convert_stage` needs, before text is sampled or a model built.

    Raises:
        HeadscopeInputError (or a variant): see :func:`check_data` and :func:`check_stage_files`.
    """
    check_stage(stage, "--stage" if cli else "stage")
    if config.stage != stage:
        raise HeadscopeInputError(f"config is for stage {config.stage}, asked for stage {stage}")
    check_out_dir(out, "--out" if cli else "out_dir")
    L = rows.seq_len if rows is not None else data.seq_len
    if rows is None:
        check_data(data, stage, config.batch_size, world, cli)
    check_stage_files(out, stage, resume, need_student, total_steps(config.tokens, config.batch_size, L))


def check_convert_args(*, model: Any, mask: Any, stage: Any, out: Any, devices: Any, device: Any, gdn_kernel: Any,
                       data_parallel: Any = None) -> Any:
    """``headscope convert``'s own arguments (the recipe checks itself: :class:`~headscope.train.recipe.ConvertRecipe`;
    the conversion folder: :func:`~headscope.train.recipe.check_convert_dir`) -> the HeadMask, checked against the teacher's
    geometry read from its config.

    Raises:
        HeadscopeInputError (or a variant): a bad value, a missing or foreign mask, an unknown
            teacher, CUDA or the fla kernel where they are not available.
    """
    from ..masks import HeadMask

    if stage is not None:
        check_stage(stage, "--stage")
    check_int("--devices", devices, lo=1, fix="need at least one process")
    check_device(device, "--device")
    check_choice("--gdn-kernel", gdn_kernel, GDN_KERNELS)
    if data_parallel is not None:
        check_choice("--data-parallel", data_parallel, ("ddp", "fsdp"))
    if gdn_kernel == "fla":
        import torch

        if importlib.util.find_spec("fla") is None:
            raise HeadscopeInputError("--gdn-kernel fla needs flash-linear-attention: pip install 'headscope[gdn]', "
                                      "or use --gdn-kernel torch")
        if (device or "cuda").startswith("cpu") or not torch.cuda.is_available():
            raise HeadscopeInputError("--gdn-kernel fla runs on CUDA only; use --gdn-kernel torch on this device")
    g = check_model(model, "--model")
    hm = HeadMask.from_json(mask)
    if g is not None:
        hm.check_geometry(g.n_layers, g.n_heads, g.n_kv_heads)
    check_mask_layers(hm, int(hm.meta.get("min_per_layer", 0) or 0))
    check_out_dir(out, "--out")
    return hm
