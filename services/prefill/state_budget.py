"""The state objects this instance put in MooncakeStore, kept within a budget by value.

A ledger (``ValueLedger``: bytes, position, last use, reuses) of the state
objects put, within ``budget_bytes``: before a put that would exceed it, the
least valuable (``hybridpd/checkpoint_value.py``) are evicted, index entry
first, then the object, so the index never promises what is gone; if that
cannot be done (the index is down) the put is skipped. Placed (speculative)
checkpoints hold at most their share until a prefill reuses one. Reuses come
from :meth:`StateBudget.record_hit` (a prefill that hit a prefix: counted in
the index for every instance's ledger) and from the index's counts, read at
most once per ``HIT_REFRESH_S`` when an eviction is due. KV block objects are
left to Mooncake's own eviction.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridpd.checkpoint_value import ValueLedger
from hybridpd.errors import UnavailableError
from hybridpd.hashing import BlockHash
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.store.client import CheckpointStore
from services.worker.metrics import PrefillCounters

logger = logging.getLogger(__name__)

#: how often (at most) the ledger re-reads the index's reuse counts, seconds
HIT_REFRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class LedgerStats:
    """The state objects this instance holds in the store (``stats()``, the gauge)."""

    nbytes: int
    objects: int
    tokens: int  # prompt tokens they restore, each counted at its position
    budget_bytes: int


class StateBudget:
    def __init__(
        self,
        ledger: ValueLedger,
        index: PrefixIndex | None,
        store: CheckpointStore | None,
        counters: PrefillCounters,
        stats_lock: threading.Lock,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock``: wall-clock seconds for the ledger's ages (reuse times come
        from every instance); tests freeze it."""
        self.ledger = ledger
        self.index = index
        self.store = store
        self.counters = counters
        self.stats_lock = stats_lock
        self.clock = clock
        self.lock = threading.Lock()  # written by the store writer's thread, read by stats / metrics
        self._hits_read_at = -math.inf  # time.monotonic() of the last read of the index's counts

    def stats(self) -> LedgerStats:
        with self.lock:
            led = self.ledger
            return LedgerStats(led.nbytes, len(led), led.tokens, led.budget_bytes)

    def make_room(self, key: BlockHash, nbytes: int, speculative: bool = False) -> None:
        """Evict the least valuable state objects until ``nbytes`` more (for ``key``;
        a re-put replaces its old bytes) fit the budget (a ``speculative`` one, a
        placed checkpoint: also their share, ``placement_share``). Raises, and so
        skips the put, when they cannot (larger than the budget; the index or the
        store failing)."""
        with self.lock:
            held = self.ledger.entries.get(key)
            need = nbytes - (held.nbytes if held is not None else 0)
            spec = speculative and (held is None or held.speculative)
            if self.ledger.fits(need, spec):
                return
        self._refresh_hits()
        with self.lock:
            victims = self.ledger.victims(need, keep=(key,), speculative=spec)
        self._evict(victims)

    def added(self, key: BlockHash, nbytes: int, position: int, speculative: bool) -> None:
        """A put of ``key`` succeeded: it is held from now on, published or not."""
        with self.lock:
            self.ledger.add(key, nbytes, position, self.clock(), speculative)

    def record_hit(self, key: BlockHash, at: float) -> None:
        """A prefill restored the state ``key``: count the reuse here and in the index."""
        with self.lock:
            self.ledger.hit(key, at)
        if self.index is None:
            return
        try:
            self.index.record_state_hits([(key, at)])
        except Exception as exc:  # a lost count only makes a checkpoint look less used
            logger.debug("reuse of a checkpoint not counted: %s", exc)

    def _evict(self, victims: list[BlockHash]) -> None:
        assert self.store is not None  # only a put (which needs the store) makes room
        if self.index is not None:  # the index first: it never promises an object that is gone
            self.index.remove_store(state_hashes=victims)
        stuck = set(self.store.remove([self.store.key("st", h) for h in victims]))
        gone = [h for h in victims if self.store.key("st", h) not in stuck]
        with self.lock:  # an object the store failed to remove still counts against the budget
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
        with self.lock:
            keys = list(self.ledger.entries)
        counts = self.index.state_hits(keys)
        with self.lock:
            for k, (n, t) in zip(keys, counts, strict=True):
                self.ledger.observe(k, n, t)
        self._hits_read_at = time.monotonic()
