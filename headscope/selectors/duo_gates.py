"""``duo_gates``: DuoAttention-style learned head gates (Xiao et al. 2024).

Every head (or every KV group, ``granularity="kv_group"``, as in DuoAttention) gets a gate
α ∈ [0, 1] that mixes its full-attention output with a streaming output (attention to the first
``sink`` tokens and the last ``window`` tokens only)::

    z_h = α_h · FullAttn_h + (1 − α_h) · StreamingAttn_h

All model weights are frozen; only α is trained, from α = 1, on synthetic passkey prompts, to keep
the final hidden states (after the final norm) at the answer-reading positions equal to the full
model's, with an L1 penalty pushing α to 0::

    loss = mean_pos ‖h − h_full‖² / ‖h_full‖²  +  l1 · mean(α)

Adam, α clipped to [0, 1] after each step (DuoAttention's recipe, at toy scale by default). Heads
are ranked by α; heads whose α is tied (e.g. all still at 1 or all at 0 after few steps) are
ordered by their accumulated distillation-gradient magnitude |∂L_distill/∂α| (column
``sensitivity``), added as a < 1e-6 tie-break. Deterministic on CPU for a fixed ``seed``.
"""

from __future__ import annotations

import time
from typing import Literal, Sequence

import numpy as np
import torch
from torch import Tensor

from ..models import LoadedModel
from ..patching.engine import Engine
from ..scores import Ranking
from .base import (AttnFn, Prompt, forward_final, layer_mask, make_ranking, own_attention, passkey_prompts, sdpa_heads,
                   streaming_mask)
from .gate_training import GateTraining, train_gates


def gate_to_heads(alpha: Tensor, n_heads: int) -> Tensor:
    """Float[Tensor, "layer n_gates"] -> Float[Tensor, "layer n_heads"] (KV-group gates repeated over the group)."""
    return alpha.repeat_interleave(n_heads // alpha.shape[1], dim=1)


def select_duo_gates(
    model: LoadedModel,
    steps: int = 12,
    n_prompts: int = 4,
    seq_lens: int | Sequence[int] = 128,
    depths: float | Sequence[float] = (0.1, 0.3, 0.5),
    seed: int = 0,
    sink: int = 4,
    window: int = 16,
    l1: float = 0.05,
    lr: float = 0.02,
    granularity: Literal["head", "kv_group"] = "head",
    progress: bool = False,
) -> Ranking:
    """Train the gates for ``steps`` steps (one prompt per step, prompts cycled) and rank heads by α.

    Returns:
        Ranking with extra columns ``alpha`` and ``sensitivity``; ``extras["loss"]`` the loss curve.

    Raises:
        ValueError: steps < 1, sink/window < 0, unknown granularity.
    """
    if steps < 1:
        raise ValueError(f"steps={steps}: train at least one step")
    if sink < 0 or window < 1:
        raise ValueError(f"sink={sink}, window={window}: need sink >= 0 and window >= 1")
    if granularity not in ("head", "kv_group"):
        raise ValueError(f"granularity={granularity!r}: use 'head' or 'kv_group'")
    t0 = time.time()
    torch.manual_seed(seed)
    g = model.geometry
    eng = Engine(model)
    prompts = passkey_prompts(model, n_prompts, seq_lens, depths, seed)
    n_gates = g.n_heads if granularity == "head" else g.n_kv_heads
    alpha = torch.ones(g.n_layers, n_gates, dtype=torch.float32, requires_grad=True)
    sens = torch.zeros(g.n_layers, n_gates, dtype=torch.float64)
    with torch.no_grad():
        refs = [forward_final(eng, p.ids[None])[0, p.read].float() for p in prompts]

    def attention(p: Prompt) -> AttnFn:
        T = p.ids.numel()
        str_m = streaming_mask(T, sink, window, eng.device)
        a_heads = gate_to_heads(alpha, g.n_heads).to(eng.device, eng.dtype)

        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            sc = eng.layers[layer].scaling
            a = a_heads[layer][None, :, None, None]
            own = layer_mask(eng, layer, T)
            o = a * own_attention(eng, layer, q, k, v) + (1 - a) * sdpa_heads(q, k, v, str_m & own, sc)
            return o.transpose(1, 2).reshape(1, T, -1)

        return attn

    def loss(i: int, p: Prompt, h: Tensor) -> tuple[Tensor, str]:
        ref, h = refs[i], h.float()
        distill = (((h - ref) ** 2).sum(-1) / (ref**2).sum(-1)).mean()
        return distill + l1 * alpha.abs().mean(), ""

    def sensitivity() -> None:  # the distillation part of the gradient: remove the L1 term's
        sens.add_((alpha.grad - l1 * torch.sign(alpha) / alpha.numel()).abs().double())

    cfg = GateTraining("duo_gates", attention, loss, after_backward=sensitivity,
                       after_step=lambda: alpha.clamp_(0.0, 1.0), loss_digits=5)
    losses = train_gates(model, eng, prompts, alpha, steps, lr, cfg, progress)
    a = gate_to_heads(alpha.detach(), g.n_heads).double().numpy()
    s = gate_to_heads(sens.float(), g.n_heads).double().numpy()
    score = a + 1e-7 * s / (s.max() + 1e-30)
    settings = {"steps": steps, "n_prompts": n_prompts, "seq_lens": seq_lens, "depths": depths, "seed": seed,
                "sink": sink, "window": window, "l1": l1, "lr": lr, "granularity": granularity}
    return make_ranking(model, score, "duo_gates", settings, columns={"alpha": a, "sensitivity": s},
                        extras={"loss": losses}, seconds=time.time() - t0)
