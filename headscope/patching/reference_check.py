"""The fast engine against the model's own forward: what the model applies, read from its forward
(the attention mask each layer receives), and the engine's outputs compared with it.

* :func:`model_reference`: one forward of the model (dynamic RoPE as freshly built,
  :func:`~headscope.arch.rope_state.fresh_rope`) capturing every layer's attention output, layer output,
  logits and the attention mask the model passes to the layer; the engine's sliding windows are set from
  those masks (:func:`mask_window`), so a window the model applies through its mask alone (SmolLM3 with
  ``use_sliding_window=False``) is the engine's too.
* :func:`compare` (float32/float64): the engine's own pass (its residual stream carried through its
  layers) against the model's: every layer's attention output and layer output, and the logits, within
  :func:`tolerance` (relative to the activations' largest magnitude) or :class:`EngineMismatch`
  naming the layer, the part and the fix.
* :func:`compare_teacher_forced` (bfloat16/float16): every layer computed by the engine from the model's
  own input to that layer (captured by :func:`model_reference`), and the logits from the model's own last
  hidden state, against the model's outputs, to the same tolerance. In 16-bit types two correct
  implementations of the same layers round apart, and carried through the stack the two residual streams
  drift apart with depth and length (SmolLM2-135M in bfloat16: 9e-2 relative at layer 12 of an 8K-token
  prompt, beyond 8·eps, with every layer right); taken one layer at a time the difference is that
  layer's rounding only, while a wrong scale, window or rotary still shows at its layer.
  :func:`teacher_forced` says which of the two a dtype gets.
* :func:`check_patches`: a few patched rows through the engine's shortcuts (cached prefix, rows joining
  at their layer) against one forward of the model with a ``hook_z`` edit (a pre-hook on the attention
  output projection), which the clean comparison cannot see.

``eng`` is always a :class:`~headscope.patching.engine.Engine` (typed ``Any`` here: the engine imports this
module, and this module does not import it back); it is used through its public layer pieces
(:class:`~headscope.patching.layer_ops.LayerOps`). When each check runs, and what a passed one is kept for:
:mod:`headscope.patching.self_check`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from ..arch import UnsupportedArchitecture, attention_out_module, decoder_layers, unwrap
from ..arch.rope_state import fresh_rope

if TYPE_CHECKING:  # pragma: no cover
    from .pass_plan import RunCache

FIX = "pass path='generic' (CLI --path generic) to patch through the TransformerLens bridge's hooks"


class EngineMismatch(UnsupportedArchitecture):
    """The fast engine disagrees with the model's own forward (an architecture variant no adapter covers)."""


def tolerance(dtype: torch.dtype) -> float:
    """Largest relative difference (to the activations' largest magnitude) accepted between the engine and
    the model's forward in ``dtype``: 1e-3 in float32/float64 (a Granite-shaped random model of 8 layers,
    d 512, differs by 1.01e-4 at 253 tokens from float32 rounding alone, while the misread windows, scales
    and rotaries this check exists for differ by 1e-2 and more); 8 units of rounding (8·eps) in 16-bit
    types (bfloat16 8·2^-7 = 6.25e-2, float16 8·2^-10 = 7.8e-3), where the two orders of the same
    operations round apart; there each layer is compared teacher-forced (:func:`teacher_forced`), so the
    difference is one layer's rounding, not the drift of the whole stack."""
    if dtype in (torch.float32, torch.float64):
        return 1e-3
    return 8 * torch.finfo(dtype).eps


def teacher_forced(dtype: torch.dtype) -> bool:
    """Whether a model in ``dtype`` is checked layer by layer from its own inputs
    (:func:`compare_teacher_forced`: bfloat16, float16) rather than along the engine's own residual stream
    (:func:`compare`: float32, float64, where the carried stream stays within the tolerance)."""
    return dtype not in (torch.float32, torch.float64)


def mask_window(mask: Any, T: int) -> tuple[bool, int | None]:
    """The sliding window of a layer's attention mask over a T-token prompt without padding.

    ``mask``: what the model passed to the layer as ``attention_mask``: None (causal; transformers skips
    the mask where the kernel's causal flag does the same), a boolean mask (True: attend) or an additive
    float mask (0: attend), ``[batch, 1 or heads, T, T]``.

    Returns ``(readable, window)``: ``(True, None)`` causal at this length, ``(True, w)`` key j visible to
    query i iff 0 <= i - j < w with w < T, ``(False, None)`` anything else (another pattern, a mask type
    that cannot be read here).
    """
    if mask is None:
        return True, None
    if not isinstance(mask, Tensor) or mask.dim() < 2 or tuple(mask.shape[-2:]) != (T, T):
        return False, None
    m = mask.reshape(-1, T, T)[0]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    m = m.cpu()
    n = int(m[-1].sum())
    w = None if n >= T else n
    qp = torch.arange(T)
    want = qp[None, :] <= qp[:, None]
    if w is not None:
        want &= qp[None, :] > qp[:, None] - w
    return bool(torch.equal(m, want)), w


def _attention_module(hf: torch.nn.Module, layer: int) -> torch.nn.Module | None:
    blk = decoder_layers(hf)[layer]
    for name in ("self_attn", "attn", "attention"):
        a = unwrap(getattr(blk, name, None))
        if isinstance(a, torch.nn.Module):
            return a
    return None


_NOT_PASSED = object()


@dataclass
class Reference:
    """The model's own forward of one prompt: logits [T - first, vocab] (float32), per layer the input
    (the residual stream the layer receives), the attention output (after the output projection) and the
    layer output, each [1, T, d_model] in the model's dtype, and the attention mask passed. A layer's input
    is usually the previous layer's output tensor itself (no copy is kept then)."""

    logits: Tensor
    first: int = 0  # logits cover positions first..T-1
    inp: list[Tensor] = field(default_factory=list)
    attn: list[Tensor] = field(default_factory=list)
    out: list[Tensor] = field(default_factory=list)
    masks: dict[int, Any] = field(default_factory=dict)


def _layer_input(args: tuple, kwargs: dict) -> Tensor:
    """The hidden states a decoder layer is called with (first positional argument, else ``hidden_states``)."""
    h = args[0] if args else kwargs["hidden_states"]
    return (h[0] if isinstance(h, tuple) else h).detach()


def _logits_from(hf: torch.nn.Module, T: int, first: int) -> dict:
    """``logits_to_keep`` (the model computes logits at positions first..T-1 only) where its forward takes it."""
    if first <= 0 or "logits_to_keep" not in inspect.signature(hf.forward).parameters:
        return {}
    return {"logits_to_keep": T - first}


@torch.no_grad()
def model_reference(eng: Any, ids: Int[Tensor, "pos"], first: int = 0) -> Reference:
    """One forward of ``ids`` through the model itself, in its dtype and on its device, capturing every
    layer's input, attention output and output (:class:`Reference`), and the engine's sliding windows set
    from the masks the model passed to each layer. ``first``: logits are needed at positions first.. only
    (the model skips the unembedding before them where it can).

    Raises:
        EngineMismatch: a layer's mask is neither causal nor a sliding window (chunked or bidirectional
            attention), naming the layer and the fix.
    """
    hf = eng.hf
    T = int(ids.numel())
    ref = Reference(logits=torch.empty(0))
    hooks = []
    try:
        for i, blk in enumerate(decoder_layers(hf)):
            hooks.append(blk.register_forward_pre_hook(
                lambda m, a, kw: ref.inp.append(_layer_input(a, kw)), with_kwargs=True))
            hooks.append(attention_out_module(hf, i).register_forward_hook(
                lambda m, a, o: ref.attn.append(o.detach())))
            hooks.append(blk.register_forward_hook(
                lambda m, a, o: ref.out.append((o[0] if isinstance(o, tuple) else o).detach())))
            am = _attention_module(hf, i)
            if am is not None:
                hooks.append(am.register_forward_pre_hook(
                    lambda m, a, kw, i=i: ref.masks.__setitem__(i, kw.get("attention_mask", _NOT_PASSED)),
                    with_kwargs=True))
        kw = _logits_from(hf, T, first)
        with fresh_rope(hf):
            ref.logits = hf(ids[None].to(eng.layers[0].device), use_cache=False, **kw).logits[0].float()
        ref.first = T - ref.logits.shape[0]
    finally:
        for hk in hooks:
            hk.remove()
    _adopt_windows(eng, ref.masks, T)
    return ref


def _adopt_windows(eng: Any, masks: dict[int, Any], T: int) -> None:
    read = eng.arch.notes.setdefault("windows_from_masks", {})
    for i, m in masks.items():
        if m is _NOT_PASSED:
            continue
        ok, w = mask_window(m, T)
        if not ok:
            if not isinstance(m, Tensor):
                continue  # a mask object that cannot be read here (flex attention): the comparison decides
            raise EngineMismatch(
                f"layer {i} of {type(eng.hf).__name__} gets an attention mask that is neither causal nor a sliding "
                f"window over a {T}-token prompt (chunked or bidirectional attention?); the fast engine computes "
                f"causal and sliding-window attention only: {FIX}.")
        L = eng.layers[i]
        mine = L.window if L.window is not None and L.window < T else None
        if w != mine:
            L.window = w
            read[i] = w
        elif w is not None:
            read[i] = w


def _rel(a: Tensor, b: Tensor) -> float:
    scale = float(b.abs().max().clamp_min(1e-6))
    return float((a.to(b.device).float() - b.float()).abs().max()) / scale


ATTN_PART = "attention output (hook_z -> output projection)"
OUT_PART = "layer output (norms, MLP, residual)"


def _layer_mismatch(eng: Any, lay: int, part: str, d: float, tol: float, T: int, how: str = "") -> EngineMismatch:
    L = eng.layers[lay]
    return EngineMismatch(
        f"the fast engine disagrees with {type(eng.hf).__name__}'s own forward at layer {lay}, {part}: relative "
        f"difference {d:.2e} > {tol:.3g} over a {T}-token prompt in {str(eng.dtype).replace('torch.', '')}{how} "
        f"(family adapter {eng.arch.family!r}, window {L.window}, soft-cap {L.softcap}, config notes "
        f"{eng.arch.notes}). This variant is not covered by the adapter: {FIX}.")


def _logits_mismatch(eng: Any, d: float, how: str = "") -> EngineMismatch:
    return EngineMismatch(
        f"the fast engine's logits differ from {type(eng.hf).__name__}'s own forward by {d:.2e} (relative) "
        f"after the last layer{how}: the final norm / unembedding (soft-cap, logit scale) is not as the adapter "
        f"{eng.arch.family!r} assumes; {FIX}.")


def _reference_logits(ref: Reference, read: Sequence[int]) -> Tensor:
    return ref.logits[torch.as_tensor(list(read), device=ref.logits.device) - ref.first]


@torch.no_grad()
def compare(eng: Any, cache: "RunCache", logits: Tensor, ref: Reference, read: Sequence[int],
            tol: float | None = None) -> float:
    """The engine's pass (its :class:`RunCache` of every position, ``logits`` [len(read), vocab]) against
    the model's (:func:`model_reference`), along the engine's own residual stream: layer ``l``'s outputs
    are computed from the engine's residual entering it, so differences carry from layer to layer (the
    check for float32/float64; 16-bit types use :func:`compare_teacher_forced`). Returns the largest
    relative difference.

    Raises:
        EngineMismatch: naming the first layer and part (attention or MLP branch) that disagrees, or
            the final norm / unembedding, and the fix (``path="generic"``).
    """
    tol = tolerance(eng.dtype) if tol is None else tol
    worst = 0.0
    T = int(cache.resid.shape[1])
    for lay in range(eng.g.n_layers):
        h_in = cache.resid[lay][None].to(eng.layers[lay].device)
        o_ref = ref.attn[lay] if lay < len(ref.attn) else None
        o_eng = eng.attn_out(lay, cache.z[lay][None])
        h_next = (cache.resid[lay + 1][None] if lay + 1 < eng.g.n_layers
                  else eng.post_attn(lay, h_in, cache.z[lay][None]))
        for part, a, b in ((ATTN_PART, o_eng, o_ref), (OUT_PART, h_next, ref.out[lay] if lay < len(ref.out) else None)):
            if b is None:
                continue
            d = _rel(a, b)
            worst = max(worst, d)
            if not d <= tol:
                raise _layer_mismatch(eng, lay, part, d, tol, T)
    d = _rel(logits, _reference_logits(ref, read))
    worst = max(worst, d)
    if not d <= tol:
        raise _logits_mismatch(eng, d)
    return worst


@torch.no_grad()
def compare_teacher_forced(eng: Any, ids: Int[Tensor, "pos"], ref: Reference, read: Sequence[int],
                           tol: float | None = None) -> float:
    """The engine layer by layer, each layer computed from the model's own input to it, against the model's
    forward of ``ids`` (:func:`model_reference`): the embedding against the model's input to layer 0, every
    layer's attention output (hook_z -> output projection) and output from ``ref.inp[l]``, and the logits
    at ``read`` from the model's own last-layer output through the engine's final norm and unembedding.
    The check for bfloat16/float16 (:func:`teacher_forced`): a difference is one layer's rounding, not the
    drift of two residual streams carried through the stack. The engine computes each layer as
    :meth:`~headscope.patching.engine.Engine.forward` does (pre-attention norm, projections, RoPE tables of
    positions 0..T-1, attention with the layer's scale, window and soft-cap, output projection, the rest
    of the block), in its residual dtype.

    Returns the largest relative difference (to each reference activation's largest magnitude).

    Raises:
        EngineMismatch: naming the first layer and part that disagrees (or the embedding, or the final
            norm / unembedding) and the fix (``path="generic"``); also when the model's forward did not
            pass through every decoder layer.
    """
    tol = tolerance(eng.dtype) if tol is None else tol
    n = eng.g.n_layers
    ids = ids.reshape(-1)
    T = int(ids.numel())
    how = ", teacher-forced (the layer computed from the model's own input to it)"
    if len(ref.inp) != n or len(ref.out) != n:
        raise EngineMismatch(
            f"{type(eng.hf).__name__}'s forward called {len(ref.inp)} of its {n} decoder layers once each "
            f"(not the layer stack the fast engine runs): {FIX}.")
    dev0 = eng.layers[0].device
    positions = torch.arange(T, device=dev0)
    rd = eng.resid_dtype
    d = _rel(eng.embed(ids[None].to(dev0), positions), ref.inp[0])
    worst = d
    if not d <= tol:
        raise EngineMismatch(
            f"the fast engine's embedding (the residual stream entering layer 0) differs from "
            f"{type(eng.hf).__name__}'s own by {d:.2e} (relative) over a {T}-token prompt (embedding scale or "
            f"learned positions not as the adapter {eng.arch.family!r} assumes): {FIX}.")
    pos = eng.positions(positions, ref.inp[0].to(dev0, rd))
    for lay in range(n):
        dev = eng.layers[lay].device
        h = ref.inp[lay].to(dev, rd)
        q, k, v = eng.qkv(lay, eng.ln1(lay, h), pos)
        z = eng.attend(lay, q, k, v, positions.to(dev))
        del q, k, v
        if lay < len(ref.attn):
            d = _rel(eng.attn_out(lay, z), ref.attn[lay])
            worst = max(worst, d)
            if not d <= tol:
                raise _layer_mismatch(eng, lay, ATTN_PART, d, tol, T, how)
        d = _rel(eng.post_attn(lay, h, z), ref.out[lay])
        worst = max(worst, d)
        if not d <= tol:
            raise _layer_mismatch(eng, lay, OUT_PART, d, tol, T, how)
    r = torch.as_tensor(list(read), device=ref.out[-1].device)
    logits = eng.unembed(ref.out[-1][:, r].to(rd))[0]
    d = _rel(logits, _reference_logits(ref, read))
    worst = max(worst, d)
    if not d <= tol:
        raise _logits_mismatch(eng, d, " (from the model's own last hidden state)")
    return worst


def patch_rows_to_check(eng: Any, T: int) -> list[tuple[int, int]]:
    """The (layer, head) row :func:`check_patches` runs (one, to keep its cost a few percent of a ranking):
    head 0 of the first layer whose window is shorter than the prompt (where the cached prefix meets the
    window), else of layer 0. A row joining there passes every later layer's cached prefix and the last
    layer's read-positions-only pass."""
    windowed = [i for i, L in enumerate(eng.layers) if L.window is not None and L.window < T]
    return [(windowed[0] if windowed else 0, 0)]


@torch.no_grad()
def check_patches(eng: Any, ids: Int[Tensor, "pos"], base: "RunCache", src: "RunCache", start: int,
                  read: Sequence[int], rows: Sequence[tuple[int, int]] | None = None,
                  tol: float | None = None) -> float:
    """Patched rows as the ranking runs them (``base``'s cached prefix up to ``start``, rows joining at
    their layer, read positions only in the last layer) against the model's own forward of ``ids`` (the
    prompt of ``base``) with the head's hook_z taken from ``src`` at every position (a pre-hook on the
    attention output projection), all rows in one batch.

    Returns the largest relative difference of the logits at ``read``. Raises:
        EngineMismatch: naming the layer and head whose patched logits disagree, and the fix.
    """
    tol = tolerance(eng.dtype) if tol is None else tol
    T = int(ids.numel())
    rows = sorted(rows if rows is not None else patch_rows_to_check(eng, T))
    dh = eng.g.d_head
    entries = []
    for lay in sorted({lay for lay, _ in rows}):
        heads = [h for l2, h in rows if l2 == lay]
        z = base.z[lay, start:][None].repeat(len(heads), 1, 1)
        zs = src.z[lay, start:]
        for r, h in enumerate(heads):
            z[r, :, h * dh:(h + 1) * dh] = zs[:, h * dh:(h + 1) * dh].to(z.dtype)
        entries.append((lay, z))
    got = eng.patched_logits_multi(base, entries, start, read)
    hf = eng.hf
    hooks = []

    def edit(lay: int):
        def pre(m: torch.nn.Module, args: tuple) -> tuple:
            z = args[0].clone()
            zs = src.z[lay].to(z.device, z.dtype)
            for r, (l2, h) in enumerate(rows):
                if l2 == lay:
                    z[r, :, h * dh:(h + 1) * dh] = zs[:, h * dh:(h + 1) * dh]
            return (z, *args[1:])
        return pre

    try:
        for lay in sorted({lay for lay, _ in rows}):
            hooks.append(attention_out_module(hf, lay).register_forward_pre_hook(edit(lay)))
        with fresh_rope(hf):
            x = ids[None].to(eng.layers[0].device).expand(len(rows), -1)
            lg = hf(x, use_cache=False, **_logits_from(hf, T, min(read))).logits
            want = lg[:, torch.as_tensor(list(read), device=x.device) - (T - lg.shape[1])].float()
    finally:
        for hk in hooks:
            hk.remove()
    worst = 0.0
    for r, (lay, h) in enumerate(rows):
        d = _rel(got[r], want[r])
        worst = max(worst, d)
        if not d <= tol:
            raise EngineMismatch(
                f"the fast engine's patched run of layer {lay}, head {h} differs from {type(hf).__name__}'s own "
                f"forward with that hook_z patch by {d:.2e} (relative) over a {T}-token prompt (the cached prefix "
                f"up to position {start}, rows joining at layer {lay}; family adapter {eng.arch.family!r}, window "
                f"{eng.layers[lay].window}): {FIX}.")
    return worst
