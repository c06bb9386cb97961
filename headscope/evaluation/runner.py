"""``headscope eval``: the retention suite on any model headscope loads, the teacher beside it, into one folder.

:func:`check_eval_args` checks every argument (tasks, formats, lengths, counts, the model specs, the corpus, the
device, the output folder) before anything loads and returns a frozen :class:`EvalConfig`; :func:`run_eval` loads
the model (and the teacher), builds or reads the haystack and the prompt sets, scores every cell of both
(:func:`headscope.evaluation.retention.evaluate_suite`: teacher-forced greedy exact match of all ``n`` prompts in
batches of ``batch_tokens`` tokens, free greedy generation of the first ``gen_n``), and writes

* ``OUT/cells/NAME__sSEED__tTOKENS/TASK.FORMATS.LENGTH.json.gz``: one cell's record with its per-prompt outcomes
  (``correct``, ``prompt_len``, ``evidence_distance``, ``gen_exact``) and the suite settings; a rerun skips the
  cells stored with the same settings (resumable per cell), and a model already scored in OUT under another name
  (the teacher evaluated alone, then as ``--teacher``) has its cells copied, not scored again (:func:`reuse_cells`);
* ``OUT/retention.csv`` (:data:`~headscope.evaluation.retention.EVAL_COLUMNS`), ``retention_summary.csv`` (intervals),
  ``retention_seeds.csv``, ``report.md`` and ``report.html`` (:mod:`headscope.evaluation.report`), over every model
  stored under OUT (two students evaluated into one folder share the teacher's cells and the prompts);
* ``OUT/prompts/`` (the prompt sets, gzip JSON) and ``OUT/haystack/`` (sampled haystack documents).

Prompts are built with the teacher's tokenizer where there is a teacher (the two must share a vocabulary), so every
model scored into one folder sees the same prompts.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..errors import HeadscopeInputError

#: the defaults of ``headscope eval`` (the conversion study's suite at its headline lengths)
DEFAULT_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")
DEFAULT_LENGTHS = (1024, 2048, 4096)
DTYPES = ("float32", "bfloat16", "float16")
TEACHER = "teacher"


@dataclass(frozen=True)
class EvalConfig:
    """One ``headscope eval`` run (checked by :func:`check_eval_args`; recorded in OUT/eval.json).

    Attributes:
        model: model spec (a converted folder, a local HF directory, a .gguf path, a cached hub id, a name).
        teacher: the reference model's spec, scored on the same prompts (None: the model alone).
        name: the model's name in the cell folders and tables (default from the spec: :func:`default_name`).
        seed / tokens: the model's training seed and total training tokens in the tables (from a converted folder's
            training.json, :func:`training_record`; else 0).
        suite: the cells and their scoring (:class:`~headscope.evaluation.retention.SuiteConfig`).
        haystack: the unseen cells' haystack (:class:`~headscope.evaluation.haystack.HaystackConfig`).
        prompt_seed: added to the study's prompt seeds (0: the study's prompts).
        device: cpu / cuda / cuda:N (None: cuda when available). dtype: the weights' dtype; on CUDA the forward
            runs under bf16 autocast either way (the study's method).
        out: the output folder.
        workers: processes that build the prompt sets (tokenizer-bound, before any scoring).
    """

    model: str
    teacher: Optional[str]
    name: str
    seed: int
    tokens: int
    suite: Any
    haystack: Any
    prompt_seed: int = 0
    device: Optional[str] = None
    dtype: str = "float32"
    out: str = "runs/eval"
    workers: int = 1
    model_info: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return json.loads(json.dumps(d))


def split_list(values: Optional[Sequence[str]]) -> list[str]:
    """Values of a repeatable CLI option, each possibly comma-separated (``--lengths 1024,2048 --lengths 4096``)."""
    return [v.strip() for x in (values or []) for v in str(x).split(",") if v.strip()]


def parse_length(s: str) -> int:
    """A prompt length: an integer of tokens, or with a K suffix (``4K`` = 4096).

    Raises:
        HeadscopeInputError (a ValueError): anything else.
    """
    m = re.fullmatch(r"(\d+)([kK]?)", s.strip())
    if not m:
        raise HeadscopeInputError(f"--lengths {s!r}: give prompt lengths in tokens, e.g. 1024,2048,4096 or 1K,2K,4K")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def default_name(spec: str) -> str:
    """The name a model is stored and shown under: a folder's name (with its parent's for a conversion stage
    folder: ``runs/conv/stage3`` -> ``conv-stage3``), a file's stem, a hub id's last part, or the alias; characters
    a cell folder may not hold become ``-``."""
    s = str(spec).rstrip("/")
    p = Path(s).expanduser()
    if p.suffix == ".gguf":
        base = p.stem
    elif re.fullmatch(r"stage\d+", p.name) and p.parent.name:
        base = f"{p.parent.name}-{p.name}"
    else:
        base = p.name or s
    base = re.sub(r"[^A-Za-z0-9._+=-]", "-", base)
    base = re.sub(r"_{2,}", "_", base).strip("-") or "model"
    return base


def training_record(spec: str) -> dict[str, int]:
    """(seed, tokens) of a converted folder from its ``training.json`` (``headscope convert``'s record): the recipe's
    total token budget of the three stages and its seed (``recipe.tokens``, ``recipe.seed``), else the stage's own
    ``tokens`` and ``seeds.train``; zeros for any other model or an unreadable record."""
    f = Path(str(spec)).expanduser() / "training.json"
    try:
        d = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError):
        d = {}
    if not isinstance(d, dict):
        d = {}
    recipe = d.get("recipe") if isinstance(d.get("recipe"), dict) else {}
    seeds = d.get("seeds") if isinstance(d.get("seeds"), dict) else {}

    def first(*values: Any) -> int:
        for v in values:
            try:
                return int(v)
            except (TypeError, ValueError):
                continue
        return 0

    return {"seed": first(recipe.get("seed"), seeds.get("train"), d.get("seed")),
            "tokens": first(recipe.get("tokens"), d.get("tokens"))}


def check_eval_args(
    model: str, teacher: Optional[str] = None, formats: Sequence[str] = ("unseen",), tasks: Sequence[str] = DEFAULT_TASKS,
    lengths: Sequence[Any] = DEFAULT_LENGTHS, n: int = 100, gen_n: int = 20, gen_max_len: int = 4096,
    batch_tokens: int = 32768, corpus: Optional[str] = None, haystack_docs: int = 1024, doc_len: int = 512,
    seed: int = 0, device: Optional[str] = None, dtype: str = "float32", out: str | Path = "runs/eval",
    name: Optional[str] = None, workers: int = 1,
) -> EvalConfig:
    """Every argument of ``headscope eval`` checked, nothing loaded -> the run's :class:`EvalConfig`.

    Raises:
        HeadscopeInputError (a ValueError), one naming the fix: an unknown task or format, a length that is not a
            number of tokens or below 128, n < 1, gen_n < 0, batch_tokens < 1, a model or teacher spec that cannot
            be loaded (:func:`headscope.models.check_model`), a missing corpus file, an unknown dtype or device, an
            output path that is a file, a name with characters a folder may not hold, the name ``teacher`` for a model
            scored beside a teacher.
    """
    from ..models import check_model
    from ..tasks.formats import FORMAT_TASKS
    from ..validate import check_choice, check_device, check_int, check_out_dir
    from .haystack import HaystackConfig
    from .retention import SuiteConfig, cell_dir

    tasks = split_list(tasks)
    formats = split_list(formats)
    for t in tasks:
        check_choice("--tasks", t, FORMAT_TASKS)
    for f in formats:
        check_choice("--formats", f, ("seen", "unseen"))
    if not tasks or not formats:
        raise HeadscopeInputError(f"--tasks / --formats: give at least one of {', '.join(FORMAT_TASKS)} / seen, unseen")
    Ls = [parse_length(str(x)) for x in split_list([str(x) for x in lengths])]
    if not Ls or min(Ls) < 128:
        raise HeadscopeInputError(f"--lengths {Ls}: give prompt lengths of at least 128 tokens")
    check_int("--n", n, lo=1, fix="score at least one prompt per cell")
    check_int("--gen-n", gen_n, lo=0, fix="0 turns the generation check off")
    check_int("--gen-max-len", gen_max_len, lo=0)
    check_int("--batch-tokens", batch_tokens, lo=1)
    check_int("--seed", seed, lo=0)
    check_int("--workers", workers, lo=1)
    check_choice("--dtype", dtype, DTYPES)
    check_device(device, "--device")
    check_out_dir(out, "--out")
    check_model(model, "MODEL")
    if teacher is not None:
        check_model(teacher, "--teacher")
    nm = name or default_name(model)
    cell_dir(out, nm, 0, 0)  # refuses a name a folder may not hold
    if teacher is not None and nm == TEACHER:
        raise HeadscopeInputError(f"--name {TEACHER!r} is the teacher's; give the model another --name")
    suite = SuiteConfig(tasks=tuple(dict.fromkeys(tasks)), formats=tuple(dict.fromkeys(formats)),
                        lengths=tuple(sorted(set(Ls))), n=n, seed=1234 + seed, unseen_seed=4321 + seed, gen_n=gen_n,
                        gen_max_len=gen_max_len, batch_tokens=batch_tokens)
    hay = HaystackConfig(corpus=None if corpus is None else str(corpus), docs=haystack_docs, doc_len=doc_len, seed=seed)
    rec = training_record(model)
    return EvalConfig(model=str(model), teacher=None if teacher is None else str(teacher), name=nm, seed=rec["seed"],
                      tokens=rec["tokens"], suite=suite, haystack=hay, prompt_seed=seed, device=device, dtype=dtype,
                      out=str(out), workers=workers)


def weights_fingerprint(spec: str) -> str:
    """What identifies a model's weights without reading them: the spec and, for a local folder or file, the names,
    sizes and modification times of its files (SHA-256, 16 hex digits). A cell stored with another fingerprint is
    scored again."""
    p = Path(str(spec)).expanduser()
    parts = [str(spec)]
    files = sorted(x for x in p.iterdir() if x.is_file()) if p.is_dir() else [p] if p.is_file() else []
    for x in files:
        st = x.stat()
        parts.append(f"{x.name}:{st.st_size}:{int(st.st_mtime)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _vocab_digest(tokenizer: Any) -> str:
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _load(spec: str, cfg: EvalConfig, dtype: Optional[str] = None) -> Any:
    import torch

    from ..models import load_hf

    return load_hf(spec, device=cfg.device, dtype=getattr(torch, dtype or cfg.dtype))[0]


def sample_dtype(device: Optional[str]) -> str:
    """The precision the haystack's documents are sampled in: bfloat16 on CUDA (the conversion study sampled its
    haystack from a bfloat16 teacher), float32 elsewhere."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return "bfloat16" if dev.type == "cuda" else "float32"


def _tokenizer(spec: str) -> Any:
    from ..models import load_tokenizer

    tok = load_tokenizer(spec)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _stored(out: Path, name: str, seed: int, tokens: int, suite: Any, extra: dict[str, Any]) -> bool:
    """Whether every cell of ``suite`` is stored for this model with these settings (then its weights need not load)."""
    from .retention import cell_dir, cell_identity, read_cell

    conf = json.loads(json.dumps({**cell_identity(suite), **extra}))
    d = cell_dir(out / "cells", name, seed, tokens)
    for task, fmt, L in suite.cells():
        c = read_cell(d, task, fmt, L)
        if c is None or c.get("config") != conf:
            return False
    return True


def reuse_cells(out: Path, name: str, seed: int, tokens: int, suite: Any, extra: dict[str, Any]) -> dict[str, int]:
    """Copy into this model's folder the cells that another folder of ``out``/cells holds with the same config (the same
    model spec and weights' fingerprint, haystack, vocabulary, dtype and suite settings): the teacher evaluated alone
    before (``headscope eval smollm2-135m``), then beside a student (``--teacher smollm2-135m``), is not scored again.
    A copy keeps its record, renamed (``model``, ``seed``, ``tokens``) and with ``reused_from``.

    Returns:
        {source folder name: cells copied from it}.
    """
    from .retention import cell_dir, cell_identity, read_cell, store_cell

    conf = json.loads(json.dumps({**cell_identity(suite), **extra}))
    d = cell_dir(out / "cells", name, seed, tokens)
    others = sorted(x for x in (out / "cells").glob("*__s*__t*") if x.is_dir() and x != d)
    copied: dict[str, int] = {}
    for task, fmt, L in suite.cells():
        old = read_cell(d, task, fmt, L)
        if old is not None and old.get("config") == conf:
            continue
        for src in others:
            rec = read_cell(src, task, fmt, L)
            if rec is not None and rec.get("config") == conf:
                d.mkdir(parents=True, exist_ok=True)
                store_cell(d, task, fmt, L, {**rec, "model": name, "seed": int(seed), "tokens": int(tokens),
                                             "reused_from": src.name}, compress=True)
                copied[src.name] = copied.get(src.name, 0) + 1
                break
    return copied


def run_eval(cfg: EvalConfig, progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Score ``cfg.model`` (and ``cfg.teacher``) on every cell of ``cfg.suite`` into ``cfg.out`` (see the module
    docstring) and write the tables and the report.

    Returns:
        {"out", "cells": cells stored per model name, "rows": rows of retention.csv, "seconds", "report": paths}.

    Raises:
        HeadscopeInputError (a ValueError): the teacher's tokenizer has another vocabulary than the model's.
    """
    import time

    from tqdm.auto import tqdm

    from ..runtime import atomic_write_text
    from .haystack import unseen_haystack
    from .report import write_report
    from .retention import build_prompt_sets, evaluate_suite, filler_digest, retention_table

    t0 = time.time()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "eval.json", json.dumps(cfg.to_dict(), indent=2))
    # tokenizers first: the prompts, the haystack's identity and the skip check need no weights
    tok = _tokenizer(cfg.model)
    runs: list[tuple[str, int, int, str]] = [(cfg.name, cfg.seed, cfg.tokens, cfg.model)]
    if cfg.teacher is not None:
        ttok = _tokenizer(cfg.teacher)
        if _vocab_digest(ttok) != _vocab_digest(tok):
            raise HeadscopeInputError(f"the teacher {cfg.teacher} and the model {cfg.model} have different tokenizers "
                                      "(vocabularies differ): a teacher must share the model's tokenizer")
        tok = ttok  # prompts from the teacher's tokenizer: every model of the folder scored on the same prompts
        runs.insert(0, (TEACHER, 0, 0, cfg.teacher))
    loaded: dict[tuple[str, str], Any] = {}

    def model_of(spec: str, dtype: str = cfg.dtype) -> Any:
        if (spec, dtype) not in loaded:
            t = time.time()
            loaded[(spec, dtype)] = _load(spec, cfg, dtype)
            log(f"loaded {spec} ({dtype}) in {time.time() - t:.1f} s")
        return loaded[(spec, dtype)]

    filler = None
    if "unseen" in cfg.suite.formats:
        sampler, sdt = cfg.teacher if cfg.teacher is not None else cfg.model, sample_dtype(cfg.device)

        def sampling_model() -> Any:
            m = model_of(sampler, sdt)
            if sdt != cfg.dtype:
                loaded.pop((sampler, sdt))  # a copy for sampling only: dropped once the documents are sampled
            return m

        t = time.time()
        filler = unseen_haystack(cfg.haystack, tok, out / "haystack", sampler=sampling_model,
                                 sampler_name=f"{sampler} ({sdt})", log=log)
        log(f"haystack: {cfg.haystack.describe()}, {len(filler.sentences)} sentences ({time.time() - t:.1f} s)")
    ident = {"haystack": filler_digest(filler) if filler is not None else None, "vocab": _vocab_digest(tok),
             "dtype": cfg.dtype}
    build_prompt_sets(tok, cfg.suite, out / "prompts", filler=filler, workers=cfg.workers, log=log)
    n_cells = len(cfg.suite.cells())
    bar = tqdm(total=n_cells * cfg.suite.n * len(runs), unit="prompt", disable=not progress, desc="eval", dynamic_ncols=True)
    stored: dict[str, int] = {}
    try:
        for name, seed, tokens, spec in runs:
            extra = {**ident, "model": spec, "weights": weights_fingerprint(spec)}
            for src, k in reuse_cells(out, name, seed, tokens, cfg.suite, extra).items():
                log(f"{name}: {k} cell(s) reused from {src} (the same model, weights and settings)")
            if _stored(out, name, seed, tokens, cfg.suite, extra):
                bar.update(n_cells * cfg.suite.n)
                stored[name] = n_cells
                continue
            bar.set_description(name)
            res = evaluate_suite(model_of(spec), tok, name, seed, tokens, cfg.suite, out / "cells", filler=filler,
                                 cache_dir=out / "prompts", log=lambda m: tqdm.write(m, file=sys.stderr),
                                 progress=bar.update, compress=True,
                                 extra_config=extra)
            stored[name] = res["done"]
            if spec != cfg.model:
                loaded.pop((spec, cfg.dtype), None)  # the teacher's memory back before the model loads
    finally:
        bar.close()
    tab = retention_table(out / "cells", out, teacher=TEACHER, source="cli")
    written = write_report(out, teacher=TEACHER)
    return {"out": str(out), "cells": stored, "rows": tab["rows"], "seconds": round(time.time() - t0, 1),
            "report": {k: str(v) for k, v in written.items()}}
