"""Tensor-free pool of fixed-size slots with prefix caching.

Used twice by the engine: for attention KV blocks (one block = ``u`` tokens)
and for recurrent-state checkpoint slots (one slot = the state of every delta
layer at one position). Bookkeeping only; the tensors live elsewhere.

States of a slot::

    free, uncached ──allocate──▶ in use (ref >= 1) ──free (ref 0)──▶ free
                                   │ cache(hash)                      │
                                   ▼                                  ▼
                               in use, cached ────free───▶ free, cached (evictable)

Free slots wait in an LRU queue; ``allocate`` takes the oldest first and
drops its hash (eviction). A cached free slot that gets ``touch``ed is taken
out of the queue again (a prefix-cache hit). A pool built with
``choose_victim`` takes the free slot that function picks instead (the state
pool: the least valuable checkpoint, ``state_cache.py``); the function sees
the free slots oldest first and must return one of them.

Cache events: every change to the set of cached hashes is reported to
``on_event`` once, as it happens: STORED when ``cache`` keys a slot by a new
hash, REMOVED when a hash leaves (eviction by ``allocate``, a re-key by
``cache``, ``uncache``). Re-caching a slot under the hash it already has, or
refusing a hash another slot holds, changes nothing and reports nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from hybridpd.engine.base import CacheEventKind
from hybridpd.hashing import BlockHash

#: receives each change of the cached set, in order
EventSink = Callable[[CacheEventKind, BlockHash], None]
#: picks the free slot ``allocate`` takes next, given the free slots oldest first
VictimChooser = Callable[[Iterable[int]], int]


class BlockPool:
    def __init__(
        self, num_slots: int, on_event: EventSink | None = None, choose_victim: VictimChooser | None = None
    ) -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self.on_event = on_event
        self.choose_victim = choose_victim
        self.ref = [0] * num_slots
        self.hash_of: list[BlockHash | None] = [None] * num_slots
        self.cached: dict[BlockHash, int] = {}
        # insertion order = eviction order (oldest first)
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot caching ``block_hash``, or None."""
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh slots with ref 1, or None (nothing taken) if too few free."""
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            slot = self._take()
            self._evict(slot)
            self.ref[slot] = 1
            out.append(slot)
        return out

    def _take(self) -> int:
        if self.choose_victim is None:
            return self.free_queue.popitem(last=False)[0]
        slot = self.choose_victim(self.free_queue)
        if slot not in self.free_queue:
            raise RuntimeError("choose_victim picked slot %d, which is not free" % slot)
        del self.free_queue[slot]
        return slot

    def touch(self, slots: Iterable[int]) -> None:
        """Take one more reference (a cache hit reusing these slots)."""
        for s in slots:
            if self.ref[s] == 0:
                del self.free_queue[s]
            self.ref[s] += 1

    def free(self, slots: Iterable[int]) -> None:
        """Drop one reference each. Pass a request's blocks tail first, so the
        tail of a prefix is evicted before its head."""
        for s in slots:
            if self.ref[s] <= 0:
                raise RuntimeError("double free of slot %d" % s)
            self.ref[s] -= 1
            if self.ref[s] == 0:
                self.free_queue[s] = None

    def cache(self, slot: int, block_hash: BlockHash) -> bool:
        """Key ``slot`` by ``block_hash``. False (no change) if another slot
        already caches that hash. Re-keys a slot that had another hash."""
        if self.cached.get(block_hash, slot) != slot:
            return False
        if self.hash_of[slot] == block_hash:  # already keyed so: no change, no event
            return True
        self._evict(slot)
        self.hash_of[slot] = block_hash
        self.cached[block_hash] = slot
        self._emit(CacheEventKind.STORED, block_hash)
        return True

    def uncache(self, block_hash: BlockHash) -> None:
        """Forget ``block_hash`` (e.g. its content failed verification)."""
        slot = self.cached.pop(block_hash, None)
        if slot is not None:
            self.hash_of[slot] = None
            self._emit(CacheEventKind.REMOVED, block_hash)

    def _evict(self, slot: int) -> None:
        old = self.hash_of[slot]
        if old is not None:
            self.hash_of[slot] = None
            if self.cached.get(old) == slot:
                del self.cached[old]
                self._emit(CacheEventKind.REMOVED, old)

    def _emit(self, kind: CacheEventKind, block_hash: BlockHash) -> None:
        if self.on_event is not None:
            self.on_event(kind, block_hash)

    def check_consistent(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests)."""
        assert all(r >= 0 for r in self.ref)
        assert set(self.free_queue) == {i for i, r in enumerate(self.ref) if r == 0}
        for h, s in self.cached.items():
            assert self.hash_of[s] == h
