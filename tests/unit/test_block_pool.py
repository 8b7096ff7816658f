"""Tensor-free block pool: ref counts, prefix cache, LRU eviction, exact ids."""

from __future__ import annotations

import pytest

from hybridpd.engine.base import CacheEventKind
from hybridpd.engine.native.block_pool import BlockPool
from hybridpd.hashing import BlockHash


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def test_allocate_free_exact_ids() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None  # nothing taken on failure
    assert pool.num_free == 1
    pool.free([2, 1, 0])
    assert pool.num_free == 4
    # freed tail-first: eviction order is 3 (never used), then 2, 1, 0
    assert pool.allocate(4) == [3, 2, 1, 0]
    pool.check_consistent()


def test_cached_blocks_survive_until_evicted() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    assert a == [0, 1]
    assert pool.cache(0, h(1)) and pool.cache(1, h(2))
    pool.free(reversed(a))
    assert pool.lookup(h(1)) == 0 and pool.num_cached == 2
    pool.touch([0])  # a hit takes it out of the free queue
    assert pool.num_free == 2
    got = pool.allocate(2)  # evicts block 2 (never used) then block 1 (LRU among free)
    assert got == [2, 1]
    assert pool.lookup(h(2)) is None and pool.lookup(h(1)) == 0
    pool.check_consistent()


def test_duplicate_hash_keeps_first_and_rekey() -> None:
    pool = BlockPool(3)
    pool.allocate(3)
    assert pool.cache(0, h(5))
    assert not pool.cache(1, h(5))  # another slot holds it
    assert pool.lookup(h(5)) == 0
    assert pool.cache(0, h(6))  # re-key: old hash forgotten
    assert pool.lookup(h(5)) is None and pool.lookup(h(6)) == 0
    pool.uncache(h(6))
    assert pool.num_cached == 0


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(RuntimeError):
        pool.free(b)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[CacheEventKind, BlockHash]] = []

    def __call__(self, kind: CacheEventKind, block_hash: BlockHash) -> None:
        self.events.append((kind, block_hash))


def test_events_name_exactly_the_evicted_hashes() -> None:
    rec = Recorder()
    pool = BlockPool(4, rec)
    cached: list[BlockHash] = []
    for p in range(5):  # distinct "prompts" of 2 blocks each: past capacity from the 3rd
        blocks = pool.allocate(2)
        assert blocks is not None
        for i, b in enumerate(blocks):
            assert pool.cache(b, h(10 * p + i))
            cached.append(h(10 * p + i))
        pool.free(reversed(blocks))
    stored = [x for k, x in rec.events if k is CacheEventKind.STORED]
    removed = [x for k, x in rec.events if k is CacheEventKind.REMOVED]
    assert stored == cached
    # tail-first frees: prompt p's 2nd block is evicted before its 1st
    assert removed == [h(1), h(0), h(11), h(10), h(21), h(20)]
    assert set(removed) == set(cached) - set(pool.cached)
    pool.check_consistent()


def test_a_hash_stored_again_after_eviction_is_stored_again() -> None:
    rec = Recorder()
    pool = BlockPool(2, rec)
    a = pool.allocate(2)
    assert a == [0, 1]
    pool.cache(0, h(1))
    pool.free(a)
    b = pool.allocate(2)  # evicts h(1)
    assert b is not None
    pool.cache(b[0], h(1))
    assert rec.events == [
        (CacheEventKind.STORED, h(1)),
        (CacheEventKind.REMOVED, h(1)),
        (CacheEventKind.STORED, h(1)),
    ]


def test_no_event_without_a_change() -> None:
    rec = Recorder()
    pool = BlockPool(3, rec)
    pool.allocate(3)
    assert pool.cache(0, h(5))
    assert pool.cache(0, h(5))  # same slot, same hash: nothing changes
    assert not pool.cache(1, h(5))  # another slot holds it: refused, nothing changes
    assert pool.cache(0, h(6))  # re-key: h(5) leaves, h(6) enters
    pool.uncache(h(6))
    pool.uncache(h(6))  # already gone
    pool.free([0, 1, 2])
    assert pool.allocate(3) is not None  # nothing cached: no evictions to report
    assert rec.events == [
        (CacheEventKind.STORED, h(5)),
        (CacheEventKind.REMOVED, h(5)),
        (CacheEventKind.STORED, h(6)),
        (CacheEventKind.REMOVED, h(6)),
    ]
