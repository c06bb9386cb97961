"""Architecture adapters: what each decoder-only family varies, read from its config and modules.

``adapt(hf_model)`` returns the typed per-layer parts the fast patching engine runs
(:class:`~headscope.arch.parts.Arch`); ``attention_out_module`` finds the module whose input is
``hook_z`` (for knockout hooks) in any supported layout. Families without an adapter run through
the TransformerLens bridge's hooks (:mod:`headscope.patching.generic`).
"""

from __future__ import annotations

from torch import nn

from .families import ADAPTERS
from .parts import Arch, LayerParts, Proj, Rope, rotate, softcap, unwrap

__all__ = ["ADAPTERS", "Arch", "LayerParts", "Proj", "Rope", "UnsupportedArchitecture", "adapt",
           "attention_out_module", "decoder_layers", "rotate", "softcap", "unwrap", "model_type"]


class UnsupportedArchitecture(NotImplementedError):
    """No fast-engine adapter covers this model (use the generic bridge path)."""


def model_type(hf_model: nn.Module) -> str:
    return str(getattr(hf_model.config, "model_type", ""))


def adapt(hf_model: nn.Module) -> Arch:
    """The model's :class:`Arch` from its family's adapter.

    Raises:
        UnsupportedArchitecture: no adapter for ``config.model_type``, or a variant the adapter
            cannot express (the message says which); ``path="generic"`` runs such models.
    """
    mtype = model_type(hf_model)
    fn = ADAPTERS.get(mtype)
    if fn is None:
        raise UnsupportedArchitecture(
            f"no fast-engine adapter for model type {mtype!r} (adapters: {sorted(ADAPTERS)}); "
            "pass path='generic' (CLI --path generic) to patch it through the TransformerLens bridge's hooks"
        )
    try:
        return fn(hf_model)
    except NotImplementedError as e:
        raise UnsupportedArchitecture(f"{mtype}: {e}") from e


def decoder_layers(hf_model: nn.Module) -> list[nn.Module]:
    """The decoder layers (transformers modules, bridge wrappers looked through), in order.

    Raises:
        UnsupportedArchitecture: no known layer list (``model.layers``, ``transformer.h``, ``gpt_neox.layers``).
    """
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = hf_model
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if obj is not None:
            return [unwrap(b) for b in obj]
    raise UnsupportedArchitecture(f"cannot find the decoder layers of {type(hf_model).__name__}")


_OUT_NAMES = (("self_attn", "o_proj"), ("attn", "c_proj"), ("attention", "dense"), ("self_attn", "out_proj"),
              ("self_attn", "dense"), ("attn", "out_proj"))


def attention_out_module(hf_model: nn.Module, layer: int) -> nn.Module:
    """The attention output projection of ``layer``: its input is hook_z flattened over heads
    (``[batch, pos, n_heads * d_head]``), so a forward-pre-hook on it edits hook_z.

    Raises:
        UnsupportedArchitecture: the layer has none of the known attribute names.
    """
    blk = decoder_layers(hf_model)[layer]
    for a_name, o_name in _OUT_NAMES:
        a = unwrap(getattr(blk, a_name, None))
        o = getattr(a, o_name, None) if a is not None else None
        if isinstance(o, nn.Module):
            return unwrap(o)
    raise UnsupportedArchitecture(f"cannot find the attention output projection of layer {layer} "
                                  f"({type(blk).__name__})")
