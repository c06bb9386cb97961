"""The engine's fp32 linear maps on CPU through oneDNN with prepacked weights.

PyTorch's CPU ``F.linear`` in float32 calls MKL's sgemm. On AMD CPUs MKL takes its AVX2 code path, so
on an AVX-512 machine such as AMD Zen 4/5 it reaches about half the fp32 peak. oneDNN (bundled with
PyTorch as MKL-DNN) runs its AVX-512 kernels on every x86 vendor. We call it through the op that
``torch.compile``'s CPU backend uses for frozen linear layers
(``torch.ops.mkldnn._linear_pointwise`` with a weight from ``torch.ops.mkldnn._reorder_linear_weight``).
The arithmetic is still float32 with float32 accumulation; only the blocking and the summation order
differ from MKL's, so results agree to float32 rounding. ``benchmarks/bench_patching.py`` measures
the speed-up.

A GELU that follows the map (GPT-2's MLP, ``act=("gelu", "tanh")``) runs in the kernel's epilogue (oneDNN's
eltwise GELU on the float32 output, probed against ``F.gelu`` once like the plain call), so the
[tokens, d_ffn] intermediate is written once instead of written, read and written again.

Only gradient-free calls take this path (the op has no autograd formula). Everything else, and every
non-CPU or non-fp32 call, uses ``F.linear``. Setting the environment variable ``HEADSCOPE_ONEDNN=0``
turns the path off.
"""

from __future__ import annotations

import os
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

# id(weight) -> (weak reference to the weight, its version when packed, packed copy); an entry is dropped
# when its weight is freed (tensors cannot be keys of a WeakKeyDictionary: == is elementwise)
_PACKED: dict[int, tuple["weakref.ref[Tensor]", int, Tensor]] = {}
_OK: Optional[bool] = None
GELU_KINDS = ("none", "tanh")  # F.gelu's ``approximate`` values, oneDNN's GELU algorithms of the same names
_ACT_OK: dict[tuple[str, str], bool] = {}


def onednn_available() -> bool:
    """True when oneDNN's prepacked fp32 linear runs here: a CPU build with MKL-DNN and the ops,
    ``HEADSCOPE_ONEDNN`` not set to ``0``, and a probe call that matches ``F.linear`` (checked once)."""
    global _OK
    if os.environ.get("HEADSCOPE_ONEDNN", "1") == "0":
        return False
    if _OK is None:
        _OK = False
        try:
            if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
                g = torch.Generator().manual_seed(0)
                x, w, b = torch.randn(5, 24, generator=g), torch.randn(7, 24, generator=g), torch.randn(7, generator=g)
                y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), b,
                                                       "none", [], "")
                _OK = bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5))
        except (RuntimeError, AttributeError, NotImplementedError):
            _OK = False
    return _OK


def fused_act_available(act: tuple[str, str]) -> bool:
    """True when oneDNN's linear with the epilogue ``act`` (``("gelu", "tanh" | "none")``) runs here and
    matches ``F.gelu(F.linear(...), approximate=...)`` on a probe (checked once per ``act``)."""
    if act[0] != "gelu" or act[1] not in GELU_KINDS or not onednn_available():
        return False
    if act not in _ACT_OK:
        ok = False
        try:
            g = torch.Generator().manual_seed(1)
            x, w, b = torch.randn(5, 24, generator=g), torch.randn(7, 24, generator=g), torch.randn(7, generator=g)
            y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), b,
                                                   act[0], [], act[1])
            ok = bool(torch.allclose(y, F.gelu(F.linear(x, w, b), approximate=act[1]), rtol=1e-5, atol=1e-5))
        except (RuntimeError, AttributeError, NotImplementedError):
            ok = False
        _ACT_OK[act] = ok
    return _ACT_OK[act]


def packed_weight(weight: Tensor) -> Tensor:
    """oneDNN's prepacked copy of ``weight`` [out, in], made once and cached per weight tensor (made
    again when the weight changes in place: the cache checks the tensor's version counter)."""
    key = id(weight)
    hit = _PACKED.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == weight._version:
        return hit[2]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    _PACKED[key] = (weakref.ref(weight, lambda _r, k=key: _PACKED.pop(k, None)), weight._version, packed)
    return packed


def linear(
    x: Float[Tensor, "*batch d_in"],
    weight: Float[Tensor, "d_out d_in"],
    bias: Optional[Float[Tensor, " d_out"]] = None,
    residual: Optional[Float[Tensor, "*batch d_out"]] = None,
    act: Optional[tuple[str, str]] = None,
) -> Float[Tensor, "*batch d_out"]:
    """``F.linear(x, weight, bias)`` (``+ residual`` when given; ``act=("gelu", approximate)``: then
    ``F.gelu(..., approximate=approximate)``, not with ``residual``); on CPU in float32 without
    autograd, through oneDNN's prepacked kernel, with the residual or the GELU applied in the kernel's
    epilogue (same float32 arithmetic; results equal the unfused ops' to float32 rounding).

    Raises:
        ValueError: ``x``'s last dimension is not ``weight``'s input size, an ``act`` other than a GELU,
            or ``act`` together with ``residual``.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight {tuple(weight.shape)} expects "
                         f"{weight.shape[-1]}; pass the weight as [out, in]")
    if act is not None and (act[0] != "gelu" or act[1] not in GELU_KINDS or residual is not None):
        raise ValueError(f"act={act}: only ('gelu', 'none' | 'tanh') without a residual")
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or (residual is not None and (residual.dtype != torch.float32 or residual.device.type != "cpu"))
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (residual is not None and residual.requires_grad)))
        or not onednn_available()
        or (act is not None and not fused_act_available(act))
    ):
        y = F.linear(x, weight, bias)
        if act is not None:
            return F.gelu(y, approximate=act[1])
        return y if residual is None else residual + y
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    b = None if bias is None else bias.detach()
    if act is not None:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed_weight(weight), b, act[0], [], act[1])
    elif residual is None:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed_weight(weight), b, "none", [], "")
    else:
        r2 = residual.reshape(-1, weight.shape[0])
        if not r2.is_contiguous():
            r2 = r2.contiguous()
        y = torch.ops.mkldnn._linear_pointwise.binary(x2, r2, packed_weight(weight), b, "add")
    return y.view(*lead, weight.shape[0])
