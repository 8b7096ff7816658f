"""Lookups read from replicas (``read_replicas``), on one Redis with a replica
(``redis-server --replicaof``) and on a 3-master Redis Cluster with a replica
per master: the replica answers (its command counts show it, the primary's do
not move) and, once it has the primary's writes (WAIT), exactly what the
primary answers; a replica that is down is skipped for the primary within
the call that finds it down, one cut off from its primary from its next link
check (each second); dead instances are still reaped (on
the primary); a master killed during traffic is replaced by its replica and
the index keeps its entries through the failover, never an over-promise."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from hybridpd.errors import UnavailableError
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import LookupResult, PrefixIndex
from hybridpd.index.redis_cluster import LocalRedisCluster
from hybridpd.index.redis_server import RedisServer
from hybridpd.procs import free_port
from tests.index_checks import over_promised
from tests.wait import wait_until

pytestmark = pytest.mark.integration

UNIT = 4
HASHER = BlockHasher(unit=UNIT, seed="replica-test")
CHAIN = HASHER.chain(list(range(900, 900 + 100 * UNIT)))


def _evalsha_calls(host: str, port: int) -> int:
    stats = redis.Redis(host=host, port=port, socket_timeout=5).info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def _populate(index: PrefixIndex, rng: random.Random) -> None:
    """Random leading runs and states in the store and on three live instances."""
    n = rng.randrange(10, len(CHAIN))
    index.publish_store(CHAIN[:n], CHAIN[rng.randrange(n)], 0)
    for j in range(3):
        k = rng.randrange(1, len(CHAIN))
        index.publish_local("prefill-%d" % j, CHAIN[:k], [CHAIN[rng.randrange(k)] for _ in range(3)])
        index.heartbeat("prefill-%d" % j)


def _lookup(index: PrefixIndex, n: int) -> LookupResult:
    return index.lookup(CHAIN[: n // UNIT], n, UNIT, False)


@pytest.fixture(scope="module")
def primary_and_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, RedisServer]]:
    d = Path(tmp_path_factory.mktemp("replica"))
    primary = RedisServer(d)
    primary.start()
    replica = RedisServer(d, extra_args=["--replicaof", primary.host, str(primary.port)])
    try:
        replica.start()
        _wait_link(replica, True)
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


def _wait_link(node: RedisServer, up: bool) -> None:
    c = redis.Redis(host=node.host, port=node.port, socket_timeout=5)
    want = "up" if up else "down"
    wait_until(lambda: c.info("replication").get("master_link_status") == want, 30, 0.05, "replica link " + want)


def _synced(primary: PrefixIndex) -> None:
    """Every write so far is on the replicas (WAIT 1: at least one acknowledged)."""
    assert primary.r.execute_command("WAIT", 1, 5000) >= 1


def test_a_replica_answers_lookups_exactly_as_the_primary(primary_and_replica: tuple[RedisServer, RedisServer]) -> None:
    primary_srv, replica_srv = primary_and_replica
    model = "m-" + uuid.uuid4().hex[:8]
    on_primary = PrefixIndex(primary_srv.url, model)
    on_replica = PrefixIndex(primary_srv.url, model, read_replicas=True, replica_url=replica_srv.url)
    rng = random.Random(3)
    _lookup(on_primary, 8), _lookup(on_replica, 8)  # each server loads the script (a NOSCRIPT counts as a call)
    before = (_evalsha_calls(primary_srv.host, primary_srv.port), _evalsha_calls(replica_srv.host, replica_srv.port))
    lookups = 0
    for _ in range(30):
        _populate(on_primary, rng)
        _synced(on_primary)
        for _ in range(3):
            n = rng.randrange(1, len(CHAIN) * UNIT + 2)
            want = _lookup(on_primary, n)
            got = _lookup(on_replica, n)
            lookups += 1
            assert (got.store_hit, got.instance_hits, got.known) == (want.store_hit, want.instance_hits, want.known)
            assert (got.source, want.source) == ("replica", "primary")
    after = (_evalsha_calls(primary_srv.host, primary_srv.port), _evalsha_calls(replica_srv.host, replica_srv.port))
    assert after[0] - before[0] == lookups  # the reference index's own, none of the replica reader's
    assert after[1] - before[1] == lookups


def test_a_replica_that_is_down_or_cut_off_is_skipped_for_the_primary(
    primary_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    primary_srv, replica_srv = primary_and_replica
    model = "m-" + uuid.uuid4().hex[:8]
    index = PrefixIndex(primary_srv.url, model, read_replicas=True, replica_url=replica_srv.url, timeout_s=0.5)
    index.publish_local("prefill-0", CHAIN[:20], [CHAIN[9]])
    index.heartbeat("prefill-0")
    _synced(index)
    want = {"prefill-0": 10 * UNIT}
    assert (_lookup(index, 200).instance_hits, _lookup(index, 200).source) == (want, "replica")
    replica_c = redis.Redis(host=replica_srv.host, port=replica_srv.port, socket_timeout=5)
    # cut off: its link to the primary is down, so how stale it is has no bound
    replica_c.execute_command("REPLICAOF", primary_srv.host, str(free_port(primary_srv.host)))
    try:
        _wait_link(replica_srv, False)
        wait_until(lambda: _lookup(index, 200).source == "primary", 10, 0.1, "reads moving to the primary")
        assert _lookup(index, 200).instance_hits == want
    finally:
        replica_c.execute_command("REPLICAOF", primary_srv.host, str(primary_srv.port))
        _wait_link(replica_srv, True)
    wait_until(lambda: _lookup(index, 200).source == "replica", 10, 0.1, "reads back on the replica")
    # down: the call that finds it down is answered by the primary, not an error
    replica_srv.stop(timeout_s=2.0)
    try:
        got = _lookup(index, 200)
        assert (got.instance_hits, got.source) == (want, "primary")
    finally:
        replica_srv.start()
        _wait_link(replica_srv, True)
    wait_until(lambda: _lookup(index, 200).source == "replica", 10, 0.1, "reads back on the restarted replica")


def test_dead_instances_are_reaped_on_the_primary(primary_and_replica: tuple[RedisServer, RedisServer]) -> None:
    primary_srv, replica_srv = primary_and_replica
    model = "m-" + uuid.uuid4().hex[:8]
    index = PrefixIndex(primary_srv.url, model, heartbeat_ttl_s=0.3, read_replicas=True, replica_url=replica_srv.url)
    index.publish_local("a", CHAIN[:10], [CHAIN[9]])
    index.publish_local("b", CHAIN[:10], [CHAIN[9]])
    index.heartbeat("a")
    index.heartbeat("b")
    _synced(index)
    assert set(_lookup(index, 60).instance_hits) == {"a", "b"}
    members = lambda: {m.decode() for m in index.r.smembers(index.keys.instances)}  # noqa: E731
    assert members() == {"a", "b"}

    def only_b() -> bool:
        index.heartbeat("b")
        _synced(index)
        return _lookup(index, 60).instance_hits == {"b": 40} and members() == {"b"}

    wait_until(only_b, 10, 0.1, "a's heartbeat (0.3 s) to expire and a to be reaped from the primary's set")


@pytest.fixture(scope="module")
def replicated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    c = LocalRedisCluster(Path(tmp_path_factory.mktemp("rcluster")), masters=3, replicas=1)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_cluster_lookups_read_the_slots_replica(replicated_cluster: LocalRedisCluster) -> None:
    cluster = replicated_cluster
    rng = random.Random(11)
    for _ in range(6):  # models on various shards
        model = "m-" + uuid.uuid4().hex[:8]
        on_primary = PrefixIndex(cluster.url, model, cluster=True)
        on_replica = PrefixIndex(cluster.url, model, cluster=True, read_replicas=True)
        (rep,) = cluster.replicas_of(on_primary.keys.instances)
        node = cluster.nodes[rep]
        _populate(on_primary, rng)
        _wait_replicated(cluster, on_primary)
        _lookup(on_replica, 8)  # the replica loads the script (Redis 7 does not replicate SCRIPT LOAD)
        before = _evalsha_calls(node.host, node.port)
        for _ in range(4):
            n = rng.randrange(1, len(CHAIN) * UNIT + 2)
            want, got = _lookup(on_primary, n), _lookup(on_replica, n)
            assert (got.store_hit, got.instance_hits, got.known) == (want.store_hit, want.instance_hits, want.known)
            assert got.source == "replica"
        assert _evalsha_calls(node.host, node.port) - before == 4


def _wait_replicated(cluster: LocalRedisCluster, index: PrefixIndex) -> None:
    """WAIT 1 on the model's master: its replica has every write so far."""
    master = cluster.nodes[cluster.master_of(index.keys.instances)]
    assert redis.Redis(host=master.host, port=master.port).execute_command("WAIT", 1, 5000) >= 1


def test_a_failover_keeps_the_index_and_never_over_promises(replicated_cluster: LocalRedisCluster) -> None:
    """The model's master is killed during traffic: lookups fail fast until its
    replica is promoted (misses for the router), then answer with every entry
    the old master had (replicated), without republishing; the old master
    returns as the new one's replica and reads go to it again."""
    cluster = replicated_cluster
    model = "fo-" + uuid.uuid4().hex[:6]
    writer = PrefixIndex(cluster.url, model, cluster=True, timeout_s=0.3)
    reader = PrefixIndex(cluster.url, model, cluster=True, read_replicas=True, timeout_s=0.3)
    writer.publish_store(CHAIN[:60], CHAIN[49], 50 * UNIT)
    writer.publish_local("prefill-0", CHAIN[:90], [CHAIN[79]])
    writer.heartbeat("prefill-0")
    _wait_replicated(cluster, writer)
    want = _lookup(writer, len(CHAIN) * UNIT)
    assert (want.store_hit, want.instance_hits) == (50 * UNIT, {"prefill-0": 80 * UNIT})
    old_master = cluster.master_of(writer.keys.instances)
    (old_replica,) = cluster.replicas_of(writer.keys.instances)

    over: list[str] = []
    counts = {"ok": 0, "unavailable": 0}
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            for index in (writer, reader):
                try:
                    got = _lookup(index, len(CHAIN) * UNIT)
                    writer.heartbeat("prefill-0")
                except UnavailableError:
                    counts["unavailable"] += 1
                    continue
                counts["ok"] += 1
                if over_promised(got, want):
                    over.append("%s > %s" % (got, want))
            time.sleep(0.005)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    restarted = False
    try:
        wait_until(lambda: counts["ok"] >= 10, 20, 0.05, "traffic before the kill")
        cluster.stop_node(old_master)
        wait_until(lambda: cluster.master_of(writer.keys.instances) == old_replica, 30, 0.2, "the replica promoted")
        ok = counts["ok"]
        wait_until(lambda: counts["ok"] >= ok + 20, 30, 0.05, "lookups answered after the failover")
        got = _lookup(writer, len(CHAIN) * UNIT)
        assert (got.store_hit, got.instance_hits) == (want.store_hit, want.instance_hits)
        wait_until(  # no replica left for the slot (the promoted one is skipped at its next check)
            lambda: _lookup(reader, len(CHAIN) * UNIT).source == "primary",
            10,
            0.1,
            "reads on the new primary",
            retry_on=(UnavailableError,),  # the reader's slot map still names the old master: one miss, re-read
        )
        cluster.start_node(old_master)
        restarted = True
        wait_until(
            lambda: cluster.replicas_of(writer.keys.instances) == [old_master], 20, 0.1, "the old master a replica"
        )
        wait_until(
            lambda: _lookup(reader, len(CHAIN) * UNIT).source == "replica",
            20,
            0.1,
            "reads on the returned node",
            retry_on=(UnavailableError,),
        )
    finally:
        stop.set()
        thread.join(10)
        if not restarted:
            cluster.start_node(old_master)
    assert not over, over[:3]
    got = _lookup(reader, len(CHAIN) * UNIT)
    assert (got.store_hit, got.instance_hits, got.source) == (want.store_hit, want.instance_hits, "replica")
