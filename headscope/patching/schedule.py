"""Scheduling of a patching sweep, apart from the compute it schedules: the work items, the shard a
process owns, the resumable store and the progress bar.

A sweep over ``pairs × layers`` is cut into items (one pair, one layer: that layer's head patches)
plus one ``base`` item per pair (m(x), m(x'), the answer-logit scale). Item ``idx`` (in pair-major
order) belongs to rank ``idx % world`` of a sharded sweep. Every finished item is written to the
:class:`~headscope.patching.store.Store` at once (atomically), so a rerun skips it, and after a
sharded sweep every rank reads the others' items back from the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from ..runtime import barrier
from .store import Store


@dataclass(frozen=True)
class Item:
    """One work item: the head patches of ``layer`` on pair ``pair``."""

    pair: int
    layer: int

    @property
    def key(self) -> str:
        return f"pair{self.pair:05d}_L{self.layer:03d}"


def base_key(pair: int) -> str:
    """Store key of a pair's unpatched metrics."""
    return f"pair{pair:05d}_base"


class Schedule:
    """Which items this process computes, what the store already holds, and the progress bar.

    Args:
        n_pairs: pairs of the sweep; heads: ``{layer: [head, ...]}`` to patch (ascending layers).
        store: the run's store (None: nothing stored or resumed).
        shard: ``(rank, world)`` of a sharded sweep (needs a store), or None.
        progress: show a tqdm bar (``desc``), counted in head patches.

    Raises:
        ValueError: a shard without a store, or outside ``0 <= rank < world``.
    """

    def __init__(self, n_pairs: int, heads: dict[int, list[int]], store: Store | None = None,
                 shard: tuple[int, int] | None = None, progress: bool = False, desc: str = "patching"):
        if shard is not None and (store is None or not 0 <= shard[0] < shard[1]):
            raise ValueError(f"shard={shard} needs 0 <= rank < world_size and a store_dir shared by all ranks")
        self.n_pairs, self.heads, self.store, self.shard = n_pairs, heads, store, shard
        self.items = [Item(i, layer) for i in range(n_pairs) for layer in sorted(heads)]
        self.done: dict[Item, dict[int, float]] = {}
        self.bases: dict[int, dict[str, float]] = {}
        self._left: dict[Item, int] = {}
        self.bar = tqdm(total=n_pairs * sum(len(v) for v in heads.values()), desc=desc, unit="patch",
                        disable=not progress)

    def mine(self, idx: int) -> bool:
        """Whether item (or pair) number ``idx`` belongs to this process."""
        return self.shard is None or idx % self.shard[1] == self.shard[0]

    def _stored(self, key: str) -> Any:
        return self.store.get(key) if self.store is not None and self.store.has(key) else None

    def load_bases(self, compute: Callable[[int], dict[str, float]]) -> None:
        """Each pair's base metrics: from the store, else ``compute(pair)`` (this process's pairs only), stored."""
        for i in range(self.n_pairs):
            have = self._stored(base_key(i))
            if have is not None:
                self.bases[i] = have
            elif self.mine(i):
                self.bases[i] = compute(i)
                if self.store is not None:
                    self.store.put(base_key(i), self.bases[i])
        self.leave_out_time()

    def leave_out_time(self) -> None:
        """Leave the time since the bar's last update out of its rate and remaining-time estimate: one-time work
        between patches (the pairs' base passes, an engine's self-check at a new length) made the first update of a
        SmolLM2 ranking come after ~77 s with an estimate of 2.5 hours for a run of ten minutes."""
        self.bar.unpause()

    def pending(self) -> dict[int, list[tuple[int, int]]]:
        """``{pair: [(layer, head), ...]}`` this process still has to compute (ascending layers); stored
        heads count as done (and advance the bar)."""
        work: dict[int, list[tuple[int, int]]] = {}
        for idx, it in enumerate(self.items):
            have = self._stored(it.key) or {}
            todo = [h for h in self.heads[it.layer] if h not in have]
            self.done[it] = dict(have)
            if todo and self.mine(idx):
                work.setdefault(it.pair, []).extend((it.layer, h) for h in todo)
                self._left[it] = len(todo)
            else:
                self.bar.update(len(self.heads[it.layer]))
        return work

    def record(self, pair: int, layer: int, head: int, value: float) -> None:
        """One computed head; a finished item is stored at once and advances the bar."""
        it = Item(pair, layer)
        self.done[it][head] = value
        self._left[it] -= 1
        if self._left[it] == 0:
            if self.store is not None:
                self.store.put(it.key, self.done[it])
            self.bar.update(len(self.heads[layer]))

    def gather(self) -> None:
        """After a sharded sweep: wait for every rank (a ``torch.distributed`` barrier when a process
        group is up), then read all items back from the store."""
        if self.shard is None:
            return
        barrier()
        assert self.store is not None
        for i in range(self.n_pairs):
            self.bases[i] = self.store.get(base_key(i))
        for it in self.items:
            self.done[it] = self.store.get(it.key)

    def close(self) -> None:
        self.bar.close()


def heads_by_layer(n_layers: int, n_heads: int, heads: Sequence[tuple[int, int]] | None = None) -> dict[int, list[int]]:
    """``{layer: [head, ...]}`` of the given (layer, head)s (default: every head).

    Raises:
        ValueError: a head outside the model.
    """
    out: dict[int, list[int]] = {}
    for layer, h in heads if heads is not None else [(a, b) for a in range(n_layers) for b in range(n_heads)]:
        if not (0 <= layer < n_layers and 0 <= h < n_heads):
            raise ValueError(f"head ({layer}, {h}) is outside the model's {n_layers} layers x {n_heads} heads")
        out.setdefault(int(layer), []).append(int(h))
    return out
