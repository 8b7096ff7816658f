"""vLLM's KV events as our cache events (``engine/vllm/kv_events.py``), without vLLM:
the mapping reads events by class name and fields, so plain objects stand in."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.engine.vllm.kv_events import KVEventFeed
from hybridpd.hashing import BlockHasher


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"
    extra_keys: list | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    group_idx: int = 0


def test_attention_blocks_become_unit_hashes_and_removals_follow() -> None:
    hasher = BlockHasher(unit=16)
    feed = KVEventFeed(hasher)
    tokens = list(range(1, 65))
    units = hasher.chain(tokens)
    feed.apply([BlockStored([units[1], units[3]], None, tokens, 32)])
    assert feed.pop() == [CacheEvent(CacheEventKind.STORED, CacheGroup.KV, tuple(units))]
    feed.apply([BlockRemoved([units[3]])])
    assert feed.pop() == [CacheEvent(CacheEventKind.REMOVED, CacheGroup.KV, tuple(units[2:4]))]
    assert feed.mismatches == 0


def test_a_block_that_does_not_match_our_chain_is_not_stored() -> None:
    hasher = BlockHasher(unit=16)
    feed = KVEventFeed(hasher)
    feed.apply([BlockStored([b"\x00" * 32], None, list(range(1, 17)), 16)])
    assert feed.pop() == [] and feed.mismatches == 1


def test_a_gap_in_the_sequence_withdraws_everything() -> None:
    feed = KVEventFeed(BlockHasher(unit=16))
    for seq in (0, 1, 2):
        feed.check_sequence(seq)
    assert feed.pop() == [] and feed.gaps == 0
    feed.check_sequence(5)  # 3 and 4 were dropped by ZMQ: a removal may be among them
    assert feed.pop() == [CacheEvent(CacheEventKind.CLEARED, None)] and feed.gaps == 1
    feed.check_sequence(6)
    assert feed.pop() == []
