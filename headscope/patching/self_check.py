"""When the fast engine checks itself against the model's own forward, and what a passed check is kept for.

The comparisons themselves are :mod:`headscope.patching.reference_check` (:func:`~headscope.patching.reference_check.model_reference`,
:func:`~headscope.patching.reference_check.compare`, :func:`~headscope.patching.reference_check.compare_teacher_forced`,
:func:`~headscope.patching.reference_check.check_patches`). :class:`SelfCheck` runs them for one
:class:`~headscope.patching.engine.Engine`: a short prompt when the engine is built, the first prompt of every
length beyond the longest checked (that prompt's own pass is the engine side of the comparison, so the check costs
one forward of the model), and a patched row against a hooked forward on the first pair of every new length.

A check that passed is kept, by :class:`CheckRecord`, per model and per *what the check verified*: the engine's
kind, the model's dtype, the :class:`~headscope.patching.pass_plan.Precision`, and everything the adapter read from the
model (each layer's parts: scale, window, soft-cap, RoPE kind, norms, block shape, ...; :func:`assumptions`).
Another engine of the same model that reads the same parts (the exact engine after the screen's, the next call of
:func:`headscope.rank`) reuses it, so each check runs once per (model, dtype, length) in a process; an engine whose
parts differ (a mutated adapter, another precision) is checked anew. A run's store keeps the records too
(:func:`load_records` / :func:`save_records`), so a resumed or repeated ranking into the same folder does not check
again. A prompt no longer than one checked needs no check (the rule since the first length checks: a window or
length-switched RoPE table shows at its length and every longer one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from jaxtyping import Int
from torch import Tensor, nn

from ..arch import Proj, unwrap
from ..runtime import __version__
from . import reference_check as check
from .pass_plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine
    from .pass_plan import RunCache
    from .store import Store

__all__ = ["CheckRecord", "SelfCheck", "assumptions", "load_records", "records", "save_records", "seconds_spent"]

BUILD_TOKENS = 12  # the synthetic prompt of the build-time check
STORE_KEY = "self_check"  # the store item holding a run's check records


@dataclass
class CheckRecord:
    """What passed for one (model, engine assumptions): prompts up to ``checked_len`` tokens agree with the model's
    forward, patched rows up to ``patch_checked_len`` with hooked forwards; ``windows``: the sliding windows read
    from the model's masks (layer -> window or None), which an engine that skips the check adopts."""

    checked_len: int = 0
    patch_checked_len: int = 0
    windows: dict[int, int | None] = field(default_factory=dict)

    def merge(self, other: "CheckRecord") -> None:
        if other.checked_len > self.checked_len:
            self.windows = dict(other.windows)
        self.checked_len = max(self.checked_len, other.checked_len)
        self.patch_checked_len = max(self.patch_checked_len, other.patch_checked_len)


_SPENT = [0.0]  # seconds spent in self-checks by this process (read by benchmarks: seconds_spent)


def seconds_spent() -> float:
    """Seconds this process has spent in self-checks (model forwards and comparisons), every engine together."""
    return _SPENT[0]


# model -> {assumptions key: record}; weak, so a model's records go with it
_RECORDS: "weakref.WeakKeyDictionary[nn.Module, dict[str, CheckRecord]]" = weakref.WeakKeyDictionary()


def records(hf: nn.Module) -> dict[str, CheckRecord]:
    """The check records of model ``hf`` in this process (a live dict: key -> :class:`CheckRecord`)."""
    if hf not in _RECORDS:
        _RECORDS[hf] = {}
    return _RECORDS[hf]


def _describe(v: Any, depth: int = 0) -> Any:
    """A JSON-able description of an adapter part that stays the same across processes and TransformerBridge boots:
    numbers and names as they are, a tensor by dtype and shape, a module by its transformers class (and its norm
    epsilon), a function by its name."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype), list(v.shape)]
    if isinstance(v, torch.device):
        return v.type
    if isinstance(v, nn.Module):  # the transformers module (a booted TransformerBridge wraps it: same numbers)
        m = unwrap(v)
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
        return ["module", type(m).__name__, eps if isinstance(eps, (int, float)) else None]
    if isinstance(v, Proj):  # a zero bias (a booted TransformerBridge adds one to the unembedding) is no bias
        has_bias = v.bias is not None and bool(v.bias.detach().any())
        return {"weight": _describe(v.weight), "bias": _describe(v.bias) if has_bias else None,
                "module": _describe(v.module)}
    if is_dataclass(v) and not isinstance(v, type) and depth < 3:
        return {f.name: _describe(getattr(v, f.name), depth + 1) for f in fields(v)}
    if isinstance(v, (list, tuple)) and depth < 3:
        return [_describe(x, depth + 1) for x in v]
    if callable(v):
        return ["function", getattr(v, "__qualname__", type(v).__name__)]
    return ["object", type(v).__name__]


def assumptions(eng: "Engine") -> str:
    """A key of everything a check of ``eng`` verifies besides the prompt: headscope's version, the engine's kind,
    the model's class and dtype, the precision, and every part the adapter read (:class:`~headscope.arch.Arch`
    but its notes). Two engines with the same key compute the same numbers from the same model."""
    a = eng.arch
    desc = {"version": __version__, "path": eng.path, "model": type(eng.hf).__name__, "dtype": str(eng.dtype),
            "precision": eng.precision.to_dict(), "family": a.family, "embed": _describe(a.embed),
            "final_norm": _describe(a.final_norm), "lm_head": _describe(a.lm_head),
            "rope_tables": _describe(a.rope_tables), "logit_divisor": a.logit_divisor,
            "final_softcap": a.final_softcap, "layers": [_describe(L) for L in a.layers]}
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:24]


def load_records(hf: nn.Module, store: "Store") -> None:
    """Add the check records kept in a run's ``store`` to model ``hf``'s (the store's config pins the model)."""
    if not store.has(STORE_KEY):
        return
    mine = records(hf)
    for key, d in store.get(STORE_KEY).items():
        rec = CheckRecord(int(d["checked_len"]), int(d["patch_checked_len"]),
                          {int(k): (None if w is None else int(w)) for k, w in d["windows"].items()})
        mine.setdefault(key, CheckRecord()).merge(rec)


def save_records(hf: nn.Module, store: "Store") -> None:
    """Keep model ``hf``'s check records in a run's ``store`` (read back by :func:`load_records`)."""
    mine = records(hf)
    if mine:
        store.put(STORE_KEY, {k: asdict(r) for k, r in mine.items()})


class SelfCheck:
    """The self-check of one :class:`~headscope.patching.engine.Engine` (``eng.checks``).

    Args:
        eng: the engine (its layer pieces are compared with the model's forward).
        enabled: False: nothing is checked (an engine with ``matmul_dtype``, or ``check=False``).
    """

    def __init__(self, eng: "Engine", enabled: bool = True):
        self.eng = eng
        self.enabled = enabled
        self.own = CheckRecord()  # what this engine checked itself
        self._checking = False
        self.seconds = 0.0  # time spent checking (model forwards and comparisons)

    # ---- what is known -------------------------------------------------------------------------
    def record(self) -> CheckRecord | None:
        """The record kept for this model and this engine's current assumptions (None: nothing passed yet)."""
        return records(self.eng.hf).get(assumptions(self.eng))

    def checked_len(self) -> int:
        rec = self.record()
        return max(self.own.checked_len, rec.checked_len if rec is not None else 0)

    def needed(self, n_tokens: int) -> bool:
        """Whether a prompt of ``n_tokens`` needs a check: checks on, none in progress, and longer than every
        prompt checked for this model and these assumptions. An engine that skips a check another one passed
        takes the windows that check read from the model's masks."""
        if not self.enabled or self._checking or n_tokens <= self.own.checked_len:
            return False
        rec = self.record()  # under the engine's assumptions now (a part changed since: not this record)
        if rec is not None and n_tokens <= rec.checked_len:
            self._adopt(rec)
            return False
        return True

    def _adopt(self, rec: CheckRecord) -> None:
        """The windows a check of another engine read from the model's masks (this engine's own record stays what
        it checked itself)."""
        for i, w in rec.windows.items():
            self.eng.layers[i].window = w
        self.eng.arch.notes.setdefault("windows_from_masks", {}).update(rec.windows)

    def _passed(self, n_tokens: int, patched: bool = False) -> None:
        if patched:
            self.own.patch_checked_len = max(self.own.patch_checked_len, n_tokens)
        else:
            self.own.checked_len = max(self.own.checked_len, n_tokens)
            self.own.windows = dict(self.eng.arch.notes.get("windows_from_masks", {}))
        records(self.eng.hf).setdefault(assumptions(self.eng), CheckRecord()).merge(self.own)

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        import time

        t0, self._checking = time.perf_counter(), True
        try:
            yield
        finally:
            self._checking = False
            dt = time.perf_counter() - t0
            self.seconds += dt
            _SPENT[0] += dt

    # ---- when to check ---------------------------------------------------------------------------
    def at_build(self) -> None:
        """The build-time check (a short synthetic prompt), unless a check that covers it passed."""
        if self.needed(min(BUILD_TOKENS, max(2, int(self.eng.g.n_ctx or BUILD_TOKENS)))):
            self.run()

    def before_pass(self, ids: Tensor) -> None:
        """Before a pass of prompt ``ids``: check it first when it is longer than every prompt checked."""
        if self.needed(int(ids.numel())):
            self.run(ids=ids)

    @torch.no_grad()
    def checked_run(self, ids: Int[Tensor, "pos"], read: Sequence[int]) -> "RunCache":
        """:meth:`~headscope.patching.engine.Engine.run` of the first prompt of a new length: the engine's pass of
        ``ids`` is also the engine side of the check (one extra forward: the model's own). Returns its cache.

        Raises:
            EngineMismatch: as :meth:`run`.
        """
        eng = self.eng
        with self._timed():
            ref = check.model_reference(eng, ids, first=min(int(r) for r in read))
            res = eng.forward(Plan(read=read, ids=ids, keep=True))
            assert res.cache is not None
            if check.teacher_forced(eng.dtype):
                check.compare_teacher_forced(eng, ids, ref, read)
            else:
                check.compare(eng, res.cache, res.out[0], ref, read)
        self._passed(int(ids.numel()))
        return res.cache

    @torch.no_grad()
    def run(self, n_tokens: int = BUILD_TOKENS, tol: float | None = None, ids: Tensor | None = None) -> float:
        """A prompt through the engine and through the model's own forward (in the model's dtype, on its device;
        dynamic RoPE as freshly built), now; every layer's attention output, layer output and the logits must
        agree to ``tol`` (default :func:`~headscope.patching.reference_check.tolerance` of the dtype), relative to the
        activations' scale. The engine's sliding windows are first set from the masks the model passes to its
        layers (:func:`~headscope.patching.reference_check.model_reference`). In float32 and float64 the engine's own pass is
        compared (:func:`~headscope.patching.reference_check.compare`); in bfloat16 and float16 each layer is computed from
        the model's own input to it (:func:`~headscope.patching.reference_check.compare_teacher_forced`), so the two
        forwards' rounding does not accumulate over depth and length.

        Args:
            n_tokens: length of the synthetic prompt (when ``ids`` is None; capped at the context).
            ids: Int[Tensor, "pos"]: check on this prompt instead (e.g. a calibration pair's clean sequence).

        Returns the largest relative difference. Raises:
            EngineMismatch: naming the first layer and part (attention or MLP branch) that disagrees,
                and the fix (``path="generic"``).
        """
        eng = self.eng
        if ids is None:
            T = min(n_tokens, max(2, int(eng.g.n_ctx or n_tokens)))
            vocab = int(eng.arch.lm_head.weight.shape[0])
            ids = (torch.arange(T) * 7919 + 11) % max(vocab - 1, 1) + 1
        ids = ids.detach().reshape(-1)
        T = int(ids.numel())
        with self._timed():
            ref = check.model_reference(eng, ids)
            if check.teacher_forced(eng.dtype):
                worst = check.compare_teacher_forced(eng, ids, ref, range(T), tol)
            else:
                res = eng.forward(Plan(read=list(range(T)), ids=ids, keep=True))
                assert res.cache is not None
                worst = check.compare(eng, res.cache, res.out[0], ref, range(T), tol)
        self._passed(T)
        return worst

    def patches(self, ids: Int[Tensor, "pos"], base: "RunCache", src: "RunCache", start: int,
                read: Sequence[int]) -> float:
        """A patched row against the model's forward with a hook_z patch
        (:func:`~headscope.patching.reference_check.check_patches`), once per new prompt length for this model and these
        assumptions; 0.0 when checked before or checks are off.

        Raises:
            EngineMismatch: naming the layer, head and fix.
        """
        T = int(ids.numel())
        rec = self.record()
        done = max(self.own.patch_checked_len, rec.patch_checked_len if rec is not None else 0)
        if not self.enabled or T <= done:
            return 0.0
        with self._timed():
            d = check.check_patches(self.eng, ids, base, src, start, read)
        self._passed(T, patched=True)
        return d
