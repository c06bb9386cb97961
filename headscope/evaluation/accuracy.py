"""Retrieval accuracy with Wilson intervals, paired tests and held-out perplexity, for any causal LM.

Works on any transformers causal LM (teacher or hybrid student) on its own device; on CUDA the
forward runs under bf16 autocast, as in training. Retrieval is scored by teacher-forced greedy
exact match (:func:`headscope.readout.greedy_exact_match`): one forward over prompt ⊕ answer[:-1]
equals greedy generation of the answer span.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ..errors import HeadscopeInputError
from ..readout import greedy_exact_match, read_positions
from ..runtime import atomic_write_text
from .pairsets import load_pairs, save_pairs

if TYPE_CHECKING:
    from ..train.data import TokenRows


def wilson_interval(hits: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927), via scipy's ``binomtest``.

    Args:
        hits: successes (0..n). n: trials (>= 1). confidence: two-sided level.

    Returns:
        (low, high) as fractions in [0, 1].

    Raises:
        HeadscopeInputError (a ValueError): n < 1 or hits outside 0..n.
    """
    if n < 1 or not 0 <= hits <= n:
        raise HeadscopeInputError(f"wilson_interval needs 0 <= hits <= n and n >= 1, got hits={hits}, n={n}")
    from scipy.stats import binomtest

    ci = binomtest(int(hits), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def paired_exact_test(a: Sequence[int], b: Sequence[int]) -> dict[str, float]:
    """Two models' 0/1 outcomes on the same prompts compared by McNemar's exact test (McNemar 1947): the
    two-sided binomial test, p = 1/2, on the prompts where exactly one of them is right (scipy's ``binomtest``).

    Args:
        a, b: per-prompt outcomes (0 or 1) of the two models, prompt for prompt.

    Returns:
        {"n": prompts, "hits_a", "hits_b", "only_a": prompts only ``a`` gets right, "only_b", "p_value": 1.0
        where they never disagree}.

    Raises:
        HeadscopeInputError (a ValueError): lengths differ or are 0, or an outcome other than 0 / 1.
    """
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise HeadscopeInputError(f"paired_exact_test needs two equal, non-empty lists of outcomes ({x.shape} vs {y.shape})")
    if not (np.isin(x, (0, 1)).all() and np.isin(y, (0, 1)).all()):
        raise HeadscopeInputError("paired_exact_test takes outcomes 0 or 1 per prompt")
    from scipy.stats import binomtest

    only_a, only_b = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    p = binomtest(only_a, only_a + only_b).pvalue if only_a + only_b else 1.0
    return {"n": int(x.size), "hits_a": int(x.sum()), "hits_b": int(y.sum()), "only_a": only_a, "only_b": only_b,
            "p_value": float(p)}


@torch.no_grad()
def retrieval_hits(
    model: Any, pairs: Sequence[Any], pad_id: int, batch_size: int = 8, pad_multiple: int = 256,
    progress: Optional[Callable[[int], None]] = None,
) -> Bool[Tensor, "pair"]:
    """Whether greedy decoding reproduces each pair's answer a⁺ exactly after its clean prompt.

    Args:
        model: a transformers causal LM. pairs: :class:`headscope.tasks.Pair` objects (clean prompt,
            answer ids). pad_id: right-padding id (causal: padding never changes real positions).
        batch_size: prompts per forward.
        pad_multiple: every batch is right-padded to a multiple of this many tokens, so that the
            kernels see few distinct shapes (a new shape can mean a new compilation or autotuning
            for Triton- and ``torch.compile``-based kernels). Padding never changes real positions.
        progress: called with the number of prompts of each batch once it is scored (e.g. a tqdm ``update``).

    Returns:
        [pair] bool on the CPU.
    """
    dev = next(model.parameters()).device
    hits: list[bool] = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        seqs = [torch.cat([p.clean, p.answer[:-1]]) for p in chunk]
        T = -(-max(len(s) for s in seqs) // pad_multiple) * pad_multiple
        ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = s
        reads = [read_positions(p.length, p.n_answer) for p in chunk]
        keep = sorted({i for r in reads for i in r})  # logits only where an answer token is read
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            try:
                logits = model(input_ids=ids.to(dev), use_cache=False, logits_to_keep=torch.tensor(keep, device=dev)).logits
            except TypeError:  # a model without transformers' logits_to_keep
                logits = model(input_ids=ids.to(dev), use_cache=False).logits
        col = {pos: k for k, pos in enumerate(keep)} if logits.shape[1] == len(keep) else {i: i for i in range(T)}
        for j, (p, r) in enumerate(zip(chunk, reads)):
            hits.append(bool(greedy_exact_match(logits[j, [col[i] for i in r]].float(), p.answer)))
        if progress is not None:
            progress(len(chunk))
    return torch.tensor(hits, dtype=torch.bool)


def prompt_depths(n: int) -> Float[np.ndarray, "n"]:
    """The needle depth of each of a cell's ``n`` prompts, in prompt order: ``linspace(0, 1, n)`` (0.5 for one
    prompt); :func:`eval_pairs` (seen) and :func:`headscope.evaluation.retention.suite_pairs` (unseen) build their
    prompts at these depths, so a prompt's depth is known from its index. Depth is the evidence's place in the
    haystack as a fraction of it (0: the start, farthest from the question; the queried needle of multi-key, the
    first value of multi-value, the chain's root of variable tracking)."""
    return np.linspace(0.0, 1.0, n) if n > 1 else np.array([0.5])


def eval_pairs_file(cache_dir: str | Path, task: str, seq_len: int, n: int, seed: int) -> Path:
    """Where :func:`eval_pairs` keeps a prompt set in ``cache_dir``."""
    return Path(cache_dir) / f"{task}@{seq_len}_n{n}_s{seed}.json.gz"


def eval_pairs(tokenizer: Any, task: str, seq_len: int, n: int, seed: int = 1234,
               cache_dir: str | Path | None = None) -> list[Any]:
    """The ``n`` evaluation prompts of ``task`` at ``seq_len`` tokens: needle depths evenly spread over
    [0, 1], seeded (the training rows of :func:`headscope.train.retrieval_rows` use other seeds).

    Building long prompts is tokenizer-bound (~0.5 s per 16K-token prompt on one CPU core), and every
    model of a comparison is scored on the same prompts: with ``cache_dir`` they are built once and kept
    in ``cache_dir/{task}@{seq_len}_n{n}_s{seed}.json.gz`` (gzip JSON, :mod:`headscope.evaluation.pairsets`; with
    the tokenizer's name and vocabulary size, rebuilt when those differ; written atomically, so concurrent
    evaluators may share the folder).
    The key does not cover the task code or tokenizer files changed in place under the same name and
    vocabulary size: use a fresh folder per run (``conversion.py`` keeps it in the run's directory).

    Returns:
        list of :class:`headscope.tasks.Pair`.
    """
    from ..tasks import make_pairs

    ident = {"tokenizer": str(getattr(tokenizer, "name_or_path", "")), "vocab": len(tokenizer)}
    f = eval_pairs_file(cache_dir, task, seq_len, n, seed) if cache_dir is not None else None
    if f is not None and f.exists():
        pairs = load_pairs(f, ident)
        if pairs is not None:
            return pairs
    depths = [float(d) for d in prompt_depths(n)]
    pairs = make_pairs(task, tokenizer, n_pairs=n, seq_len=seq_len, depth=depths, seed=seed)
    if f is not None:
        save_pairs(f, ident, pairs)
    return pairs


def retrieval_accuracy(
    model: Any, tokenizer: Any, task: str, seq_len: int, n: int, seed: int = 1234, batch_size: int = 8,
    cache_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Retrieval accuracy of ``n`` prompts of ``task`` at ``seq_len`` tokens (:func:`eval_pairs`;
    ``cache_dir`` keeps the prompts for the next model).

    Returns:
        {accuracy, hits, n, lo, hi (95 % Wilson interval), mean_len (tokens)}.
    """
    pairs = eval_pairs(tokenizer, task, seq_len, n, seed, cache_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    h = retrieval_hits(model, pairs, pad, batch_size)
    k = int(h.sum())
    lo, hi = wilson_interval(k, len(h))
    return {"accuracy": k / len(h), "hits": k, "n": len(h), "lo": lo, "hi": hi,
            "mean_len": float(np.mean([p.length for p in pairs]))}


@torch.no_grad()
def perplexity(model: Any, rows: "TokenRows", batch_size: int = 8) -> float:
    """exp(mean next-token NLL, nats) over the real tokens of ``rows``."""
    from ..train.stages import lm_loss

    dev = next(model.parameters()).device
    tot, cnt = 0.0, 0
    for i in range(0, len(rows), batch_size):
        ids, m = rows.ids[i : i + batch_size].to(dev), rows.mask[i : i + batch_size].to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(input_ids=ids, use_cache=False).logits
        k = int((m[:, 1:] & m[:, :-1]).sum())
        tot += float(lm_loss(logits, ids, m)) * k
        cnt += k
    if cnt == 0:
        raise HeadscopeInputError("perplexity: no real token pairs in the held-out rows")
    return math.exp(tot / cnt)


def evaluate(
    model: Any, tokenizer: Any, heldout: "TokenRows | None", tasks: Sequence[str], lengths: Sequence[int], n: int,
    batch_size: int = 16, seed: int = 1234, cache_dir: str | Path | None = None, partial: str | Path | None = None,
) -> dict[str, Any]:
    """Held-out perplexity (``ppl``, if ``heldout``) and ``"{task}@{length}"`` retrieval cells
    (:func:`retrieval_accuracy`; the batch shrinks with the length: ``batch_size · 512 / length`` rows;
    ``cache_dir``: where the prompts are kept for the next model, see :func:`eval_pairs`).

    ``partial``: a JSON file that every finished cell is written to at once (atomically); cells already
    in it are read back, not recomputed, so an evaluation stopped part-way resumes where it stopped.
    The file records ``n`` and ``seed`` (its ``_meta``); a file written with others is ignored (with a
    warning) and rewritten. It does not know the model: use one file per model. Only the requested cells
    (and ``ppl``) are returned. The caller keeps or removes the file afterwards."""
    import json
    import warnings

    res: dict[str, Any] = {}
    meta = {"n": int(n), "seed": int(seed)}
    pf = Path(partial) if partial is not None else None
    if pf is not None and pf.exists():
        old = json.loads(pf.read_text())
        if old.pop("_meta", None) == meta:
            res.update(old)
        else:
            warnings.warn(f"{pf} was written with other settings than n={n}, seed={seed}; recomputing its cells",
                          stacklevel=2)

    def save() -> None:
        if pf is not None:
            atomic_write_text(pf, json.dumps({"_meta": meta, **res}, indent=2))

    model.eval()
    if heldout is not None and "ppl" not in res:
        res["ppl"] = perplexity(model, heldout, batch_size)
        save()
    for task in tasks:
        for L in lengths:
            if f"{task}@{L}" in res:
                continue
            res[f"{task}@{L}"] = retrieval_accuracy(model, tokenizer, task, L, n, seed=seed,
                                                    batch_size=max(1, batch_size * 512 // L), cache_dir=cache_dir)
            save()
    want = {f"{t}@{L}" for t in tasks for L in lengths} | ({"ppl"} if heldout is not None else set())
    return {k: v for k, v in res.items() if k in want}
