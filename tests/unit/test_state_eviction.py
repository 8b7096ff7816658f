"""Local state-checkpoint eviction by value (#16 item 4): the pool's victim
chooser, StateCache's value bookkeeping and events, slots sized from
``state_cache_mb``, and an engine where a reused system prompt's checkpoint
survives a flood of one-off prompts that LRU order would have let evict it."""

from __future__ import annotations

import torch

from hybridpd.engine.base import CacheEventKind, EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.block_pool import BlockPool
from hybridpd.engine.native.delta import DeltaState
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.engine.native.state_cache import MIN_SLOTS, StateCache, slot_bytes, slots_for
from hybridpd.engine.native.state_slots import StateSlots
from hybridpd.hashing import BlockHash
from tests.unit.engine_helpers import make_engine, prompt

STORED, REMOVED = CacheEventKind.STORED, CacheEventKind.REMOVED
MCFG = HybridModelConfig(num_layers=4)  # the bundled tiny model's shape: 3 delta layers


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


# -- BlockPool's victim chooser ----------------------------------------------------------------
def test_a_chooser_picks_the_victim_and_the_removal_is_reported() -> None:
    events: list[tuple[CacheEventKind, BlockHash]] = []
    seen: list[list[int]] = []

    def last_free(free: object) -> int:
        order = list(free)  # type: ignore[call-overload]
        seen.append(order)
        return order[-1]

    pool = BlockPool(3, lambda k, x: events.append((k, x)), choose_victim=last_free)
    got = pool.allocate(3)
    assert got == [2, 1, 0] and seen[0] == [0, 1, 2]
    for slot, i in zip(got, (1, 2, 3), strict=True):
        pool.cache(slot, h(i))
    pool.free([2, 1, 0])  # free queue: 2, 1, 0 (oldest first)
    assert pool.allocate(1) == [0] and seen[-1] == [2, 1, 0]
    assert events[-1] == (REMOVED, h(3)) and pool.lookup(h(3)) is None
    assert [x for k, x in events if k is STORED] == [h(1), h(2), h(3)]
    pool.check_consistent()


def test_a_chooser_that_names_a_busy_slot_is_a_bug() -> None:
    pool = BlockPool(2, choose_victim=lambda free: 7)
    try:
        pool.allocate(1)
    except RuntimeError as exc:
        assert "not free" in str(exc)
    else:
        raise AssertionError("no error")


# -- StateCache ----------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _states(fill: float) -> list[DeltaState]:
    conv = torch.full((MCFG.conv_kernel - 1, MCFG.conv_dim), fill)
    ssm = torch.full((MCFG.delta_heads, MCFG.delta_key_dim, MCFG.delta_value_dim), fill)
    return [DeltaState(conv.clone(), ssm.clone()) for _ in range(3)]


class _Cache:
    """A StateCache (bookkeeping) with its StateSlots (tensors), written as the engine does."""

    def __init__(self, n: int, events: list[tuple[CacheEventKind, BlockHash]]) -> None:
        self.sc = StateCache(n, 3, MCFG, lambda k, x: events.append((k, x)), clock=Clock())
        self.slots = StateSlots(n, 3, MCFG, torch.device("cpu"))

    def store(self, key: BlockHash, states: list[DeltaState], pos: int) -> bool:
        """True when ``key`` is cached afterwards (held already, or written now)."""
        slot = self.sc.store(key, pos)
        if slot is not None:
            self.slots.write(slot, states)
            self.sc.written(slot)
        return self.sc.lookup(key) is not None

    def restore(self, slot: int) -> list[DeltaState]:
        self.sc.restored(slot)
        return self.slots.read(slot)


def test_a_reused_checkpoint_survives_one_offs_that_lru_would_keep() -> None:
    """3 slots: A (reused 3 times), then one-offs B, C, D, E, F at the same position.
    By value A stays for log2(1 + 3) = 2 turnovers after its last use; LRU (a plain
    pool where a restore refreshes recency) evicts A at the first one-off past capacity."""
    events: list[tuple[CacheEventKind, BlockHash]] = []
    c = _Cache(3, events)
    sc = c.sc
    lru = BlockPool(3)
    lru_slots: dict[BlockHash, int] = {}

    def lru_store(key: BlockHash) -> None:
        (slot,) = lru.allocate(1) or []
        lru_slots[key] = slot
        lru.cache(slot, key)
        lru.free([slot])

    c.store(h(0xA), _states(1.0), 96)
    lru_store(h(0xA))
    for _ in range(3):  # three admissions restore A
        slot = sc.lookup(h(0xA))
        assert slot is not None
        assert torch.equal(c.restore(slot)[0].ssm, _states(1.0)[0].ssm)
        lru.touch([lru_slots[h(0xA)]])
        lru.free([lru_slots[h(0xA)]])
    a_slot = sc.lookup(h(0xA))
    assert a_slot is not None and sc.hits[a_slot] == 3
    for i in (0xB, 0xC, 0xD, 0xE, 0xF):
        assert c.store(h(i), _states(float(i)), 96)
        lru_store(h(i))
    assert sc.lookup(h(0xA)) == a_slot, "the reused checkpoint was evicted"
    assert lru.lookup(h(0xA)) is None, "LRU keeps it too: the test shows nothing"
    # by value the one-offs went oldest first: B, C, D; E and F remain beside A
    assert [x for k, x in events if k is REMOVED] == [h(0xB), h(0xC), h(0xD)]
    assert set(sc.pool.cached) == {h(0xA), h(0xE), h(0xF)}
    # two turnovers (6 writes) after its last use A is worth what a new one-off is: it goes
    for i in range(0x10, 0x13):
        c.store(h(i), _states(0.0), 96)
    assert sc.lookup(h(0xA)) == a_slot
    for i in range(0x13, 0x15):
        c.store(h(i), _states(0.0), 96)
    assert sc.lookup(h(0xA)) is None and (REMOVED, h(0xA)) in events
    sc.pool.check_consistent()


def test_value_prefers_a_longer_prefix_and_an_empty_slot() -> None:
    events: list[tuple[CacheEventKind, BlockHash]] = []
    c = _Cache(2, events)
    sc = c.sc
    c.store(h(1), _states(1.0), 1024)
    c.store(h(2), _states(2.0), 64)
    slot1 = sc.lookup(h(1))
    assert slot1 is not None
    assert sc.value(slot1) > sc.value(1 - slot1)
    c.store(h(3), _states(3.0), 64)  # evicts the short one, though it is newer
    assert sc.lookup(h(1)) == slot1 and sc.lookup(h(2)) is None
    sc.pool.uncache(h(3))  # an empty slot is taken before any cached one
    c.store(h(4), _states(4.0), 16)
    assert sc.lookup(h(1)) == slot1 and sc.lookup(h(4)) is not None
    assert [k for k, _ in events] == [STORED, STORED, REMOVED, STORED, REMOVED, STORED]
    assert sc.writes == 4


def test_a_re_store_is_a_use() -> None:
    c = _Cache(2, [])
    sc = c.sc
    c.store(h(1), _states(1.0), 64)
    c.store(h(2), _states(2.0), 64)
    assert sc.store(h(1), 64) is None  # already cached: refreshed, nothing to write
    slot1 = sc.lookup(h(1))
    assert slot1 is not None and float(c.slots.ssm[slot1, 0, 0, 0, 0]) == 1.0
    c.store(h(3), _states(3.0), 64)
    assert sc.lookup(h(1)) == slot1 and sc.lookup(h(2)) is None


# -- sizing ----------------------------------------------------------------------------------------
def test_slots_are_sized_from_the_budget() -> None:
    nbytes = slot_bytes(3, MCFG)
    assert nbytes == 4 * 3 * ((4 - 1) * 768 + 4 * 64 * 64) == 224_256
    assert slots_for(64.0, 3, MCFG) == (64 << 20) // 224_256 == 299
    assert slots_for(1.0, 3, MCFG) == 4 and slots_for(0.01, 3, MCFG) == MIN_SLOTS
    eng = make_engine(state_cache_mb=8.0)
    try:
        sc, slots = eng.cache.state_cache, eng.runner.slots
        assert sc.slot_bytes == nbytes
        per_slot = (slots.conv[0].numel() * slots.conv.element_size()) + (
            slots.ssm[0].numel() * slots.ssm.element_size()
        )
        assert per_slot == nbytes
        assert eng.state_pool.num_slots == (8 << 20) // nbytes == 37
        assert eng.compute_model is sc.compute
    finally:
        eng.close()
    eng = make_engine(num_state_slots=3)  # the override tests use
    try:
        assert eng.state_pool.num_slots == 3
    finally:
        eng.close()


# -- the engine --------------------------------------------------------------------------------
def _shared_then_flood(lru_order: bool) -> tuple[int, int]:
    """4 state slots. A 96-token system prompt is sent 3 times with different
    suffixes (the first checkpoints its end: ``checkpoints=(96,)``; the others hit
    it), then 6 one-off 100-token prompts (a checkpoint at 96 each). Returns the
    hit a 4th request sharing the system prompt gets, and the state slot restores."""
    eng = make_engine(num_state_slots=4)
    if lru_order:
        eng.state_pool.choose_victim = None  # the pool's own order: oldest stored first
    system = prompt(96, 7)
    try:
        for i in range(3):
            tokens = system + prompt(20, 100 + i)
            r = EngineRequest(RequestId("s%d" % i), tokens, SamplingParams(max_tokens=1), checkpoints=(96,))
            eng.generate([r])
        for i in range(6):
            eng.generate([EngineRequest(RequestId("o%d" % i), prompt(100, 200 + i), SamplingParams(max_tokens=1))])
        sc = eng.cache.state_cache
        return eng.local_hit(system + prompt(20, 999)), sum(sc.hits)
    finally:
        eng.close()


def test_the_reused_system_prompt_survives_a_flood_by_value_not_by_age() -> None:
    hit, restores = _shared_then_flood(lru_order=False)
    assert hit == 96 and restores == 2
    hit_lru, _ = _shared_then_flood(lru_order=True)
    assert hit_lru == 0  # oldest-first would have evicted it


def test_a_slot_is_busy_until_written_and_an_abandoned_one_is_forgotten() -> None:
    """``store`` keys a slot the caller writes next: no other store takes it before
    ``written``; a step that failed ``abandon``s it, and no lookup finds the key."""
    events: list[tuple[CacheEventKind, BlockHash]] = []
    c = _Cache(2, events)
    sc = c.sc
    first = sc.store(h(1), 64)
    second = sc.store(h(2), 1024)
    assert first is not None and second is not None and first != second
    assert sc.store(h(3), 2048) is None  # both busy: nothing evicted for it
    sc.written(second)
    sc.abandon(first)
    assert sc.lookup(h(1)) is None and sc.lookup(h(2)) == second
    assert events == [(STORED, h(1)), (STORED, h(2)), (REMOVED, h(1))]
    assert sc.store(h(3), 16) == first  # the empty slot before the cached one
    sc.written(first)
    sc.pool.check_consistent()
