"""vLLM's KV events as our cache events (``engine/vllm/kv_events.py``), without vLLM:
the mapping reads events by class name and fields, so plain objects stand in.
The shapes are those vLLM 0.32 publishes (measured on the tiny Qwen3-Next): full
blocks with all their tokens, a prompt's partial tail as one unit's tokens under
its parent hash, one event per group, store puts with ``medium="cpu"`` and no kind."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.engine.vllm.kv_events import GroupSpec, KVEventFeed
from hybridpd.hashing import BlockHasher

U = 16
B = 64  # vLLM's block, four units
HYBRID = {0: GroupSpec("mamba", B), 1: GroupSpec("full_attention", B)}


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    group_idx: int = 0
    kv_cache_spec_kind: str | None = "full_attention"
    extra_keys: list | None = None
    medium: str | None = "GPU"


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    group_idx: int = 0
    medium: str | None = "GPU"


@dataclass
class AllBlocksCleared:
    medium: str | None = "GPU"


def _stored(kind: CacheGroup, hashes: list[bytes], store: bool = False) -> CacheEvent:
    return CacheEvent(CacheEventKind.STORED, kind, tuple(sorted(hashes)), store=store)


def _removed(kind: CacheGroup, hashes: list[bytes]) -> CacheEvent:
    return CacheEvent(CacheEventKind.REMOVED, kind, tuple(sorted(hashes)))


def _full(
    chain: list[bytes], tokens: list[int], blocks: int, group: int, kind: str | None, **kw: object
) -> BlockStored:
    """vLLM's event for the first ``blocks`` full blocks of a prompt in one group."""
    ends = [chain[(i + 1) * B // U - 1] for i in range(blocks)]
    return BlockStored(ends, None, tokens[: blocks * B], B, group, kind, **kw)  # type: ignore[arg-type]


def _partial(chain: list[bytes], tokens: list[int], pos: int, group: int, kind: str | None) -> BlockStored:
    """vLLM's event for a partial entry at ``pos``: the last unit's tokens under its parent."""
    k = pos // U
    return BlockStored([chain[k - 1]], chain[k - 2], tokens[pos - U : pos], U, group, kind)


def test_attention_blocks_become_unit_hashes_and_removals_follow() -> None:
    hasher = BlockHasher(unit=U)
    feed = KVEventFeed(hasher)
    tokens = list(range(1, 65))
    units = hasher.chain(tokens)
    feed.apply([BlockStored([units[1], units[3]], None, tokens, 32)])
    assert feed.pop() == [_stored(CacheGroup.KV, units)]
    feed.apply([BlockRemoved([units[3]])])
    assert feed.pop() == [_removed(CacheGroup.KV, units[2:4])]
    assert feed.mismatches == 0


def test_a_state_is_claimed_only_while_every_group_holds_it() -> None:
    hasher = BlockHasher(unit=U)
    feed = KVEventFeed(hasher, HYBRID)
    tokens = list(range(5, 5 + 2 * B + 3))
    chain = hasher.chain(tokens)
    feed.register_prompt(chain)
    feed.apply([_full(chain, tokens, 2, 0, "mamba"), _full(chain, tokens, 2, 1, "full_attention")])
    ends = [chain[3], chain[7]]
    assert feed.pop() == [_stored(CacheGroup.KV, chain[:8]), _stored(CacheGroup.STATE, ends)]
    # the Mamba group's block at 128 goes: the state there is gone, the attention KV stays
    feed.apply([BlockRemoved([chain[7]], group_idx=0)])
    assert feed.pop() == [_removed(CacheGroup.STATE, [chain[7]])]
    # the attention block at 64 goes: its units go, and the state at 64 with them
    feed.apply([BlockRemoved([chain[3]], group_idx=1)])
    assert feed.pop() == [_removed(CacheGroup.STATE, [chain[3]]), _removed(CacheGroup.KV, chain[:4])]


def test_a_partial_entry_covers_its_block_from_the_start_and_withdraws_it() -> None:
    """vLLM names only the last unit of a prompt's partial tail; the registered prompt
    gives the units between the block start and it (they were never removed before)."""
    hasher = BlockHasher(unit=U)
    feed = KVEventFeed(hasher, HYBRID)
    tokens = list(range(7, 7 + 100))  # 6 units; the tail checkpoint at (100 - 1) // 16 * 16 = 96
    chain = hasher.chain(tokens)
    feed.register_prompt(chain)
    feed.apply(
        [
            _full(chain, tokens, 1, 0, "mamba"),
            _full(chain, tokens, 1, 1, "full_attention"),
            _partial(chain, tokens, 96, 0, "mamba"),
            _partial(chain, tokens, 96, 1, "full_attention"),
        ]
    )
    assert feed.pop() == [_stored(CacheGroup.KV, chain[:6]), _stored(CacheGroup.STATE, [chain[3], chain[5]])]
    # a second prompt's partial entry at 80 in its own copy of that block: unit 5 covered twice
    feed.apply([_partial(chain, tokens, 80, 0, "mamba"), _partial(chain, tokens, 80, 1, "full_attention")])
    assert feed.pop() == [_stored(CacheGroup.STATE, [chain[4]])]
    feed.apply([BlockRemoved([chain[5]], group_idx=1)])  # the entry at 96 is evicted
    assert feed.pop() == [_removed(CacheGroup.STATE, [chain[5]]), _removed(CacheGroup.KV, [chain[5]])]
    feed.apply([BlockRemoved([chain[4]], group_idx=1)])  # and the one at 80: unit 5 has no cover left
    assert feed.pop() == [_removed(CacheGroup.STATE, [chain[4]]), _removed(CacheGroup.KV, [chain[4]])]
    assert feed.mismatches == 0 and feed.uncovered == 0


def test_an_unregistered_partial_entry_claims_only_what_its_tokens_prove() -> None:
    hasher = BlockHasher(unit=U)
    feed = KVEventFeed(hasher, HYBRID)
    tokens = list(range(9, 9 + 100))
    chain = hasher.chain(tokens)
    feed.apply([_partial(chain, tokens, 96, 1, "full_attention"), _partial(chain, tokens, 96, 0, "mamba")])
    # unit 5 alone: the run of KV from 0 is broken, so no lookup can reach the state at 96
    assert feed.pop() == [_stored(CacheGroup.KV, [chain[5]]), _stored(CacheGroup.STATE, [chain[5]])]


def test_store_puts_are_store_entries_and_never_change_a_local_group() -> None:
    """The defect: a store put (medium "cpu", no kind) overwrote the group's kind, so
    a later local Mamba removal went down the KV branch and the state stayed claimed."""
    hasher = BlockHasher(unit=U)
    feed = KVEventFeed(hasher)  # kinds learned from the local events only
    tokens = list(range(3, 3 + B + 1))
    chain = hasher.chain(tokens)
    feed.register_prompt(chain)
    feed.apply([_full(chain, tokens, 1, 0, "mamba"), _full(chain, tokens, 1, 1, "full_attention")])
    assert feed.pop() == [_stored(CacheGroup.KV, chain[:4]), _stored(CacheGroup.STATE, [chain[3]])]
    feed.apply(
        [
            _full(chain, tokens, 1, 0, None, medium="cpu"),
            BlockStored([chain[3]], None, [], B, 1, None, medium="cpu"),  # a put without tokens: the prompt's
        ]
    )
    assert feed.pop() == [_stored(CacheGroup.KV, chain[:4], store=True), _stored(CacheGroup.STATE, [chain[3]], True)]
    assert feed.kinds == {0: "mamba", 1: "full_attention"}
    feed.apply([BlockRemoved([chain[3]], group_idx=0)])
    assert feed.pop() == [_removed(CacheGroup.STATE, [chain[3]])]
    feed.apply([BlockRemoved([chain[3]], group_idx=0, medium="cpu")])  # never reported by Mooncake; ignored
    assert feed.pop() == []


def test_a_salted_first_block_put_is_proven_by_the_registered_prompt_only() -> None:
    """vLLM 0.32's store puts carry no extra keys (measured: tests/vllm/test_index_truth.py
    with the store connector's events forwarded), so a salted prompt's first block is not
    proven by its tokens (a mismatch, counted). The registered prompt names its units, so
    the store KV is claimed all the same; unregistered, nothing is."""
    hasher = BlockHasher(unit=U)
    tokens = list(range(11, 11 + B + 5))
    chain = hasher.chain(tokens, cache_salt="tenant")
    put = BlockStored([chain[3]], None, tokens[:B], B, 1, None, medium="cpu")  # the attention group's, no kind
    feed = KVEventFeed(hasher, HYBRID)
    feed.register_prompt(chain)
    feed.apply([put])
    assert feed.mismatches == 1
    assert feed.pop() == [_stored(CacheGroup.KV, chain[:4], store=True)]  # no state: no Mamba put came
    feed = KVEventFeed(hasher, HYBRID)
    feed.apply([put])
    assert feed.pop() == [] and feed.mismatches == 1 and feed.uncovered == 1


def test_a_block_that_does_not_match_our_chain_is_not_stored() -> None:
    hasher = BlockHasher(unit=U)
    feed = KVEventFeed(hasher)
    feed.apply([BlockStored([b"\x00" * 32], None, list(range(1, 17)), 16)])
    assert feed.pop() == [] and feed.mismatches == 1


def test_clear_and_a_gap_in_the_sequence_withdraw_everything() -> None:
    hasher = BlockHasher(unit=U)
    feed = KVEventFeed(hasher, HYBRID)
    for seq in (0, 1, 2):
        feed.check_sequence(seq)
    assert feed.pop() == [] and feed.gaps == 0
    tokens = list(range(11, 11 + B + 1))
    chain = hasher.chain(tokens)
    feed.apply([_full(chain, tokens, 1, 0, "mamba"), _full(chain, tokens, 1, 1, "full_attention")])
    feed.pop()
    feed.check_sequence(5)  # 3 and 4 were dropped by ZMQ: a removal may be among them
    assert feed.pop() == [CacheEvent(CacheEventKind.CLEARED, None)] and feed.gaps == 1
    feed.apply([BlockRemoved([chain[3]], group_idx=1)])  # forgotten with the clear: nothing to withdraw
    assert feed.pop() == []
    feed.apply([_full(chain, tokens, 1, 0, "mamba"), _full(chain, tokens, 1, 1, "full_attention")])
    assert feed.pop() == [_stored(CacheGroup.KV, chain[:4]), _stored(CacheGroup.STATE, [chain[3]])]
    feed.apply([AllBlocksCleared()])
    assert feed.pop() == [CacheEvent(CacheEventKind.CLEARED, None)]
