"""Cache events -> this instance's index entries, in order, by one thread.

A batch the index refuses (Redis down, or a failover's read-only replica) is
kept and replayed in order once it answers (the writes are idempotent), up to
``MAX_BACKLOG`` hashes; past that the oldest are dropped and counted, and the
instance's entries are cleared before the rest is replayed. A batch lost to
any other error clears them too. Either way the index may under-claim for a
while, never claim what is gone. At start the instance's old entries are
cleared: a restarted actor has an empty cache, whatever its predecessor
published. ``flush`` lets a prefill return only once its own step's events are
in the index (bounded wait), so the router's next lookup sees them.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Literal

from hybridpd.engine.base import CacheEvent
from hybridpd.errors import UnavailableError
from hybridpd.index.prefix_index import PrefixIndex
from services.worker.metrics import DecodeCounters, PrefillCounters

logger = logging.getLogger(__name__)

#: hashes kept for replay while the index is unavailable
MAX_BACKLOG = 200_000


class IndexMirror:
    def __init__(
        self,
        instance: str,
        index: PrefixIndex,
        counters: PrefillCounters | DecodeCounters,
        stats_lock: threading.Lock,
    ) -> None:
        self.instance = instance
        self.index = index
        self.counters = counters
        self.stats_lock = stats_lock
        self._events: deque[CacheEvent] = deque()
        self._cond = threading.Condition()
        self._enqueued = 0  # batches collected
        self._applied = 0  # batches the index took (or that were dropped)
        self._stop = threading.Event()
        self._cleared = False
        #: the last index write succeeded (flush waits only then)
        self.healthy = True
        threading.Thread(target=self._run, name="index-publisher", daemon=True).start()

    def add(self, events: list[CacheEvent]) -> None:
        """One step's events (the engine loop's thread)."""
        with self._cond:
            self._events.extend(events)
            self._enqueued += 1
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every batch added so far is in the index; False on timeout."""
        with self._cond:
            if not self.healthy:
                return False
            target = self._enqueued
            return self._cond.wait_for(
                lambda: self._applied >= target or not self.healthy or self._stop.is_set(), timeout_s
            )

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: bool(self._events) or not self._cleared or self._stop.is_set(), 1.0)
                batch, target = list(self._events), self._enqueued
            if not self._cleared or batch:
                outcome = self._write(batch)
                if outcome == "retry":
                    self._trim_backlog()
                else:
                    with self._cond:
                        for _ in batch:
                            self._events.popleft()
                        self._applied = max(self._applied, target)
                        self._cond.notify_all()
                if outcome != "applied":
                    self._stop.wait(0.5)

    def _write(self, batch: list[CacheEvent]) -> Literal["applied", "retry", "dropped"]:
        """Mirror ``batch``: "applied"; "retry" (the index is unavailable: kept
        for replay); "dropped" (any other error: the batch is lost, and since it
        may have held a removal, this instance's entries are cleared before the
        next batch)."""
        try:
            if not self._cleared:  # a restarted actor, or a batch was lost: start from empty
                self.index.clear_local(self.instance)
                self._cleared = True
            self.index.apply_local(self.instance, batch)
        except UnavailableError as exc:
            logger.debug("index unavailable, %d cache events kept for replay: %s", len(batch), exc)
            with self._cond:
                self.healthy = False
                self._cond.notify_all()  # a waiting flush gives up
            return "retry"
        except Exception:
            logger.exception("%d cache events not published (dropped; this instance's entries are cleared)", len(batch))
            with self._cond:
                self._cleared = False
            self._count_dropped(batch)
            return "dropped"
        self.healthy = True
        with self.stats_lock:
            self.counters.cache_events_published += len(batch)
        return "applied"

    def _trim_backlog(self) -> None:
        with self._cond:
            dropped: list[CacheEvent] = []
            while self._events and sum(len(e.hashes) for e in self._events) > MAX_BACKLOG:
                dropped.append(self._events.popleft())
            if dropped:
                self._applied = self._enqueued  # readers waiting on flush: nothing to wait for
                # what was dropped may have been a removal: clear before replaying the rest
                self._cleared = False
                self._cond.notify_all()
        if dropped:
            logger.warning("index unavailable: %d cache events dropped (backlog full)", len(dropped))
            self._count_dropped(dropped)

    def _count_dropped(self, batch: list[CacheEvent]) -> None:
        with self.stats_lock:
            self.counters.cache_events_dropped += len(batch)
