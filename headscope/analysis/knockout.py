"""Knockout validation (SPEC.md §7, last item): ablate heads' ``hook_z`` and measure retrieval.

:func:`ablate` is a context manager that replaces the output ``hook_z`` (the per-head attention
output before the output projection, TransformerLens ``blocks.{l}.attn.hook_z``, shape
``[batch, pos, n_heads, d_head]``) of chosen (layer, head)s in every forward or ``generate`` call
made on ``LoadedModel.hf_model`` while the block is open. It is a forward-pre-hook on each
affected layer's attention output projection (:func:`headscope.arch.attention_out_module`:
``o_proj``, GPT-2 ``attn.c_proj``, GPT-NeoX ``attention.dense``, ...; its input is hook_z
flattened over heads), so it works on the plain transformers model and on a model wrapped
by the TransformerBridge alike; every hook is removed on exit, also when the block raises.

Methods:

* ``"zero"``: the head's slice is set to 0 (equivalent to deleting the head's columns of W_O);
* ``"mean"``: the slice is set to the head's mean hook_z over a reference set of prompts, averaged
  over prompts AND positions (one ``d_head`` vector per head, the same at every position; each
  token of the reference set counts once, so longer prompts weigh more);
* ``"resample"``: the slice is set to the head's hook_z on ONE other prompt (the reference),
  aligned by absolute position: a token at position ``p`` takes the reference's row ``p``;
  positions past the reference's end take its last row. ``p`` is the ``position_ids`` the model
  passes to the decoder layer (a forward-pre-hook on each ablated layer reads it), so tokens already
  in the KV cache count during cached ``generate`` and a cached generation equals an uncached one.
  Give a reference at least as long as the inputs (e.g. prompt ⊕ answer of a prompt of the same
  length) to avoid the fallback; ``AblationState.fallback_positions`` counts the positions that
  used it.

Weight processing: when the TransformerBridge's weights were processed
(``bridge.enable_compatibility_mode()``, which folds each head's value bias b_V, and a LayerNorm's
bias through W_V, into the output bias), hook_z no longer holds the head's constant share c;
``"zero"`` then sets hook_z to −c (c from before processing, recorded when ``LoadedModel.bridge``
boots; see :func:`folded_value_bias`), which is zero ablation of the original model. ``"mean"`` and ``"resample"`` references recorded on the processed model are in its basis
and need no change (b_V cancels); do not mix references recorded before and after processing.

Retrieval accuracy (:func:`retrieval_accuracy`) is greedy exact match of the needle value read
under teacher forcing (``headscope.readout.greedy_exact_match``: argmax at every answer position
equals the answer token — exactly what greedy generation of the answer span produces, one forward
per prompt). :func:`generate_answers` is the true ``generate`` path used to check that equivalence.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..arch import adapt, attention_out_module, decoder_layers, unwrap
from ..errors import HeadscopeInputError, InputTypeError
from ..models import LoadedModel, value_bias
from ..readout import greedy_exact_match
from ..tasks.base import Pair

Method = Literal["zero", "mean", "resample"]
METHODS = ("zero", "mean", "resample")
Head = tuple[int, int]
PromptLike = Pair | Tensor | Sequence[int] | str


# ---- module access ------------------------------------------------------------------------------
def o_proj_module(model: LoadedModel, layer: int) -> torch.nn.Module:
    """The attention output projection of ``layer`` (its input is hook_z flattened over heads:
    o_proj, GPT-2 attn.c_proj, GPT-NeoX attention.dense, ...), bridge wrappers removed.

    Raises:
        UnsupportedArchitecture: no known output projection (see :func:`headscope.arch.attention_out_module`).
    """
    return unwrap(attention_out_module(model.hf_model, layer))


def _layer_module(model: LoadedModel, layer: int) -> torch.nn.Module:
    return unwrap(decoder_layers(model.hf_model)[layer])


# ---- the bridge's weight processing (the value biases are read by headscope.models.value_bias) ------
def folded_value_bias(model: LoadedModel) -> dict[int, Float[Tensor, "hd"]]:
    """Per layer, the value bias that the TransformerBridge's weight processing moved out of hook_z.

    ``bridge.enable_compatibility_mode()`` / ``process_weights(fold_value_biases=True)``
    (TransformerLens 4.3) set b_O ← b_O + Σ_h W_O[:, h]·b_V[h] and b_V ← 0 (after folding the norm's
    bias into b_V): hook_z then lacks each head's constant share c[h] (:func:`headscope.models.value_bias`), which
    sits in the output bias instead. Setting hook_z of head h to −d[h], d = c before processing −
    c now, removes the share again: W_O[:, h]·(−d[h]) cancels the folded W_O[:, h]·c[h]. The c
    before processing is recorded by :attr:`LoadedModel.bridge` when it boots
    (``model.info["value_bias"]``). Empty when there is no processed bridge or nothing was folded
    (layers with d = 0 are left out).

    Raises:
        NotImplementedError: the weights were processed but c before processing is unknown (a
            bridge booted outside ``LoadedModel.bridge``) and the model may have value or norm
            biases; the message names the fixes.
    """
    b = model._bridge
    if b is None or not getattr(b, "_weights_processed", False):
        return {}
    raw = model.info.get("value_bias")
    if raw is not None:
        now = value_bias(b, model.geometry.n_heads)
        d = {l: (raw[l] - now[l]) for l in raw}
        return {l: v for l, v in d.items() if bool(v.abs().max() > 0)}
    try:
        if all(p.v.bias is None and not isinstance(getattr(p.ln1, "bias", None), Tensor)
               for p in adapt(model.hf_model).layers):
            return {}  # no value bias and no norm bias anywhere: nothing was folded
    except NotImplementedError:
        pass
    raise NotImplementedError(
        "zero ablation on a TransformerBridge whose weights were processed: fold_value_biases moved every "
        "head's value bias into the output bias, so zeroing hook_z would keep the head's bias share, and "
        "headscope does not know the biases from before processing. Boot the bridge through "
        "LoadedModel.bridge before processing (it records them), or process with "
        "enable_compatibility_mode(fold_value_biases=False) (or no_processing=True), or ablate on the "
        "unprocessed model"
    )


def normalize_heads(model: LoadedModel, heads: Any) -> list[Head]:
    """Sorted unique (layer, head) tuples; accepts pairs, a DataFrame with layer/head columns, or a
    ``HeadMask``-like object with ``.fa_heads`` (``{layer: [heads]}``).

    Raises:
        HeadscopeInputError (a ValueError): a layer or head index outside the model's geometry, or
            ``heads`` in none of the accepted forms.
    """
    if hasattr(heads, "fa_heads") and hasattr(heads, "heads"):  # a HeadMask
        heads = dict(enumerate(heads.fa_heads))
    try:
        if hasattr(heads, "columns") and {"layer", "head"} <= set(heads.columns):
            items = list(zip(heads["layer"].astype(int), heads["head"].astype(int)))
        elif isinstance(heads, dict):
            items = [(int(l), int(h)) for l, hs in heads.items() for h in hs]
        else:
            items = [(int(l), int(h)) for l, h in heads]
    except (TypeError, ValueError):
        raise HeadscopeInputError(
            f"heads {heads!r:.80} are not (layer, head) pairs; pass [(layer, head), ...], a DataFrame with layer/head "
            "columns, {layer: [heads]} or a HeadMask"
        ) from None
    g = model.geometry
    bad = [(l, h) for l, h in items if not (0 <= l < g.n_layers and 0 <= h < g.n_heads)]
    if bad:
        raise HeadscopeInputError(f"heads {bad} outside the model ({g.n_layers} layers x {g.n_heads} heads); indices start at 0")
    return sorted(set(items))


def _as_ids(model: LoadedModel, p: PromptLike) -> Int[Tensor, "pos"]:
    if isinstance(p, Pair):
        return p.clean
    if isinstance(p, str):
        return torch.tensor(model.tokenizer(p, add_special_tokens=True)["input_ids"])
    return torch.as_tensor(p, dtype=torch.long).flatten()


# ---- references --------------------------------------------------------------------------------
@torch.no_grad()
def record_z(model: LoadedModel, ids: Int[Tensor, "pos"], layers: Sequence[int]) -> dict[int, Float[Tensor, "pos hd"]]:
    """hook_z (flattened over heads) of the given layers on one prompt, from an un-ablated forward."""
    store: dict[int, Tensor] = {}
    handles = []
    for layer in sorted(set(layers)):
        def hook(_mod: Any, args: tuple, layer: int = layer) -> None:
            store[layer] = args[0][0].detach().clone()

        handles.append(o_proj_module(model, layer).register_forward_pre_hook(hook))
    try:
        model.hf_model(ids.to(model.device)[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return store


def mean_reference(
    model: LoadedModel, prompts: Sequence[PromptLike], layers: Sequence[int]
) -> dict[int, Float[Tensor, "hd"]]:
    """Mean hook_z per layer (flattened heads) over all positions of all ``prompts``.

    Each token counts once (mean over prompts and positions pooled). For ``Pair`` inputs the clean
    prompt is used. Raises ValueError for an empty reference set.
    """
    if len(prompts) == 0:
        raise ValueError("mean ablation needs a non-empty reference set of prompts (reference=[...])")
    sums: dict[int, Tensor] = {}
    n = 0
    for p in prompts:
        ids = _as_ids(model, p)
        z = record_z(model, ids, layers)
        for layer, zl in z.items():
            s = zl.double().sum(0)
            sums[layer] = sums[layer] + s if layer in sums else s
        n += ids.numel()
    return {layer: (s / n).to(model.dtype) for layer, s in sums.items()}


def resample_reference(model: LoadedModel, prompt: PromptLike, layers: Sequence[int]) -> dict[int, Tensor]:
    """hook_z of every given layer on one reference prompt (for a Pair: clean ⊕ answer[:-1])."""
    if isinstance(prompt, Pair):
        ids = torch.cat([prompt.clean, prompt.answer[:-1]])
    else:
        ids = _as_ids(model, prompt)
    return record_z(model, ids, layers)


@dataclass
class AblationState:
    """What an open :func:`ablate` block did: calls seen and positions that used the resample fallback."""

    heads: list[Head]
    method: str
    calls: int = 0
    fallback_positions: int = 0
    values: dict[int, Tensor] = field(default_factory=dict, repr=False)


@contextlib.contextmanager
def ablate(
    model: LoadedModel,
    heads: Any,
    method: Method = "zero",
    reference: Any = None,
) -> Iterator[AblationState]:
    """Ablate ``hook_z`` of ``heads`` in every forward / ``generate`` call on ``model.hf_model``.

    Args:
        model: a :class:`~headscope.models.LoadedModel` (bridged or not).
        heads: (layer, head) pairs, a DataFrame with ``layer``/``head`` columns, or ``{layer: [heads]}``.
        method: ``"zero"``, ``"mean"`` or ``"resample"`` (see the module docstring).
        reference: for ``"mean"`` a sequence of prompts (token tensors, strings or Pairs) or a ready
            ``{layer: Float[Tensor, "n_heads*d_head"]}`` from :func:`mean_reference`; for
            ``"resample"`` one prompt or a ready ``{layer: Float[Tensor, "pos n_heads*d_head"]}``.

    Yields:
        AblationState (calls made, resample fallback count).

    Raises (before any hook is installed or reference computed):
        InputTypeError: ``model`` is not a LoadedModel.
        HeadscopeInputError (a ValueError): unknown method, a missing or empty reference, a list of
            prompts as the ``"resample"`` reference, heads outside the model.
        NotImplementedError: ``"zero"`` on a bridge whose weights were processed without a record of
            the value biases from before (see :func:`folded_value_bias`).
        RuntimeError: (inside the block) ``"resample"`` when a decoder layer is called without
            ``position_ids`` / ``cache_position``.
    """
    if not isinstance(model, LoadedModel):
        raise InputTypeError(f"ablate needs a LoadedModel (headscope.load_model(...)), not {type(model).__name__}")
    if method not in METHODS:
        raise HeadscopeInputError(f"unknown ablation method {method!r}; use one of {METHODS}")
    hs = normalize_heads(model, heads)
    if method != "zero" and reference is not None and not isinstance(reference, dict):
        if method == "mean" and (isinstance(reference, (str, Pair)) or len(reference) == 0):
            raise HeadscopeInputError("mean ablation needs a non-empty list of reference prompts (reference=[...])")
        if method == "resample" and isinstance(reference, (list, tuple)) and reference and not isinstance(reference[0], int):
            raise HeadscopeInputError("resample ablation takes ONE reference prompt (a Pair, a string or token ids), "
                                      "not a list of prompts")
    layers = sorted({l for l, _ in hs})
    dh = model.geometry.d_head
    values: dict[int, Tensor] = {}
    if method != "zero":
        if reference is None:
            raise HeadscopeInputError(f"{method} ablation needs reference=: prompts (mean) or one prompt (resample)")
        if isinstance(reference, dict):
            values = {int(k): v for k, v in reference.items()}
        elif method == "mean":
            values = mean_reference(model, list(reference), layers)
        else:
            values = resample_reference(model, reference, layers)
        missing = [l for l in layers if l not in values]
        if missing:
            raise HeadscopeInputError(f"reference has no hook_z for layers {missing}; recompute it for these heads")
    fold = folded_value_bias(model) if method == "zero" else {}
    state = AblationState(hs, method, values=values)
    by_layer: dict[int, list[int]] = {}
    for l, h in hs:
        by_layer.setdefault(l, []).append(h)
    positions: dict[int, Tensor] = {}

    def layer_hook(layer: int):
        def hook(_mod: Any, args: tuple, kwargs: dict) -> None:
            # absolute positions of this call's tokens as the model itself uses them (tokens already
            # in the KV cache counted): every supported decoder passes position_ids to its layers
            pos = kwargs.get("position_ids")
            if pos is None:
                pos = kwargs.get("cache_position")
            if layer == layers[0]:
                state.calls += 1
            if pos is None:
                if method != "resample":
                    return
                raise RuntimeError(
                    f"layer {layer} was called without position_ids or cache_position; position-indexed "
                    "(resample) ablation needs them: call the model, not the layer, or use method='zero'/'mean'"
                )
            pos = pos[0] if pos.dim() == 3 else pos  # multimodal rope: [3, batch, pos], first row = text
            positions[layer] = pos if pos.dim() == 2 else pos[None]

        return hook

    def make_hook(layer: int):
        cols = torch.cat([torch.arange(h * dh, (h + 1) * dh) for h in by_layer[layer]])

        def hook(_mod: Any, args: tuple) -> tuple:
            z = args[0].clone()
            cols_d = cols.to(z.device)
            if method == "zero":
                z[..., cols_d] = 0 if layer not in fold else -fold[layer].to(z.device, z.dtype)[cols_d]
            elif method == "mean":
                z[..., cols_d] = values[layer].to(z.device, z.dtype)[cols_d]
            else:
                ref = values[layer]
                pos = positions.pop(layer).to(ref.device).clamp(min=0)  # [batch or 1, pos]
                over = pos >= ref.shape[0]
                if layer == layers[0]:
                    state.fallback_positions += int(over.sum()) * (z.shape[0] // pos.shape[0])
                rows = ref[pos.clamp(max=ref.shape[0] - 1)].to(z.device, z.dtype)  # [batch or 1, pos, hd]
                z[..., cols_d] = rows[..., cols_d].expand(z.shape[0], -1, -1)
            return (z,) + tuple(args[1:])

        return hook

    handles = []
    try:
        for layer in layers:
            handles.append(_layer_module(model, layer).register_forward_pre_hook(layer_hook(layer), with_kwargs=True))
            handles.append(o_proj_module(model, layer).register_forward_pre_hook(make_hook(layer)))
        yield state
    finally:
        for h in handles:
            h.remove()


# ---- retrieval accuracy --------------------------------------------------------------------------
@torch.no_grad()
def answer_logits(
    model: LoadedModel, pairs: Sequence[Pair], batch_size: int = 16
) -> list[Float[Tensor, "ans vocab"]]:
    """Teacher-forced logits at the answer positions of each pair's clean prompt ⊕ a⁺[:-1].

    Pairs of equal total length run together in batches of ``batch_size``; only the last |a⁺|
    positions are unembedded (``logits_to_keep``).
    """
    seqs = [torch.cat([p.clean, p.answer[:-1]]) for p in pairs]
    out: list[Tensor | None] = [None] * len(pairs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (s, p) in enumerate(zip(seqs, pairs)):
        groups.setdefault((s.numel(), p.n_answer), []).append(i)
    for (_, n_ans), idx in groups.items():
        for b in range(0, len(idx), batch_size):
            chunk = idx[b : b + batch_size]
            ids = torch.stack([seqs[i] for i in chunk]).to(model.device)
            logits = model.hf_model(ids, use_cache=False, logits_to_keep=n_ans).logits
            for j, i in enumerate(chunk):
                out[i] = logits[j, -n_ans:].float().cpu()
    return out  # type: ignore[return-value]


def retrieval_correct(model: LoadedModel, pairs: Sequence[Pair], batch_size: int = 16) -> Bool[Tensor, "pair"]:
    """Greedy exact match of the needle value per pair (teacher-forced, see module docstring).

    Call inside :func:`ablate` to measure accuracy under ablation.
    """
    logits = answer_logits(model, pairs, batch_size=batch_size)
    return torch.stack([greedy_exact_match(lg, p.answer) for lg, p in zip(logits, pairs)])


def retrieval_accuracy(model: LoadedModel, pairs: Sequence[Pair], batch_size: int = 16) -> float:
    """Fraction of pairs whose needle value greedy decoding reproduces exactly (0..1)."""
    if len(pairs) == 0:
        raise ValueError("retrieval_accuracy needs at least one prompt")
    return float(retrieval_correct(model, pairs, batch_size=batch_size).float().mean())


@torch.no_grad()
def generate_answers(model: LoadedModel, pairs: Sequence[Pair]) -> list[Int[Tensor, "ans"]]:
    """The true ``generate`` path: greedy decoding of |a⁺| new tokens after each clean prompt.

    Uses the KV cache on a plain model and ``use_cache=False`` once the TransformerBridge is booted
    (cached generation is broken on bridged models, see HELPERS/models).
    """
    use_cache = model._bridge is None
    out = []
    for p in pairs:
        ids = p.clean.to(model.device)[None]
        gen = model.hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=p.n_answer,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=model.tokenizer.pad_token_id,
        )
        out.append(gen[0, ids.shape[1] :].cpu())
    return out


def generate_correct(model: LoadedModel, pairs: Sequence[Pair]) -> Bool[Tensor, "pair"]:
    """Exact match of generated answers against a⁺ (slow reference for :func:`retrieval_correct`)."""
    gens = generate_answers(model, pairs)
    return torch.tensor([g.numel() == p.n_answer and bool((g == p.answer).all()) for g, p in zip(gens, pairs)])


__all__ = [
    "ablate",
    "AblationState",
    "mean_reference",
    "resample_reference",
    "record_z",
    "normalize_heads",
    "o_proj_module",
    "folded_value_bias",
    "answer_logits",
    "retrieval_correct",
    "retrieval_accuracy",
    "generate_answers",
    "generate_correct",
    "METHODS",
]
