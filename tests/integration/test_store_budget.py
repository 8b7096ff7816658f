"""The state budget per prefill instance in MooncakeStore (#16 item 4), with a real
Redis and a real mooncake_master: under a workload larger than the budget the
state bytes a worker holds stay within it, the least valuable objects are
evicted (index entry first, then the object), and a long shared system prompt
survives a flood of one-off prompts, still promised by the index and loaded by
another instance. The publisher's clock is frozen, so values age by cache
turnovers only and every eviction is determined by the request sequence."""

from __future__ import annotations

import pytest

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.hashing import BlockHash
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from hybridpd.models.bundled import resolve_model_dir
from hybridpd.store.client import CheckpointStore
from hybridpd.store.master import MooncakeMaster
from services.prefill.actor import PrefillWorker
from services.worker.messages import PrefillCommand
from tests.unit.engine_helpers import prompt

NAMES = ("prefill-budget-0", "prefill-budget-1")
UNIT = 16
SYSTEM = prompt(96, 7001)  # the shared system prompt: 6 blocks, checkpointed at its end
BUDGET_MB = 0.9  # room for 4 state objects of the tiny model (3 delta layers: 224,256 bytes + header)


def _req(rid: str, tokens: tuple[int, ...], checkpoints: tuple[int, ...] = ()) -> EngineRequest:
    # max_tokens=1: the request finishes at prefill (no handoff to offer)
    return EngineRequest(RequestId(rid), tokens, SamplingParams(max_tokens=1, ignore_eos=True), checkpoints=checkpoints)


def _state_key(eng: NativeEngine, tokens: tuple[int, ...], pos: int) -> BlockHash:
    return eng.hasher.chain(list(tokens[:pos]))[pos // UNIT - 1]


def _promised(index: PrefixIndex, h: BlockHash) -> bool:
    return bool(index.r.exists(index.keys.st(h)))


@pytest.mark.usefixtures("fp32_row_exact")
def test_the_shared_system_prompt_survives_a_flood_within_the_budget(
    redis_server: RedisServer, mooncake_master: MooncakeMaster
) -> None:
    # B = 64: the hits at 96 leave no tail of their own (slot-column rule), so only the
    # checkpoints named below are put
    cfg = load_config(env={}, overrides={"store_state_budget_mb": BUDGET_MB, "mamba_block_size": 64})
    budget = int(BUDGET_MB * (1 << 20))
    eng = NativeEngine(cfg, resolve_model_dir(cfg.model), role="prefill", instance=NAMES[0], export_checkpoints=True)
    master = (mooncake_master.address, mooncake_master.metadata_url)
    w = PrefillWorker(cfg, NAMES[0], redis_server.url, *master, engine=eng)
    w.publisher.budget.clock = lambda: 1.0e9  # ages are turnovers only: deterministic
    index = PrefixIndex(redis_server.url, eng.model_id)
    store = w.store
    assert store is not None and w.publisher.ledger.budget_bytes == budget
    put: dict[BlockHash, int] = {}  # every state object this worker put -> position
    all_tokens: list[tuple[int, ...]] = []
    w2 = None
    try:

        def run(rid: str, tokens: tuple[int, ...], checkpoints: tuple[int, ...] = ()) -> int:
            all_tokens.append(tokens)
            res = w.prefill(PrefillCommand(_req(rid, tokens, checkpoints)))
            assert w.publisher.settle(60), "the export thread did not finish"
            held = w.publisher.ledger_stats()
            assert held.nbytes <= budget, (rid, held)  # never over the budget
            return res.num_cached_tokens

        # the system prompt, 5 times: the first checkpoints its end (a junction) and its
        # tail (112); the other 4 hit 96 locally, and each hit is counted in the index
        sys_key = _state_key(eng, SYSTEM, 96)
        assert run("s0", SYSTEM + prompt(20, 7100), checkpoints=(96,)) == 0
        put[sys_key] = 96
        put[_state_key(eng, SYSTEM + prompt(20, 7100), 112)] = 112
        for i in range(1, 5):
            assert run("s%d" % i, SYSTEM + prompt(20, 7100 + i)) == 96
        assert index.state_hits([sys_key]) == [(4, 1.0e9)]
        obj = w.publisher.ledger.entries[sys_key].nbytes
        assert budget // obj == 4 and w.counters.checkpoint_state_bytes == w.publisher.ledger.nbytes
        # the flood: 8 one-off prompts (tail checkpoint at 96 each), twice the budget
        for i in range(8):
            tokens = prompt(100, 7200 + i)
            assert run("o%d" % i, tokens) == 0
            put[_state_key(eng, tokens, 96)] = 96

        held = set(w.publisher.ledger.entries)
        evicted = set(put) - held
        assert len(held) == 4 and len(evicted) == 6 == w.counters.checkpoint_evictions
        assert w.counters.checkpoint_exports == 10 and w.counters.checkpoint_export_failures == 0
        assert sys_key in held, "the shared system prompt's checkpoint was evicted"
        # the index never promises what is gone, and the store really lost it
        for h in evicted:
            assert not _promised(index, h)
            assert store.exists([store.key("st", h)]) == [False]
        for h in held:
            assert _promised(index, h)
            assert store.exists([store.key("st", h)]) == [True]
        stats = w.stats()["store_state"]
        assert stats["bytes"] == 4 * obj <= budget and stats["objects"] == 4
        assert stats["tokens"] == 4 * 96 and stats["bytes_per_token"] == obj / 96

        # another instance, with an empty cache, is routed to the store hit and loads it
        later = SYSTEM + prompt(30, 7300)
        all_tokens.append(later)
        chain = eng.hasher.chain(list(later))
        assert index.lookup(chain, len(later), UNIT, False).store_hit == 96
        eng2 = NativeEngine(cfg, resolve_model_dir(cfg.model), role="prefill", instance=NAMES[1])
        w2 = PrefillWorker(cfg, NAMES[1], redis_server.url, *master, engine=eng2)
        res = w2.prefill(PrefillCommand(_req("later", later), store_hit=96))
        assert (res.loaded_from_store, res.num_cached_tokens) == (96, 96)
        assert w2.publisher.settle(60)
        assert index.state_hits([sys_key])[0][0] == 5  # its reuse is counted for the owner's ledger
    finally:
        if w2 is not None:
            w2.close()
        w.close()
        kv = {h for t in all_tokens for h in eng.hasher.chain(list(t))}
        index.remove_store(kv_hashes=list(kv), state_hashes=list(put))
        for name in NAMES:
            index.clear_local(name)
        cleaner = CheckpointStore(*master, eng.model_id)
        try:
            cleaner.remove([cleaner.key("kv", h) for h in kv] + [cleaner.key("st", h) for h in put])
        finally:
            cleaner.close()


# -- what the publisher does when it cannot make room (fakes: no services needed) ---------------
class _FakeStore:
    """put_checkpoint's contract: make_room(state bytes) first; nothing written if it raises."""

    def __init__(self) -> None:
        self.objects: set[str] = set()

    def key(self, kind: str, h: BlockHash) -> str:
        return "%s/%s" % (kind, h.hex())

    def put_checkpoint(self, kv, st, unit, make_room=None):
        from hybridpd.store.client import PutResult

        if make_room is not None:
            make_room(100)
        self.objects.add(self.key("st", st.key))
        return PutResult(1, 100, 0.0, 100)

    def remove(self, keys: list[str]) -> list[str]:
        self.objects -= set(keys)
        return []  # every one removed


class _FakeIndex:
    def __init__(self) -> None:
        self.down = False
        self.entries: set[BlockHash] = set()

    def publish_store(self, block_hashes, state_hash, position) -> None:
        self.entries.add(state_hash)

    def remove_store(self, kv_hashes=(), state_hashes=()) -> None:
        from hybridpd.errors import UnavailableError

        if self.down:
            raise UnavailableError("redis down")
        self.entries -= set(state_hashes)

    def state_hits(self, hashes):
        return [(0, 0.0) for _ in hashes]


def test_without_the_index_nothing_is_evicted_and_nothing_more_is_put() -> None:
    import threading

    from hybridpd.engine.base import BufferMeta, KVExport, StateCheckpoint
    from services.prefill.publisher import CachePublisher
    from services.worker.metrics import PrefillCounters

    store, index, counters = _FakeStore(), _FakeIndex(), PrefillCounters()
    pub = CachePublisher(
        "p", index, store, UNIT, counters, threading.Lock(), lambda n, v: None,  # type: ignore[arg-type]
        state_budget_bytes=250, clock=lambda: 5.0,
    )  # fmt: skip
    try:

        def export(i: int) -> BlockHash:
            key = BlockHash(bytes([i]) * 32)
            meta = BufferMeta("m", "state", 16, "float32", (), "delta")
            pub.writer.put(KVExport(meta, ()), StateCheckpoint(meta, key, ()))
            assert pub.settle(10)
            return key

        a, b = export(1), export(2)
        assert index.entries == {a, b} and pub.ledger_stats().nbytes == 200
        index.down = True
        export(3)  # no room without evicting, and the index cannot drop an entry: skipped
        assert index.entries == {a, b} and len(store.objects) == 2 and pub.ledger_stats().nbytes == 200
        assert (counters.checkpoint_export_failures, counters.checkpoint_evictions) == (1, 0)
        index.down = False
        c = export(4)  # the oldest goes: entry first, then object
        assert index.entries == {b, c} and store.objects == {store.key("st", b), store.key("st", c)}
        assert counters.checkpoint_evictions == 1 and pub.ledger_stats().nbytes == 200
        pub.ledger.budget_bytes = 50  # an object larger than the whole budget is never put
        export(5)
        assert counters.checkpoint_export_failures == 2 and pub.ledger_stats().objects == 2
    finally:
        pub.close()
