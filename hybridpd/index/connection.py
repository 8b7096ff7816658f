"""The prefix index's Redis connections (``PrefixIndex`` builds on them), and how
logs and banners show a Redis URL (:func:`redacted_url`).

Every Redis failure (refused, timed out, auth, a cluster shard down) surfaces
as ``UnavailableError`` within the configured timeout (:func:`mapped`), so
callers degrade to routing on load and recomputing; redis-py reconnects by
itself once Redis is back (and the lookup script is loaded again after a
restart).

``cluster=True``: ``url`` names any node of a Redis Cluster. All of a model's
keys share one hash slot (schema.py), so every call is answered by the shard
that owns it; a lost shard means misses for its models until it is back (or
until the cluster promotes one of its replicas).

``read_replicas=True``: lookups (the router's one read per request) go to a
replica (``read_replicas.py``): on a cluster one of the slot's replicas (round
robin), else ``replica_url``. A replica that fails a call (or cannot load the
script) is not read until a check finds it up again, and that call goes on
with the primary. Every write goes to the primary.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import REPLICA
from redis.connection import parse_url
from redis.retry import Retry

from hybridpd.errors import UnavailableError
from hybridpd.index.read_replicas import LINK_CHECK_S, REPLICA_DISCOVERY_S, Replica, readonly

logger = logging.getLogger(__name__)

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


def redacted_url(url: str) -> str:
    """``url`` as logs and banners may show it: the password of its userinfo as ``***`` (the user stays)."""
    return re.sub(r"^([a-z][a-z0-9+.-]*://[^:@/?#]*:)[^@/?#]*@", r"\1***@", url, flags=re.I)


@contextmanager
def mapped() -> Iterator[None]:
    """Redis failures inside the block as ``UnavailableError`` (other errors pass)."""
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


def _watch(ref: weakref.ref[IndexConnection]) -> None:
    """The replica checker of one ``IndexConnection``: every ``LINK_CHECK_S`` until the index is gone."""
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


class IndexConnection:
    """Where the index's commands go: the primary (one Redis, or the cluster node
    owning the model's slot, named by ``slot_key``), and with ``read_replicas``
    the replicas the lookup script runs on. ``PrefixIndex`` builds on it."""

    def __init__(
        self,
        url: str,
        slot_key: bytes,
        *,
        timeout_s: float = 0.5,
        cluster: bool = False,
        read_replicas: bool = False,
        replica_url: str | None = None,
    ) -> None:
        if read_replicas and not cluster and not replica_url:
            raise ValueError("read_replicas without a cluster needs replica_url")
        self.cluster = cluster
        self._url, self._timeout_s = url, timeout_s
        self._r: Any = None
        if not cluster:  # a plain client connects lazily by itself
            self._r = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
            )
        self._script = resources.files("hybridpd.index").joinpath("lookup.lua").read_text()
        self._sha = hashlib.sha1(self._script.encode()).hexdigest()
        self._instances_key = slot_key
        self._stale_slots = False
        self._next_refresh = 0.0
        self.read_replicas = read_replicas
        self._replica_url = replica_url
        self._replicas: dict[str, Replica] = {}
        self._replicas_lock = threading.Lock()
        self._turn = 0  # round robin over a slot's replicas
        self._next_discovery = time.monotonic() + REPLICA_DISCOVERY_S
        self._watcher: threading.Thread | None = None

    @property
    def r(self) -> Any:
        """The redis-py client. A cluster client is made on first use (it reads the slot
        map when made): call it inside ``mapped`` so a cluster that cannot be reached
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
        with mapped():
            return bool(self.r.ping())

    def server_info(self) -> tuple[str, bool | None]:
        """The server's Redis version and whether it runs in cluster mode (None where
        the user may not run ``INFO``), from the node ``url`` names."""
        node = redis.Redis.from_url(self._url, socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s)
        try:
            with mapped():
                info = node.info()
            return str(info.get("redis_version", "")), bool(info.get("cluster_enabled"))
        except redis.ResponseError as exc:  # NOPERM: INFO is in ACL @dangerous
            logger.warning("cannot read INFO from the index's Redis (%s): mode and version unchecked", exc)
            return "", None
        finally:
            node.close()

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

    def _replica(self) -> Replica | None:
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

    def _replica_at(self, addr: tuple[str, int] | None) -> Replica:
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
                    pool = redis.ConnectionPool(redis_connect_func=readonly, **opts)
                rep = self._replicas[name] = Replica(redacted_url(name), pool)
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
