"""The prefix index on a real 3-master Redis Cluster (redis-server in cluster
mode, started here): lookups equal the single-Redis index and the brute-force
reference on randomized chains, models spread over the shards, and a master
killed during traffic costs misses for its models, never an over-promise;
the index recovers when the master returns."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpd.checkpoints import known_prefix, longest_usable_hit
from hybridpd.errors import UnavailableError
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_cluster import LocalRedisCluster
from hybridpd.index.redis_server import RedisServer
from tests.index_checks import over_promised
from tests.wait import wait_until

pytestmark = pytest.mark.integration

UNIT = 4
HASHER = BlockHasher(unit=UNIT, seed="cluster-test")
CHAIN = HASHER.chain(list(range(500, 500 + 120 * UNIT)))  # 120 blocks: several of the script's chunks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    c = LocalRedisCluster(Path(tmp_path_factory.mktemp("cluster")), masters=3)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _publish(index: PrefixIndex, kv: list[bool], states: set[int], insts: list[tuple[list[bool], set[int]]]) -> None:
    index.publish_store([h for h, p in zip(CHAIN, kv, strict=True) if p], None, 0)
    for i in states:
        index.publish_store([], CHAIN[i], (i + 1) * UNIT)
    for j, (ikv, ist) in enumerate(insts):
        name = "prefill-%d" % j
        index.publish_local(name, [h for h, p in zip(CHAIN, ikv, strict=True) if p], [CHAIN[i] for i in ist])
        index.heartbeat(name)


_presence = st.lists(st.booleans(), min_size=len(CHAIN), max_size=len(CHAIN)).map(
    lambda xs: [True] * 40 + xs[40:]  # a long leading run, then holes
)
_states = st.sets(st.integers(0, len(CHAIN) - 1), max_size=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_tokens=st.integers(1, len(CHAIN) * UNIT + 3),
    kv=_presence,
    states=_states,
    insts=st.lists(st.tuples(_presence, _states), max_size=3),
    eagle=st.booleans(),
)
def test_cluster_lookup_equals_single_redis_and_brute_force(
    cluster: LocalRedisCluster,
    redis_server: RedisServer,
    n_tokens: int,
    kv: list[bool],
    states: set[int],
    insts: list[tuple[list[bool], set[int]]],
    eagle: bool,
) -> None:
    model = "m-" + uuid.uuid4().hex[:8]  # a fresh model: a fresh slot, anywhere in the cluster
    on_cluster = PrefixIndex(cluster.url, model, cluster=True)
    single = PrefixIndex(redis_server.url, model)
    for index in (on_cluster, single):
        _publish(index, kv, states, insts)
    nb = min(n_tokens // UNIT, len(CHAIN))
    got = on_cluster.lookup(CHAIN[:nb], n_tokens, UNIT, eagle)
    assert got == single.lookup(CHAIN[:nb], n_tokens, UNIT, eagle)

    def brute(present: list[bool], st_: set[int]) -> int:
        return longest_usable_hit(n_tokens, UNIT, present[:nb], {(i + 1) * UNIT for i in st_ if i < nb}, eagle)

    assert got.store_hit == brute(kv, states)
    assert got.instance_hits == {"prefill-%d" % j: brute(ikv, ist) for j, (ikv, ist) in enumerate(insts)}
    assert got.known == max(known_prefix(n_tokens, UNIT, g[:nb]) for g in [kv, *(i[0] for i in insts)])
    names = ["prefill-%d" % j for j in range(len(insts))]
    held = [x.lookup(CHAIN[:nb], n_tokens, UNIT, eagle, names).held for x in (on_cluster, single)]
    assert held[0] == held[1] and set(held[0]) == set(names)
    assert set(on_cluster.live_instances()) == set(single.live_instances()) == set(names)
    for name in names:
        assert on_cluster.local_entries(name) == single.local_entries(name)


def test_models_spread_over_the_shards_and_each_lookup_is_one_shard(cluster: LocalRedisCluster) -> None:
    owners = {
        cluster.master_of(PrefixIndex(cluster.url, "model-%d" % i, cluster=True).keys.instances) for i in range(12)
    }
    assert owners == {0, 1, 2}
    index = PrefixIndex(cluster.url, "spread", cluster=True)
    index.publish_store(CHAIN[:30], CHAIN[19], 20 * UNIT)
    index.publish_local("prefill-0", CHAIN[:50], [CHAIN[39]])
    index.heartbeat("prefill-0")
    home = cluster.master_of(index.keys.instances)
    for i, node in enumerate(cluster.nodes):  # every key of the model lives on its home shard
        keys = PrefixIndex(node.url, "probe").r.execute_command("KEYS", index.keys.prefix.replace("{", "\\{") + "*")
        assert (len(keys) > 0) == (i == home), (i, home, len(keys))


def test_a_master_killed_during_traffic_costs_misses_never_over_promises(cluster: LocalRedisCluster) -> None:
    """Two models, one on the master that is killed: while it is down, every call
    for that model fails fast with UnavailableError (the router routes on load
    and recomputes), the other model's lookups go on unchanged; when the master
    is back (empty) the model's hits are zero until published again, then exact."""
    models = ["victim-" + uuid.uuid4().hex[:6], ""]
    victim = PrefixIndex(cluster.url, models[0], cluster=True)
    home = cluster.master_of(victim.keys.instances)
    while True:  # a bystander model on another shard
        models[1] = "bystander-" + uuid.uuid4().hex[:6]
        bystander = PrefixIndex(cluster.url, models[1], cluster=True)
        if cluster.master_of(bystander.keys.instances) != home:
            break
    expected = {}
    for index in (victim, bystander):
        index.publish_store(CHAIN[:60], CHAIN[49], 50 * UNIT)
        index.publish_local("prefill-0", CHAIN[:90], [CHAIN[79]])
        index.heartbeat("prefill-0")
        expected[index.keys.prefix] = index.lookup(CHAIN, len(CHAIN) * UNIT, UNIT, False)
    assert expected[victim.keys.prefix].store_hit == 50 * UNIT

    over: list[str] = []
    counts = {"ok": 0, "unavailable": 0, "bystander_ok": 0, "bystander_failed": 0}
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            for index, key in ((victim, "ok"), (bystander, "bystander_ok")):
                want = expected[index.keys.prefix]
                try:
                    got = index.lookup(CHAIN, len(CHAIN) * UNIT, UNIT, False)
                    index.heartbeat("prefill-0")
                except UnavailableError:
                    counts["unavailable" if index is victim else "bystander_failed"] += 1
                    continue
                counts[key] += 1
                if over_promised(got, want):
                    over.append("%s: %s > %s" % (key, got, want))
            time.sleep(0.005)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    restarted = False
    try:
        wait_until(lambda: counts["ok"] >= 10, 20, 0.05, "traffic on both models before the kill")
        cluster.stop_node(home)
        wait_until(lambda: counts["unavailable"] >= 20, 20, 0.05, "lookups of the killed shard's model failing")
        before = counts["bystander_ok"]
        wait_until(lambda: counts["bystander_ok"] >= before + 20, 20, 0.05, "the bystander served while down")
        cluster.start_node(home)
        restarted = True
        wait_until(
            lambda: victim.lookup(CHAIN, len(CHAIN) * UNIT, UNIT, False).instance_hits.get("prefill-0") == 0,
            20,
            0.1,
            "the returned master answering (empty: heartbeats re-register, no hit yet)",
            retry_on=(UnavailableError,),
        )
    finally:
        stop.set()
        thread.join(10)
        if not restarted:
            cluster.start_node(home)  # the module's other tests need all three
    assert not over, over[:3]
    assert counts["bystander_failed"] == 0, counts
    # the index recovers: what the instance publishes again is found again, exactly
    victim.publish_store(CHAIN[:60], CHAIN[49], 50 * UNIT)
    victim.publish_local("prefill-0", CHAIN[:90], [CHAIN[79]])
    victim.heartbeat("prefill-0")
    assert victim.lookup(CHAIN, len(CHAIN) * UNIT, UNIT, False) == expected[victim.keys.prefix]


_ev = st.one_of(
    st.tuples(
        st.sampled_from(["stored", "removed"]),
        st.sampled_from(["kv", "state"]),
        st.booleans(),
        st.lists(st.integers(0, 5), min_size=1, max_size=3),
    ),
    st.just(("cleared", "", False, [])),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(_ev, max_size=12))
def test_apply_local_on_the_cluster_equals_single_redis(
    cluster: LocalRedisCluster, redis_server: RedisServer, batch: list
) -> None:
    """A batch of cache events (stored, removed, cleared; local and store) leaves the same
    entries on the cluster as on one Redis: its commands (one key per DEL in a
    pipeline) all run on the model's shard."""
    from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup

    model = "m-" + uuid.uuid4().hex[:8]
    on_cluster = PrefixIndex(cluster.url, model, cluster=True)
    single = PrefixIndex(redis_server.url, model)
    events = [
        CacheEvent(CacheEventKind.CLEARED, None)
        if kind == "cleared"
        else CacheEvent(CacheEventKind(kind), CacheGroup(group), tuple(CHAIN[i] for i in idx), store)
        for kind, group, store, idx in batch
    ]
    for index in (on_cluster, single):
        index.publish_local("i", CHAIN[:3], [CHAIN[2]])  # entries before the batch
        index.publish_store(CHAIN[:2], CHAIN[1], 2 * UNIT)
        index.apply_local("i", events)
        index.heartbeat("i")
    assert on_cluster.local_entries("i") == single.local_entries("i")
    got = on_cluster.lookup(CHAIN[:8], 8 * UNIT + 1, UNIT, False)
    assert got == single.lookup(CHAIN[:8], 8 * UNIT + 1, UNIT, False)
    on_cluster.clear_local("i")
    assert on_cluster.local_entries("i") == (set(), set())


def test_the_lookup_reloads_its_script_on_the_slots_node(cluster: LocalRedisCluster) -> None:
    """After SCRIPT FLUSH on the model's shard the next lookup loads the script there and answers."""
    index = PrefixIndex(cluster.url, "flush-" + uuid.uuid4().hex[:6], cluster=True)
    index.publish_local("prefill-0", CHAIN[:10], [CHAIN[9]])
    index.heartbeat("prefill-0")
    assert index.lookup(CHAIN, len(CHAIN) * UNIT, UNIT, False).instance_hits == {"prefill-0": 10 * UNIT}
    home = cluster.nodes[cluster.master_of(index.keys.instances)]
    PrefixIndex(home.url, "probe").r.script_flush()
    assert index.lookup(CHAIN, len(CHAIN) * UNIT, UNIT, False).instance_hits == {"prefill-0": 10 * UNIT}


def test_the_stack_refuses_a_cluster_mode_mismatch(
    cluster: LocalRedisCluster, redis_server: RedisServer, tmp_path: Path
) -> None:
    """--redis-url at a cluster node without --redis-cluster (and the reverse) is a ConfigError at start."""
    from hybridpd.config import load_config
    from hybridpd.errors import ConfigError
    from launch.stack import LocalStack

    for url, flag, words in ((cluster.url, False, "runs in cluster mode"), (redis_server.url, True, "does not run")):
        cfg = load_config(env={}, overrides={"redis_url": url, "redis_cluster": flag})
        stack = LocalStack(cfg, tmp_path)
        with pytest.raises(ConfigError, match=words):
            stack._start_redis()
