"""The fast engine's MLP of a sequential pre-norm block, in cache-sized blocks of tokens.

``h + down(act(gate(x)) · up(x))`` (gated: Llama, Qwen, Mistral, SmolLM3, Granite; Phi-3's fused
``gate_up_proj`` as two row views, gate first) or
``h + down(act(up(x)))`` (GPT-2's ``Conv1D`` ``c_fc`` / ``c_proj``), ``x = ln2(h)``: the linear maps go
through :func:`~headscope.patching.linear.linear` (oneDNN, prepacked weights, the residual added in the
down projection's epilogue), the [tokens, d_ffn] intermediates stay in the CPU's cache and are updated
in place. Each token's numbers are those of the module's own call up to float32 rounding; the engine's
self-check compares them with the model's forward. A module this does not recognize, or one carrying
hooks, is called as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..arch.parts import Proj, unwrap, weight_view
from .linear import fused_act_available, linear

# activations with a fused in-place equivalent (GELUTanh is F.gelu(approximate="tanh") itself; NewGELU
# writes the same tanh formula out in several ops)
_TANH_GELU = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh")


@dataclass
class MlpLinears:
    """A recognized MLP: ``gate`` None for an ungated one; ``act(x)`` may overwrite x. ``fused``: the
    activation as a GELU epilogue of the up projection (``("gelu", approximate)``, ungated MLPs whose
    activation is a GELU), None: ``act`` is called."""

    gate: Proj | None
    up: Proj
    down: Proj
    act: Callable[[Tensor], Tensor]
    fused: tuple[str, str] | None = None


def _hooked(*mods: nn.Module | None) -> bool:
    return any(m is not None and bool(m._forward_hooks or m._forward_pre_hooks) for m in mods)


def _act(mod: nn.Module) -> Callable[[Tensor], Tensor]:
    name = type(mod).__name__
    if isinstance(mod, nn.SiLU) or name == "SiLUActivation":
        return lambda x: F.silu(x, inplace=True)
    if name in _TANH_GELU:
        return lambda x: F.gelu(x, approximate="tanh")
    if isinstance(mod, nn.GELU):
        return lambda x: F.gelu(x, approximate=mod.approximate)
    return mod


def _gelu_kind(mod: nn.Module) -> tuple[str, str] | None:
    """``("gelu", approximate)`` when the activation module is that GELU (else None)."""
    if type(mod).__name__ in _TANH_GELU:
        return ("gelu", "tanh")
    if isinstance(mod, nn.GELU) and mod.approximate in ("none", "tanh"):
        return ("gelu", mod.approximate)
    return None


def mlp_linears(mlp: nn.Module) -> MlpLinears | None:
    """The MLP's linear maps as [out, in] projections (views of its weights), or None (unrecognized,
    hooked, or a training-mode dropout)."""
    if _hooked(mlp):
        return None
    names = ("gate_proj", "up_proj", "down_proj")
    mods = [unwrap(getattr(mlp, n, None)) for n in names]
    act = unwrap(getattr(mlp, "act_fn", None))
    if act is not None and all(isinstance(m, nn.Linear) for m in mods) and not _hooked(act, *mods):
        gate, up, down = (Proj(m.weight, m.bias, m) for m in mods)  # type: ignore[union-attr]
        return MlpLinears(gate, up, down, _act(act))
    gu, down_m, act = (unwrap(getattr(mlp, n, None)) for n in ("gate_up_proj", "down_proj", "activation_fn"))
    if (act is not None and isinstance(gu, nn.Linear) and isinstance(down_m, nn.Linear)
            and gu.out_features == 2 * down_m.in_features and not _hooked(gu, down_m, act)):
        # Phi-3: gate_up_proj's output is [gate | up] (chunk(2)); each half as a view of the weight's rows
        f = down_m.in_features
        halves = [Proj(weight_view(gu.weight, f"rows{lo}:{lo + f}", lambda t, lo=lo: t[lo:lo + f]),
                       None if gu.bias is None else weight_view(gu.bias, f"rows{lo}:{lo + f}",
                                                                lambda t, lo=lo: t[lo:lo + f]), gu)
                  for lo in (0, f)]
        return MlpLinears(halves[0], halves[1], Proj(down_m.weight, down_m.bias, down_m), _act(act))
    fc, proj, act = (unwrap(getattr(mlp, n, None)) for n in ("c_fc", "c_proj", "act"))
    drop = getattr(mlp, "dropout", None)
    conv = all(type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None for m in (fc, proj))
    if conv and act is not None and not _hooked(fc, proj, act) and not (
            isinstance(drop, nn.Dropout) and drop.training and drop.p > 0):
        up, down = (Proj(weight_view(m.weight, "t", lambda t: t.t()), m.bias, m) for m in (fc, proj))  # type: ignore[union-attr]
        kind = _gelu_kind(act)
        return MlpLinears(None, up, down, _act(act), kind if kind and fused_act_available(kind) else None)
    return None


def mlp_blocks(parts: MlpLinears, norm: Callable[[Tensor], Tensor], h: Tensor, block: int = 1024) -> Tensor:
    """h + MLP(norm(h)) over blocks of ``block`` tokens (see the module docstring)."""
    flat = h.reshape(-1, h.shape[-1])
    out = torch.empty_like(flat)
    gate, up, down = parts.gate, parts.up, parts.down
    for s in range(0, flat.shape[0], block):
        hb = flat[s: s + block]
        x = norm(hb)
        if parts.fused is not None:  # GELU in the up projection's epilogue
            a = linear(x, up.weight, up.bias, act=parts.fused)
        else:
            u = linear(x, up.weight, up.bias)
            a = parts.act(linear(x, gate.weight, gate.bias)).mul_(u) if gate is not None else parts.act(u)
        out[s: s + block] = linear(a, down.weight, down.bias, residual=hb)
    return out.view(h.shape)
