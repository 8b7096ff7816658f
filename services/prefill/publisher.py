"""The prefill worker's two outbound streams, drained after every engine step.

* **cache events** (``Engine.pop_cache_events``: what the local cache stored,
  evicted or cleared) are mirrored into this instance's index entries, in
  order, by one thread. A batch the index refuses (Redis down) is kept and
  replayed in order once it answers (the writes are idempotent), up to
  ``MAX_BACKLOG`` hashes; past that the oldest are dropped and counted, and
  the instance's entries are cleared before the rest is replayed (the index
  may then under-claim, never claim what is gone). At
  start the instance's old entries are cleared: a restarted actor has an empty
  cache, whatever its predecessor published.
* **checkpoint exports** (``Engine.pop_exports``) are put in MooncakeStore by
  another thread and published in the index only after the put succeeded.

``flush`` lets a prefill return only once the events of its own step are in
the index (bounded wait), so the router's next lookup sees them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable

from hybridpd.engine.base import CacheEvent, Engine, KVExport, StateCheckpoint
from hybridpd.errors import UnavailableError
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.store.client import CheckpointStore
from services.worker.metrics import PrefillCounters

logger = logging.getLogger(__name__)

#: hashes kept for replay while the index is unavailable
MAX_BACKLOG = 200_000


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
    ) -> None:
        self.instance = instance
        self.index = index
        self.store = store
        self.unit = unit
        self.counters = counters
        self.stats_lock = stats_lock
        self.observe = observe
        self._events: deque[CacheEvent] = deque()
        self._cond = threading.Condition()
        self._enqueued = 0  # batches collected
        self._applied = 0  # batches the index took (or that were dropped)
        self._exports: queue.Queue[tuple[KVExport, StateCheckpoint]] = queue.Queue()
        self._stop = threading.Event()
        self._cleared = index is None
        self._healthy = True  # the last index write succeeded (flush waits only then)
        threading.Thread(target=self._run_events, name="index-publisher", daemon=True).start()
        threading.Thread(target=self._run_exports, name="store-publisher", daemon=True).start()

    def collect(self, engine: Engine) -> None:
        """Take the engine's exports and cache events (loop thread, under the engine lock)."""
        for item in engine.pop_exports():
            self._exports.put(item)
        events = engine.pop_cache_events()
        if events and self.index is not None:
            with self._cond:
                self._events.extend(events)
                self._enqueued += 1
                self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every batch collected so far is in the index; False on timeout."""
        with self._cond:
            if not self._healthy:
                return False
            target = self._enqueued
            return self._cond.wait_for(
                lambda: self._applied >= target or not self._healthy or self._stop.is_set(), timeout_s
            )

    # -- cache events -> index ---------------------------------------------------------
    def _run_events(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: bool(self._events) or not self._cleared or self._stop.is_set(), 1.0)
                batch, target = list(self._events), self._enqueued
            if not self._cleared or batch:
                if self._write(batch):
                    with self._cond:
                        for _ in batch:
                            self._events.popleft()
                        self._applied = max(self._applied, target)
                        self._cond.notify_all()
                else:
                    self._trim_backlog()
                    self._stop.wait(0.5)

    def _write(self, batch: list[CacheEvent]) -> bool:
        assert self.index is not None
        try:
            if not self._cleared:  # a restarted actor: its predecessor's entries are gone
                self.index.clear_local(self.instance)
                self._cleared = True
            self.index.apply_local(self.instance, batch)
        except UnavailableError as exc:
            logger.debug("index unavailable, %d cache events kept for replay: %s", len(batch), exc)
            with self._cond:
                self._healthy = False
                self._cond.notify_all()  # a waiting flush gives up
            return False
        except Exception:
            logger.exception("cache events not published (dropped)")
            self._count_dropped(batch)
            return True
        self._healthy = True
        with self.stats_lock:
            self.counters.cache_events_published += len(batch)
        return True

    def _trim_backlog(self) -> None:
        with self._cond:
            dropped: list[CacheEvent] = []
            while self._events and sum(len(e.hashes) for e in self._events) > MAX_BACKLOG:
                dropped.append(self._events.popleft())
            if dropped:
                self._applied = self._enqueued  # readers waiting on flush: nothing to wait for
                # what was dropped may have been a removal: once Redis answers, clear this
                # instance's entries before replaying the rest (the index may then under-claim,
                # never claim what is gone)
                self._cleared = False
                self._cond.notify_all()
        if dropped:
            logger.warning("index unavailable: %d cache events dropped (backlog full)", len(dropped))
            self._count_dropped(dropped)

    def _count_dropped(self, batch: list[CacheEvent]) -> None:
        with self.stats_lock:
            self.counters.cache_events_dropped += len(batch)

    # -- exports -> store, then index ----------------------------------------------------
    def _run_exports(self) -> None:
        while not self._stop.is_set():
            try:
                kv, st = self._exports.get(timeout=0.5)
            except queue.Empty:
                continue
            self._export(kv, st)

    def _export(self, kv: KVExport, st: StateCheckpoint) -> None:
        try:
            if self.store is None:
                raise UnavailableError("no MooncakeStore configured")
            res = self.store.put_checkpoint(kv, st, self.unit)
            with self.stats_lock:
                self.counters.checkpoint_exports += 1
                self.counters.checkpoint_export_bytes += res.bytes_written
            self.observe("store_put_seconds", res.seconds)
            if self.index is not None:  # published only after the put succeeded
                self.index.publish_store(kv.block_hashes, st.key, st.meta.position)
        except Exception as exc:  # store/index failures of any kind degrade, never fail
            with self.stats_lock:
                self.counters.checkpoint_export_failures += 1
            logger.warning("checkpoint at %d not published: %s", st.meta.position, exc)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
