"""Retention of retrieval after conversion: a seen / unseen-format suite, scored per (model, cell).

The suite (:class:`SuiteConfig`) crosses tasks × formats × lengths:

* ``formats="seen"``: the RULER-style prompts of :func:`headscope.evaluation.accuracy.eval_pairs` (built-in
  filler, the templates that earlier conversions trained on) — the in-distribution cells;
* ``formats="unseen"``: :func:`headscope.tasks.formats.format_pairs` of the ``unseen`` family on a
  natural-text haystack (held-out teacher documents or a user corpus; no training row shares a
  wording, key word, variable name or filler sentence with them).

Every cell is scored by teacher-forced greedy exact match of the answer span
(:func:`headscope.evaluation.accuracy.retrieval_hits`) on all ``n`` prompts, and by free greedy generation
(:func:`greedy_generation_hits`) on the first ``gen_n`` prompts of the cells up to ``gen_max_len``
tokens, which confirms the teacher-forced score. Each (model, cell) is written to its own JSON file as
it finishes (:func:`evaluate_suite`); a rerun skips the stored cells. :func:`retention_table` joins the
cells with the teacher's into ``retention.csv`` and its interval summaries; :func:`depth_table` splits
each cell by needle depth (where in the prompt the evidence sits), into ``retention_depth.csv``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..errors import HeadscopeInputError
from ..runtime import atomic_write_bytes, atomic_write_text
from .accuracy import eval_pairs, eval_pairs_file, prompt_depths, retrieval_hits, wilson_interval
from .pairsets import load_pairs, save_pairs

RETENTION_COLUMNS = ("model", "seed", "tokens", "task", "formats", "length", "n", "hits", "accuracy", "teacher_accuracy")
#: retention.csv of ``headscope eval``: the study's columns, then ``agreement`` (share of the generation-checked prompts
#: where free greedy generation's exact match equals teacher forcing's) and ``source`` (who made the row: ``cli``)
EVAL_COLUMNS = RETENTION_COLUMNS + ("agreement", "source")
DEPTH_COLUMNS = ("model", "seed", "tokens", "task", "formats", "length", "depth_lo", "depth_hi", "distance_tokens", "n",
                 "hits", "accuracy", "teacher_hits", "teacher_accuracy")
DISTANCE_COLUMNS = ("model", "seed", "tokens", "task", "formats", "length", "distance_lo", "distance_hi", "n", "hits",
                    "accuracy", "teacher_hits", "teacher_accuracy", "distance_from")
#: bin edges of :func:`distance_table`, tokens from the end of the evidence to the end of the prompt
DISTANCE_EDGES = (0, 512, 1024, 1536, 2048, 3072, 4096, 8192, 16384)


@dataclass(frozen=True)
class SuiteConfig:
    """The cells of the suite and how they are scored (recorded in every cell file).

    Attributes:
        tasks: retrieval tasks (:data:`headscope.tasks.formats.FORMAT_TASKS`).
        formats: ``"seen"`` and/or ``"unseen"``.
        lengths: prompt lengths in tokens.
        n: prompts per cell (needle depths evenly spread over [0, 1]).
        seed: prompt seed of the seen cells (as :func:`eval_pairs`; training rows use other seeds).
        unseen_seed: prompt seed of the unseen cells.
        gen_n: prompts per cell also scored by free greedy generation (0 = none).
        gen_max_len: generation only in cells of at most this many tokens.
        batch_tokens: tokens per forward of the teacher-forced scoring (batch = batch_tokens // length, >= 1).
        gen_cache: the generation check decodes with the model's own transformers ``Cache`` (one prefill, then
            one token per forward; a hybrid's :class:`headscope.hybrid.HybridCache`); False: one full forward
            per new token without a cache (the method of the conversion study's cells scored in its sessions 1-3).
    """

    tasks: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")
    formats: tuple[str, ...] = ("seen", "unseen")
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    n: int = 100
    seed: int = 1234
    unseen_seed: int = 4321
    gen_n: int = 20
    gen_max_len: int = 4096
    batch_tokens: int = 8192
    gen_cache: bool = True

    def __post_init__(self) -> None:
        from ..tasks.formats import FORMAT_TASKS

        bad = [t for t in self.tasks if t not in FORMAT_TASKS]
        if bad or not self.tasks:
            raise HeadscopeInputError(f"suite tasks {bad or '[]'}: choose from {', '.join(FORMAT_TASKS)}")
        if not self.formats or any(f not in ("seen", "unseen") for f in self.formats):
            raise HeadscopeInputError(f"suite formats {self.formats}: use 'seen' and/or 'unseen'")
        if self.n < 1 or self.gen_n < 0 or not self.lengths or min(self.lengths) < 128:
            raise HeadscopeInputError(f"suite needs n >= 1 ({self.n}), gen_n >= 0 ({self.gen_n}), lengths >= 128 ({self.lengths})")

    def cells(self) -> list[tuple[str, str, int]]:
        """(task, formats, length) of every cell, shortest first."""
        return [(t, f, int(L)) for L in sorted(self.lengths) for f in self.formats for t in self.tasks]


def filler_digest(filler: Any) -> str:
    """SHA-256 (first 16 hex digits) of a filler's sentences: identifies a haystack in cache keys."""
    return hashlib.sha256("\n".join(filler.sentences).encode()).hexdigest()[:16]


def prompt_set_file(cache_dir: str | Path, cfg: SuiteConfig, task: str, formats: str, length: int) -> Path:
    """Where :func:`suite_pairs` keeps a cell's prompt set in ``cache_dir`` (gzip JSON)."""
    if formats == "seen":
        return eval_pairs_file(cache_dir, task, length, cfg.n, cfg.seed)
    return Path(cache_dir) / f"unseen_{task}@{int(length)}_n{cfg.n}_s{cfg.unseen_seed}.json.gz"


def _build_prompt_set(job: tuple[Any, ...]) -> tuple[str, str, int, float]:
    """One prompt set built into the cache (a worker of :func:`build_prompt_sets`) -> (task, formats, length, seconds)."""
    tokenizer, cfg, task, formats, length, filler, cache_dir = job
    t0 = time.time()
    suite_pairs(tokenizer, cfg, task, formats, length, filler, cache_dir)
    return task, formats, length, time.time() - t0


def build_prompt_sets(tokenizer: Any, cfg: SuiteConfig, cache_dir: str | Path, filler: Any = None, workers: int = 1,
                      cells: Optional[Sequence[tuple[str, str, int]]] = None,
                      log: Callable[[str], None] = print) -> int:
    """Build the prompt sets of ``cells`` (default every cell of ``cfg``) that ``cache_dir`` does not hold yet, the
    longest first, over ``workers`` processes (a ``spawn`` pool: safe after CUDA has started; building is
    tokenizer-bound, ~0.5 s per 16K-token prompt on one core). The sets are those :func:`suite_pairs` builds alone
    (seeded per cell), so scoring reads them back unchanged.

    Returns:
        the number of sets built.
    """
    todo = [c for c in (cfg.cells() if cells is None else cells)
            if not prompt_set_file(cache_dir, cfg, *c).exists()]
    todo.sort(key=lambda c: -c[2])
    if not todo:
        return 0
    jobs = [(tokenizer, cfg, t, f, L, filler, cache_dir) for t, f, L in todo]
    t0 = time.time()
    if workers <= 1 or len(todo) == 1:
        for job in jobs:
            _build_prompt_set(job)
    else:
        import multiprocessing as mp
        import os
        from concurrent.futures import ProcessPoolExecutor

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_build_prompt_set, jobs))
    log(f"built {len(todo)} prompt set(s) in {time.time() - t0:.1f} s ({min(workers, len(todo))} process(es))")
    return len(todo)


def suite_pairs(tokenizer: Any, cfg: SuiteConfig, task: str, formats: str, length: int, filler: Any = None,
                cache_dir: str | Path | None = None) -> list[Any]:
    """The ``cfg.n`` prompts of one cell (the same for every model; with ``cache_dir`` built once).

    Raises:
        HeadscopeInputError (a ValueError): an unseen cell without ``filler``.
    """
    if formats == "seen":
        return eval_pairs(tokenizer, task, length, cfg.n, cfg.seed, cache_dir)
    if filler is None:
        raise HeadscopeInputError("unseen cells need a natural-text haystack: pass filler=natural_filler(texts, 'unseen', ...)")
    from ..tasks.formats import format_pairs

    ident = {"tokenizer": str(getattr(tokenizer, "name_or_path", "")), "vocab": len(tokenizer), "filler": filler_digest(filler)}
    f = prompt_set_file(cache_dir, cfg, task, formats, length) if cache_dir is not None else None
    if f is not None and f.exists():
        got = load_pairs(f, ident)
        if got is not None:
            return got
    depths = [float(d) for d in prompt_depths(cfg.n)]
    pairs = format_pairs(tokenizer, "unseen", task, filler, n_pairs=cfg.n, seq_len=length, depth=depths, seed=cfg.unseen_seed)
    if f is not None:
        save_pairs(f, ident, pairs)
    return pairs


def _greedy_decode(model: Any, ids: Int[Tensor, "b t"], n_new: int, use_cache: bool) -> Int[Tensor, "b t_plus_new"]:
    """``ids`` followed by ``n_new`` greedy tokens (bf16 autocast on CUDA, argmax of the float32 logits)."""
    import inspect

    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.device.type == "cuda")
    if not use_cache:
        for _ in range(n_new):
            with amp:
                logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.float().argmax(-1)[:, None]], 1)
        return ids
    params = inspect.signature(model.forward).parameters
    last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    key = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.25 names it `cache`
    with amp:
        out = model(input_ids=ids, use_cache=True, **last)
    for k in range(n_new):
        t = out.logits[:, -1].float().argmax(-1)
        ids = torch.cat([ids, t[:, None]], 1)
        if k + 1 < n_new:
            past = out.get("cache")
            past = out.get("past_key_values") if past is None else past
            with amp:
                out = model(input_ids=t[:, None], use_cache=True, **{key: past})
    return ids


@torch.no_grad()
def greedy_generation_hits(model: Any, tokenizer: Any, pairs: Sequence[Any], extra: int = 2,
                           batch_tokens: int = 32768, use_cache: bool = True) -> dict[str, Any]:
    """Free greedy generation after each clean prompt. ``use_cache``: the prompt is run once and each new token
    is decoded from the model's own transformers ``Cache`` (what ``generate`` does; for a hybrid its
    :class:`headscope.hybrid.HybridCache`, checked against its full forward in ``tests/test_hybrid_cache.py``),
    so a cell costs one forward per prompt group instead of ``len(answer) + extra``; otherwise one full forward
    per new token without a cache (any causal LM runs it unchanged). Both are greedy argmax over float32 logits.

    Generates ``len(answer) + extra`` tokens. ``exact``: the first ``len(answer)`` generated tokens are
    the answer a⁺ (what teacher forcing scores); ``text``: the first run of digits in the decoded
    continuation is the answer value (a tokenization-free check).

    Prompts of equal length and answer length are generated together (the 20 of each 1K seen cell were),
    ``batch_tokens // length`` rows per forward: no padding, so each row is the same computation as alone
    (the teacher-forced scoring batches likewise); 20 prompts of a cell take 6 forwards instead of 120.

    Returns:
        {"exact": [bool per pair], "text": [bool per pair], "outputs": [decoded continuation per pair]},
        in the order of ``pairs``.
    """
    dev = next(model.parameters()).device
    groups: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault((int(p.clean.shape[-1]), int(p.n_answer)), []).append(i)
    new: dict[int, list[int]] = {}
    for (length, n_answer), idx in groups.items():
        rows = max(1, batch_tokens // (length + n_answer + extra))
        for k in range(0, len(idx), rows):
            part = idx[k:k + rows]
            ids = _greedy_decode(model, torch.stack([pairs[i].clean for i in part]).to(dev), n_answer + extra, use_cache)
            for r, i in enumerate(part):
                new[i] = ids[r, length:].tolist()
    exact, text, outs = [], [], []
    for i, p in enumerate(pairs):
        s = tokenizer.decode(new[i], skip_special_tokens=True)
        m = re.search(r"\d+", s)
        exact.append(new[i][: p.n_answer] == p.answer.tolist())
        text.append(bool(m) and m.group(0) == str(p.meta.get("value")))
        outs.append(s)
    return {"exact": exact, "text": text, "outputs": outs}


def cell_dir(root: str | Path, model: str, seed: int, tokens: int) -> Path:
    """Folder of one model's cell files: ROOT/MODEL__sSEED__tTOKENS/. A model name may carry settings as
    ``+name=value`` parts (e.g. ``hydra-7to1+fa_pos=rope``); it may not contain ``__`` (the separator).

    Raises:
        HeadscopeInputError (a ValueError): a name with other characters, or with ``__``.
    """
    if not re.fullmatch(r"[A-Za-z0-9._+=-]+", model) or "__" in model:
        raise HeadscopeInputError(f"model name {model!r}: use letters, digits, '.', '_', '-', '+' or '=' and no '__' (it names a folder)")
    return Path(root) / f"{model}__s{int(seed)}__t{int(tokens)}"


def cell_identity(cfg: "SuiteConfig") -> dict[str, Any]:
    """The settings a stored cell is compared on before it is skipped: ``cfg`` without the suite's lists of tasks,
    formats and lengths (a cell's prompts depend on its own task, format and length, on ``n`` and the seeds only)."""
    return {k: v for k, v in asdict(cfg).items() if k not in ("tasks", "formats", "lengths")}


def evaluate_suite(
    model: Any, tokenizer: Any, name: str, seed: int, tokens: int, cfg: SuiteConfig, root: str | Path,
    filler: Any = None, cache_dir: str | Path | None = None, deadline: Optional[float] = None,
    log: Callable[[str], None] = print, cells: Optional[Sequence[tuple[str, str, int]]] = None,
    progress: Optional[Callable[[int], None]] = None, compress: bool = False,
    extra_config: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Score ``model`` on every cell of ``cfg`` into ``root``/``name``__s``seed``__t``tokens``/TASK.FORMATS.LENGTH.json.

    ``cells``: the (task, formats, length) cells to score, in this order (default :meth:`SuiteConfig.cells`, all,
    shortest first), so that a short session scores the cells it needs first; each must be a cell of ``cfg``
    (:class:`~headscope.errors.HeadscopeInputError` otherwise, before any cell is scored).

    A cell file holds {model, seed, tokens, task, formats, length, n, hits, accuracy, per-prompt
    ``correct`` (0/1), generation: gen_n, gen_exact_hits, gen_text_hits, gen_agree (prompts where the
    generation's exact match equals teacher forcing's), mean_len, per prompt its length (prompt_len) and the tokens
    from the end of its evidence span to the end of the prompt (evidence_distance: how far back the needle is),
    seconds (the cell's wall time, of which
    prompt_seconds loading or building its prompts, score_seconds the teacher-forced scoring and gen_seconds the
    generation check), config}. Cells already stored
    with the same config are skipped; ``deadline`` (a ``time.time()`` value) stops before starting a new
    cell once passed (rerun to continue).

    ``compress``: write each cell as gzip JSON (``TASK.FORMATS.LENGTH.json.gz``, what ``headscope eval`` writes)
    instead of plain JSON; either form is read back (:func:`load_cells`, the skip check). ``progress``: called
    with the number of prompts scored as each batch finishes, and with a skipped cell's ``n`` (a progress bar
    over cells x prompts). ``extra_config``: more settings stored in each cell's ``config`` beside ``cfg``'s (e.g. the
    haystack's digest, the model's weights' fingerprint); a cell is skipped only where they are equal too.

    Returns:
        {"done": cells stored now or before, "left": cells not reached}.
    """
    todo = cfg.cells() if cells is None else [(str(t), str(f), int(L)) for t, f, L in cells]
    unknown = sorted(set(todo) - set(cfg.cells()))
    if unknown:
        raise HeadscopeInputError(f"cells {unknown} are not cells of the suite (tasks {list(cfg.tasks)}, formats "
                                  f"{list(cfg.formats)}, lengths {list(cfg.lengths)})")
    model.eval()
    d = cell_dir(root, name, seed, tokens)
    d.mkdir(parents=True, exist_ok=True)
    # a cell's identity: what its prompts and scores depend on (task, format and length are its file name), not
    # which other cells the suite holds, so an eval of fewer tasks or lengths reuses the cells already stored
    conf = json.loads(json.dumps({**cell_identity(cfg), **(extra_config or {})}))  # as stored (tuples become lists)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    done, left = 0, 0
    for task, fmt, L in todo:
        old = read_cell(d, task, fmt, L)
        if old is not None and old.get("config") == conf:
            done += 1
            if progress is not None:
                progress(cfg.n)
            continue
        if deadline is not None and time.time() > deadline:
            left += 1
            continue
        t0 = time.time()
        pairs = suite_pairs(tokenizer, cfg, task, fmt, L, filler, cache_dir)
        t1 = time.time()
        h = retrieval_hits(model, pairs, pad, batch_size=max(1, cfg.batch_tokens // L), progress=progress)
        t2 = time.time()
        rec: dict[str, Any] = {"model": name, "seed": int(seed), "tokens": int(tokens), "task": task, "formats": fmt,
                               "length": L, "n": len(h), "hits": int(h.sum()), "accuracy": int(h.sum()) / len(h),
                               "correct": h.int().tolist(), "mean_len": float(np.mean([p.length for p in pairs])),
                               "prompt_len": [p.length for p in pairs],
                               "evidence_distance": [p.length - int(p.evidence[1]) for p in pairs]}
        k = min(cfg.gen_n, len(pairs)) if L <= cfg.gen_max_len else 0
        if k:
            g = greedy_generation_hits(model, tokenizer, pairs[:k], batch_tokens=cfg.batch_tokens, use_cache=cfg.gen_cache)
            rec.update(gen_n=k, gen_exact_hits=int(sum(g["exact"])), gen_text_hits=int(sum(g["text"])),
                       gen_agree=int(sum(int(a) == int(b) for a, b in zip(g["exact"], h[:k].tolist()))),
                       gen_exact=[int(x) for x in g["exact"]], gen_examples=g["outputs"][:3])
        else:
            rec.update(gen_n=0, gen_exact_hits=0, gen_text_hits=0, gen_agree=0)
        t3 = time.time()
        rec.update(seconds=round(t3 - t0, 2), prompt_seconds=round(t1 - t0, 2), score_seconds=round(t2 - t1, 2),
                   gen_seconds=round(t3 - t2, 2), config=conf)
        store_cell(d, task, fmt, L, rec, compress)
        done += 1
        log(f"{name} s{seed} t{tokens} {task} {fmt} {L}: {rec['hits']}/{rec['n']}"
            + (f" (generation {rec['gen_exact_hits']}/{k}, agrees on {rec['gen_agree']})" if k else "")
            + f", {rec['seconds']} s")
    return {"done": done, "left": left}


def write_cell(path: str | Path, rec: dict[str, Any]) -> None:
    """One cell record to ``path``, atomically: gzip JSON where the name ends in ``.gz``, else plain JSON."""
    text = json.dumps(rec)
    if str(path).endswith(".gz"):
        atomic_write_bytes(path, gzip.compress(text.encode(), mtime=0))
    else:
        atomic_write_text(path, text)


def cell_files(folder: str | Path, task: str, formats: str, length: int) -> tuple[Path, Path]:
    """The two names a cell's record may have in a model's folder: plain JSON, gzip JSON."""
    f = Path(folder) / f"{task}.{formats}.{int(length)}.json"
    return f, f.with_name(f.name + ".gz")


def store_cell(folder: str | Path, task: str, formats: str, length: int, rec: dict[str, Any], compress: bool) -> None:
    """Write a cell's record (:func:`write_cell`, gzip JSON with ``compress``) and remove its other form (a record of
    another config)."""
    plain, gz = cell_files(folder, task, formats, length)
    write_cell(gz if compress else plain, rec)
    (plain if compress else gz).unlink(missing_ok=True)


def _read_json(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)


def read_cell(folder: str | Path, task: str, formats: str, length: int) -> Optional[dict[str, Any]]:
    """The stored record of one cell in a model's folder (:func:`cell_dir`), plain or gzip JSON; None if absent."""
    for f in cell_files(folder, task, formats, length):
        if f.exists():
            return _read_json(f)
    return None


def load_cells(root: str | Path) -> list[dict[str, Any]]:
    """Every stored cell record under ``root`` (see :func:`evaluate_suite`; plain or gzip JSON)."""
    files = sorted([*Path(root).glob("*__s*__t*/*.json"), *Path(root).glob("*__s*__t*/*.json.gz")])
    return [_read_json(f) for f in files]


def _teacher_cells(cells: Sequence[dict[str, Any]], teacher: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    """The teacher's cell per (task, formats, length): the first stored (seed, tokens) where several are."""
    tea: dict[tuple[str, str, int], dict[str, Any]] = {}
    for c in cells:
        if c["model"] == teacher:
            tea.setdefault((c["task"], c["formats"], c["length"]), c)
    return tea


def ratio_interval(student: Sequence[int], teacher: Sequence[int], n_boot: int = 2000, seed: int = 0,
                   confidence: float = 0.95) -> tuple[float, float, float]:
    """Retention = student accuracy ÷ teacher accuracy on the same prompts, with a paired percentile
    bootstrap interval (prompts resampled with replacement, both models' outcomes kept together;
    Efron & Tibshirani 1993, ch. 13). Resamples in which the teacher has no hit are dropped.

    Returns:
        (ratio, low, high); NaN where the teacher has no hit.

    Raises:
        HeadscopeInputError (a ValueError): different prompt counts, or none.
    """
    s, t = np.asarray(student, dtype=float), np.asarray(teacher, dtype=float)
    if s.shape != t.shape or s.size == 0:
        raise HeadscopeInputError(f"ratio_interval needs paired outcomes of equal, non-zero length ({s.size} vs {t.size})")
    if t.sum() == 0:
        return float("nan"), float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, s.size, size=(n_boot, s.size))
    ts, ss = t[idx].sum(1), s[idx].sum(1)
    ok = ts > 0
    r = ss[ok] / ts[ok]
    a = (1 - confidence) / 2
    return float(s.sum() / t.sum()), float(np.quantile(r, a)), float(np.quantile(r, 1 - a))


def retention_table(root: str | Path, out: str | Path, teacher: str = "teacher", n_boot: int = 2000,
                    source: Optional[str] = None) -> dict[str, Any]:
    """``out``/retention.csv (columns :data:`RETENTION_COLUMNS`, one row per model, seed, tokens, task,
    formats, length; the teacher's own rows included), ``retention_summary.csv`` (per row: 95 % Wilson
    intervals of both accuracies, the retention with its paired bootstrap interval, the greedy-generation
    check) and ``retention_seeds.csv`` (per model, tokens and cell over seeds: mean, standard deviation,
    min and max of accuracy and retention). The teacher is the stored model named ``teacher`` (its
    first seed/tokens where several are stored). ``source``: retention.csv gets the columns :data:`EVAL_COLUMNS`,
    ``source`` set to it on every row and ``agreement`` = gen_agree / gen_n (empty where no prompt was generated).

    Returns:
        {"rows": rows in retention.csv, "missing_teacher": cells without a teacher record}.
    """
    import pandas as pd

    cells = load_cells(root)
    tea = _teacher_cells(cells, teacher)
    rows, summ, missing = [], [], 0
    for c in cells:
        t = tea.get((c["task"], c["formats"], c["length"]))
        missing += t is None
        # hits / n in float64 (the cell files' accuracy went through float32: 0.47 was stored as 0.4699999988)
        ta = t["hits"] / t["n"] if t is not None and t["n"] == c["n"] else float("nan")
        rows.append({k: c[k] for k in RETENTION_COLUMNS if k not in ("accuracy", "teacher_accuracy")}
                    | {"accuracy": c["hits"] / c["n"], "teacher_accuracy": ta})
        if source is not None:
            rows[-1].update(agreement=c["gen_agree"] / c["gen_n"] if c.get("gen_n") else float("nan"), source=source)
        lo, hi = wilson_interval(c["hits"], c["n"])
        s = {**{k: v for k, v in rows[-1].items() if k not in ("agreement", "source")}, "accuracy_lo": lo, "accuracy_hi": hi}
        if t is not None and t["n"] == c["n"]:
            s["teacher_lo"], s["teacher_hi"] = wilson_interval(t["hits"], t["n"])
            s["retention"], s["retention_lo"], s["retention_hi"] = ratio_interval(c["correct"], t["correct"], n_boot)
        s.update({k: c.get(k, 0) for k in ("gen_n", "gen_exact_hits", "gen_text_hits", "gen_agree")})
        summ.append(s)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows, columns=list(RETENTION_COLUMNS if source is None else EVAL_COLUMNS)).sort_values(["model", "seed", "tokens", "task", "formats", "length"])
    df.to_csv(out / "retention.csv", index=False)
    sm = pd.DataFrame(summ)
    sm.to_csv(out / "retention_summary.csv", index=False)
    if len(sm):
        if "retention" not in sm:
            sm["retention"] = float("nan")
        g = sm.groupby(["model", "tokens", "task", "formats", "length"])
        seeds = g.agg(n_seeds=("seed", "nunique"), accuracy_mean=("accuracy", "mean"), accuracy_sd=("accuracy", "std"),
                      accuracy_min=("accuracy", "min"), accuracy_max=("accuracy", "max"),
                      retention_mean=("retention", "mean"), retention_sd=("retention", "std"),
                      retention_min=("retention", "min"), retention_max=("retention", "max")).reset_index()
        seeds.to_csv(out / "retention_seeds.csv", index=False)
    return {"rows": len(df), "missing_teacher": missing}


def prompt_distances(cells: Sequence[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Per (task, formats, length): the per-prompt ``evidence_distance`` and ``prompt_len`` of the first cell that
    stored them (:func:`evaluate_suite` does since 2026-12-03), with that cell's model as ``from``. Every model's
    cell of a key is scored on the same prompts (the suite's seeded prompt sets), so one cell's distances hold for
    all, including cells stored before the field existed.

    Raises:
        HeadscopeInputError (a ValueError): two cells of one key store different prompt lengths (their prompts differ,
            so distances cannot be shared).
    """
    ref: dict[tuple[str, str, int], dict[str, Any]] = {}
    for c in cells:
        if "evidence_distance" not in c:
            continue
        key = (c["task"], c["formats"], int(c["length"]))
        have = ref.get(key)
        if have is None:
            ref[key] = {"distance": list(c["evidence_distance"]), "prompt_len": list(c["prompt_len"]), "from": c["model"]}
        elif have["prompt_len"] != list(c["prompt_len"]):
            raise HeadscopeInputError(f"cells {key} of {have['from']} and {c['model']} store different prompt lengths: "
                                      "they were scored on different prompts (another suite config?); keep one suite per root")
    return ref


def distance_table(root: str | Path, out: str | Path, edges: Sequence[int] = DISTANCE_EDGES, teacher: str = "teacher") -> int:
    """``out``/retention_distance.csv (columns :data:`DISTANCE_COLUMNS`): every stored cell's prompts binned by the
    exact distance from the end of their evidence to the end of the prompt, in tokens ([lo, hi) per pair of ``edges``;
    distances from :func:`prompt_distances`), with hits and accuracy beside the teacher's on the same prompts.
    Unlike :func:`depth_table`'s relative depth, this tells distance from prompt length: the same distance bin in
    cells of different lengths. Cells whose key has no stored distances are left out; bins without prompts too.

    Returns:
        the number of rows written.

    Raises:
        HeadscopeInputError (a ValueError): ``edges`` not strictly increasing or fewer than two; a cell whose prompt
            count differs from the stored distances'; as :func:`prompt_distances`.
    """
    e = [int(x) for x in edges]
    if len(e) < 2 or any(b <= a for a, b in zip(e, e[1:])):
        raise HeadscopeInputError(f"edges={list(edges)}: give at least two strictly increasing bin edges (tokens)")
    cells = load_cells(root)
    ref = prompt_distances(cells)
    tea = _teacher_cells(cells, teacher)
    rows = []
    for c in cells:
        key = (c["task"], c["formats"], int(c["length"]))
        if key not in ref:
            continue
        ok = np.asarray(c["correct"], dtype=int)
        dist = np.asarray(ref[key]["distance"])
        if len(dist) != len(ok):
            raise HeadscopeInputError(f"{c['model']} {key}: {len(ok)} prompts but {len(dist)} stored distances")
        t = tea.get(key)
        tok = np.asarray(t["correct"], dtype=int) if t is not None and len(t["correct"]) == len(ok) else None
        for lo, hi in zip(e, e[1:]):
            sel = (dist >= lo) & (dist < hi)
            n = int(sel.sum())
            if n == 0:
                continue
            rows.append(_bin_row(c, ok, tok, sel, distance_lo=lo, distance_hi=hi, distance_from=ref[key]["from"]))
    return _write_bins(rows, DISTANCE_COLUMNS, "distance_lo", Path(out) / "retention_distance.csv")


def _bin_row(c: dict[str, Any], ok: np.ndarray, tok: Optional[np.ndarray], sel: np.ndarray, **bin_cols: Any) -> dict[str, Any]:
    """One row of a binned table: cell ``c``'s keys, ``bin_cols``, and hits / accuracy of the prompts ``sel`` for the
    model (``ok``) and the teacher (``tok``, None without a teacher cell)."""
    return {"model": c["model"], "seed": c["seed"], "tokens": c["tokens"], "task": c["task"], "formats": c["formats"],
            "length": c["length"], **bin_cols, "n": int(sel.sum()), "hits": int(ok[sel].sum()),
            "accuracy": float(ok[sel].mean()), "teacher_hits": int(tok[sel].sum()) if tok is not None else None,
            "teacher_accuracy": float(tok[sel].mean()) if tok is not None else float("nan")}


def _write_bins(rows: list[dict[str, Any]], columns: Sequence[str], bin_col: str, path: Path) -> int:
    """Write a binned table's ``rows`` to ``path`` (CSV, ``columns``, sorted by cell then ``bin_col``); its row count."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows, columns=list(columns))
    if len(df):
        df = df.sort_values(["model", "seed", "tokens", "task", "formats", "length", bin_col])
    df.to_csv(path, index=False)
    return len(df)


def depth_table(root: str | Path, out: str | Path, bins: int = 5, teacher: str = "teacher") -> int:
    """``out``/retention_depth.csv (columns :data:`DEPTH_COLUMNS`): every stored cell split into ``bins``
    equal-width needle-depth bins [k/bins, (k+1)/bins) (the last one closed), each with its hits and accuracy
    beside the teacher's on the same prompts (the teacher's first seed/tokens, as :func:`retention_table`).
    ``distance_tokens``: the bin's middle distance from the evidence to the prompt's end, (1 - depth) x the
    cell's mean prompt length, rounded (an approximation: depth places the evidence in the haystack, not in
    tokens). Method: the prompts of a cell are built at :func:`headscope.evaluation.accuracy.prompt_depths`, so
    prompt i's depth is known from its index.

    Returns:
        the number of rows written.

    Raises:
        HeadscopeInputError (a ValueError): ``bins`` < 1.
    """
    if bins < 1:
        raise HeadscopeInputError(f"bins={bins}: give at least 1 depth bin")
    cells = load_cells(root)
    tea = _teacher_cells(cells, teacher)
    rows = []
    for c in cells:
        t = tea.get((c["task"], c["formats"], c["length"]))
        ok = np.asarray(c["correct"], dtype=int)
        tok = np.asarray(t["correct"], dtype=int) if t is not None and len(t["correct"]) == len(ok) else None
        k = np.minimum((prompt_depths(len(ok)) * bins).astype(int), bins - 1)
        for b in range(bins):
            sel = k == b
            n = int(sel.sum())
            if n == 0:
                continue
            mid = (b + 0.5) / bins
            rows.append(_bin_row(c, ok, tok, sel, depth_lo=b / bins, depth_hi=(b + 1) / bins,
                                 distance_tokens=int(round((1 - mid) * float(c.get("mean_len", c["length"]))))))
    return _write_bins(rows, DEPTH_COLUMNS, "depth_lo", Path(out) / "retention_depth.csv")
