"""Direct logit attribution of every head (figure 2a) and the clean-vs-corrupted layer-output cosine
matrix (figure 2b) (SPEC.md §7; paper §5.7). Re-exported by :mod:`headscope.analysis.anatomy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from ..readout import DEFAULT_LAMBDA, logit_diff, span_weights

# ---- direct logit attribution (figure 2a) -------------------------------------------------------
@dataclass
class DLA:
    """Direct logit attribution of one or more pairs.

    heads: Float[Tensor, "pair layer head"], each head's direct contribution to m (logits).
    other: Float[Tensor, "pair component"], the remaining components in ``components`` order
        (embed, then per layer the o_proj bias when it has one, then mlp.{l}).
    total: Float[Tensor, "pair"], m computed from the final residual with the frozen norm scale
        (equals heads.sum + other.sum).
    m: Float[Tensor, "pair"], m from the model's own logits.
    """

    heads: Tensor
    other: Tensor
    components: list[str]
    total: Tensor
    m: Tensor

    @property
    def mean(self) -> Float[np.ndarray, "layer head"]:
        return self.heads.mean(0).numpy()


def _frozen_norm(norm: Any, h: Tensor) -> tuple[Callable[[Tensor], Tensor], Tensor | None]:
    """A norm linearized at the run's activations ``h`` [n, d] (its scale frozen, the standard DLA
    convention): returns (the linear map applied to a component [n, d] or [..., n, d], the norm's
    constant bias or None). RMSNorm (Llama ``w·x·s``, Gemma ``(1+w)·x·s``) and LayerNorm
    (``w·(x − mean x)·s + b``) are supported.

    Raises:
        NotImplementedError: another kind of norm.
    """
    if norm is None:
        return (lambda c: c), None
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    hd = h.double()
    if isinstance(norm, torch.nn.LayerNorm):
        mu = hd.mean(-1, keepdim=True)
        s = torch.rsqrt((hd - mu).pow(2).mean(-1, keepdim=True) + norm.eps)
        gain = w.double() if w is not None else torch.ones_like(hd[0])
        return (lambda c: (c.double() - c.double().mean(-1, keepdim=True)) * s * gain), (
            None if norm.bias is None else norm.bias.double())
    if w is None or eps is None or "RMSNorm" not in type(norm).__name__:
        raise NotImplementedError(f"DLA needs an RMSNorm or LayerNorm, got {type(norm).__name__}")
    gain = (1.0 + w.double()) if "Gemma" in type(norm).__name__ else w.double()
    s = torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + float(eps))
    return (lambda c: c.double() * s * gain), None


@torch.no_grad()
def direct_logit_attribution(
    model: Any, pairs: Sequence[Any], lam: float = DEFAULT_LAMBDA, run: Literal["clean", "corrupted"] = "clean"
) -> DLA:
    """Each head's direct contribution to the λ-weighted logit difference m (eq. 9), figure 2a.

    For read position j the final residual is h_j = embed + Σ_l (attention branch + MLP branch of
    layer l), and the attention branch is Σ_h W_O^{l,h} z^{l,h}_j + b_O^l (times Granite's residual
    multiplier; through Gemma's / OLMo 2's post-attention norm). Every norm on the path (the final
    norm, post-attention norms) is linearized by freezing its scale to the value of the run being
    attributed (standard DLA convention), so the attributions add up exactly to m of that run. A
    component c then contributes Σ_j w_j N_j(c_j) · (W_U[a⁺_j] − W_U[a⁻_j]) / divisor, w_j = λ^j/Σλ^j,
    N_j the frozen final norm. With final-logit soft-capping (Gemma 2/3) the attribution is of the
    logits before the cap (``total`` then differs from ``m``).

    Args:
        model: a LoadedModel with a fast-engine adapter.
        pairs: calibration pairs.
        lam: λ of eq. 9; run: attribute the clean run (default) or the corrupted one.

    Returns:
        :class:`DLA` (heads [pair, layer, head] in logits).

    Raises:
        NotImplementedError: a norm other than RMSNorm / LayerNorm on the path.
    """
    from ..patching.engine import Engine, head_slice
    from ..patching.hybrid_engine import is_hybrid
    from ..patching.receivers import sequences

    if is_hybrid(model.hf_model):
        return _hybrid_dla(model, pairs, lam, run)
    eng = Engine(model)
    g = eng.g
    WU = eng.arch.lm_head.weight  # [vocab, d_model]
    ub = eng.arch.lm_head.bias
    div = eng.arch.logit_divisor
    heads_all, other_all, total_all, m_all = [], [], [], []
    names: list[str] = []
    for pair in pairs:
        clean, corr, read = sequences(pair)
        cache = eng.run(clean if run == "clean" else corr, read)
        ridx = torch.as_tensor(read, device=eng.device)
        w = span_weights(len(read), lam).to(eng.device).double()
        u = (WU[pair.answer.to(eng.device)] - WU[pair.counter_answer.to(eng.device)]).double()  # [ans, d]
        comps: list[tuple[str, Tensor]] = [("embed", cache.resid[0, ridx].double())]
        head_c = torch.empty(g.n_layers, g.n_heads, len(read), g.d_model, dtype=torch.float64, device=eng.device)
        h = None
        for layer in range(g.n_layers):
            L = eng.layers[layer]
            h_in = cache.resid[layer, ridx]
            z = cache.z[layer, ridx]  # [ans, H*dh]
            Wo, bo = L.o.weight, L.o.bias
            o_full = eng.lin(L.o, z)
            post, post_b = _frozen_norm(L.post_attn_norm, o_full)
            rm = L.residual_multiplier
            for hd in range(g.n_heads):
                sl = head_slice(hd, g.d_head)
                head_c[layer, hd] = post(z[:, sl] @ Wo[:, sl].T) * rm
            if bo is not None:
                comps.append((f"attn_bias.{layer}", post(bo.expand_as(o_full)) * rm))
            if post_b is not None:
                comps.append((f"attn_norm_bias.{layer}", post_b.expand_as(o_full) * rm))
            attn = eng.attn_write(layer, z)
            mid = h_in + attn
            mlp = eng.mlp_write(layer, h_in if L.parallel else mid)
            comps.append((f"mlp.{layer}", mlp.double()))
            h = mid + mlp
        assert h is not None
        fin, fin_b = _frozen_norm(eng.arch.final_norm, h)
        if fin_b is not None:
            comps.append(("final_norm_bias", fin_b.expand_as(h)))
        if ub is not None:
            comps.append(("unembed_bias", torch.zeros_like(h, dtype=torch.float64)))

        def contrib(c: Tensor, normed: bool = False) -> Tensor:
            x = c if normed else fin(c)
            return ((x * u).sum(-1) * w).sum(-1) / div

        heads_all.append(contrib(head_c).cpu())
        names = [n for n, _ in comps]
        vals = [contrib(c, normed=n == "final_norm_bias") for n, c in comps]
        if ub is not None:  # the unembedding bias adds b[a+] - b[a-] at every read position
            vals[-1] = ((ub[pair.answer.to(ub.device)] - ub[pair.counter_answer.to(ub.device)]).double() * w).sum() / div
        other_all.append(torch.stack(vals).cpu())
        total = contrib(h)
        if fin_b is not None:
            total = total + contrib(fin_b.expand_as(h), normed=True)
        if ub is not None:
            total = total + vals[-1]
        total_all.append(total.cpu())
        m_all.append(logit_diff(cache.logits, pair.answer, pair.counter_answer, lam).cpu())
    return DLA(torch.stack(heads_all), torch.stack(other_all), names, torch.stack(total_all), torch.stack(m_all))


# ---- layer-output cosine similarity (figure 2b) ------------------------------------------------
@torch.no_grad()
def layer_cosine(model: Any, pairs: Sequence[Any]) -> Float[np.ndarray, "layer layer"]:
    """Cosine similarity between layer outputs of the clean and the corrupted run, across depth.

    C[l, l'] = cos( h_clean^{(l)}, h_corrupted^{(l')} ) where h^{(l)} is the residual stream after
    layer l (the layer's output) at the answer-reading positions (:func:`read_positions`); the
    cosine is averaged over read positions and pairs. The diagonal shows where along depth the
    corrupted run's representation departs from the clean one; off-diagonal entries show how
    similar outputs of different depths are.

    Returns:
        Float[ndarray, "layer layer"] (rows: clean layer, columns: corrupted layer).
    """
    from ..patching.engine import Engine
    from ..patching.hybrid_engine import is_hybrid
    from ..patching.receivers import sequences

    if is_hybrid(model.hf_model):
        return _hybrid_cosine(model, pairs)
    eng = Engine(model)
    g = eng.g
    acc = np.zeros((g.n_layers, g.n_layers))
    n = 0
    for pair in pairs:
        clean, corr, read = sequences(pair)
        ridx = torch.as_tensor(read, device=eng.device)
        outs = []
        for seq in (clean, corr):
            cache = eng.run(seq, read)
            last = eng.post_attn(g.n_layers - 1, cache.resid[-1, ridx][None], cache.z[-1, ridx][None])[0]
            outs.append(torch.cat([cache.resid[1:, ridx], last[None]]).double())  # [layer, ans, d]
        a = torch.nn.functional.normalize(outs[0], dim=-1)
        b = torch.nn.functional.normalize(outs[1], dim=-1)
        acc += torch.einsum("lad,mad->lm", a, b).cpu().numpy() / len(read)
        n += 1
    if n == 0:
        raise ValueError("layer_cosine needs at least one pair")
    return acc / n


# ---- a converted model (head-wise FA/GDN hybrid): the same quantities read through hooks ---------------------
#: decoder-layer norms that act on the attention output before it joins the residual (Gemma's sandwich): a hybrid
#: with one of them has no per-head DLA here
_POST_ATTENTION_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


@torch.no_grad()
def _hybrid_capture(hf: Any, ids: Tensor, read: Sequence[int]) -> dict[str, Any]:
    """One forward of a hybrid with hooks: at the read positions, the input of every layer's ``o_proj`` (its ``hook_z``,
    each head's fused output in the head's slot), the embedding (layer 0's input), every MLP's output, every decoder
    layer's output, the final norm's input, and the logits. Hooking ``o_proj`` sends each layer to the reference
    forward (as the hybrid patching engine does)."""
    from ..hybrid.modeling_hybrid import attention_name, decoder_layers

    layers = list(decoder_layers(hf))
    dev = next(hf.parameters()).device
    ridx = torch.as_tensor(list(read), device=dev)
    got: dict[str, Any] = {"z": {}, "mlp": {}, "out": {}}

    def hidden(args: tuple, kwargs: dict) -> Tensor:
        return args[0] if args else kwargs["hidden_states"]

    hooks = [layers[0].register_forward_pre_hook(
        lambda m, a, k: got.__setitem__("embed", hidden(a, k)[0, ridx].detach()), with_kwargs=True)]
    for i, layer in enumerate(layers):
        attn = getattr(layer, attention_name(layer))
        hooks.append(attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: got["z"].__setitem__(i, a[0][0, ridx].detach())))
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, o, i=i: got["mlp"].__setitem__(i, o[0, ridx].detach())))
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, i=i: got["out"].__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0, ridx].detach())))
    norm = _final_norm(hf)
    hooks.append(norm.register_forward_pre_hook(lambda m, a: got.__setitem__("final", a[0][0, ridx].detach())))
    try:
        got["logits"] = hf(input_ids=ids[None].to(dev), use_cache=False).logits[0, ridx].float()
    finally:
        for h in hooks:
            h.remove()
    return got


def _final_norm(hf: Any) -> Any:
    body = hf.base_model
    for name in ("norm", "final_layer_norm"):
        if isinstance(getattr(body, name, None), torch.nn.Module):
            return getattr(body, name)
    raise NotImplementedError(f"no final norm found in {type(hf).__name__}")


def _hybrid_dla(model: Any, pairs: Sequence[Any], lam: float, run: str) -> DLA:
    """:func:`direct_logit_attribution` of a converted model (:func:`headscope.hybridize`): each head's columns of the
    ``o_proj`` input (its fused output) times its columns of ``o_proj``, through the final norm frozen at the run's
    residual; components embed, the ``o_proj`` bias, every MLP. Families whose attention output joins the residual
    directly (Llama / SmolLM2, Qwen2, Qwen3, Mistral, GPT-NeoX).

    Raises:
        InputNotImplementedError: a hybrid whose layers norm the attention output (Gemma 3) or soft-cap the logits.
    """
    from ..errors import InputNotImplementedError
    from ..hybrid.modeling_hybrid import attention_name, decoder_layers
    from ..patching.engine import head_slice
    from ..patching.receivers import sequences

    hf = model.hf_model
    layers = list(decoder_layers(hf))
    if any(hasattr(layer, n) for layer in layers for n in _POST_ATTENTION_NORMS) or getattr(hf.config, "final_logit_softcapping", None):
        raise InputNotImplementedError(f"DLA of a converted {type(hf).__name__} (post-attention norms or logit soft-cap) is "
                                       "not implemented; run anatomy with --no-model")
    g = model.geometry
    WU = hf.get_output_embeddings().weight
    fin_norm = _final_norm(hf)
    heads_all, other_all, total_all, m_all = [], [], [], []
    names: list[str] = []
    for pair in pairs:
        clean, corr, read = sequences(pair)
        cap = _hybrid_capture(hf, clean if run == "clean" else corr, read)
        dev = cap["final"].device
        w = span_weights(len(read), lam).to(dev).double()
        u = (WU[pair.answer.to(WU.device)] - WU[pair.counter_answer.to(WU.device)]).double().to(dev)
        fin, fin_b = _frozen_norm(fin_norm, cap["final"])

        def contrib(c: Tensor, normed: bool = False) -> Tensor:
            x = c if normed else fin(c)
            return ((x * u).sum(-1) * w).sum(-1)

        head_c = torch.empty(g.n_layers, g.n_heads, len(read), g.d_model, dtype=torch.float64, device=dev)
        comps: list[tuple[str, Tensor]] = [("embed", cap["embed"].double())]
        for layer_i, layer in enumerate(layers):
            o = getattr(layer, attention_name(layer)).o_proj
            z = cap["z"][layer_i].double()
            Wo = o.weight.double()
            for hd in range(g.n_heads):
                sl = head_slice(hd, g.d_head)
                head_c[layer_i, hd] = z[:, sl] @ Wo[:, sl].T
            if o.bias is not None:
                comps.append((f"attn_bias.{layer_i}", o.bias.double().expand(len(read), -1)))
            comps.append((f"mlp.{layer_i}", cap["mlp"][layer_i].double()))
        if fin_b is not None:
            comps.append(("final_norm_bias", fin_b.expand_as(cap["final"])))
        heads_all.append(contrib(head_c).cpu())
        names = [n for n, _ in comps]
        other_all.append(torch.stack([contrib(c, normed=n == "final_norm_bias") for n, c in comps]).cpu())
        total = contrib(cap["final"].double())
        if fin_b is not None:
            total = total + contrib(fin_b.expand_as(cap["final"]), normed=True)
        total_all.append(total.cpu())
        m_all.append(logit_diff(cap["logits"], pair.answer.to(dev), pair.counter_answer.to(dev), lam).cpu())
    return DLA(torch.stack(heads_all), torch.stack(other_all), names, torch.stack(total_all), torch.stack(m_all))


def _hybrid_cosine(model: Any, pairs: Sequence[Any]) -> Float[np.ndarray, "layer layer"]:
    """:func:`layer_cosine` of a converted model: every decoder layer's output at the read positions, clean against
    corrupted, read with forward hooks."""
    from ..patching.receivers import sequences

    n_layers = model.geometry.n_layers
    acc = np.zeros((n_layers, n_layers))
    for pair in pairs:
        clean, corr, read = sequences(pair)
        outs = []
        for seq in (clean, corr):
            cap = _hybrid_capture(model.hf_model, seq, read)
            outs.append(torch.stack([cap["out"][i] for i in range(n_layers)]).double())  # [layer, ans, d]
        a = torch.nn.functional.normalize(outs[0], dim=-1)
        b = torch.nn.functional.normalize(outs[1], dim=-1)
        acc += torch.einsum("lad,mad->lm", a, b).cpu().numpy() / len(read)
    if not len(pairs):
        raise ValueError("layer_cosine needs at least one pair")
    return acc / len(pairs)
