"""Tensor-free block pool: ref counts, prefix cache, LRU eviction, exact ids."""

from __future__ import annotations

import pytest

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
