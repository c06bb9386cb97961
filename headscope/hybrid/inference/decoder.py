"""Whole-model prefill and decode steps of a hybrid model (Llama-form, Gemma 3 or GPT-NeoX decoder layers) through
its per-layer caches.

:class:`StaticDecoder` runs the decoder layers itself, every attention layer on the lean backends; ``generate``'s
decode steps replay its :meth:`StaticDecoder.step_replayed` (the ``graph`` backend, ``model_step.py``). Driven
directly (benchmarks, tests): ``dec = StaticDecoder(model, batch, max_len)``, ``dec.prefill(ids)`` (fills the caches,
logits of the last position), ``dec.step(next_ids)``; ``capture()`` / ``replay()`` record and re-run one step at a
fixed length, ``prefill_graphed(ids)`` replays a recorded prefill for every batch of ids' shape.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...arch.residual import after_attention as _post
from ..modeling_hybrid import attention_name
from .graphs import capture as _capture
from .inference_config import InferenceConfig, inference_config, use_inference
from .forward import DeferredOutput, DevicePosition, applies as _lean_applies, decode_step, plan as _plan
from .kernels.layer_tail import MAX_ROWS as _TAIL_ROWS, applies as _tail_applies, layer_tail


def _compile(fn: Any, cfg: InferenceConfig) -> Any:
    """``torch.compile`` of a tail function (``cfg.tail_backend``, ``cfg.tail_mode``)."""
    return torch.compile(fn, backend=cfg.tail_backend, fullgraph=True, mode=cfg.tail_mode)


def _pre(layer: Any, h: Tensor) -> Tensor:
    return layer.input_layernorm(h)


def _embed(base: Any, ids: Tensor, pos: Tensor) -> tuple:
    """A step's start: the tokens' embeddings [batch, T, hidden] (the module's own scale: Gemma 3's √hidden) and the
    rotary embedding's (cos, sin), or per layer type a dict of them (Gemma 3: a RoPE base per layer type)."""
    h, rot = base.get_input_embeddings()(ids), base.rotary_emb
    types = getattr(rot, "layer_types", None)
    return h, ({t: rot(h, pos, t) for t in types} if types else rot(h, pos))


def _head(model: Any, h: Tensor) -> Tensor:
    """A step's end: logits [batch, T, vocab] = lm_head(final norm(h)), soft-capped as the model's
    ``final_logit_softcapping`` says (Gemma: c · tanh(logits / c))."""
    base = model.base_model
    logits = model.lm_head((base.norm if hasattr(base, "norm") else base.final_layer_norm)(h))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _post_fused(layer: Any, nxt: Any, h: Tensor, a: Tensor, W_gu: Optional[Tensor], b_gu: Optional[Tensor]) -> tuple:
    """``_post`` with the gated MLP's gate and up projections as one GEMM (``W_gu`` = [gate; up] rows; None: the
    two projections), and the next layer's input norm (``nxt``; None after the last layer) in the same call:
    (h, next layer's input)."""
    h = h + a
    x = layer.post_attention_layernorm(h)
    if W_gu is None:
        g, u = layer.mlp.gate_proj(x), layer.mlp.up_proj(x)
    else:
        g, u = F.linear(x, W_gu, b_gu).chunk(2, dim=-1)
    dn = layer.mlp.down_proj
    h = h + F.linear(layer.mlp.act_fn(g) * u, dn.weight, dn.bias)
    return h, (nxt.input_layernorm(h) if nxt is not None else None)


def _graphable(dev: torch.device) -> bool:
    """Whether :meth:`StaticDecoder.step_replayed` captures its step in a CUDA graph on ``dev`` (tests emulate it)."""
    return dev.type == "cuda"


def _norm_params(m: Any) -> Optional[tuple]:
    """An RMSNorm module's (weight, ε), or None when it has no weight or ε attribute."""
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return None if eps is None or getattr(m, "weight", None) is None else (m.weight, float(eps))


def _version(p: Tensor) -> int:
    """A tensor's version counter (-1 for inference-mode tensors, which have none)."""
    try:
        return p._version
    except RuntimeError:
        return -1


def _hooked(layer: Any) -> bool:
    """Whether any module the fused tail would bypass (norms, MLP and its projections) has forward hooks."""
    mods = [layer.post_attention_layernorm, layer.input_layernorm, layer.mlp, layer.mlp.gate_proj, layer.mlp.up_proj,
            layer.mlp.down_proj]
    return any(m._forward_hooks or m._forward_pre_hooks for m in mods)


def _gated_mlp(layer: Any) -> bool:
    """Whether a decoder layer's MLP has the gated form down(act(gate(x)) · up(x)) that ``_post_fused`` computes
    (Llama / Qwen3 / Mistral ``*MLP``: linear gate_proj, up_proj, down_proj and an act_fn); checked numerically
    against the module's own forward before use (:meth:`StaticDecoder._fused_tail_ok`)."""
    m = getattr(layer, "mlp", None)
    return (m is not None and not hasattr(layer, "pre_feedforward_layernorm")  # Gemma 3's sandwich norms: not this
            and all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and callable(getattr(m, "act_fn", None)) and hasattr(layer, "post_attention_layernorm")
            and hasattr(layer, "input_layernorm"))


class StaticDecoder:
    """Prefill / decode a hybrid model (every decoder layer's attention a HeadwiseHybridAttention): Llama-form
    decoder layers (Llama, Qwen2, Qwen3, Mistral), Gemma 3's and GPT-NeoX's (``_post``, ``_embed``, ``_head``).

    Args:
        model: a hybrid causal LM (an all-FA mask with ``fusion="none"`` gives the teacher's function).
        batch, max_len: sequences decoded together and cache capacity (prompt + new tokens).
        compile_tail: ``torch.compile`` each layer's input norm and residual + norm + MLP tail (one graph shared by
            all layers) and a step's ends (embedding + rotary, final norm + LM head); eager after a compile failure
            (warned). With gated MLPs (checked against the modules first; not with hooks on them, warned) a layer's
            tail and the next input norm are one compiled call (gate/up in one GEMM up to
            ``config.fused_gate_up_max_bytes``), or with ``config.tail_kernel`` one Triton launch per layer
            (``kernels/layer_tail.py``) that also computes the next layer's input projection.
        config: an InferenceConfig to attach (``use_inference``) unless it is the model's; None: the model's.
        caches: one HybridDecodeCache of capacity ``max_len`` per layer (a ``HybridCache``'s ``decode_caches``);
            None: new ones.

    Raises:
        ValueError: a layer's attention is not a hybrid layer.
    """

    def __init__(self, model: Any, batch: int, max_len: int, compile_tail: bool = False,
                 config: Optional[InferenceConfig] = None, caches: Optional[list] = None):
        self.model, self.base = model, model.base_model
        self.layers = layers = self.base.layers
        self.attns = [getattr(layer, attention_name(layer)) for layer in layers]
        self.types = getattr(model.config, "layer_types", None)  # per layer: its (cos, sin) in a dict of _embed's
        for i, attn in enumerate(self.attns):
            if not hasattr(attn, "new_decode_cache"):
                raise ValueError(f"layer {i} is not a hybrid attention layer; hybridize the model first")
        if config is not None and config is not inference_config(model):
            use_inference(model, config)
        self.config = cfg = inference_config(model)
        if caches is not None and (len(caches) != len(layers) or any(c is None or c.max_len != max_len for c in caches)):
            raise ValueError(f"caches must be one HybridDecodeCache of max_len {max_len} per layer ({len(layers)})")
        self.caches = caches if caches is not None else [a.new_decode_cache(batch, max_len) for a in self.attns]
        self._dstep: Optional[tuple] = None  # step_replayed's inputs (token, position, slots, valid, n_valid)
        self._dp: Optional[DevicePosition] = None  # the replayed step's device position (None: cache.length)
        self._dgraph: Optional[tuple] = None  # its (graph, static logits), captured on first use on CUDA
        self.batch, self.max_len = batch, max_len
        self._graph = self._pf_graph = self._pf_ids = None  # capture()'s graph; capture_prefill()'s graph and ids
        self._pre, self._post, self._fused, self._embed, self._head = _pre, _post, None, _embed, _head
        self._gu: list = [None] * len(layers)  # per layer: (weight versions, W_gu, b_gu)
        self._tk: Optional[list] = None  # per layer: the norms' (weight, ε) of layer_tail.layer_tail, where it applies
        if compile_tail:
            self._pre, self._post, self._embed, self._head = (_compile(f, cfg) for f in (_pre, _post, _embed, _head))
            if all(_gated_mlp(layer) for layer in layers):
                if any(_hooked(layer) for layer in layers):
                    warnings.warn("StaticDecoder: forward hooks on the layers' norms or MLPs; the fused layer tail "
                                  "would bypass them, so the modules are called (two compiled calls per layer)",
                                  stacklevel=2)
                elif self._fused_tail_ok():
                    self._fused = _compile(_post_fused, cfg)
                    self._tk = self._tail_kernel_params() if cfg.tail_kernel else None

    def _gate_up(self, i: int) -> tuple:
        """Layer i's [gate; up] weight (and bias), concatenated once and again when either changes; (None, None)
        above ``config.fused_gate_up_max_bytes`` (the two projections are used). A captured CUDA graph keeps the
        copy it was captured with: capture again after editing the weights (as for the lean path's projections)."""
        m = self.layers[i].mlp
        ps = (m.gate_proj.weight, m.up_proj.weight, m.gate_proj.bias, m.up_proj.bias)
        if (ps[0].numel() + ps[1].numel()) * ps[0].element_size() > self.config.fused_gate_up_max_bytes:
            return None, None
        key = tuple((id(p), _version(p), p.device, p.dtype) if p is not None else None for p in ps)
        got = self._gu[i]
        if got is None or got[0] != key:
            with torch.no_grad():
                W = torch.cat([ps[0], ps[1]], 0)
                b = None if ps[2] is None and ps[3] is None else torch.cat(
                    [ps[2] if ps[2] is not None else ps[0].new_zeros(ps[0].shape[0]),
                     ps[3] if ps[3] is not None else ps[1].new_zeros(ps[1].shape[0])])
            got = self._gu[i] = (key, W, b)
        return got[1], got[2]

    @torch.no_grad()
    def _fused_tail_ok(self, tol: Optional[float] = None) -> bool:
        """The fused tail (eager) against the layers' own modules on random hidden states, for every layer: False
        (with a warning) when they differ by more than ``tol`` relative to the largest value (default 1e-4 in
        fp32, 3e-2 in 16-bit types: one GEMM of concatenated rows may round differently)."""
        layers = self.layers
        i = self._differs_from_modules(lambda i, h, a: _post_fused(layers[i], layers[i + 1] if i + 1 < len(layers)
                                                                   else None, h, a, *self._gate_up(i)), (2, 3), 0, tol)
        if i is not None:
            warnings.warn("StaticDecoder: the fused layer tail (gate/up in one GEMM) differs from the MLP "
                          f"module's forward in layer {i} ({type(layers[i].mlp).__name__}); using the module",
                          stacklevel=3)
            return False
        return True

    @torch.no_grad()
    def _differs_from_modules(self, tail: Any, rows: tuple, seed: int, tol: Optional[float] = None) -> Optional[int]:
        """The first layer whose ``tail(i, h, a) -> (h', next layer's input or None)`` differs from the layers' own
        modules (``_post``, then ``_pre`` of the next layer) on random h, a [*rows, hidden] by more than ``tol``
        relative to the largest value (default 1e-4 in fp32, 3e-2 in 16-bit types); None when none does."""
        layers = self.layers
        w = layers[0].mlp.gate_proj.weight
        if tol is None:
            tol = 1e-4 if w.dtype in (torch.float32, torch.float64) else 3e-2
        g = torch.Generator(device="cpu").manual_seed(seed)
        h = torch.randn(*rows, w.shape[1], generator=g).to(w.device, w.dtype)
        a = torch.randn(*rows, w.shape[1], generator=g).to(w.device, w.dtype)
        for i in range(len(layers)):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            ref_h = _post(layers[i], h, a)
            ref_x = _pre(nxt, ref_h) if nxt is not None else None
            for got, ref in zip(tail(i, h, a), (ref_h, ref_x)):
                if ref is not None and ((got.float() - ref.float()).abs().max() > tol * ref.float().abs().max().clamp_min(1e-6)):
                    return i
        return None

    def _tail_kernel_params(self) -> Optional[list]:
        """Per layer (post-attention norm's weight and ε, next layer's input norm's or None) for
        :func:`~headscope.hybrid.inference.kernels.layer_tail.layer_tail`; None where it does not apply here (device, sizes, a norm
        without an ε attribute, the gate/up weights not concatenated) or differs from the layers' modules on random
        inputs (warned). The check feeds the attention output through an identity o_proj (exact in any dtype)."""
        layers = self.layers
        w = layers[0].mlp.gate_proj.weight
        rows = min(self.batch, _TAIL_ROWS)
        inter, hidden = w.shape
        if not _tail_applies(rows, hidden, hidden, inter, w.device):
            return None
        params = []
        for i, layer in enumerate(layers):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            post = _norm_params(layer.post_attention_layernorm)
            pre = _norm_params(nxt.input_layernorm) if nxt is not None else None
            if post is None or (nxt is not None and pre is None) or self._gate_up(i)[0] is None:
                return None
            params.append((post, pre))
        eye = torch.eye(hidden, dtype=w.dtype, device=w.device)
        i = self._differs_from_modules(
            lambda i, h, a: self._kernel_tail(i, h, a.contiguous(), eye, None, None, params), (rows,), 2)
        if i is not None:
            warnings.warn(f"StaticDecoder: the one-launch layer tail (layer_tail) differs from layer {i}'s modules; "
                          "using the compiled tail", stacklevel=3)
            return None
        return params

    def _kernel_tail(self, i: int, h: Tensor, y: Tensor, w_o: Tensor, b_o: Optional[Tensor], attn: Optional[tuple],
                     params: list, proj: Optional[Any] = None) -> tuple:
        """Layer i's tail through :func:`~headscope.hybrid.inference.kernels.layer_tail.layer_tail` (h [rows, hidden], y o_proj's
        input [rows, k_o]; ``params`` from :meth:`_tail_kernel_params`) -> (h, next layer's input or None); with
        ``proj`` (the next layer's lean plan) the second is that layer's input projection."""
        (wp, ep), pre = params[i]
        mlp = self.layers[i].mlp
        W_gu, b_gu = self._gate_up(i)
        return layer_tail(y, h, w_o, b_o, wp, ep, W_gu, b_gu, mlp.down_proj.weight, mlp.down_proj.bias,
                          *(pre if pre is not None else (None, 0.0)), w_in=proj.W if proj is not None else None,
                          b_in=proj.b if proj is not None else None, attn=attn)

    def _projects(self, i: int, h: Tensor) -> Optional[Any]:
        """The lean plan of layer i + 1 when the tail kernel of layer i can compute its input projection
        (the layer takes the lean path for this step, its rows a multiple of 16)."""
        if i + 1 >= len(self.layers):
            return None
        attn = self.attns[i + 1]
        if not _lean_applies(attn, h):
            return None
        p = _plan(attn)
        return p if p.W.shape[0] % 16 == 0 else None

    def _layers(self, h: Tensor, pe: Any, pos: Tensor) -> Tensor:
        """The decoder layers over hidden states h [batch, T, hidden] (attention through the caches; pe: _embed's)."""
        layers, pes = self.layers, [pe[t] for t in self.types] if isinstance(pe, dict) else [pe] * len(self.layers)
        if self._fused is not None:
            rows = h.shape[0] * h.shape[1]
            tk = self._tk if (self._tk is not None and h.shape[1] == 1 and rows <= _TAIL_ROWS) else None
            x = self._tail(0, layers[0], h)
            z = None  # the layer's input projection, when the tail kernel before computed it
            for i, (layer, attn, pe, dc) in enumerate(zip(layers, self.attns, pes, self.caches)):
                if tk is not None:
                    a = self._attend(attn, x if z is None else h, pe, dc, pos, defer=True, z_in=z)
                    z = None
                    if isinstance(a, DeferredOutput) and not _tail_applies(
                            rows, h.shape[-1], a.y.shape[1], layer.mlp.down_proj.weight.shape[1], h.device):
                        a = a.finish()  # o_proj's input of a size the kernel does not take: the separate kernels
                    if isinstance(a, DeferredOutput):  # the combination, o_proj and the tail in one launch
                        proj = self._projects(i, h)
                        hn, nxt = self._kernel_tail(i, h.reshape(rows, -1), a.y, a.w_o, a.b_o, a.attn, tk, proj)
                        h = hn.view_as(h)
                        if proj is not None:
                            z, x = nxt.view(h.shape[0], 1, -1), None
                        else:
                            x = nxt.view_as(h) if nxt is not None else None
                        continue
                else:
                    a = self._attend(attn, x, pe, dc, pos)
                h, x = self._tail(2, layer, layers[i + 1] if i + 1 < len(layers) else None, h, a, *self._gate_up(i))
            return h
        for layer, attn, pe, dc in zip(layers, self.attns, pes, self.caches):
            x = self._tail(0, layer, h)
            a = self._attend(attn, x, pe, dc, pos)
            h = self._tail(1, layer, h, a)
        return h

    def _attend(self, attn: Any, x: Tensor, pe: Any, dc: Any, pos: Tensor, defer: bool = False,
                z_in: Optional[Tensor] = None) -> Any:
        """One layer's attention into its cache: a decode step through the lean backend directly (with the replayed
        step's device position, a deferred output or the projection the tail before computed), else the module (whose
        output is never deferred).

        Raises:
            ValueError: a device-position step of a layer the lean backend does not compute."""
        if x.shape[1] == 1 and (self._dp is not None or z_in is not None or (defer and _lean_applies(attn, x))):
            if not _lean_applies(attn, x):
                raise ValueError("device-position decoding (StaticDecoder.step_replayed) and the tail kernel run on the "
                                 "lean decode backend only: no gradient, weights in the input's dtype, "
                                 "InferenceConfig.decode 'lean' or 'auto' on CUDA")
            return decode_step(attn, x, pe, pos, dc, self._dp, defer, z_in)
        return attn(x, position_embeddings=pe, cache=dc, position_ids=pos)[0]

    def _tail(self, i: int, *args: Any) -> Any:
        """``_pre`` (i = 0), ``_post`` (i = 1), ``_post_fused`` (i = 2), ``_embed`` (i = 3) or ``_head`` (i = 4),
        compiled when ``compile_tail``; a compile failure warns once and turns them all back to eager (the fused
        tail stays fused: it was checked against the modules)."""
        fn, eager = ((self._pre, _pre), (self._post, _post), (self._fused, _post_fused), (self._embed, _embed),
                     (self._head, _head))[i]
        if fn is eager:
            return eager(*args)
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a compile failure: eager from here on
            warnings.warn(f"StaticDecoder: torch.compile of the layer tail failed ({type(e).__name__}: {e}); "
                          "running it eagerly", stacklevel=3)
            self._pre, self._post, self._embed, self._head = _pre, _post, _embed, _head
            self._fused = _post_fused if self._fused is not None else None
            return eager(*args)

    @property
    def length(self) -> int:
        return self.caches[0].length

    def cache_bytes(self, length: Optional[int] = None) -> int:
        """Bytes the caches hold at ``length`` tokens (default: now)."""
        return sum(c.nbytes(length) for c in self.caches)

    @torch.no_grad()
    def _body(self, ids: Tensor) -> Tensor:
        m = self.base
        B, T = ids.shape
        past = self.length
        pos = torch.arange(past, past + T, device=ids.device)[None].expand(B, -1)
        step = T == 1  # a decode step: its ends compiled (compile_tail); a prefill's eager
        h, pe = self._tail(3, m, ids, pos) if step else _embed(m, ids, pos)
        h = self._layers(h, pe, pos)[:, -1:]
        return (self._tail(4, self.model, h) if step else _head(self.model, h))[:, 0]

    def prefill(self, ids: Tensor) -> Tensor:
        """Start fresh sequences: ``ids`` [batch, T] → logits [batch, vocab] of the last position."""
        for c in self.caches:
            c.length = 0
        return self._body(ids)

    def step(self, ids: Tensor) -> Tensor:
        """Append ``ids`` [batch, 1] (or a few tokens) → logits of the last position."""
        return self._body(ids)

    def _state(self) -> list:
        """Each cache's (GDN state, convolution tail) as clones (None where absent)."""
        return [tuple(None if t is None else t.clone() for t in (c.S, c.conv)) for c in self.caches]

    def _restore(self, saved: list, n: int) -> None:
        """The caches back at length ``n`` with the state of :meth:`_state` (warm-up calls advance it)."""
        self._set_length(n)
        for c, ts in zip(self.caches, saved):
            for t, s in zip((c.S, c.conv), ts):
                if t is not None:
                    t.copy_(s)

    def capture(self, ids: Tensor, warmup: int = 3) -> Tensor:
        """Record one step at the current length in a CUDA graph (warm-up steps on a side stream first,
        which compile the glue); returns the graph's static logits. The caches' length and state stay."""
        n, saved = self.length, self._state()

        def run() -> Tensor:
            self._set_length(n)
            return self.step(ids)

        self._graph, self._static = _capture(run, warmup, device=self._device())
        self._restore(saved, n)
        return self._static

    def capture_prefill(self, ids: Tensor, warmup: int = 2) -> None:
        """Record the prefill of ``ids`` [batch, T] in a CUDA graph (after ``warmup`` eager prefills);
        :meth:`prefill_graphed` replays it for any ids of that shape. Replaces an earlier prefill graph.

        Raises:
            ValueError: ids' batch is not the decoder's or T exceeds ``max_len``.
            RuntimeError: no CUDA device (see :func:`headscope.hybrid.inference.graphs.capture`).
        """
        if ids.dim() != 2 or ids.shape[0] != self.batch:
            raise ValueError(f"ids must be [batch={self.batch}, T]; got {tuple(ids.shape)}")
        if ids.shape[1] > self.max_len:
            raise ValueError(f"{ids.shape[1]} tokens exceed the caches' max_len {self.max_len}; "
                             "make the StaticDecoder with a larger max_len")
        self._pf_graph = None  # free the old graph's pool first
        self._pf_ids = ids.clone()
        self._pf_graph, self._pf_out = _capture(lambda: self.prefill(self._pf_ids), warmup, device=self._device())

    def prefill_graphed(self, ids: Tensor) -> Tensor:
        """:meth:`prefill` through a CUDA graph of ids' shape (captured on first use of the shape):
        ``ids`` [batch, T] → logits [batch, vocab] of the last position (the graph's static output:
        clone it to keep it past the next replay)."""
        if self._pf_graph is None or self._pf_ids.shape != ids.shape:
            self.capture_prefill(ids)
        else:
            self._pf_ids.copy_(ids)
        self._pf_graph.replay()
        self._set_length(ids.shape[1])
        return self._pf_out

    def _position_step(self, tok: Tensor, pos: Tensor, slots: Tensor, valid: Tensor, n_valid: Tensor) -> Tensor:
        """One decode step of the tokens ``tok`` [batch, 1] at the device position ``pos`` ([1] long): the FA mask
        ``valid`` (= slots ≤ pos) and the split-K length ``n_valid`` (= pos + 1) updated in place first (``self._dp``
        must point at these tensors); logits [batch, 1, vocab]. Capturable: every
        input is read from device memory."""
        torch.le(slots, pos, out=valid)
        torch.add(pos, 1, out=n_valid)
        pid = pos.expand(tok.shape[0], 1)
        h, pe = self._tail(3, self.base, tok, pid)
        return self._tail(4, self.model, self._layers(h, pe, pid))

    @torch.no_grad()
    def step_replayed(self, ids: Tensor) -> Tensor:
        """One decode step at the caches' length, replayed from a CUDA graph: ``ids`` [batch, 1] → logits
        [batch, 1, vocab] (a static buffer, overwritten by the next step: copy it to keep it). The graph is
        captured on first use; it reads the position from device memory (a ``DevicePosition``; the FA heads
        attend over the cache buffer masked to the written slots), so one graph serves every later length; warm-up
        and capture leave the caches as they were. Off CUDA the same device-position step runs eagerly (tests).
        ``transformers``' ``generate`` reaches this through
        :func:`~headscope.hybrid.inference.model_step.model_forward`.

        Raises:
            ValueError: ids not [batch, 1], or the caches are full. Any error of the capture (the caches are then
                as before the call; the next call captures again).
        """
        B = self.batch
        if ids.dim() != 2 or ids.shape != (B, 1):
            raise ValueError(f"ids must be [batch={B}, 1]; got {tuple(ids.shape)}")
        n = self.length
        if n >= self.max_len:
            raise ValueError(f"the caches hold {self.max_len} tokens and are full")
        if self._dstep is None:  # the step's inputs, read from device memory: token, position, slots, mask, length
            slots = torch.arange(self.max_len, device=ids.device)
            pos = torch.full((1,), n, dtype=torch.long, device=ids.device)
            self._dstep = (ids.clone(), pos, slots, slots <= pos, pos + 1)
        tok, pos, _, valid, n_valid = self._dstep
        tok.copy_(ids)
        pos.fill_(n)
        self._dp = DevicePosition(pos, valid, n_valid)
        try:
            if self._dgraph is None and _graphable(ids.device):
                saved = self._state()
                try:
                    self._dgraph = _capture(lambda: self._position_step(*self._dstep), warmup=2, device=ids.device)
                finally:
                    self._restore(saved, n)
            if self._dgraph is not None:
                self._dgraph[0].replay()
                logits = self._dgraph[1]
            else:
                logits = self._position_step(*self._dstep)
        finally:
            self._dp = None
        self._set_length(n + 1)
        return logits

    def replay(self) -> Tensor:
        self._graph.replay()
        return self._static

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _set_length(self, n: int) -> None:
        for c in self.caches:
            c.length = n
