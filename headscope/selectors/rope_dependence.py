"""``rope_dependence``: HwH's RoPE Positional Dependence (RPD) and RoPE Frequency Importance (RFIS).

RPD of head h: how much its attention distribution changes when RoPE is removed from its q and k,
``KL(p_RoPE ‖ p_noRoPE)`` per query position, averaged over the query positions and prompts (nats).
RFIS of frequency band b: the same KL when the rotation is removed from band b only (the rotary
frequency pairs are split into ``n_bands`` contiguous bands, band 0 = the highest frequencies).
Positional heads score high on RPD, retrieval heads low. HwH keeps retrieval heads as (NoPE) full
attention and sends positional heads to linear attention, so the ranking's ``score`` is ``−RPD``
(``prefer="retrieval"``, default); ``prefer="positional"`` ranks by ``+RPD``.

Queries: the last ``n_queries`` positions of each prompt (all with ``n_queries=None``); keys: every
earlier position (causal). q/k are the model's own (after QK-norm where the model has it).
"""

from __future__ import annotations

import time
from typing import Literal, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from ..models import LoadedModel
from ..arch import LayerParts, rotate
from ..patching import attention
from ..patching.contract import PlanEngine
from ..patching.engine import Engine
from ..scores import Ranking
from .base import make_ranking, passkey_prompts


def kl_rows(logp: Float[Tensor, "... key"], logq: Float[Tensor, "... key"]) -> Float[Tensor, "..."]:
    """KL(p ‖ q) = Σ p (log p − log q) over the last axis, with 0·log 0 = 0 (masked keys)."""
    p = logp.exp()
    d = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
    return d.sum(-1)


def band_slices(half: int, n_bands: int) -> list[tuple[int, int]]:
    """Split ``half`` rotary frequency indices into ``n_bands`` contiguous bands (numpy array_split sizes).

    Raises:
        ValueError: n_bands outside 1..half.
    """
    if not 1 <= n_bands <= half:
        raise ValueError(f"n_bands={n_bands} must lie in 1..{half} (the head has {half} rotary frequencies)")
    edges = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(half), n_bands)])
    return [(int(edges[i]), int(edges[i + 1])) for i in range(n_bands)]


@torch.no_grad()
def rope_kl(
    eng: PlanEngine, ids: Tensor, n_queries: int | None = 64, n_bands: int = 4
) -> tuple[Float[Tensor, "layer head"], Float[Tensor, "band layer head"]]:
    """Per head, mean KL(p_RoPE ‖ p_noRoPE) (RPD) and per band KL(p_RoPE ‖ p_band-removed) (RFIS) on one
    prompt. Layers without RoPE (NoPE layers, learned positions) score 0. Attention uses the layer's own
    scale, sliding window and soft-cap; partial rotary splits the rotated dimensions only.

    Raises:
        ValueError: a model without RoPE in any layer; n_bands outside 1..rotary_dim/2.
    """
    g = eng.g
    ids = ids.to(eng.device)
    T = ids.numel()
    if all(L.rope is None for L in eng.layers) or eng.arch.rope_tables is None:
        raise ValueError(f"rope_dependence needs RoPE; {eng.arch.family} has no rotary layer")
    cache = eng.run(ids, [T - 1])
    pos = eng.positions(torch.arange(T, device=eng.device), cache.resid[0])
    nq = T if n_queries is None else min(T, n_queries)
    qpos = torch.arange(T - nq, T, device=eng.device)
    rpd = torch.zeros(g.n_layers, g.n_heads)
    rfis = torch.zeros(n_bands, g.n_layers, g.n_heads)

    def logpat(q: Tensor, k: Tensor, L: LayerParts) -> Tensor:
        return attention.probs(q[None], k[None], qpos, L.scaling, L.window, L.softcap)[0].clamp_min(1e-45).log()

    for layer in range(g.n_layers):
        L = eng.layers[layer]
        cs = pos.cos_sin(L)
        if cs is None:
            continue
        cos, sin = cs
        half = cos.shape[-1] // 2
        bands = band_slices(half, n_bands)
        q, k, _ = eng.project(layer, eng.ln1(layer, cache.resid[layer][None]))
        q = q[0].transpose(0, 1)  # [H, T, dh]
        k = k[0].transpose(0, 1)  # [KV, T, dh]
        qr, kr = rotate(q, cos, sin), rotate(k, cos, sin)
        full = logpat(qr[:, qpos], kr, L)
        rpd[layer] = kl_rows(full, logpat(q[:, qpos], k, L)).mean(-1).cpu()
        for b, (lo, hi) in enumerate(bands):
            c, s_ = cos.clone(), sin.clone()
            for off in (0, half):
                c[:, off + lo: off + hi] = 1.0
                s_[:, off + lo: off + hi] = 0.0
            rfis[b, layer] = kl_rows(full, logpat(rotate(q, c, s_)[:, qpos], rotate(k, c, s_), L)).mean(-1).cpu()
    return rpd, rfis


def select_rope_dependence(
    model: LoadedModel,
    n_prompts: int = 4,
    seq_lens: int | Sequence[int] = 256,
    depths: float | Sequence[float] = (0.1, 0.5, 0.9),
    seed: int = 0,
    n_queries: int | None = 64,
    n_bands: int = 4,
    prefer: Literal["retrieval", "positional"] = "retrieval",
) -> Ranking:
    """RPD and RFIS averaged over passkey prompts; ranking by −RPD (default) or +RPD.

    Returns:
        Ranking with extra columns ``rpd`` and ``rfis_band_0..n_bands-1`` (nats).

    Raises:
        ValueError: unknown ``prefer``, bad ``n_bands``.
    """
    if prefer not in ("retrieval", "positional"):
        raise ValueError(f"prefer={prefer!r}: use 'retrieval' (score = -RPD) or 'positional' (score = +RPD)")
    t0 = time.time()
    eng = Engine(model)
    prompts = passkey_prompts(model, n_prompts, seq_lens, depths, seed)
    rpd = torch.zeros(model.geometry.n_layers, model.geometry.n_heads, dtype=torch.float64)
    rfis = torch.zeros(n_bands, *rpd.shape, dtype=torch.float64)
    for p in prompts:
        a, b = rope_kl(eng, p.ids, n_queries, n_bands)
        rpd += a.double()
        rfis += b.double()
    rpd /= len(prompts)
    rfis /= len(prompts)
    r = rpd.numpy()
    cols = {"rpd": r, **{f"rfis_band_{i}": rfis[i].numpy() for i in range(n_bands)}}
    settings = {"n_prompts": n_prompts, "seq_lens": seq_lens, "depths": depths, "seed": seed,
                "n_queries": n_queries, "n_bands": n_bands, "prefer": prefer}
    half = model.geometry.d_head // 2
    return make_ranking(model, -r if prefer == "retrieval" else r, "rope_dependence", settings, columns=cols,
                        extras={"bands": band_slices(half, n_bands)}, seconds=time.time() - t0)
