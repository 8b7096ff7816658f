"""Redis prefix index against a real redis-server: lookup == brute force,
liveness, repair of stale entries, outage and recovery, AUTH."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpd.checkpoints import known_prefix, longest_usable_hit
from hybridpd.errors import UnavailableError
from hybridpd.hashing import BlockHash, BlockHasher, HashAlgo
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from hybridpd.store.client import CheckpointStore
from hybridpd.store.loader import fetch_checkpoint
from hybridpd.store.master import MooncakeMaster
from tests.unit.engine_helpers import make_engine, prompt, req
from tests.wait import wait_until

UNIT = 4
HASHER = BlockHasher(unit=UNIT, seed="index-test")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_tokens=st.integers(1, 160),
    kv_present=st.lists(st.booleans(), min_size=40, max_size=40),
    st_present=st.lists(st.booleans(), min_size=40, max_size=40),
    inst_kv=st.lists(st.lists(st.booleans(), min_size=40, max_size=40), min_size=0, max_size=3),
    inst_st=st.lists(st.lists(st.booleans(), min_size=40, max_size=40), min_size=3, max_size=3),
    eagle=st.booleans(),
)
def test_lookup_equals_brute_force(
    redis_server: RedisServer,
    n_tokens: int,
    kv_present: list[bool],
    st_present: list[bool],
    inst_kv: list[list[bool]],
    inst_st: list[list[bool]],
    eagle: bool,
) -> None:
    index = PrefixIndex(redis_server.url, "m-" + uuid.uuid4().hex[:8])
    chain = HASHER.chain(list(range(100, 100 + 160)))
    nb = n_tokens // UNIT
    hashes = chain[:nb]
    index.publish_store([h for h, p in zip(chain, kv_present, strict=False) if p], None, 0)
    for h, p in zip(chain, st_present, strict=False):
        if p:
            index.publish_store([], h, 0)
    for i, kv in enumerate(inst_kv):
        name = "prefill-%d" % i
        index.publish_local(
            name,
            [h for h, p in zip(chain, kv, strict=False) if p],
            [h for h, p in zip(chain, inst_st[i], strict=False) if p],
        )
        index.heartbeat(name)
    got = index.lookup(hashes, n_tokens, UNIT, eagle)

    def brute(kv: list[bool], sp: list[bool]) -> int:
        states = {(i + 1) * UNIT for i in range(nb) if sp[i]}
        return longest_usable_hit(n_tokens, UNIT, kv[:nb], states, eagle)

    assert got.store_hit == brute(kv_present, st_present)
    assert got.instance_hits == {"prefill-%d" % i: brute(kv, inst_st[i]) for i, kv in enumerate(inst_kv)}
    assert got.known == max(known_prefix(n_tokens, UNIT, kv[:nb]) for kv in [kv_present, *inst_kv])


LONG = HASHER.chain(list(range(3000, 3000 + 420 * UNIT)))  # 420 blocks: several of the lookup's chunks


def _presence(run: int, toggles: set[int]) -> list[bool]:
    return [(i < run) != (i in toggles) for i in range(len(LONG))]


# around the scan chunks' boundaries: 31 store keys, 30 instance hashes per call
_EDGES = sorted({max(0, c * k + d) for c in (31, 30) for k in (1, 2, 4, 13) for d in (-1, 0, 1)})
_pos = st.one_of(st.integers(0, 419), st.sampled_from([0, 419, *_EDGES]))
_group = st.tuples(_pos, st.sets(_pos, max_size=4), st.sets(_pos, max_size=6))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_tokens=st.one_of(st.integers(1, 420 * UNIT + 3), st.just(420 * UNIT)),
    store=_group,
    insts=st.lists(_group, max_size=2),
    eagle=st.booleans(),
)
def test_long_chain_lookup_equals_brute_force(
    redis_server: RedisServer,
    n_tokens: int,
    store: tuple[int, set[int], set[int]],
    insts: list[tuple[int, set[int], set[int]]],
    eagle: bool,
) -> None:
    """Chains of many of the lookup's scan chunks: runs ending in any chunk,
    holes before and after the chunk boundaries, misses."""
    index = PrefixIndex(redis_server.url, "m-" + uuid.uuid4().hex[:8])
    nb = min(n_tokens // UNIT, len(LONG))
    kv = _presence(store[0], store[1])
    index.publish_store([h for h, p in zip(LONG, kv, strict=True) if p], None, 0)
    for i in store[2]:
        index.publish_store([], LONG[i], 0)
    for j, (run, toggles, states) in enumerate(insts):
        name = "prefill-%d" % j
        ikv = _presence(run, toggles)
        index.publish_local(name, [h for h, p in zip(LONG, ikv, strict=True) if p], [LONG[i] for i in states])
        index.heartbeat(name)
    got = index.lookup(LONG[:nb], n_tokens, UNIT, eagle)

    def brute(present: list[bool], states: set[int]) -> int:
        return longest_usable_hit(n_tokens, UNIT, present[:nb], {(i + 1) * UNIT for i in states if i < nb}, eagle)

    assert got.store_hit == brute(kv, store[2])
    assert got.instance_hits == {
        "prefill-%d" % j: brute(_presence(run, toggles), states) for j, (run, toggles, states) in enumerate(insts)
    }
    groups = [kv] + [_presence(run, toggles) for run, toggles, _ in insts]
    assert got.known == max(known_prefix(n_tokens, UNIT, g[:nb]) for g in groups)


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_lookup_key_layout(redis_server: RedisServer, algo: HashAlgo) -> None:
    """The script cuts keys and hashes out of one argument at a fixed stride: model
    ids with multi-byte characters and colons, 16- and 32-byte hashes, a hash named
    twice (EXISTS counts it twice), hashes of unequal length refused."""
    index = PrefixIndex(redis_server.url, "mödel:%s:" % uuid.uuid4().hex[:6])
    chain = BlockHasher(unit=UNIT, algo=algo, seed="layout").chain(list(range(200, 200 + 300 * UNIT)))
    index.publish_store(chain[:250], chain[199], 200 * UNIT)
    index.publish_local("i", chain[:140], [chain[129], chain[139]])
    index.heartbeat("i")
    got = index.lookup(chain, 300 * UNIT, UNIT, False)
    assert (got.store_hit, got.instance_hits) == (200 * UNIT, {"i": 140 * UNIT})
    assert index.lookup(chain, 300 * UNIT, UNIT, True).instance_hits == {"i": 130 * UNIT}
    index.publish_store([], chain[129], 0)
    dup = chain[:100] + chain[99:130] + chain[250:]  # 131 = one chunk and 3 blocks, then a hole
    got = index.lookup(dup, len(dup) * UNIT, UNIT, False)
    assert (got.store_hit, got.instance_hits) == (131 * UNIT, {"i": 131 * UNIT})
    assert index.lookup([], 1, UNIT, False).store_hit == 0
    with pytest.raises(ValueError):
        index.lookup([chain[0], BlockHash(chain[1][:8])], 3 * UNIT, UNIT, False)


def test_the_lookup_answers_decode_affinity_in_its_round_trip(redis_server: RedisServer) -> None:
    """``held_by``: each decode instance's leading run of the whole chain's KV blocks
    (across SMISMEMBER chunks and past the hit cap, without the state rule), whether
    or not it heartbeats; the hits are unchanged; a name with the separator is refused."""
    index = PrefixIndex(redis_server.url, "m-" + uuid.uuid4().hex[:8])
    chain = HASHER.chain(list(range(100 * UNIT)))
    index.publish_local("d0", chain[:75], [])  # 75: two chunks of 30 and 15 more
    index.publish_local("d1", chain[:3] + chain[4:90], [])  # a hole at block 4
    index.publish_local("d2", chain, [])  # all 100, though the hit cap is 99
    index.publish_local("p", chain[:50], [chain[49]])
    index.heartbeat("p")
    got = index.lookup(chain, 100 * UNIT, UNIT, False, ["d0", "d1", "d2", "d3"])
    assert got.held == {"d0": 75, "d1": 3, "d2": 100, "d3": 0}
    assert got.instance_hits == {"p": 50 * UNIT} == index.lookup(chain, 100 * UNIT, UNIT, False).instance_hits
    assert index.lookup(chain, 100 * UNIT, UNIT, False).held == {}
    with pytest.raises(ValueError, match="newline"):
        index.lookup(chain, 100 * UNIT, UNIT, False, ["a\nb"])


def test_dead_instances_drop_out(redis_server: RedisServer) -> None:
    index = PrefixIndex(redis_server.url, "m-" + uuid.uuid4().hex[:8], heartbeat_ttl_s=0.3)
    chain = HASHER.chain(list(range(40)))
    index.publish_local("a", chain, chain)
    index.publish_local("b", chain, chain)
    index.heartbeat("a")
    index.heartbeat("b")
    assert set(index.lookup(chain, 40, UNIT, False).instance_hits) == {"a", "b"}
    alive = lambda name: bool(index.r.exists(index.keys.heartbeat(name)))  # noqa: E731
    assert alive("a") and alive("b")
    wait_until(lambda: not alive("a"), 5, what="a's heartbeat (ttl 0.3 s) to expire")
    index.heartbeat("b")
    assert index.lookup(chain, 40, UNIT, False).instance_hits == {"b": 36}
    assert alive("b") and not alive("a")


def test_stale_entry_is_repaired(redis_server: RedisServer, mooncake_master: MooncakeMaster) -> None:
    eng = make_engine(export_checkpoints=True)
    toks = prompt(300, 31)
    eng.generate([req("w", toks, 1)])
    ((kv, state),) = eng.pop_exports()
    assert state.key is not None
    store = CheckpointStore(mooncake_master.address, mooncake_master.metadata_url, eng.model_id)
    index = PrefixIndex(redis_server.url, eng.model_id + uuid.uuid4().hex[:6])
    try:
        store.put_checkpoint(kv, state, 16)
        index.publish_store(kv.block_hashes, state.key, state.meta.position)  # after the put succeeded
        chain = eng.hasher.chain(list(toks) + [7] * 40)
        hit = index.lookup(chain, len(toks) + 40, 16, False).store_hit
        assert hit == state.meta.position
        assert fetch_checkpoint(index, store, chain[: hit // 16], 16) is not None
        # the object disappears behind the index's back
        store.remove([store.key("st", state.key)])
        assert fetch_checkpoint(index, store, chain[: hit // 16], 16) is None
        assert index.lookup(chain, len(toks) + 40, 16, False).store_hit == 0
    finally:
        store.remove([store.key("kv", h) for h in kv.block_hashes])
        store.close()


def test_outage_raises_typed_error_then_recovers(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path)
    srv.start()
    index = PrefixIndex(srv.url, "m-outage", timeout_s=0.3)
    chain = HASHER.chain(list(range(40)))
    index.publish_store(chain, chain[-1], 40)
    assert index.lookup(chain, 41, UNIT, False).store_hit == 40
    srv.stop()
    t0 = time.monotonic()
    with pytest.raises(UnavailableError):
        index.lookup(chain, 41, UNIT, False)
    assert time.monotonic() - t0 < 2.0  # within the configured timeout (plus slack), not hanging
    with pytest.raises(UnavailableError):
        index.heartbeat("a")
    srv.start()  # same port; persistence is off, so the index is empty again
    assert index.ping()
    assert index.lookup(chain, 41, UNIT, False).store_hit == 0
    index.publish_store(chain, chain[-1], 40)
    assert index.lookup(chain, 41, UNIT, False).store_hit == 40
    srv.stop()


def test_auth(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path, password='s3"cret\\x')
    srv.start()
    try:
        assert PrefixIndex(srv.url, "m").ping()
        lines = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
        assert not any("s3" in line for line in lines if "redis-server" in line)  # not on a command line
        bad = PrefixIndex(srv.url.replace(srv.password or "", "wrong"), "m")
        with pytest.raises(UnavailableError):
            bad.ping()
        with pytest.raises(UnavailableError):
            PrefixIndex("redis://127.0.0.1:%d/0" % srv.port, "m").lookup([], 1, 4, False)
    finally:
        srv.stop()


_ev = st.one_of(
    st.tuples(
        st.sampled_from(["stored", "removed"]),
        st.sampled_from(["kv", "state"]),
        st.lists(st.integers(0, 5), min_size=1, max_size=3),
    ),
    st.just(("cleared", "", [])),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(_ev, max_size=12))
def test_apply_local_equals_applying_the_events_one_by_one(redis_server: RedisServer, batch: list) -> None:
    """A batch's coalesced commands leave exactly the entries of its events applied in order,
    and every set that exists has the entry TTL."""
    from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup

    index = PrefixIndex(redis_server.url, "m-" + uuid.uuid4().hex[:8], ttl_s=777)
    hashes = HASHER.chain(list(range(40, 40 + 6 * UNIT)))
    want: dict[str, set[BlockHash]] = {"kv": set(), "state": set()}
    events = []
    for kind, group, idx in batch:
        if kind == "cleared":
            events.append(CacheEvent(CacheEventKind.CLEARED, None))
            want = {"kv": set(), "state": set()}
            continue
        hs = tuple(hashes[i] for i in idx)
        events.append(CacheEvent(CacheEventKind(kind), CacheGroup(group), hs))
        (want[group].update if kind == "stored" else want[group].difference_update)(hs)
    index.apply_local("i", events)
    assert index.local_entries("i") == (want["kv"], want["state"])
    for key in (index.keys.local_kv("i"), index.keys.local_st("i")):
        ttl = index.r.ttl(key)
        assert ttl == -2 or 0 < ttl <= 777, ttl  # absent, or expiring like every entry


def test_weights_changed_under_one_name_never_hit_the_old_state(
    redis_server: RedisServer, mooncake_master: MooncakeMaster, tmp_path: Path
) -> None:
    """#51: the same directory name with changed weights is a new identity, so what the
    old weights left in the index and the store is never found under the new one."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hybridpd.config import load_config
    from hybridpd.engine.factory import resolve_model
    from hybridpd.model_identity import engine_identity

    cfg = load_config(env={})
    bundled = resolve_model(cfg)
    assert isinstance(bundled, Path)
    old = engine_identity(cfg, bundled)
    changed = tmp_path / bundled.name
    shutil.copytree(bundled, changed)
    weights = load_file(changed / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = weights[first] * 1.001
    save_file(weights, changed / "model.safetensors")
    new = engine_identity(cfg, changed)
    assert new != old
    chain = HASHER.chain(list(range(7000, 7000 + 8 * UNIT)))
    PrefixIndex(redis_server.url, old).publish_store(chain, chain[-1], 8 * UNIT)
    assert PrefixIndex(redis_server.url, old).lookup(chain, 8 * UNIT + 1, UNIT, False).store_hit == 8 * UNIT
    assert PrefixIndex(redis_server.url, new).lookup(chain, 8 * UNIT + 1, UNIT, False).store_hit == 0
    stores = [CheckpointStore(mooncake_master.address, mooncake_master.metadata_url, m) for m in (old, new)]
    try:
        assert stores[0].key("st", chain[-1]) != stores[1].key("st", chain[-1])
    finally:
        for s in stores:
            s.close()
