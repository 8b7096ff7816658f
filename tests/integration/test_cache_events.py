"""One cache-event stream into the index (issue #15): a prefill worker mirrors
its engine's stored / removed / cleared events into a real Redis, in order;
evicted prefixes stop being claimed; an outage is replayed; a restarted
worker clears what its predecessor published. The engine is the toy engine
(tests/unit/toy_engine.py); ``test_native_eviction_*`` runs the native one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.errors import UnavailableError
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from hybridpd.procs import free_port
from services.prefill.actor import PrefillWorker
from services.router.routing import choose
from services.worker.messages import PrefillCommand
from tests.unit.toy_engine import ToyEngine
from tests.wait import Pending, wait_until

NAME = "prefill-0"


def _req(rid: str, seed: int, n: int = 40) -> EngineRequest:
    prompt = tuple((seed * 7919 + i * 104729) % 997 + 1 for i in range(n))
    return EngineRequest(RequestId(rid), prompt, SamplingParams(max_tokens=4))


def _claimed(index: PrefixIndex, eng: ToyEngine, req: EngineRequest) -> int:
    """The local hit the index promises NAME for ``req`` (what the router sees)."""
    index.heartbeat(NAME)
    chain = eng.hasher.chain(req.prompt_token_ids)
    return index.lookup(chain, len(req.prompt_token_ids), eng.unit, False).instance_hits.get(NAME, 0)


def test_the_index_follows_stores_and_evictions(redis_server: RedisServer) -> None:
    eng = ToyEngine(capacity=4)  # two 40-token prompts (2 full blocks each) fit
    index = PrefixIndex(redis_server.url, eng.model_id)
    index.publish_local(NAME, [b"\x01" * 32], [])  # a predecessor's entry: must go at start
    w = PrefillWorker(load_config(env={}), NAME, redis_server.url, None, None, engine=eng)
    try:
        a, b, c = _req("a", 1), _req("b", 2), _req("c", 3)
        w.prefill(PrefillCommand(a))
        kv, _ = index.local_entries(NAME)
        assert kv == set(eng.cache), "the prefill returned before its blocks were in the index"
        assert _claimed(index, eng, a) == 32
        w.prefill(PrefillCommand(b))
        w.prefill(PrefillCommand(c))  # evicts a's blocks
        assert eng.local_hit(a.prompt_token_ids) == 0
        kv, _ = index.local_entries(NAME)
        assert kv == set(eng.cache)
        assert _claimed(index, eng, a) == 0 and _claimed(index, eng, c) == 32
        # routed by what is really cached: a is a miss everywhere, c a local hit here
        loads = {NAME: 0.0, "prefill-1": 0.0}
        hits_a = {NAME: _claimed(index, eng, a)}
        assert choose(len(a.prompt_token_ids), sorted(loads), hits_a, 0, loads).kind == "miss"
        hits_c = {NAME: _claimed(index, eng, c)}
        decision = choose(len(c.prompt_token_ids), sorted(loads), hits_c, 0, loads)
        assert (decision.instance, decision.kind) == (NAME, "local_hit")
        assert w.stats()["cache_events_published"] > 0
    finally:
        w.close()
        index.clear_local(NAME)


def test_events_of_an_outage_are_replayed_in_order(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path)
    srv.start()
    eng = ToyEngine(capacity=4)
    w = PrefillWorker(load_config(env={}), NAME, srv.url, None, None, engine=eng)
    index = PrefixIndex(srv.url, eng.model_id)
    try:
        w.prefill(PrefillCommand(_req("a", 1)))
        srv.stop()
        t0 = time.monotonic()
        for i, seed in enumerate((2, 3, 4)):  # stored then evicted while Redis is down
            w.prefill(PrefillCommand(_req("x%d" % i, seed)))
        assert time.monotonic() - t0 < 10  # prefills do not wait on a dead index
        srv.start()  # same port, empty

        def replayed() -> bool | Pending:
            kv, _ = index.local_entries(NAME)
            return kv == set(eng.cache) or Pending("%d of %d hashes" % (len(kv), len(eng.cache)))

        wait_until(replayed, 15, 0.2, "the outage's events replayed in the index", retry_on=(UnavailableError,))
    finally:
        w.close()
        srv.stop()


def _kv_claimed(index: PrefixIndex) -> set:
    return index.local_entries(NAME)[0]


@contextmanager
def _own_redis(tmp_path: Path) -> Iterator[tuple[PrefillWorker, ToyEngine, PrefixIndex, redis.Redis]]:
    """A prefill worker (toy engine) publishing to a Redis of its own, and an admin
    connection to that Redis (its role and ACL are changed by the test)."""
    srv = RedisServer(tmp_path)
    srv.start()
    eng = ToyEngine(capacity=4)
    w = PrefillWorker(load_config(env={}), NAME, srv.url, None, None, engine=eng)
    admin = redis.Redis.from_url(srv.url)
    try:
        yield w, eng, PrefixIndex(srv.url, eng.model_id), admin
    finally:
        w.close()
        admin.close()
        srv.stop()


def test_a_failover_replica_keeps_the_batch_for_replay(tmp_path: Path) -> None:
    """Redis answers READONLY (the server became a replica, as in a failover):
    a transient error, so the removals are kept and replayed once it is a
    master again, and nothing is dropped (not cleared, not stale)."""
    with _own_redis(tmp_path) as (w, eng, index, admin):
        a = _req("a", 1)
        w.prefill(PrefillCommand(a))
        assert _kv_claimed(index) == set(eng.cache)
        admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a master that never answers
        for i, seed in enumerate((2, 3)):  # evicts a's blocks while writes are refused
            w.prefill(PrefillCommand(_req("x%d" % i, seed)))
        assert eng.local_hit(a.prompt_token_ids) == 0 and _kv_claimed(index) != set(eng.cache)
        admin.execute_command("REPLICAOF", "NO", "ONE")

        def replayed() -> bool | Pending:
            kv = _kv_claimed(index)
            return kv == set(eng.cache) or Pending("%d claimed, %d cached" % (len(kv), len(eng.cache)))

        wait_until(replayed, 15, 0.1, "the refused events replayed", retry_on=(UnavailableError,))
        assert w.stats()["cache_events_dropped"] == 0


def test_a_dropped_batch_clears_the_instance_so_nothing_removed_stays_claimed(tmp_path: Path) -> None:
    """An error that is not an outage (here: the operator's ACL denies SREM)
    loses a batch that held removals. The publisher then clears this
    instance's entries before the next batch: the index may under-claim for a
    while, never claim the evicted prefix."""
    with _own_redis(tmp_path) as (w, eng, index, admin):
        a = _req("a", 1)
        w.prefill(PrefillCommand(a))
        a_blocks = set(eng.cache)
        assert _kv_claimed(index) == a_blocks
        admin.execute_command("ACL", "SETUSER", "default", "-srem")
        for i, seed in enumerate((2, 3)):
            w.prefill(PrefillCommand(_req("x%d" % i, seed)))
        assert eng.local_hit(a.prompt_token_ids) == 0  # a was evicted; its removal was refused

        def not_claimed() -> bool | Pending:
            stale = _kv_claimed(index) & a_blocks
            return not stale or Pending("%d evicted blocks still claimed" % len(stale))

        wait_until(not_claimed, 10, 0.1, "the evicted prefix no longer claimed")
        assert w.stats()["cache_events_dropped"] >= 1
        admin.execute_command("ACL", "SETUSER", "default", "+srem")
        w.prefill(PrefillCommand(_req("y", 4)))
        assert _kv_claimed(index) <= set(eng.cache) and _kv_claimed(index)  # publishing again, truthfully


@pytest.mark.usefixtures("fp32_row_exact")
def test_native_eviction_is_published_one_step_later(redis_server: RedisServer) -> None:
    """The stale-index defect: the native engine's pool evicts, and the index must stop
    claiming the evicted prefix for this instance (it fails if eviction events are dropped)."""
    from hybridpd.engine.native.engine import NativeEngine
    from hybridpd.models.bundled import resolve_model_dir

    cfg = load_config(env={}, overrides={"num_kv_blocks": 16, "prefix_match_unit": 16})
    eng = NativeEngine(cfg, resolve_model_dir(cfg.model), role="prefill", instance=NAME)
    index = PrefixIndex(redis_server.url, eng.model_id)
    w = PrefillWorker(cfg, NAME, redis_server.url, None, None, engine=eng)
    try:
        # 72 tokens: 5 blocks each (a checkpoint at 64 is this prompt's hit), 16 blocks in all
        reqs = [_req("n%d" % i, 10 + i, n=72) for i in range(5)]
        claims = []
        for r in reqs:
            w.prefill(PrefillCommand(r))
            with w.loop.lock:
                real = [eng.local_hit(q.prompt_token_ids) for q in reqs]
            index.heartbeat(NAME)
            claimed = [
                index.lookup(eng.hasher.chain(q.prompt_token_ids), 72, eng.unit, False).instance_hits.get(NAME, 0)
                for q in reqs
            ]
            claims.append(claimed)
            assert claimed == real, [*claims, real]
        assert claims[0][0] > 0 and claims[-1][0] == 0, claims  # the first prompt was cached, then evicted
    finally:
        w.close()
        index.clear_local(NAME)
