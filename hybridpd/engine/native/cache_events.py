"""The native engine's cache-event stream (``Engine.pop_cache_events``).

Both ``BlockPool``s report every change of their cached hashes through a sink
bound to their group (``CacheGroup.KV`` for attention blocks, ``STATE`` for
checkpoint slots). The log keeps the changes in order and coalesces a run of
the same (kind, group) into one :class:`CacheEvent`::

    kv STORED a, kv STORED b, state STORED s, kv REMOVED a
      -> [CacheEvent(STORED, KV, (a, b)), CacheEvent(STORED, STATE, (s,)),
          CacheEvent(REMOVED, KV, (a,))]

Bounded: an engine nobody drains (a local engine, a benchmark) must not grow
without end. Past ``limit`` undrained hashes the log replaces its backlog by
a resync: CLEARED, then STORED of every hash the pools cache now. Applied to
any mirror, that gives the same result as the dropped backlog, and its size
is bounded by the pools' capacity.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.hashing import BlockHash

logger = logging.getLogger(__name__)


class CacheEventLog:
    def __init__(self, limit: int, snapshot: Callable[[], Iterable[tuple[CacheGroup, Iterable[BlockHash]]]]) -> None:
        """``snapshot`` returns, per group, every hash cached now (for a resync)."""
        self.limit = limit
        self._snapshot = snapshot
        self._runs: list[tuple[CacheEventKind, CacheGroup | None, list[BlockHash]]] = []
        self._size = 0

    def sink(self, group: CacheGroup) -> Callable[[CacheEventKind, BlockHash], None]:
        """The ``on_event`` callback of the pool holding ``group``."""

        def record(kind: CacheEventKind, block_hash: BlockHash) -> None:
            self.record(kind, group, block_hash)

        return record

    def record(self, kind: CacheEventKind, group: CacheGroup, block_hash: BlockHash) -> None:
        if self._runs and self._runs[-1][0] is kind and self._runs[-1][1] is group:
            self._runs[-1][2].append(block_hash)
        else:
            self._runs.append((kind, group, [block_hash]))
        self._size += 1
        if self._size > self.limit:
            self._resync()

    def _resync(self) -> None:
        logger.info("cache events: %d undrained changes, replaced by a resync", self._size)
        self._runs = [(CacheEventKind.CLEARED, None, [])]
        self._size = 0
        for group, hashes in self._snapshot():
            held = list(hashes)
            if held:
                self._runs.append((CacheEventKind.STORED, group, held))
                self._size += len(held)

    def drain(self) -> list[CacheEvent]:
        """Every change since the last call, in order, coalesced."""
        out = [CacheEvent(kind, group, tuple(hashes)) for kind, group, hashes in self._runs]
        self._runs, self._size = [], 0
        return out
