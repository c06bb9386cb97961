"""The generic patching path: any architecture the TransformerLens bridge boots, through its ``hook_z``.

:class:`BridgeEngine` implements :class:`~headscope.patching.contract.PatchingEngine` (the passes of
:class:`~headscope.patching.hooked.HookedEngine`) for models without an architecture adapter. It makes
no assumption about the architecture; it finds the activation to patch through the bridge and runs
the model's own forward:

* **where** ``blocks.{l}.attn.hook_z`` lives: the bridge aliases it to the input of the attention's
  output-projection component (``o.hook_in``); the transformers module inside that component gets a
  plain forward pre-hook, and the forward runs the transformers modules themselves (the bridge's
  wrappers are swapped out for the duration of the call; its per-hook bookkeeping and re-implemented
  attention are skipped);
* **the prefix once**: a patch at positions ``start..`` cannot change positions before ``start``
  (causal attention), so the prompt's first ``start`` tokens run once, with the model's own KV cache,
  and every patched forward computes only the suffix, attending to a copy of that cache expanded over
  its rows;
* **logits at the read rows only**: the unembedding gets the read positions' hidden states alone (a
  pre-hook on the output embedding), not all positions × vocabulary;
* **several patches per forward**: one batch row per patched head, rows of several layers together.

Each shortcut is checked against the bridge: when the engine is built, a short prompt's ``hook_z`` and
logits from the plain forward must equal the bridge's, and a patched row through the cached prefix
must equal the same patch through the bridge's full forward (to ``1e-4``, relative, fp32); then, for
every new prompt, the unpatched suffix through the cached prefix must give the full pass's logits.
A shortcut that fails falls back (cache → full forwards; plain modules → the bridge's own hooks), with
a warning that says which and why: slower, never silently wrong. ``mode`` says what runs.

:func:`~headscope.patching.contract.make_engine` picks the path: the fast engine where an adapter exists and passes
its self-check, the generic one where no adapter exists; an adapter that fails its self-check refuses (an unknown
variant must never give a silently wrong ranking).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from typing import Any, Iterator, Sequence

import torch
from jaxtyping import Int
from torch import Tensor, nn

from ..arch import UnsupportedArchitecture
from ..models import LoadedModel
from .hooked import Edits, HookedEngine, join_hook, z_hook
from .pass_plan import RunCache

CHECK_TOL = 1e-4  # relative, fp32 (lower precision: LOW_TOL)
LOW_TOL = 3e-2


def _original(m: nn.Module) -> nn.Module | None:
    try:
        o = getattr(m, "original_component", None)
    except Exception:  # a bridge component without its module raises
        return None
    return o if isinstance(o, nn.Module) and o is not m else None


def bridge_swaps(root: nn.Module) -> list[tuple[nn.Module, str, nn.Module, nn.Module]]:
    """Every TransformerBridge wrapper installed in ``root``'s module tree, as (parent, name, wrapper,
    transformers module inside it); the transformers modules' own children are searched too."""
    out: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []

    def walk(mod: nn.Module) -> None:
        for name, ch in list(mod._modules.items()):
            if ch is None:
                continue
            orig = _original(ch)
            if orig is not None:
                out.append((mod, name, ch, orig))
                walk(orig)
            else:
                walk(ch)

    walk(root)
    return out


def _modules(bridge: Any, n_layers: int, hook_z: bool) -> list[nn.Module] | None:
    """Per layer, the transformers module inside the bridge's component: with ``hook_z`` the one whose
    input is ``blocks.{l}.attn.hook_z`` (the bridge's alias ``o.hook_in``), else the decoder layer
    (``blocks.{l}``). None where the bridge does not say."""
    mods = []
    for i in range(n_layers):
        try:
            comp: Any = bridge.blocks[i]
            if hook_z:
                comp = comp.attn
                alias = getattr(comp, "hook_aliases", {}).get("hook_z")
                if not isinstance(alias, str) or not alias.endswith(".hook_in"):
                    return None
                for part in alias[: -len(".hook_in")].split("."):
                    comp = getattr(comp, part, None)
        except (AttributeError, IndexError, TypeError):
            return None
        mod = _original(comp) if isinstance(comp, nn.Module) else None
        if mod is None:
            return None
        mods.append(mod)
    return mods


def _cache_kw(hf: nn.Module) -> str | None:
    """The forward's KV-cache keyword (``cache`` in transformers 5, ``past_key_values`` before), or None."""
    params = inspect.signature(hf.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / float(b.float().abs().max().clamp_min(1e-6))


class BridgeEngine(HookedEngine):
    """Receiver patching of any architecture the TransformerLens bridge boots, at its ``hook_z``
    hook points. ``path = "generic"``.

    ``mode``: ``"plain"`` (the transformers modules with pre-hooks) or ``"bridge"`` (the bridge's own
    hooks, full forwards); in plain mode ``prefix`` (the cached prefix) and ``join`` (rows join the batch
    at their patched layer) say which shortcuts passed the checks; ``why`` lists the ones given up.

    Args:
        model: the model.
        check: run the build-time checks (default True); without them every shortcut is trusted.

    Raises:
        UnsupportedArchitecture: the bridge has no ``hook_z`` hook point for some layer.
    """

    path = "generic"

    def __init__(self, model: LoadedModel, check: bool = True):
        super().__init__(model)
        self.bridge = model.bridge
        missing = [f"blocks.{i}.attn.hook_z" for i in range(self.g.n_layers)
                   if f"blocks.{i}.attn.hook_z" not in self.bridge.hook_dict]
        if missing:
            raise UnsupportedArchitecture(
                f"the TransformerLens bridge of {type(model.hf_model).__name__} has no {missing[0]} hook point; "
                "headscope cannot patch this model's heads")
        self.tol = CHECK_TOL if self.dtype == torch.float32 else LOW_TOL
        self._swaps = bridge_swaps(self.hf)
        self._zmods = _modules(self.bridge, self.g.n_layers, hook_z=True)
        self._blocks = _modules(self.bridge, self.g.n_layers, hook_z=False)
        self._cache_kw = _cache_kw(self.hf)
        self.mode = "plain" if self._zmods is not None else "bridge"
        if self._zmods is None:
            self.why.append("no transformers module found behind the bridge's hook_z alias")
        self.prefix = self._cache_kw is not None
        self.join = self._blocks is not None
        self._prefix: tuple[Tensor, Any] | None = None  # (prefix ids, the model's KV cache of them)
        if check:
            self.self_check()

    def __repr__(self) -> str:
        return f"BridgeEngine(mode={self.mode!r}, prefix={self.prefix}, join={self.join})"

    def _bridge_hooked(self) -> bool:
        """Hooks a user put on the bridge's hook points (the plain mode would skip them)."""
        return any(hp._forward_hooks or hp._forward_pre_hooks for hp in self.bridge.hook_dict.values())

    @contextlib.contextmanager
    def _plain(self) -> Iterator[None]:
        """The transformers modules in place of the bridge's wrappers, for the duration of a forward."""
        for parent, name, _, orig in self._swaps:
            parent._modules[name] = orig
        try:
            yield
        finally:
            for parent, name, wrapper, _ in reversed(self._swaps):
                parent._modules[name] = wrapper

    # ---- one forward of the transformers model ------------------------------------------------
    def _forward(self, ids: Int[Tensor, "batch pos"], read_off: Sequence[int], edits: Edits | None = None,
                 cache: Any = None, grab: list[Tensor] | None = None, join: dict[int, int] | None = None) -> Tensor:
        """Logits [B, len(read_off), vocab] at ``read_off`` (offsets into ``ids``) of one forward of the
        transformers modules. ``edits`` replace hook_z rows; ``grab`` collects every layer's hook_z
        ([B, pos, H·dh]); ``cache``: the KV cache of the positions before ``ids`` (extended in place);
        ``join`` {layer: n}: n copies of row 0 join the batch at that layer's input."""
        hooks = []
        S = ids.shape[1]
        off = torch.as_tensor(list(read_off), device=ids.device)

        def head_hook(mod: nn.Module, args: tuple) -> tuple | None:  # the read rows only into the unembedding
            h = args[0]
            if h.dim() == 3 and h.shape[1] == S:
                return (h[:, off.to(h.device)], *args[1:])
            return None

        assert self._zmods is not None
        with self._plain():
            try:
                for i, m in enumerate(self._zmods):
                    if grab is not None or (edits and i in edits):
                        hooks.append(m.register_forward_pre_hook(z_hook(i, S, edits, grab), with_kwargs=True))
                for i, n in (join or {}).items():
                    hooks.append(self._blocks[i].register_forward_pre_hook(join_hook(n), with_kwargs=True))  # type: ignore[index]
                out_emb = self.hf.get_output_embeddings() if hasattr(self.hf, "get_output_embeddings") else None
                if isinstance(out_emb, nn.Module):
                    hooks.append(out_emb.register_forward_pre_hook(head_hook))
                kw: dict[str, Any] = {"use_cache": cache is not None}
                if cache is not None:
                    kw[self._cache_kw] = cache  # type: ignore[index]
                logits = self.hf(input_ids=ids, **kw).logits
            finally:
                for h in hooks:
                    h.remove()
        if logits.shape[1] != off.numel():  # the unembedding was not a module call: read after it
            logits = logits[:, off.to(logits.device)]
        return logits

    def _prefix_cache(self, ids: Tensor, start: int) -> Any:
        """The model's KV cache of ``ids[:start]`` (computed once per prompt prefix)."""
        if self._prefix is not None and torch.equal(self._prefix[0], ids[:start]):
            return self._prefix[1]
        with self._plain():
            out = self.hf(input_ids=ids[None, :start], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        self._prefix = (ids[:start].clone(), cache)
        return cache

    def _cached_rows(self, ids: Tensor, start: int, rows: int | Sequence[int]) -> Any:
        """A fresh copy of the prefix cache with ``rows`` batch rows, or ``rows[i]`` rows in layer i
        (the forward extends it)."""
        c = copy.deepcopy(self._prefix_cache(ids, start))
        if not isinstance(rows, int) and len(set(rows)) == 1:
            rows = rows[0]
        if isinstance(rows, int):
            if rows > 1:
                c.batch_repeat_interleave(rows)
            return c
        for layer, n in zip(c.layers, rows):
            if n > 1:
                layer.batch_repeat_interleave(n)
        return c

    # ---- the routes of HookedEngine's passes -------------------------------------------------------
    def _run_other(self, ids: Tensor, read: list[int]) -> RunCache | None:
        """Through the bridge's own hooks (``run_with_cache``) in bridge mode or where a user hooked the bridge."""
        if not (self.mode == "bridge" or self._bridge_hooked()):
            return None
        names = [f"blocks.{i}.attn.hook_z" for i in range(self.g.n_layers)]
        logits, cache = self.bridge.run_with_cache(ids[None].to(self.device), names_filter=lambda n: n in names)
        z = torch.stack([cache[n][0].reshape(ids.numel(), -1) for n in names])
        empty = torch.empty(self.g.n_layers, 0)
        return RunCache(empty, z, empty, empty, logits[0, read], ids=ids.cpu(), read=read)

    def _patched_other(self, ids: Tensor, flat: list[tuple[int, Tensor]], start: int, read: list[int]
                       ) -> Tensor | None:
        """Full forwards through the bridge's own hook points in bridge mode or where a user hooked the bridge."""
        if not (self.mode == "bridge" or self._bridge_hooked()):
            return None
        return self._bridge_patched(ids, flat, start, read)

    def _prefix_ok(self, base: RunCache, ids: Tensor, start: int, read: list[int]) -> bool:
        self._check_prefix(base, ids, start, read)
        return self.prefix

    def _bridge_patched(self, ids: Tensor, flat: list[tuple[int, Tensor]], start: int, read: list[int]) -> Tensor:
        """:meth:`patched_logits_multi` of the rows ``flat`` ((layer, hook_z [suffix, H·dh]) each) through the
        bridge's own hook points (full forwards)."""
        g = self.g
        rows: dict[int, list[Tensor]] = {}
        idx: dict[int, list[int]] = {}
        for r, (layer, z) in enumerate(flat):
            rows.setdefault(layer, []).append(z)
            idx.setdefault(layer, []).append(r)
        hooks = []
        for layer, members in rows.items():
            ix = torch.as_tensor(idx[layer], device=self.device)
            vals = torch.stack(members).to(self.device)

            def hook(zh: Tensor, hook: Any = None, ix: Tensor = ix, vals: Tensor = vals) -> Tensor:
                zh = zh.clone()
                zh[ix, start:] = vals.view(len(ix), -1, g.n_heads, g.d_head).to(zh.dtype)
                return zh

            hooks.append((f"blocks.{layer}.attn.hook_z", hook))
        logits = self.bridge.run_with_hooks(ids[None].expand(len(flat), -1), fwd_hooks=hooks)
        return logits[:, read]

    # ---- checks ---------------------------------------------------------------------------------
    def _give_up(self, what: str, why: str) -> None:
        if what == "bridge":
            self.mode = "bridge"
        else:
            setattr(self, what, False)
        self._prefix = None
        self.why.append(f"{what}: {why}")
        warnings.warn(f"generic path: {why}; " + ("using the bridge's own hooks" if what == "bridge" else
                      f"running without the {what!r} shortcut") + " (slower, exact)", stacklevel=3)

    def _check_prefix(self, base: RunCache, ids: Tensor, start: int, read: list[int]) -> None:
        """Once per prompt prefix: the unpatched suffix through the cached prefix must give the full
        pass's logits at ``read`` (else the prefix shortcut is given up)."""
        if self._prefix is not None and torch.equal(self._prefix[0], ids[:start]):
            return
        got = self._forward(ids[None, start:], [p - start for p in read], cache=self._cached_rows(ids, start, 1))
        ref = base.logits if base.read is not None and list(base.read) == read else self._forward(ids[None], read)[0]
        d = _rel(got[0], ref.to(got.device))
        if not d <= self.tol:
            self._give_up("prefix", f"the model's KV cache of the first {start} tokens does not reproduce its "
                                    f"full forward on this prompt (relative difference {d:.1e})")

    @torch.no_grad()
    def self_check(self, n_tokens: int = 24) -> None:
        """A short prompt through the bridge and through the transformers modules: every layer's hook_z
        and the logits must agree; then patched rows (two in layer 0, one in each later layer) through
        each shortcut must equal the same patches through the bridge's full forward (relative ``tol``).
        A shortcut that fails is given up, with a warning."""
        if self.mode == "bridge":
            return
        g = self.g
        T = min(n_tokens, max(4, int(self.g.n_ctx or n_tokens)))
        vocab = int(getattr(self.hf.config, "vocab_size", None) or 1000)
        ids = ((torch.arange(T) * 7919 + 11) % max(vocab - 1, 1) + 1).to(self.device)
        read = [T - 3, T - 2, T - 1]
        self.mode = "bridge"
        ref = self.run(ids, read)
        self.mode = "plain"
        try:
            got = self.run(ids, read)
        except Exception as e:  # noqa: BLE001 - any failure of the plain forward means: use the bridge
            return self._give_up("bridge", f"the transformers modules without the bridge's wrappers fail ({e!r})")
        for lay in range(g.n_layers):
            d = _rel(got.z[lay], ref.z[lay])
            if not d <= self.tol:
                return self._give_up("bridge", f"layer {lay}'s hook_z from the transformers modules differs from "
                                               f"the bridge's (relative {d:.1e})")
        d = _rel(got.logits, ref.logits)
        if not d <= self.tol:
            return self._give_up("bridge", f"the transformers modules' logits differ from the bridge's "
                                           f"(relative {d:.1e})")
        start = T // 2
        entries = [(0, ref.z[0, start:][None] * torch.tensor([0.5, -1.0])[:, None, None].to(ref.z))]
        entries += [(lay, ref.z[lay, start:][None] * 0.5) for lay in range(1, g.n_layers)]
        want = self._bridge_patched(ids, [(lay, z[j]) for lay, z in entries for j in range(z.shape[0])], start, read)
        for what in ("join", "prefix"):  # each shortcut alone, then together
            if not getattr(self, what):
                continue
            other = "prefix" if what == "join" else "join"
            keep = getattr(self, other)
            setattr(self, other, False)
            d, err = self._try(ref, entries, start, read, want)
            setattr(self, other, keep)
            if not d <= self.tol:
                self._give_up(what, err or f"patched rows with it differ from the bridge's full forward "
                                           f"(relative {d:.1e})")
        d, err = self._try(ref, entries, start, read, want)
        if not d <= self.tol:
            if self.join and self.prefix:
                self._give_up("join", err or f"patched rows with the cached prefix and rows joining at their layer "
                                             f"differ from the bridge's full forward (relative {d:.1e})")
                d, err = self._try(ref, entries, start, read, want)
            if not d <= self.tol:
                self._give_up("bridge", err or f"patched rows of the transformers modules differ from the bridge's "
                                               f"(relative {d:.1e})")
        self._prefix = None

    def _try(self, ref: RunCache, entries: list, start: int, read: list[int], want: Tensor) -> tuple[float, str]:
        self._prefix = None
        try:
            return _rel(self.patched_logits_multi(ref, entries, start, read), want), ""
        except Exception as e:  # noqa: BLE001 - a shortcut the model cannot take
            return float("inf"), f"it fails on this model ({e!r})"
