"""``flashmorph_gates``: FlashMorph-style layer selection with learned FA/linear gates.

Every attention layer gets a converted linear-attention branch next to its full attention (FA); a
gate g_l = sigmoid(θ_l) mixes them, ``z = g_l · FA + (1 − g_l) · Linear``. All model weights are
frozen; only θ is trained (from θ = ``init_logit``, i.e. mostly FA) on synthetic passkey retrieval
with a linearization penalty that pushes the model onto the linear branch::

    loss = CE(answer tokens | teacher forcing) + lin · mean_l g_l

The gates are then discretized under an FA budget: the ranking lists whole layers by gate (all
heads of the highest-gate layer first), so ``ranking.mask(k * n_heads, min_per_layer=0)`` keeps the
k highest-gate layers; :func:`fa_layers` gives the layer list directly. ``granularity="head"`` (an
extension) trains one gate per head and ranks heads by gate.

The linear branch (our choice, stated): headscope.hybrid's gated delta rule (GDN, eq. 7–8,
:func:`headscope.hybrid.gdn.gdn_chunked_torch`) run on the layer's own frozen q/k/v (q, k after
RoPE and L2-normalized, K/V expanded from GQA to one per head), with constant β = ``beta`` and
constant decay α = ``decay`` — no new parameters besides the gates (FlashMorph also trains the
converted branch; here it is only migrated). Deterministic on CPU for a fixed ``seed``.
"""

from __future__ import annotations

import math
import time
from typing import Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..hybrid.gdn import gdn_chunked_torch
from ..models import LoadedModel
from ..patching.engine import Engine
from ..scores import Ranking
from .base import AttnFn, Prompt, make_ranking, own_attention, passkey_prompts
from .gate_training import GateTraining, train_gates


def linear_branch(q: Tensor, k: Tensor, v: Tensor, beta: float, decay: float) -> Tensor:
    """Frozen GDN branch: q [B,H,T,dh], k/v [B,KV,T,dh] -> [B,H,T,dh]."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    qn = F.normalize(q.transpose(1, 2).float(), dim=-1)
    kn = F.normalize(k.transpose(1, 2).float(), dim=-1)
    vv = v.transpose(1, 2).float()
    B, T, H, _ = qn.shape
    gl = torch.full((B, T, H), math.log(decay), device=q.device)
    bt = torch.full((B, T, H), beta, device=q.device)
    y, _ = gdn_chunked_torch(qn, kn, vv, gl, bt, scale=1.0)
    return y.transpose(1, 2).to(q.dtype)


def fa_layers(ranking: Ranking, n_fa_layers: int) -> list[int]:
    """The ``n_fa_layers`` layers with the highest gates of a flashmorph ranking (sorted).

    Raises:
        ValueError: not a flashmorph ranking, or n_fa_layers outside 1..n_layers.
    """
    if "layer_gate" not in ranking.scores:
        raise ValueError("fa_layers needs a ranking from select(model, 'flashmorph_gates')")
    lg = ranking.scores.groupby("layer")["layer_gate"].max()
    if not 1 <= n_fa_layers <= len(lg):
        raise ValueError(f"n_fa_layers={n_fa_layers} must lie in 1..{len(lg)}")
    return sorted(int(x) for x in lg.sort_values(ascending=False, kind="stable").index[:n_fa_layers])


def select_flashmorph_gates(
    model: LoadedModel,
    steps: int = 12,
    n_prompts: int = 4,
    seq_lens: int | Sequence[int] = 128,
    depths: float | Sequence[float] = (0.1, 0.3, 0.5),
    seed: int = 0,
    lin: float = 0.5,
    lr: float = 0.1,
    init_logit: float = 3.0,
    beta: float = 1.0,
    decay: float = 0.97,
    granularity: Literal["layer", "head"] = "layer",
    progress: bool = False,
) -> Ranking:
    """Train the FA/linear gates for ``steps`` steps (one prompt per step, cycled); rank by gate.

    Returns:
        Ranking with extra columns ``gate`` (per head; = its layer's gate at layer granularity) and
        ``layer_gate`` (mean gate of the layer); ``extras["loss"]``, ``extras["layer_gates"]``.

    Raises:
        ValueError: steps < 1, beta outside (0, 1], decay outside (0, 1], unknown granularity.
    """
    if steps < 1:
        raise ValueError(f"steps={steps}: train at least one step")
    if not (0 < beta <= 1 and 0 < decay <= 1):
        raise ValueError(f"beta={beta}, decay={decay}: both must lie in (0, 1]")
    if granularity not in ("layer", "head"):
        raise ValueError(f"granularity={granularity!r}: use 'layer' or 'head' (extension)")
    t0 = time.time()
    torch.manual_seed(seed)
    g = model.geometry
    eng = Engine(model)
    prompts = passkey_prompts(model, n_prompts, seq_lens, depths, seed)
    theta = torch.full((g.n_layers, 1 if granularity == "layer" else g.n_heads), float(init_logit), requires_grad=True)

    def attention(p: Prompt) -> AttnFn:
        T = p.ids.numel()
        gate = torch.sigmoid(theta).expand(g.n_layers, g.n_heads).to(eng.device, eng.dtype)

        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            a = gate[layer][None, :, None, None]
            o = a * own_attention(eng, layer, q, k, v) + (1 - a) * linear_branch(q, k, v, beta, decay)
            return o.transpose(1, 2).reshape(1, T, -1)

        return attn

    def loss(i: int, p: Prompt, h: Tensor) -> tuple[Tensor, str]:
        logits = eng.head(h).float()
        ce = F.cross_entropy(logits, p.answer.to(logits.device))
        return ce + lin * torch.sigmoid(theta).mean(), f" ce {float(ce):.4f}"

    cfg = GateTraining("flashmorph", attention, loss, loss_digits=4)
    losses = train_gates(model, eng, prompts, theta, steps, lr, cfg, progress)
    gate = torch.sigmoid(theta.detach()).expand(g.n_layers, g.n_heads).double().numpy()
    layer_gate = np.repeat(gate.mean(1, keepdims=True), g.n_heads, 1)
    if granularity == "layer":
        order = np.argsort(-layer_gate[:, 0], kind="stable")
        pos = np.empty(g.n_layers)
        pos[order] = np.arange(g.n_layers)
        score = 1.0 - (pos[:, None] * g.n_heads + np.arange(g.n_heads)[None]) / g.n_total  # whole layers first
    else:
        score = gate
    settings = {"steps": steps, "n_prompts": n_prompts, "seq_lens": seq_lens, "depths": depths, "seed": seed,
                "lin": lin, "lr": lr, "init_logit": init_logit, "beta": beta, "decay": decay,
                "granularity": granularity, "linear_branch": "frozen GDN (headscope.hybrid.gdn), constant beta/decay"}
    return make_ranking(model, score, "flashmorph_gates", settings, columns={"gate": gate, "layer_gate": layer_gate},
                        extras={"loss": losses, "layer_gates": layer_gate[:, 0].tolist()}, seconds=time.time() - t0)
