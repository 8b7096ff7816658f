# Over 350 lines: the one client of the index schema (schema.py): entries of every kind and the lookup.
"""Client of the global prefix index (schema: ``schema.py``).

Every Redis failure (refused, timed out, auth, a cluster shard down) surfaces
as ``UnavailableError`` within the configured timeout, so callers degrade to
routing on load and recomputing; redis-py reconnects by itself once Redis is
back (and re-loads the Lua script after a restart).

``cluster=True``: ``url`` names any node of a Redis Cluster. All of a model's
keys share one hash slot (schema.py), so every call here is answered by the
shard that owns it; a lost shard means misses for its models until it is back
(or until the cluster promotes one of its replicas).

``read_replicas=True``: lookups (the router's one read per request) go to a
replica: on a cluster one of the slot's replicas (round robin), else
``replica_url``. A replica answers as its primary did a replication lag ago
(Redis replication is asynchronous; the router's ``RecentPrefills`` covers its
own newest prefills, and a promise broken by a removal not yet replicated is a
recompute, counted, never wrong tokens). A replica is read only while its link
to the primary is up (``INFO replication``, checked when the replica is first
named, then every second by a background thread): one cut off from its primary
has no bound on how stale it is. A replica that fails a call (or cannot load
the script) is not read until a check finds it up again, and that call goes on
with the primary. Every write, and the removal of dead instances the lookup
reports (one more round trip, at most once a second), goes to the primary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import REPLICA
from redis.connection import parse_url
from redis.retry import Retry
from redis.utils import str_if_bytes

from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.errors import UnavailableError
from hybridpd.hashing import BlockHash, join_prefixed
from hybridpd.index.schema import IndexKeys

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What a prefill instance reports with each heartbeat."""

    queued_tokens: int = 0
    running_requests: int = 0
    free_blocks: int = 0


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest usable hit (tokens) in the store and per live instance, and
    ``known``: how far the prompt's attention blocks are known anywhere (store
    or a live instance; a multiple of the unit, capped like a hit at the last
    block before the final token, not reduced for EAGLE). Past the usable hits
    it is the junction where the prompt leaves every cached prefix."""

    store_hit: int
    instance_hits: Mapping[str, int] = field(default_factory=dict)
    known: int = 0
    #: which server answered: "primary" or "replica" (not part of the answer's value)
    source: str = field(default="primary", compare=False)


#: Redis errors of a server that will answer again (a failover, a restart loading its data)
TRANSIENT_ERRORS = (
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.MasterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
)


@contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError) as exc:
        raise UnavailableError("prefix index (Redis) unavailable: %s" % exc) from exc
    except TRANSIENT_ERRORS as exc:
        raise UnavailableError("prefix index (Redis) cannot serve this now: %s" % exc) from exc
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise UnavailableError("prefix index (Redis) rejected our credentials: %s" % exc) from exc
        raise


#: how often a read replica's link to its primary is checked (seconds)
LINK_CHECK_S = 1.0
#: while a cluster slot has no usable replica, its replicas are looked for again this often (seconds)
REPLICA_DISCOVERY_S = 5.0

#: removes the instances a lookup reported dead, each only if its heartbeat is still absent
#: (KEYS[1] the instances set; ARGV: heartbeat key, instance name, ...)
_REAP = """
for i = 1, #ARGV, 2 do
  if redis.call("EXISTS", ARGV[i]) == 0 then redis.call("SREM", KEYS[1], ARGV[i + 1]) end
end
"""


def _readonly(conn: Any) -> None:
    """Connect callback of a cluster replica's connections: READONLY, so it answers for its master's slots."""
    conn.on_connect()
    conn.send_command("READONLY")
    if str_if_bytes(conn.read_response()) != "OK":
        raise redis.ConnectionError("the replica refused READONLY")


@dataclass(slots=True)
class _Replica:
    """A replica lookups read while ``ok``: its link to the primary was up at its last
    check (when it was first named, then every ``LINK_CHECK_S`` off the request path)."""

    name: str
    pool: Any
    ok: bool | None = None  # None: not checked yet

    def check(self) -> None:
        up, why = _link_up(self.pool)
        if up and self.ok is not True:
            logger.info("index replica %s: reading it", self.name)
        elif not up and self.ok is not False:
            logger.warning("index replica %s: not read (%s)", self.name, why)
        self.ok = up

    def failed(self, exc: BaseException) -> None:
        if self.ok:
            logger.warning("index replica %s: not read until its link checks up again: %s", self.name, exc)
        self.ok = False


def _watch(ref: weakref.ref[PrefixIndex]) -> None:
    """The replica checker of one ``PrefixIndex``: every ``LINK_CHECK_S`` until the index is gone."""
    while True:
        time.sleep(LINK_CHECK_S)
        index = ref()
        if index is None:
            return
        try:
            index._check_replicas()
        except Exception:  # a check that fails leaves the states as they were; the next one retries
            logger.debug("index replica check failed", exc_info=True)
        del index


def redacted_url(url: str) -> str:
    """``url`` as logs and banners may show it: the password of its userinfo as ``***`` (the user stays)."""
    return re.sub(r"^([a-z][a-z0-9+.-]*://[^:@/?#]*:)[^@/?#]*@", r"\1***@", url, flags=re.I)


def _link_up(pool: Any) -> tuple[bool, str]:
    """Whether the server of ``pool`` is a replica whose link to its primary is up (and why not)."""
    try:
        info = redis.Redis(connection_pool=pool).info("replication")
    except redis.ResponseError as exc:
        if "NOPERM" in str(exc):  # INFO is in ACL @dangerous: trust the operator's replica
            return True, ""
        return False, str(exc)
    except redis.RedisError as exc:
        return False, str(exc)
    if info.get("role") != "slave":
        return False, "role %s, not a replica" % info.get("role")
    if info.get("master_link_status") != "up":
        return False, "its link to the primary is %s" % info.get("master_link_status")
    return True, ""


class PrefixIndex:
    def __init__(
        self,
        url: str,
        model_id: str,
        *,
        ttl_s: int = 3600,
        heartbeat_ttl_s: float = 10.0,
        timeout_s: float = 0.5,
        cluster: bool = False,
        read_replicas: bool = False,
        replica_url: str | None = None,
    ) -> None:
        if read_replicas and not cluster and not replica_url:
            raise ValueError("read_replicas without a cluster needs replica_url")
        self.keys = IndexKeys(model_id)
        self.ttl_s = ttl_s
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self.cluster = cluster
        self._url, self._timeout_s = url, timeout_s
        self._r: Any = None
        if not cluster:  # a plain client connects lazily by itself
            self._r = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
            )
        self._script = resources.files("hybridpd.index").joinpath("lookup.lua").read_text()
        self._sha = hashlib.sha1(self._script.encode()).hexdigest()
        self._instances_key = self.keys.instances.encode()
        self._stale_slots = False
        self._next_refresh = 0.0
        self.read_replicas = read_replicas
        self._replica_url = replica_url
        self._replicas: dict[str, _Replica] = {}
        self._replicas_lock = threading.Lock()
        self._turn = 0  # round robin over a slot's replicas
        self._next_reap = 0.0
        self._next_discovery = time.monotonic() + REPLICA_DISCOVERY_S
        self._watcher: threading.Thread | None = None

    @property
    def r(self) -> Any:
        """The redis-py client. A cluster client is made on first use (it reads the slot
        map when made): call it inside ``_mapped`` so a cluster that cannot be reached
        is an ``UnavailableError`` there, not in a constructor."""
        if self._r is None:
            # NOTE: few retries: a shard that is down must turn into a miss within the timeout, not a stall
            self._r = redis.RedisCluster.from_url(
                self._url,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                require_full_coverage=False,
                retry=Retry(NoBackoff(), 1),
            )
        return self._r

    def ping(self) -> bool:
        with _mapped():
            return bool(self.r.ping())

    def server_info(self) -> tuple[str, bool | None]:
        """The server's Redis version and whether it runs in cluster mode (None where
        the user may not run ``INFO``), from the node ``url`` names."""
        node = redis.Redis.from_url(self._url, socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s)
        try:
            with _mapped():
                info = node.info()
            return str(info.get("redis_version", "")), bool(info.get("cluster_enabled"))
        except redis.ResponseError as exc:  # NOPERM: INFO is in ACL @dangerous
            logger.warning("cannot read INFO from the index's Redis (%s): mode and version unchecked", exc)
            return "", None
        finally:
            node.close()

    # -- store entries ---------------------------------------------------------------
    def publish_store(self, block_hashes: Sequence[BlockHash], state_hash: BlockHash | None, position: int) -> None:
        """Mark KV blocks and (optionally) state@position as present in the
        store. Call only after the store put succeeded."""
        with _mapped():
            pipe = self.r.pipeline(transaction=False)
            for h in block_hashes:
                pipe.set(self.keys.kv(h), 1, ex=self.ttl_s)
            if state_hash is not None:
                pipe.set(self.keys.st(state_hash), position, ex=self.ttl_s)
            pipe.execute()

    def remove_store(self, kv_hashes: Sequence[BlockHash] = (), state_hashes: Sequence[BlockHash] = ()) -> None:
        """Drop entries whose objects are missing or corrupt (index repair)."""
        keys = [self.keys.kv(h) for h in kv_hashes] + [self.keys.st(h) for h in state_hashes]
        if keys:
            with _mapped():
                self.r.delete(*keys)

    # -- instance entries ------------------------------------------------------------
    def publish_local(self, instance: str, kv_hashes: Sequence[BlockHash], state_hashes: Sequence[BlockHash]) -> None:
        with _mapped():
            pipe = self.r.pipeline(transaction=False)
            if kv_hashes:
                pipe.sadd(self.keys.local_kv(instance), *kv_hashes)
            if state_hashes:
                pipe.sadd(self.keys.local_st(instance), *state_hashes)
            pipe.execute()

    def apply_local(self, instance: str, events: Sequence[CacheEvent]) -> None:
        """Mirror ``instance``'s cache events, in order, in one round trip (idempotent:
        replaying a batch that failed half-way gives the same entries). Events
        marked ``store`` write the store entries instead (``kv:``/``st:`` with the
        TTL; a store removal deletes them; the store is never cleared).

        Consecutive additions to one set (or removals from it) go as one
        ``SADD``/``SREM``, and each set touched gets one ``EXPIRE`` at the end: a
        batch of single-block events costs Redis a few commands, not two per
        event. Operations on different keys commute; those on one key keep
        their order (a run is sent before the other operation on its key)."""
        if not events:
            return
        with _mapped():
            pipe = self.r.pipeline(transaction=False)
            runs: dict[str, tuple[CacheEventKind, list[BlockHash]]] = {}  # set key -> its pending run
            touched: set[str] = set()

            def flush(key: str) -> None:
                kind, hashes = runs.pop(key)
                if kind is CacheEventKind.STORED:
                    pipe.sadd(key, *hashes)
                    touched.add(key)
                else:
                    pipe.srem(key, *hashes)

            for ev in events:
                if ev.store:
                    if ev.kind is CacheEventKind.CLEARED or not ev.hashes:
                        continue
                    keys = [self.keys.kv(h) if ev.group is CacheGroup.KV else self.keys.st(h) for h in ev.hashes]
                    for k in keys:  # NOTE: one key per DEL: a cluster pipeline refuses several
                        if ev.kind is CacheEventKind.STORED:
                            pipe.set(k, 1, ex=self.ttl_s)
                        else:
                            pipe.delete(k)
                    continue
                if ev.kind is CacheEventKind.CLEARED:
                    runs.clear()  # what the batch did to the sets before is moot
                    pipe.delete(self.keys.local_kv(instance))
                    pipe.delete(self.keys.local_st(instance))
                    continue
                if not ev.hashes:
                    continue
                key = self.keys.local_kv(instance) if ev.group is CacheGroup.KV else self.keys.local_st(instance)
                if key in runs and runs[key][0] is not ev.kind:
                    flush(key)
                runs.setdefault(key, (ev.kind, []))[1].extend(ev.hashes)
            for key in list(runs):
                flush(key)
            for key in sorted(touched):
                pipe.expire(key, self.ttl_s)
            pipe.execute()

    def local_entries(self, instance: str) -> tuple[set[BlockHash], set[BlockHash]]:
        """(KV hashes, state hashes) the index holds for ``instance`` (tests, tools)."""
        with _mapped():
            kv = self.r.smembers(self.keys.local_kv(instance))
            st = self.r.smembers(self.keys.local_st(instance))
        return {BlockHash(_raw(h)) for h in kv}, {BlockHash(_raw(h)) for h in st}

    def held_blocks(self, instances: Sequence[str], block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per instance, how many leading blocks of the chain its local cache holds
        (one SMISMEMBER each, in one round trip): decode affinity."""
        if not instances or not block_hashes:
            return {}
        with _mapped():
            pipe = self.r.pipeline(transaction=False)
            for inst in instances:
                pipe.smismember(self.keys.local_kv(inst), list(block_hashes))
            rows = pipe.execute()
        out = {}
        for inst, row in zip(instances, rows, strict=True):
            n = 0
            while n < len(row) and row[n]:
                n += 1
            out[inst] = n
        return out

    def refresh_local(self, instance: str) -> None:
        """Refresh the TTL of ``instance``'s local entries without a heartbeat (a
        decode instance: not a prefill candidate, so not in the instance set)."""
        with _mapped():
            pipe = self.r.pipeline(transaction=False)
            pipe.expire(self.keys.local_kv(instance), self.ttl_s)
            pipe.expire(self.keys.local_st(instance), self.ttl_s)
            pipe.execute()

    def clear_local(self, instance: str) -> None:
        """Drop every local entry of ``instance`` (its engine cleared its cache)."""
        with _mapped():
            self.r.delete(self.keys.local_kv(instance), self.keys.local_st(instance))

    def heartbeat(self, instance: str, load: InstanceLoad) -> None:
        """Refresh liveness (and the TTL of the instance's local entries)."""
        with _mapped():
            pipe = self.r.pipeline(transaction=False)
            pipe.set(self.keys.heartbeat(instance), json.dumps(asdict(load)), px=self.heartbeat_ttl_ms)
            pipe.sadd(self.keys.instances, instance)
            pipe.expire(self.keys.local_kv(instance), self.ttl_s)
            pipe.expire(self.keys.local_st(instance), self.ttl_s)
            pipe.execute()

    def live_instances(self) -> dict[str, InstanceLoad]:
        with _mapped():
            names = sorted(m.decode() if isinstance(m, bytes) else m for m in self.r.smembers(self.keys.instances))
            if not names:
                return {}
            loads = self.r.mget([self.keys.heartbeat(n) for n in names])
        return {n: InstanceLoad(**json.loads(v)) for n, v in zip(names, loads, strict=True) if v is not None}

    # -- the lookup ------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[BlockHash], num_tokens: int, unit: int, eagle: bool) -> LookupResult:
        """One EVALSHA: the store hit, each live instance's local hit and how far the chain is known
        (on a replica with ``read_replicas``; dead instances it reports are then removed on the primary)."""
        packed = _pack_lookup(self.keys, block_hashes, num_tokens, unit, eagle)
        with _mapped():
            res, source = self._evalsha(LOOKUP_ARGC, packed)
        hits, dead = _result(res)
        if dead:
            self._reap(dead)
        return LookupResult(hits.store_hit, hits.instance_hits, hits.known, source)

    def _reap(self, dead: Sequence[str]) -> None:
        """Remove instances without a heartbeat from the set, on the primary, at most once a
        second (a failure is left to the next lookup that finds them)."""
        now = time.monotonic()
        if now < self._next_reap:
            return
        self._next_reap = now + 1.0
        args = [a for n in dead for a in (self.keys.heartbeat(n), n)]
        try:
            with _mapped():
                self.r.eval(_REAP, 1, self._instances_key, *args)
        except (UnavailableError, redis.RedisError) as exc:
            logger.debug("dead instances %s not removed now: %s", dead, exc)

    def _script_head(self, argc: int) -> bytes:
        """EVALSHA, the script, one declared key (the model's ``instances`` set: it names
        the slot, so a cluster or a proxy routes the script by it), then ``argc`` arguments."""
        key = self._instances_key
        return b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n$%d\r\n%s\r\n" % (
            argc + 4,
            self._sha.encode(),
            len(key),
            key,
        )

    def _pool(self) -> Any:
        """The connection pool of the primary that answers for this model's slot (on a
        cluster, the slot map is re-read at most once a second after a connection error)."""
        if not self.cluster:
            return self.r.connection_pool
        self._refresh_slots()
        node = self.r.get_node_from_key(self._instances_key)
        return self.r.get_redis_connection(node).connection_pool

    def _refresh_slots(self) -> None:
        if self._stale_slots and time.monotonic() >= self._next_refresh:
            self._next_refresh = time.monotonic() + 1.0
            self.r.nodes_manager.initialize()
            self._stale_slots = False

    def _replica(self) -> _Replica | None:
        """A replica to read now (None: read the primary): ``replica_url``, or on a
        cluster the first usable one of the slot's replicas, in turn."""
        if not self.read_replicas:
            return None
        if self._watcher is None:
            self._start_watcher()
        if not self.cluster:
            addrs: list[tuple[str, int] | None] = [None]
        else:
            self._refresh_slots()
            addrs = list(self._slot_replicas())
        self._turn += 1
        for k in range(len(addrs)):
            rep = self._replica_at(addrs[(self._turn + k) % len(addrs)])
            if rep.ok:
                return rep
        return None

    def _slot_replicas(self) -> list[tuple[str, int]]:
        slot = self.r.keyslot(self._instances_key)
        nodes = self.r.nodes_manager.slots_cache.get(slot) or []
        return [(n.host, n.port) for n in nodes if n.server_type == REPLICA]

    def _replica_at(self, addr: tuple[str, int] | None) -> _Replica:
        """The replica at ``addr`` (None: ``replica_url``), made and checked the first time it
        is named (a cluster node gets the credentials and TLS of ``url`` and connections that
        say READONLY); from then on the watcher thread checks it."""
        name = self._replica_url if addr is None else "%s:%d" % addr
        assert name is not None
        with self._replicas_lock:
            rep = self._replicas.get(name)
            if rep is None:
                timeouts: dict[str, Any] = {
                    "socket_timeout": self._timeout_s,
                    "socket_connect_timeout": self._timeout_s,
                }
                if addr is None:
                    pool = redis.ConnectionPool.from_url(name, **timeouts)
                else:
                    opts = {**parse_url(self._url), "host": addr[0], "port": addr[1], **timeouts}
                    pool = redis.ConnectionPool(redis_connect_func=_readonly, **opts)
                rep = self._replicas[name] = _Replica(redacted_url(name), pool)
                rep.check()
            return rep

    def _start_watcher(self) -> None:
        with self._replicas_lock:
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=_watch, args=(weakref.ref(self),), name="hpd-index-replicas", daemon=True
                )
                self._watcher.start()

    def _check_replicas(self) -> None:
        """The watcher's round: check every replica named so far; on a cluster whose slot
        has no usable replica, re-read the slot map every ``REPLICA_DISCOVERY_S`` (a
        replica added, or a failed master back as one) and forget replicas no longer in it."""
        with self._replicas_lock:
            replicas = list(self._replicas.values())
        for rep in replicas:
            rep.check()
        if not self.cluster or any(r.ok for r in replicas) or time.monotonic() < self._next_discovery:
            return
        self._next_discovery = time.monotonic() + REPLICA_DISCOVERY_S
        self.r.nodes_manager.initialize(disconnect_startup_nodes_pools=False)
        current = {"%s:%d" % a for a in self._slot_replicas()}
        with self._replicas_lock:
            gone = [self._replicas.pop(n) for n in list(self._replicas) if n not in current]
        for rep in gone:
            rep.pool.disconnect()

    def _evalsha(self, argc: int, packed: bytes) -> tuple[Any, str]:
        """EVALSHA of the lookup script with ``argc`` pre-packed arguments, on a usable
        replica with ``read_replicas``, else the primary; returns (reply, "primary" or
        "replica"). NOSCRIPT: the script is loaded on that server and sent again; on a
        cluster, MOVED/ASK: the slot map is re-read and it is sent again; a replica that
        fails (or cannot load the script) is marked unusable and the call goes on with
        the primary (at most 3 sends; then, or when the script still is not there,
        ``UnavailableError``)."""
        replica = self._replica()
        for _ in range(3):
            pool = self._pool() if replica is None else replica.pool
            conn = None
            try:
                conn = pool.get_connection()  # connects: a lost node fails here
                conn.send_packed_command([self._script_head(argc), packed])
                return conn.read_response(), "primary" if replica is None else "replica"
            except redis.exceptions.NoScriptError:
                try:
                    self._load_script(pool)
                except (redis.RedisError, UnavailableError) as exc:
                    if replica is None:
                        raise
                    replica.failed(exc)
                    replica = None
            except (redis.exceptions.MovedError, redis.exceptions.AskError) as exc:
                if not self.cluster:
                    raise
                if replica is not None:
                    replica.failed(exc)  # no longer a replica of the slot's master
                    replica = None
                self.r.nodes_manager.initialize()
            except BaseException as exc:
                if conn is not None:
                    conn.disconnect()  # a half-read reply must not reach the next caller
                if replica is not None and isinstance(exc, redis.RedisError):
                    replica.failed(exc)
                    replica = None
                    continue
                if self.cluster and isinstance(exc, redis.ConnectionError | redis.TimeoutError):
                    self._stale_slots = True  # a failover may have moved the slot: re-read the map
                raise
            finally:
                if conn is not None:
                    pool.release(conn)
        raise UnavailableError("prefix index (Redis): the lookup script did not run after 3 tries")

    def _load_script(self, pool: Any) -> None:
        """SCRIPT LOAD on the server of ``pool`` only (a cluster's other shards may be down)."""
        conn = pool.get_connection()
        try:
            conn.send_command("SCRIPT", "LOAD", self._script)
            sha = conn.read_response()
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        sha = sha.decode() if isinstance(sha, bytes) else str(sha)
        if sha != self._sha:
            raise UnavailableError(
                "prefix index (Redis) loaded the lookup script as %s, expected %s" % (sha, self._sha)
            )

    # -- checkpoint reuse (eviction by value: hybridpd/checkpoint_value.py) --------------------
    def record_state_hits(self, hits: Sequence[tuple[BlockHash, float]]) -> None:
        """Count one reuse per ``(state hash, unix time)``: a prefill that hit the
        prefix ending at that hash (locally or from the store). ``hpd:<m>:hit:<H>``
        is a hash of ``n`` (reuses) and ``t`` (the last one's time), expiring
        ``ttl_s`` after its last reuse; the ledgers of the instances that put a
        state object read it to value their objects (``state_hits``)."""
        if not hits:
            return
        with _mapped():
            pipe = self.r.pipeline(transaction=False)
            for h, t in hits:
                key = self.keys.hits(h)
                pipe.hincrby(key, "n", 1)
                pipe.hset(key, "t", repr(float(t)))
                pipe.expire(key, self.ttl_s)
            pipe.execute()

    def state_hits(self, state_hashes: Sequence[BlockHash]) -> list[tuple[int, float]]:
        """``(reuses, last reuse's unix time)`` per state hash, in one round trip;
        ``(0, 0.0)`` for one never reused (or expired)."""
        if not state_hashes:
            return []
        with _mapped():
            pipe = self.r.pipeline(transaction=False)
            for h in state_hashes:
                pipe.hmget(self.keys.hits(h), "n", "t")
            rows = pipe.execute()
        return [(int(n or 0), float(t or 0.0)) for n, t in rows]


#: arguments of lookup.lua: prefix, num_tokens, unit, eagle, the chain's KV keys, hash length
LOOKUP_ARGC = 6


def _pack_lookup(keys: IndexKeys, hashes: Sequence[bytes], num_tokens: int, unit: int, eagle: bool) -> bytes:
    """lookup.lua's arguments as RESP bulk strings. The chain goes as ONE string, its
    store KV keys back to back (``prefix + "kv:" + h`` each, joined in C): Redis
    then parses 6 arguments instead of 1,285, and the script cuts keys and hashes
    out of it at a fixed stride. ValueError if the hashes differ in length."""
    chain = join_prefixed(keys.kv(BlockHash(b"")), hashes)
    head = (keys.prefix, num_tokens, unit, "1" if eagle else "0")
    out = [b"$%d\r\n%s\r\n" % (len(p), p) for p in map(_arg, head)]
    out += (b"$%d\r\n" % len(chain), chain, b"\r\n")  # one copy of the chain, in the final join
    size = b"%d" % (len(hashes[0]) if hashes else 0)
    out.append(b"$%d\r\n%s\r\n" % (len(size), size))
    return b"".join(out)


def _arg(x: object) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def _result(res: Sequence[Any]) -> tuple[LookupResult, list[str]]:
    """lookup.lua's reply: the hits of the live instances, and the dead ones (hit -1)."""
    inst, dead = {}, []
    for i in range(2, len(res), 2):
        name, hit = res[i].decode(), int(res[i + 1])
        if hit < 0:
            dead.append(name)
        else:
            inst[name] = hit
    return LookupResult(int(res[0]), inst, int(res[1])), dead


def _raw(field: bytes | str) -> bytes:
    return field if isinstance(field, bytes) else field.encode()
