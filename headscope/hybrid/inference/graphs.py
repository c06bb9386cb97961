"""CUDA-graph capture of a fixed-shape inference call (a prefill, a decode step): :func:`capture`, and
:class:`ShapeGraphs` (one graph per shape key, new data copied into its static inputs). Why: docs/hybrid.md,
"How the kernels work: CUDA graphs".
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

_recording = contextvars.ContextVar("headscope_graph_recording", default=False)


def recording() -> bool:
    """True inside :func:`warm_up` and :func:`capture` (and :func:`for_graph`): calls that a graph will replay,
    whose host time does not count, so the lean path may pick shapes for memory instead of host time
    (``prefill.block_tokens``). The warm-up and the capture see the same value, so the capture meets no shape the
    warm-up has not compiled and tuned."""
    return _recording.get()


@contextlib.contextmanager
def for_graph() -> Iterator[None]:
    """Mark the calls in the block as recorded for a CUDA graph (see :func:`recording`): wrap both your own
    warm-up and your own ``torch.cuda.graph`` capture in it, or neither."""
    tok = _recording.set(True)
    try:
        yield
    finally:
        _recording.reset(tok)


def warm_up(fn: Callable[[], Any], n: int, device: Any = None) -> None:
    """Run ``fn()`` ``n`` times on a side stream of ``device`` (default: the current CUDA device), as a
    CUDA-graph capture wants before it (compilation, autotuning and lazy initialisation happen here)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    with torch.cuda.device(dev), for_graph():
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(n):
                fn()
        torch.cuda.current_stream(dev).wait_stream(s)


def capture(fn: Callable[[], Any], warmup: int = 2, device: Any = None) -> tuple["torch.cuda.CUDAGraph", Any]:
    """Record ``fn()`` (no arguments, no host synchronisation) in a CUDA graph after ``warmup`` eager calls on a side
    stream of ``device`` (default: the current one; the call's tensors live there), which compile and tune what the
    call needs -> (graph, static output): ``graph.replay()`` re-runs the call and rewrites the static output and
    every buffer the call writes (e.g. a decode cache) in place.

    Raises:
        RuntimeError: CUDA is not available (call ``fn`` eagerly).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA graphs need a CUDA device; on this machine run the call eagerly "
                           "(StaticDecoder: prefill instead of prefill_graphed, step instead of capture/replay)")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    warm_up(fn, warmup, dev)
    with torch.cuda.device(dev), for_graph():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev)):
            out = fn()
    return graph, out


class ShapeGraphs:
    """CUDA graphs of one fixed-shape function, one per key, replayed on new data copied into static inputs.

    ``fn(*inputs) -> tuple of tensors`` is recorded once per key (after an eager warm-up that compiles and tunes
    it) over static input tensors; each later call of that key copies its data into them (``fill``), replays the
    graph and returns the static outputs, which the next call of any key may overwrite: read them on the same stream
    before calling again. All graphs of an instance share one memory pool per device (they run one after another on
    one stream, never concurrently, and their static inputs and outputs stay referenced, so no graph is handed
    another's live tensors). The least recently used graph is dropped beyond ``max_graphs``.

    On a CPU tensor, inside a capture or a graph recording of its own (:func:`recording`), or under ``torch.compile``,
    :meth:`run` calls ``fn`` on the static inputs directly: the same data path, without a graph. So does every call
    after a capture failed (warned once, with the error).
    """

    def __init__(self, fn: Callable[..., tuple], max_graphs: int = 8):
        self.fn, self.max_graphs = fn, max_graphs
        self._entries: dict = {}  # key -> (static inputs, graph or None, static outputs, the fill's memo)
        self._pools: dict = {}
        self.failed: Optional[str] = None  # why a capture failed: no graphs after it

    def _direct(self, dev: torch.device) -> bool:
        return (self.failed is not None or dev.type != "cuda" or recording()
                or torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling())

    def _capture(self, ins: list, dev: torch.device) -> tuple:
        """(graph, static outputs) of ``fn`` on ``ins`` after two warm-up calls (which may write ``ins``)."""
        pool = self._pools.setdefault(dev, torch.cuda.graph_pool_handle())
        warm_up(lambda: self.fn(*ins), 2, dev)
        with torch.cuda.device(dev), for_graph():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(dev)):
                outs = self.fn(*ins)
        return graph, outs

    def __len__(self) -> int:
        return len(self._entries)

    def release(self) -> None:
        """Drop every graph and static buffer (their memory returns to PyTorch's cache)."""
        self._entries.clear()
        self._pools.clear()

    def nbytes(self) -> int:
        """Bytes held between calls: the static inputs, and the graphs' memory pool (their outputs and the
        intermediates of the largest graph, reserved for the replays; on CPU, where there are no graphs, the
        outputs)."""
        held = {id(t): t.numel() * t.element_size() for ins, g, outs, _ in self._entries.values()
                for t in (*ins, *(outs if g is None else ())) if isinstance(t, torch.Tensor)}
        return sum(held.values()) + self.pool_bytes()

    def pool_bytes(self) -> int:
        """Bytes of the CUDA memory segments of the graphs' pool (0 without graphs)."""
        pools = {tuple(p) for p in self._pools.values()}
        if not pools:
            return 0
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", (0, 0))) in pools)

    def run(self, key: Any, make_inputs: Callable[[], list], fill: Callable[[list, dict], None]) -> tuple:
        """``fn``'s outputs for the inputs that ``fill(static, memo)`` copies into the static inputs of ``key`` (made
        by ``make_inputs()`` on its first call); ``memo`` is a dict kept with them, for ``fill`` to skip copies of
        what has not changed since its last call."""
        ent = self._entries.pop(key, None)
        ins, graph, outs, memo = ent if ent is not None else (make_inputs(), None, None, {})
        fill(ins, memo)
        dev = next(t.device for t in ins if isinstance(t, torch.Tensor))
        if graph is None and not self._direct(dev):
            while len(self._entries) >= self.max_graphs:
                self._entries.pop(next(iter(self._entries)))
            saved = [t.clone() if isinstance(t, torch.Tensor) else None for t in ins]  # fn may write its inputs
            try:
                graph, outs = self._capture(ins, dev)
            except Exception as e:  # noqa: BLE001 - e.g. a kernel that cannot be captured on this GPU / toolchain
                self.failed = f"{type(e).__name__}: {e}"
                self._entries.clear()
                graph = None
                warnings.warn(f"headscope: CUDA-graph capture failed ({self.failed}); running these calls without "
                              "graphs from now on", stacklevel=3)
            for t, s_ in zip(ins, saved):  # the warm-up's writes undone: the call starts from the filled inputs
                if s_ is not None:
                    t.copy_(s_)
            del saved
        if graph is None or self._direct(dev):  # the same data path, eagerly (or recorded into the caller's graph)
            out_now = self.fn(*ins)
            if graph is None:
                outs = out_now
            self._entries[key] = (ins, graph, outs, memo)
            return out_now
        graph.replay()
        self._entries[key] = (ins, graph, outs, memo)  # most recently used last
        return outs
