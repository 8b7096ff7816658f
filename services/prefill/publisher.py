"""The prefill worker's two outbound streams, drained after every engine step.

Three jobs, one module each; :class:`CachePublisher` wires them to a worker:

* ``worker/index_mirror.py`` (:class:`IndexMirror`, one thread): the engine's cache
  events (``Engine.pop_cache_events``: what the local cache stored, evicted or
  cleared) mirrored into this instance's index entries, in order; outages
  replayed, lost batches cleared so the index never claims what is gone.
* ``store_writer.py`` (:class:`StoreWriter`, another thread): checkpoint
  exports (``Engine.pop_exports``) put in MooncakeStore, published in the
  index only after the put succeeded; reuses counted.
* ``state_budget.py`` (:class:`StateBudget`): the state objects this
  instance put, within ``store_state_budget_mb``, evicted by value.

``flush`` lets a prefill return only once the events of its own step are in
the index (bounded wait), so the router's next lookup sees them; ``settle``
waits for the store writer (tests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hybridpd.checkpoint_value import LINEAR_ONLY, ComputeModel, ValueLedger
from hybridpd.engine.base import Engine, EngineRequest
from hybridpd.hashing import BlockHash, BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.store.client import CheckpointStore
from services.prefill.state_budget import LedgerStats, StateBudget
from services.prefill.store_writer import StoreWriter
from services.worker.index_mirror import IndexMirror
from services.worker.metrics import PrefillCounters

__all__ = ["CachePublisher", "LedgerStats"]


class CachePublisher:
    def __init__(
        self,
        instance: str,
        index: PrefixIndex | None,
        store: CheckpointStore | None,
        unit: int,
        counters: PrefillCounters,
        stats_lock: threading.Lock,
        observe: Callable[[str, float], None],
        *,
        hasher: BlockHasher | None = None,
        state_budget_bytes: int = 1 << 30,
        half_life_s: float = 1800.0,
        compute: ComputeModel = LINEAR_ONLY,
        clock: Callable[[], float] = time.time,
        speculative_share: float = 1.0,
    ) -> None:
        ledger = ValueLedger(state_budget_bytes, half_life_s, compute, speculative_share)
        self.budget = StateBudget(ledger, index, store, counters, stats_lock, clock)
        self.mirror = IndexMirror(instance, index, counters, stats_lock) if index is not None else None
        mirror = self.mirror
        self.writer = StoreWriter(
            index,
            store,
            unit,
            self.budget,
            counters,
            stats_lock,
            observe,
            hasher,
            index_healthy=lambda: mirror is None or mirror.healthy,
        )

    @property
    def ledger(self) -> ValueLedger:
        return self.budget.ledger

    def collect(self, engine: Engine) -> None:
        """Take the engine's exports and cache events (loop thread, under the engine lock)."""
        for kv, st in engine.pop_exports():
            self.writer.put(kv, st)
        events = engine.pop_cache_events()
        if events and self.mirror is not None:
            self.mirror.add(events)

    def record_hit(self, request: EngineRequest, num_cached: int) -> None:
        self.writer.record_hit(request, num_cached)

    def tag_answer(self, key: BlockHash) -> None:
        self.writer.tag_answer(key)

    def ledger_stats(self) -> LedgerStats:
        return self.budget.stats()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every batch collected so far is in the index; False on timeout."""
        return True if self.mirror is None else self.mirror.flush(timeout_s)

    def settle(self, timeout_s: float) -> bool:
        """Wait until every export and hit collected so far is processed; False on timeout."""
        return self.writer.settle(timeout_s)

    def close(self) -> None:
        if self.mirror is not None:
            self.mirror.close()
        self.writer.close()
