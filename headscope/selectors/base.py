"""Shared pieces of the selectors: the Ranking builder, calibration prompts, a differentiable forward.

Every selector returns the same :class:`~headscope.scores.Ranking` as :func:`headscope.rank`:
``.scores`` has one row per (layer, head) with columns ``layer, head, kv_group, score, rank``
(rank 1 = the head that most deserves full attention) plus the selector's own columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from ..runtime import __version__
from ..models import LoadedModel
from ..patching.attention import visible
from ..patching.contract import PlanEngine
from ..patching.pass_plan import Plan
from ..readout import read_positions
from ..scores import Ranking
from ..tasks import niah_single


def make_ranking(
    model: LoadedModel,
    score: Float[np.ndarray, "layer head"],
    method: str,
    settings: dict[str, Any],
    columns: dict[str, Any] | None = None,
    extras: dict[str, Any] | None = None,
    seconds: float | None = None,
) -> Ranking:
    """Ranking from a layer × head score matrix (higher = keep as FA), ties broken by (layer, head).

    Args:
        score: Float[ndarray, "layer head"]; NaN is not allowed.
        columns: extra per-head columns, each a Float[ndarray, "layer head"].

    Raises:
        ValueError: a score matrix of the wrong shape or with NaN.
    """
    g = model.geometry
    s = np.asarray(score, dtype=float)
    if s.shape != (g.n_layers, g.n_heads):
        raise ValueError(f"{method}: score matrix has shape {s.shape}, expected ({g.n_layers}, {g.n_heads})")
    if np.isnan(s).any():
        raise ValueError(f"{method}: score matrix contains NaN")
    layer, head = np.meshgrid(np.arange(g.n_layers), np.arange(g.n_heads), indexing="ij")
    df = pd.DataFrame({"layer": layer.ravel(), "head": head.ravel(), "kv_group": (head // g.group_size).ravel()})
    for name, m in (columns or {}).items():
        df[name] = np.asarray(m, dtype=float).reshape(g.n_layers, g.n_heads).ravel()
    df["score"] = s.ravel()
    df["rank"] = df["score"].rank(ascending=False, method="first").astype(int)
    prov = {
        "headscope_version": __version__,
        **model.provenance(),
        "selector": method,
        "settings": {k: v for k, v in settings.items()},
        "score": f"{method} score",
        "seed": settings.get("seed"),
        "n_pairs": settings.get("n_prompts"),
        "tasks": ["niah_single"] if "n_prompts" in settings else None,
    }
    if seconds is not None:
        prov["seconds"] = round(float(seconds), 2)
    return Ranking(df, g.to_dict(), prov, None, dict(extras or {}))


@dataclass
class Prompt:
    """One teacher-forced passkey prompt: ids = prompt ⊕ a⁺[:-1].

    ids: Int[Tensor, "pos"]; read: positions whose logits predict the answer tokens;
    answer: Int[Tensor, "ans"]; needle: (start, end) token span of the needle value in ``ids``.
    """

    ids: Tensor
    read: list[int]
    answer: Tensor
    needle: tuple[int, int]
    meta: dict[str, Any]


def passkey_prompts(
    model: LoadedModel,
    n_prompts: int,
    seq_lens: int | Sequence[int] = 256,
    depths: float | Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    seed: int = 0,
    n_digits: int = 4,
) -> list[Prompt]:
    """Synthetic passkey prompts (the niah_single generator), ``n_prompts`` per length, depths cycled.

    Raises:
        ValueError: n_prompts < 1 (or the generator's own errors: depth outside [0, 1], length too short).
    """
    if n_prompts < 1:
        raise ValueError(f"n_prompts={n_prompts}: need at least one prompt")
    lens = [seq_lens] if isinstance(seq_lens, int) else list(seq_lens)
    out: list[Prompt] = []
    for j, L in enumerate(lens):
        for p in niah_single(model.tokenizer, n_pairs=n_prompts, seq_len=int(L), depth=depths, seed=seed + 1000 * j,
                             n_digits=n_digits):
            ids = torch.cat([p.clean, p.answer[:-1]])
            out.append(Prompt(ids, read_positions(p.length, p.n_answer), p.answer, p.evidence, dict(p.meta)))
    return out


# ---- a differentiable Llama-family forward with a pluggable attention ------------------------------

AttnFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""attn_fn(layer, q [B,H,T,dh], k [B,KV,T,dh], v [B,KV,T,dh]) -> hook_z [B,T,H*dh] (after RoPE)."""


def causal_mask(T: int, device: torch.device) -> Tensor:
    """Bool[Tensor, "T T"], True where key j <= query i."""
    i = torch.arange(T, device=device)
    return i[None, :] <= i[:, None]


def streaming_mask(T: int, sink: int, window: int, device: torch.device) -> Tensor:
    """Bool[Tensor, "T T"]: causal, and key j among the first ``sink`` tokens or i - j < ``window``."""
    i = torch.arange(T, device=device)
    qi, kj = i[:, None], i[None, :]
    return (kj <= qi) & ((kj < sink) | (qi - kj < window))


def sdpa_heads(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Float[Tensor, "batch head pos dh"]:
    """Softmax attention with GQA expansion; q [B,H,T,dh], k/v [B,KV,T,dh], mask [T,T] (True = attend)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def own_attention(eng: PlanEngine, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Float[Tensor, "batch head pos dh"]:
    """The model's own attention of ``layer`` (its scale, sliding window and soft-cap) over a whole
    prompt: q [B,H,T,dh], k/v [B,KV,T,dh] -> [B,H,T,dh]."""
    B, H, T, dh = q.shape
    z = eng.attend(layer, q, k, v, torch.arange(T, device=q.device))
    return z.view(B, T, H, dh).transpose(1, 2)


def layer_mask(eng: PlanEngine, layer: int, T: int) -> Tensor:
    """[T, T] mask of the layer's own attention (True = attend): causal, within its sliding window."""
    return visible(torch.arange(T, device=eng.device), T, eng.layers[layer].window)


def forward_final(
    eng: PlanEngine, ids: Int[Tensor, "batch pos"], attn_fn: AttnFn | None = None
) -> Float[Tensor, "batch pos d_model"]:
    """Final hidden states (after the final norm) of one prompt (``ids`` [1, T]) with ``attn_fn`` in
    place of every attention (``attn_fn(layer, q, k, v) -> hook_z [1, T, H·dh]``).

    Gradients flow (no ``no_grad``); the model's weights should be frozen by the caller.
    ``attn_fn=None`` is the model's own attention.
    """
    if ids.shape[0] != 1:
        raise ValueError(f"forward_final runs one prompt at a time; got a batch of {ids.shape[0]}")
    T = ids.shape[-1]
    res = eng.forward(Plan(read=list(range(T)), ids=ids[0], attn=attn_fn, grad=torch.is_grad_enabled(),
                           logits=False))
    return eng.final(res.out)


def frozen(model: LoadedModel) -> "_Frozen":
    """Context manager: every weight of the model has requires_grad=False inside, restored after."""
    return _Frozen(model.hf_model)


class _Frozen:
    def __init__(self, m: torch.nn.Module):
        self.m = m
        self.saved: list[tuple[torch.nn.Parameter, bool]] = []

    def __enter__(self) -> None:
        for p in self.m.parameters():
            self.saved.append((p, p.requires_grad))
            p.requires_grad_(False)

    def __exit__(self, *exc: Any) -> None:
        for p, r in self.saved:
            p.requires_grad_(r)
