"""Checkpoint exports -> MooncakeStore, then the index; reuses counted. One thread.

Each export (``Engine.pop_exports``: a prefix's KV blocks and the state at its
end) is put in the store within the state budget (``state_budget.py`` makes
room first, or the put is skipped), and published in the index only after
the put succeeded. A prefill that hit a prefix is counted as a reuse of the
state there (hashed here, off the request's path). Failures of any kind
degrade (counted, logged), never fail a request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hybridpd.checkpoint_value import ShareFull
from hybridpd.engine.base import EngineRequest, KVExport, StateCheckpoint
from hybridpd.errors import UnavailableError
from hybridpd.hashing import BlockHash, BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.store.client import CheckpointStore
from services.prefill.state_budget import StateBudget
from services.worker.metrics import PrefillCounters

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Hit:
    """A prefill of ``request`` that restored its first ``num_cached`` tokens (a prefix
    ending at a state checkpoint) at ``at``."""

    request: EngineRequest
    num_cached: int
    at: float


class StoreWriter:
    def __init__(
        self,
        index: PrefixIndex | None,
        store: CheckpointStore | None,
        unit: int,
        budget: StateBudget,
        counters: PrefillCounters,
        stats_lock: threading.Lock,
        observe: Callable[[str, float], None],
        hasher: BlockHasher | None = None,
        index_healthy: Callable[[], bool] = lambda: True,
    ) -> None:
        """``observe(histogram, seconds)``; ``index_healthy()``: reuse counts
        are skipped while the index is down (they would only wait for its timeout)."""
        self.index = index
        self.store = store
        self.unit = unit
        self.budget = budget
        self.counters = counters
        self.stats_lock = stats_lock
        self.observe = observe
        self.hasher = hasher
        self.index_healthy = index_healthy
        self._queue: queue.Queue[tuple[KVExport, StateCheckpoint] | _Hit] = queue.Queue()
        #: state keys of answer checkpoints not exported yet (their bytes are counted apart)
        self._answer_keys: dict[BlockHash, bool] = {}
        self._tag_lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="store-publisher", daemon=True).start()

    def put(self, kv: KVExport, st: StateCheckpoint) -> None:
        self._queue.put((kv, st))

    def record_hit(self, request: EngineRequest, num_cached: int) -> None:
        """A prefill of ``request`` restored its first ``num_cached`` tokens (a local or
        store hit): count a reuse of the state checkpoint there (keyed by the request's
        chain, hashed only where it came without one). Ignored without a store or an index."""
        if self.store is None or self.index is None or self.hasher is None or num_cached <= 0 or num_cached % self.unit:
            return
        self._queue.put(_Hit(request, num_cached, self.budget.clock()))

    def tag_answer(self, key: BlockHash) -> None:
        """The export of state ``key`` will be an answer checkpoint's: its bytes count
        as ``answer_checkpoint_bytes`` (bounded: the oldest tags go first)."""
        with self._tag_lock:
            self._answer_keys[key] = True
            while len(self._answer_keys) > 1024:
                self._answer_keys.pop(next(iter(self._answer_keys)))

    def settle(self, timeout_s: float) -> bool:
        """Wait until every export and hit queued so far is processed; False on timeout."""
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout_s)

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                if isinstance(item, _Hit):
                    if self.index_healthy() and self.hasher is not None:  # record_hit queues none without
                        req, n = item.request, item.num_cached
                        tokens = req.prompt_token_ids[:n]
                        chain = self.hasher.extend(req.block_hashes, tokens, cache_salt=req.cache_salt)
                        self.budget.record_hit(chain[-1], item.at)
                else:
                    self._export(*item)
            except Exception:  # this thread must outlive any one item
                logger.exception("store publisher: item dropped")
            finally:
                self._queue.task_done()

    def _export(self, kv: KVExport, st: StateCheckpoint) -> None:
        try:
            if self.store is None:
                raise UnavailableError("no MooncakeStore configured")
            key = st.key
            res = self.store.put_checkpoint(
                kv,
                st,
                self.unit,
                make_room=None if key is None else lambda n: self.budget.make_room(key, n, st.speculative),
            )
            if key is not None:  # held from the put on, published or not
                self.budget.added(key, res.state_bytes, st.meta.position, st.speculative)
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
