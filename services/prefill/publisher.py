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
  That thread keeps a ledger of the state objects this instance put
  (``ValueLedger``: bytes, position, last use, reuses) within
  ``state_budget_bytes``: before a put that would exceed it, the least
  valuable (``hybridpd/checkpoint_value.py``) are evicted, index entry first,
  then the object, so the index never promises what is gone; if that cannot
  be done (the index is down) the put is skipped. Reuses come from
  ``record_hit`` (a prefill that hit a prefix: counted in the index for every
  instance's ledger) and from the index's counts, read at most once per
  ``HIT_REFRESH_S`` when an eviction is due. KV block objects are left to
  Mooncake's own eviction.

``flush`` lets a prefill return only once the events of its own step are in
the index (bounded wait), so the router's next lookup sees them; ``settle``
waits for the export thread (tests).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridpd.checkpoint_value import LINEAR_ONLY, ComputeModel, ShareFull, ValueLedger
from hybridpd.engine.base import CacheEvent, Engine, KVExport, StateCheckpoint
from hybridpd.errors import UnavailableError
from hybridpd.hashing import BlockHash, BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.store.client import CheckpointStore
from services.worker.metrics import PrefillCounters

logger = logging.getLogger(__name__)

#: hashes kept for replay while the index is unavailable
MAX_BACKLOG = 200_000
#: how often (at most) the ledger re-reads the index's reuse counts, seconds
HIT_REFRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class _Hit:
    """A prefill that restored ``tokens`` (a prefix ending at a state checkpoint) at ``at``."""

    tokens: tuple[int, ...]
    cache_salt: str | None
    at: float


@dataclass(frozen=True, slots=True)
class LedgerStats:
    """The state objects this instance holds in the store (``stats()``, the gauge)."""

    nbytes: int
    objects: int
    tokens: int  # prompt tokens they restore, each counted at its position
    budget_bytes: int


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
        self.instance = instance
        self.index = index
        self.store = store
        self.unit = unit
        self.counters = counters
        self.stats_lock = stats_lock
        self.observe = observe
        self.hasher = hasher
        #: wall-clock seconds for the ledger's ages (reuse times come from every instance); tests freeze it
        self.clock = clock
        self.ledger = ValueLedger(state_budget_bytes, half_life_s, compute, speculative_share)
        self._ledger_lock = threading.Lock()  # written by the export thread, read by stats / metrics
        self._hits_read_at = -math.inf  # time.monotonic() of the last read of the index's counts
        self._events: deque[CacheEvent] = deque()
        self._cond = threading.Condition()
        self._enqueued = 0  # batches collected
        self._applied = 0  # batches the index took (or that were dropped)
        self._exports: queue.Queue[tuple[KVExport, StateCheckpoint] | _Hit] = queue.Queue()
        #: state keys of answer checkpoints not exported yet (their bytes are counted apart)
        self._answer_keys: dict[BlockHash, bool] = {}
        self._tag_lock = threading.Lock()
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

    def record_hit(self, token_ids: Sequence[int], cache_salt: str | None, num_cached: int) -> None:
        """A prefill restored its first ``num_cached`` tokens (a local or store hit):
        count a reuse of the state checkpoint there (hashed and written by the export
        thread, off the request's path). Ignored without a store or an index."""
        if self.store is None or self.index is None or self.hasher is None or num_cached <= 0 or num_cached % self.unit:
            return
        self._exports.put(_Hit(tuple(token_ids[:num_cached]), cache_salt, self.clock()))

    def ledger_stats(self) -> LedgerStats:
        with self._ledger_lock:
            led = self.ledger
            return LedgerStats(led.nbytes, len(led), led.tokens, led.budget_bytes)

    def settle(self, timeout_s: float) -> bool:
        """Wait until every export and hit collected so far is processed; False on timeout."""
        q = self._exports
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout_s)

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

    def _write(self, batch: list[CacheEvent]) -> str:
        """Mirror ``batch``: "applied"; "retry" (the index is unavailable: kept
        for replay); "dropped" (any other error: the batch is lost, and since it
        may have held a removal, this instance's entries are cleared before the
        next batch: the index may under-claim, never claim what is gone)."""
        assert self.index is not None
        try:
            if not self._cleared:  # a restarted actor, or a batch was lost: start from empty
                self.index.clear_local(self.instance)
                self._cleared = True
            self.index.apply_local(self.instance, batch)
        except UnavailableError as exc:
            logger.debug("index unavailable, %d cache events kept for replay: %s", len(batch), exc)
            with self._cond:
                self._healthy = False
                self._cond.notify_all()  # a waiting flush gives up
            return "retry"
        except Exception:
            logger.exception("%d cache events not published (dropped; this instance's entries are cleared)", len(batch))
            with self._cond:
                self._cleared = False
            self._count_dropped(batch)
            return "dropped"
        self._healthy = True
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
                item = self._exports.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                if isinstance(item, _Hit):
                    if self._healthy:  # while the index is down a count would only wait for its timeout
                        self._record_hit(item)
                else:
                    self._export(*item)
            except Exception:  # this thread must outlive any one item
                logger.exception("store publisher: item dropped")
            finally:
                self._exports.task_done()

    def _export(self, kv: KVExport, st: StateCheckpoint) -> None:
        try:
            if self.store is None:
                raise UnavailableError("no MooncakeStore configured")
            key = st.key
            res = self.store.put_checkpoint(
                kv,
                st,
                self.unit,
                make_room=None if key is None else lambda n: self._make_room(key, n, st.speculative),
            )
            if key is not None:  # held from the put on, published or not
                with self._ledger_lock:
                    self.ledger.add(key, res.state_bytes, st.meta.position, self.clock(), st.speculative)
            with self._tag_lock:
                answer = key is not None and self._answer_keys.pop(key, False)
            with self.stats_lock:
                if answer:
                    self.counters.answer_checkpoint_bytes += res.bytes_written
                self.counters.checkpoint_exports += 1
                self.counters.checkpoint_export_bytes += res.bytes_written
                self.counters.checkpoint_state_bytes += res.state_bytes
            self.observe("store_put_seconds", res.seconds)
            if self.index is not None:  # published only after the put succeeded
                self.index.publish_store(kv.block_hashes, st.key, st.meta.position)
        except ShareFull as exc:  # a placed checkpoint larger than its share: not a failure
            with self.stats_lock:
                self.counters.placed_exports_skipped += 1
            logger.debug("placed checkpoint at %d not put: %s", st.meta.position, exc)
        except Exception as exc:  # store/index failures of any kind degrade, never fail
            with self.stats_lock:
                self.counters.checkpoint_export_failures += 1
            logger.warning("checkpoint at %d not published: %s", st.meta.position, exc)

    def tag_answer(self, key: BlockHash) -> None:
        """The export of state ``key`` will be an answer checkpoint's: its bytes count
        as ``answer_checkpoint_bytes`` (bounded: the oldest tags go first)."""
        with self._tag_lock:
            self._answer_keys[key] = True
            while len(self._answer_keys) > 1024:
                self._answer_keys.pop(next(iter(self._answer_keys)))

    # -- the state budget ----------------------------------------------------------------
    def _make_room(self, key: BlockHash, nbytes: int, speculative: bool = False) -> None:
        """Evict the least valuable state objects until ``nbytes`` more (for ``key``;
        a re-put replaces its old bytes) fit the budget (a ``speculative`` one, a
        placed checkpoint: also their share, ``placement_share``). Raises, and so
        skips the put, when they cannot (larger than the budget; the index or the
        store failing)."""
        with self._ledger_lock:
            held = self.ledger.entries.get(key)
            need = nbytes - (held.nbytes if held is not None else 0)
            spec = speculative and (held is None or held.speculative)
            if self.ledger.fits(need, spec):
                return
        self._refresh_hits()
        with self._ledger_lock:
            victims = self.ledger.victims(need, keep=(key,), speculative=spec)
        self._evict(victims)

    def _evict(self, victims: list[BlockHash]) -> None:
        assert self.store is not None
        if self.index is not None:  # the index first: it never promises an object that is gone
            self.index.remove_store(state_hashes=victims)
        stuck = set(self.store.remove([self.store.key("st", h) for h in victims]))
        gone = [h for h in victims if self.store.key("st", h) not in stuck]
        with self._ledger_lock:  # an object the store failed to remove still counts against the budget
            self.ledger.remove(gone)
        with self.stats_lock:
            self.counters.checkpoint_evictions += len(gone)
        logger.debug("evicted %d state checkpoints from the store (budget)", len(gone))
        if stuck:
            raise UnavailableError("the store did not remove %d state objects" % len(stuck))

    def _refresh_hits(self) -> None:
        """Merge every instance's reuse counts of our objects (at most once per HIT_REFRESH_S)."""
        if self.index is None or time.monotonic() - self._hits_read_at < HIT_REFRESH_S:
            return
        with self._ledger_lock:
            keys = list(self.ledger.entries)
        counts = self.index.state_hits(keys)
        with self._ledger_lock:
            for k, (n, t) in zip(keys, counts, strict=True):
                self.ledger.observe(k, n, t)
        self._hits_read_at = time.monotonic()

    def _record_hit(self, hit: _Hit) -> None:
        assert self.hasher is not None and self.index is not None
        key = self.hasher.chain(list(hit.tokens), cache_salt=hit.cache_salt)[-1]
        with self._ledger_lock:
            self.ledger.hit(key, hit.at)
        try:
            self.index.record_state_hits([(key, hit.at)])
        except Exception as exc:  # a lost count only makes a checkpoint look less used
            logger.debug("reuse of the checkpoint at %d not counted: %s", len(hit.tokens), exc)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
