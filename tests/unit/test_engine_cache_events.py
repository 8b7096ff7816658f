"""pop_cache_events: the native engine reports what its local prefix cache
stores and evicts, so the index can mirror it (issue #15's stale-index defect)."""

from __future__ import annotations

import itertools
from collections import defaultdict

from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.engine.native.cache_events import CacheEventLog
from hybridpd.hashing import BlockHash
from tests.unit.engine_helpers import assert_no_leaks, make_engine, prompt, req

STORED, REMOVED, CLEARED = CacheEventKind.STORED, CacheEventKind.REMOVED, CacheEventKind.CLEARED
KV, STATE = CacheGroup.KV, CacheGroup.STATE


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def test_log_coalesces_runs_in_order() -> None:
    log = CacheEventLog(100, lambda: [])
    for kind, group, i in [(STORED, KV, 1), (STORED, KV, 2), (STORED, STATE, 3), (REMOVED, KV, 1), (REMOVED, KV, 2)]:
        log.record(kind, group, h(i))
    assert log.drain() == [
        CacheEvent(STORED, KV, (h(1), h(2))),
        CacheEvent(STORED, STATE, (h(3),)),
        CacheEvent(REMOVED, KV, (h(1), h(2))),
    ]
    assert log.drain() == []


def test_log_past_its_limit_resyncs_from_the_pools() -> None:
    log = CacheEventLog(3, lambda: [(KV, [h(7), h(8)]), (STATE, [])])
    for i in range(4):
        log.record(STORED, KV, h(i))
    assert log.drain() == [CacheEvent(CLEARED, None), CacheEvent(STORED, KV, (h(7), h(8)))]


def _mirror(events: list[CacheEvent], mirror: dict[CacheGroup, set[BlockHash]]) -> list[tuple]:
    """Apply ``events`` to ``mirror``; returns them flattened (kind, group, hash)."""
    flat = []
    for ev in events:
        assert ev.kind is not CLEARED and ev.group is not None
        for x in ev.hashes:
            flat.append((ev.kind, ev.group, x))
            if ev.kind is STORED:
                assert x not in mirror[ev.group], "stored twice without a removal"
                mirror[ev.group].add(x)
            else:
                assert x in mirror[ev.group], "removed without being stored"
                mirror[ev.group].remove(x)
    return flat


def test_engine_events_follow_eviction_exactly() -> None:
    # 16 blocks of 16 tokens and 2 state slots; a 100-token prompt caches 6 KV
    # blocks and its checkpoint at 96 (and needs 7 blocks): past capacity at the 3rd
    eng = make_engine(num_kv_blocks=16, num_state_slots=2)
    prompts = [prompt(100, 40 + i) for i in range(5)]
    mirror: dict[CacheGroup, set[BlockHash]] = defaultdict(set)
    flat = []
    for i, toks in enumerate([*prompts, prompts[0]]):
        eng.generate([req("r%d" % i, toks, 1)])
        events = eng.pop_cache_events()
        for a, b in itertools.pairwise(events):  # coalesced: no two neighbours share (kind, group)
            assert (a.kind, a.group) != (b.kind, b.group)
        flat += _mirror(events, mirror)
        assert mirror[KV] == set(eng.kv_pool.cached)
        assert mirror[STATE] == set(eng.state_pool.cached)
    chains = [eng.hasher.chain(list(t)) for t in prompts]
    stored = [x for k, g, x in flat if k is STORED and g is KV]
    removed = [x for k, g, x in flat if k is REMOVED and g is KV]
    assert stored[:30] == [x for c in chains for x in c]  # every prompt block, once, in order
    assert removed  # the pool did evict
    # removed = evicted: everything not cached now (prompt 0 was stored again after its removal)
    assert set(removed) - set(chains[0]) == {x for c in chains for x in c} - set(eng.kv_pool.cached)
    # prompt 0 was evicted, then computed again: its blocks and checkpoint are stored again
    assert all(x in eng.kv_pool.cached for x in chains[0])
    assert [k for k, g, x in flat if x == chains[0][0] and g is KV] == [STORED, REMOVED, STORED]
    assert [k for k, g, x in flat if x == chains[0][5] and g is STATE] == [STORED, REMOVED, STORED]
    assert eng.pop_cache_events() == []
    assert_no_leaks(eng)


def test_an_engine_without_prefix_caching_reports_nothing() -> None:
    eng = make_engine(enable_prefix_caching=False)
    eng.generate([req("a", prompt(100, 1), 4)])
    assert eng.pop_cache_events() == []
