"""``retrieval_score``: Wu et al. 2024 ("Retrieval Head Mechanistically Explains Long-Context Factuality").

During greedy decoding of the needle, head h *copies* at a decoding step when (1) the emitted token
w lies in the needle, and (2) the context token that h attends to most lies inside the needle span and
equals w. The head's retrieval score on a prompt is |g_h| / |k|: the number of distinct needle
positions it copied from, over the needle's length in tokens (the paper's wording: g_h is the *set*
of tokens copied, so a needle position counts once however many steps copy from it). Scores are
averaged over prompts, lengths and depths.

Repeated needle tokens: this is not the same as counting copying steps. For the needle "4 4 2 1", a
head that attends to the first "4" at both steps that emit "4" (and correctly at the other two) has
copied from 3 distinct positions, score 3/4 = 0.75, where counting every copying step would give
4/4 = 1.0. Only a head that attends to each "4" at its own step reaches 1.0.

Decoding is done by teacher forcing with the clean answer: the logits at step j are those of greedy
decoding as long as steps < j emitted the answer, so step j counts only while every earlier step
was right (``valid``); the emitted token is the argmax at that step. Attention patterns are computed
from the patching engine's own queries and keys (after RoPE / QK-norm), at the answer-reading
positions only. Here the needle is the value span (the digits of "The special magic number is 4821.").
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..models import LoadedModel
from ..patching import attention
from ..patching.contract import PlanEngine
from ..patching.engine import Engine
from ..scores import Ranking
from .base import Prompt, make_ranking, passkey_prompts


def retrieval_scores(
    patterns: Float[Tensor, "step layer head key"],
    tokens: Int[Tensor, "key"],
    emitted: Int[Tensor, "step"],
    needle: tuple[int, int],
    valid: Bool[Tensor, "step"] | None = None,
) -> Float[Tensor, "layer head"]:
    """Wu et al.'s retrieval score of every head on one prompt, from attention patterns.

    Args:
        patterns: attention of each decoding step's query over the keys (rows sum to 1; keys a step
            cannot see should be 0).
        tokens: token id at each key position.
        emitted: the token emitted at each decoding step.
        needle: (start, end) key positions of the needle, end exclusive.
        valid: steps that count (default all), e.g. those that greedy decoding really reaches.

    Returns:
        |{needle positions copied by h}| / (end − start), in [0, 1]: distinct positions, so a
        position copied at several steps (a repeated needle token) counts once; see the module
        docstring ("4 4 2 1": 0.75, not 1.0, when both "4" steps copy the first "4").

    Raises:
        ValueError: shapes that do not agree or an empty / out-of-range needle span.
    """
    S, Ln, H, T = patterns.shape
    s, e = needle
    if not 0 <= s < e <= T:
        raise ValueError(f"needle span {needle} is not a non-empty range inside {T} key positions")
    if tokens.shape != (T,) or emitted.shape != (S,):
        raise ValueError(f"tokens {tuple(tokens.shape)} / emitted {tuple(emitted.shape)} do not match patterns {tuple(patterns.shape)}")
    valid = torch.ones(S, dtype=torch.bool) if valid is None else valid.bool()
    top = patterns.argmax(-1)  # [S, L, H]
    in_needle = (top >= s) & (top < e)
    same = tokens[top] == emitted[:, None, None]
    w_in_needle = torch.isin(emitted, tokens[s:e])
    hit = in_needle & same & w_in_needle[:, None, None] & valid[:, None, None]
    copied = torch.zeros(Ln, H, e - s, dtype=torch.bool)
    for j in range(S):
        li, hi = hit[j].nonzero(as_tuple=True)
        copied[li, hi, top[j, li, hi] - s] = True
    return copied.sum(-1).double() / (e - s)


@torch.no_grad()
def answer_patterns(eng: PlanEngine, ids: Int[Tensor, "pos"], read: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Attention patterns of the read positions' queries, every layer and head, and the logits there.

    Returns:
        (Float[Tensor, "read layer head pos"], Float[Tensor, "read vocab"]).
    """
    cache = eng.run(ids, read)
    g = eng.g
    rd = torch.as_tensor(list(read), device=eng.device)
    pos = eng.positions(rd, cache.resid[0])
    out = []
    for layer in range(g.n_layers):
        L = eng.layers[layer]
        x = eng.ln1(layer, cache.resid[layer, rd][None])  # [1, S, d]
        q, _, _ = eng.project(layer, x)
        q = eng.rotate(layer, q, pos.cos_sin(L)).transpose(1, 2)  # [1, H, S, dh]
        p = attention.probs(q, cache.k[layer][None], rd, L.scaling, L.window, L.softcap)  # [1, H, S, T]
        out.append(p[0].transpose(0, 1))  # [S, H, T]
    return torch.stack(out, 1), cache.logits


def prompt_retrieval_scores(eng: PlanEngine, p: Prompt) -> tuple[Tensor, bool]:
    """Retrieval scores of one prompt and whether greedy decoding reproduced the whole answer."""
    pats, logits = answer_patterns(eng, p.ids, p.read)
    emitted = logits.argmax(-1).cpu()
    right = emitted == p.answer
    valid = torch.cat([torch.ones(1, dtype=torch.bool), right[:-1].cumprod(0).bool()])
    return retrieval_scores(pats.float().cpu(), p.ids, emitted, p.needle, valid), bool(right.all())


def select_retrieval_score(
    model: LoadedModel,
    n_prompts: int = 12,
    seq_lens: int | Sequence[int] = 256,
    depths: float | Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    seed: int = 0,
    n_digits: int = 4,
) -> Ranking:
    """Mean retrieval score over ``n_prompts`` passkey prompts per length in ``seq_lens``.

    Returns:
        Ranking with extra columns ``retrieval_score`` (= score) and ``retrieval_score_std``;
        provenance records the greedy accuracy of the prompts.
    """
    t0 = time.time()
    eng = Engine(model)
    prompts = passkey_prompts(model, n_prompts, seq_lens, depths, seed, n_digits)
    scores, correct = [], []
    for p in prompts:
        s, ok = prompt_retrieval_scores(eng, p)
        scores.append(s.numpy())
        correct.append(ok)
    arr = np.stack(scores)
    mean = arr.mean(0)
    std = arr.std(0, ddof=1) if len(arr) > 1 else np.zeros_like(mean)
    settings = {"n_prompts": n_prompts, "seq_lens": seq_lens, "depths": depths, "seed": seed, "n_digits": n_digits}
    r = make_ranking(model, mean, "retrieval_score", settings,
                     columns={"retrieval_score": mean, "retrieval_score_std": std}, seconds=time.time() - t0)
    r.provenance["greedy_accuracy"] = float(np.mean(correct))
    r.provenance["n_prompts_total"] = len(prompts)
    return r
