"""The training loop of the learned-gate selectors (:mod:`~headscope.selectors.duo_gates`,
:mod:`~headscope.selectors.flashmorph_gates`): one loop, each selector a :class:`GateTraining` of it.

All model weights are frozen; only the gate parameter is trained, with Adam, one calibration prompt per step
(prompts cycled). Per step: the selector's ``attention(prompt)`` mixes each layer's own attention with its
other branch under the current gates; the final hidden states at the prompt's answer-reading positions go to
its ``loss``; after the backward pass its ``after_backward`` sees the gradient (DuoAttention's tie-break
sensitivity) and after the Adam step its ``after_step`` projects the parameter (DuoAttention's clip to [0, 1]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..models import LoadedModel
from ..patching.contract import PlanEngine
from .base import AttnFn, Prompt, forward_final, frozen


@dataclass(frozen=True)
class GateTraining:
    """One selector's configuration of :func:`train_gates`.

    Attributes:
        name: the selector's name, in progress lines.
        attention: prompt -> the attention function of one forward under the current gates.
        loss: (prompt index, prompt, final hidden states at its read positions [n_read, d_model]) ->
            (scalar loss, progress text after the loss).
        after_backward: called with nothing after ``loss.backward()`` (the gradient is on the parameter).
        after_step: called after the optimizer step (under ``torch.no_grad``).
        loss_digits: decimals of the loss in progress lines.
    """

    name: str
    attention: Callable[[Prompt], AttnFn]
    loss: Callable[[int, Prompt, Tensor], tuple[Tensor, str]]
    after_backward: Callable[[], None] | None = None
    after_step: Callable[[], None] | None = None
    loss_digits: int = 5


def train_gates(
    model: LoadedModel, eng: PlanEngine, prompts: Sequence[Prompt], param: Tensor, steps: int, lr: float,
    cfg: GateTraining, progress: bool = False,
) -> list[float]:
    """Train ``param`` (the gates, ``requires_grad``) for ``steps`` Adam steps at ``lr``; the loss of each step.

    The model's weights are frozen for the duration (:func:`~headscope.selectors.base.frozen`).
    """
    opt = torch.optim.Adam([param], lr=lr)
    losses: list[float] = []
    with frozen(model):
        for step in range(steps):
            i = step % len(prompts)
            p = prompts[i]
            h = forward_final(eng, p.ids[None], cfg.attention(p))[0, p.read]
            loss, note = cfg.loss(i, p, h)
            opt.zero_grad()
            loss.backward()
            if cfg.after_backward is not None:
                with torch.no_grad():
                    cfg.after_backward()
            opt.step()
            if cfg.after_step is not None:
                with torch.no_grad():
                    cfg.after_step()
            losses.append(float(loss.detach()))
            if progress:
                print(f"{cfg.name} step {step + 1}/{steps} loss {losses[-1]:.{cfg.loss_digits}f}{note}", flush=True)
    return losses
