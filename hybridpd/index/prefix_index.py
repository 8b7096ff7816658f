"""Client of the global prefix index (schema: ``schema.py``): the store's and
each instance's entries, liveness, the lookup and checkpoint reuse.

Its Redis connections, a cluster, read replicas and how failures surface
(``UnavailableError``, within the configured timeout) are ``connection.py``'s;
a lookup may be answered by a replica, and the removal of dead instances it
reports (one more round trip, at most once a second) goes to the primary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis

from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.errors import UnavailableError
from hybridpd.hashing import BlockHash, join_prefixed
from hybridpd.index.connection import IndexConnection, mapped
from hybridpd.index.schema import IndexKeys

logger = logging.getLogger(__name__)


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
    #: per decode instance asked about (``held_by``), how many leading blocks of the
    #: chain its local cache holds: decode affinity, from the same round trip
    held: Mapping[str, int] = field(default_factory=dict)
    #: which server answered: "primary" or "replica" (not part of the answer's value)
    source: str = field(default="primary", compare=False)


#: removes the instances a lookup reported dead, each only if its heartbeat is still absent
#: (KEYS[1] the instances set; ARGV: heartbeat key, instance name, ...)
_REAP = """
for i = 1, #ARGV, 2 do
  if redis.call("EXISTS", ARGV[i]) == 0 then redis.call("SREM", KEYS[1], ARGV[i + 1]) end
end
"""


class PrefixIndex(IndexConnection):
    """One model's entries in the index (its keys: ``IndexKeys(model_id)``)."""

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
        self.keys = IndexKeys(model_id)
        super().__init__(
            url,
            self.keys.instances.encode(),
            timeout_s=timeout_s,
            cluster=cluster,
            read_replicas=read_replicas,
            replica_url=replica_url,
        )
        self.ttl_s = ttl_s
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self._next_reap = 0.0

    # -- store entries ---------------------------------------------------------------
    def publish_store(self, block_hashes: Sequence[BlockHash], state_hash: BlockHash | None, position: int) -> None:
        """Mark KV blocks and (optionally) state@position as present in the
        store. Call only after the store put succeeded."""
        with mapped():
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
            with mapped():
                self.r.delete(*keys)

    # -- instance entries ------------------------------------------------------------
    def publish_local(self, instance: str, kv_hashes: Sequence[BlockHash], state_hashes: Sequence[BlockHash]) -> None:
        with mapped():
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
        with mapped():
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
        with mapped():
            kv = self.r.smembers(self.keys.local_kv(instance))
            st = self.r.smembers(self.keys.local_st(instance))
        return {BlockHash(_raw(h)) for h in kv}, {BlockHash(_raw(h)) for h in st}

    def refresh_local(self, instance: str) -> None:
        """Refresh the TTL of ``instance``'s local entries without a heartbeat (a
        decode instance: not a prefill candidate, so not in the instance set)."""
        with mapped():
            pipe = self.r.pipeline(transaction=False)
            pipe.expire(self.keys.local_kv(instance), self.ttl_s)
            pipe.expire(self.keys.local_st(instance), self.ttl_s)
            pipe.execute()

    def clear_local(self, instance: str) -> None:
        """Drop every local entry of ``instance`` (its engine cleared its cache)."""
        with mapped():
            self.r.delete(self.keys.local_kv(instance), self.keys.local_st(instance))

    def heartbeat(self, instance: str) -> None:
        """Refresh liveness (and the TTL of the instance's local entries): the lookup
        treats an instance without a live heartbeat key as dead (``live_instances``). The key holds no load:
        the router learns an instance's load from its own pings and the actor's metrics."""
        with mapped():
            pipe = self.r.pipeline(transaction=False)
            pipe.set(self.keys.heartbeat(instance), b"1", px=self.heartbeat_ttl_ms)
            pipe.sadd(self.keys.instances, instance)
            pipe.expire(self.keys.local_kv(instance), self.ttl_s)
            pipe.expire(self.keys.local_st(instance), self.ttl_s)
            pipe.execute()

    def live_instances(self) -> list[str]:
        """The instances whose heartbeat is live, by name."""
        with mapped():
            names = sorted(m.decode() if isinstance(m, bytes) else m for m in self.r.smembers(self.keys.instances))
            if not names:
                return []
            alive = self.r.mget([self.keys.heartbeat(n) for n in names])
        return [n for n, v in zip(names, alive, strict=True) if v is not None]

    # -- the lookup ------------------------------------------------------------------
    def lookup(
        self,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        unit: int,
        eagle: bool,
        held_by: Sequence[str] = (),
    ) -> LookupResult:
        """One EVALSHA: the store hit, each live instance's local hit, how far the chain is
        known and how many leading blocks each of the ``held_by`` (decode) instances holds
        (on a replica with ``read_replicas``; dead instances it reports are then removed on
        the primary). ValueError for an instance name with a newline (the names' separator)."""
        if any("\n" in name for name in held_by):
            raise ValueError("instance names cannot hold a newline")
        packed = _pack_lookup(self.keys, block_hashes, num_tokens, unit, eagle, held_by)
        with mapped():
            res, source = self._evalsha(LOOKUP_ARGC, packed)
        hits, dead = _result(res)
        if dead:
            self._reap(dead)
        return replace(hits, source=source)

    def _reap(self, dead: Sequence[str]) -> None:
        """Remove instances without a heartbeat from the set, on the primary, at most once a
        second (a failure is left to the next lookup that finds them)."""
        now = time.monotonic()
        if now < self._next_reap:
            return
        self._next_reap = now + 1.0
        args = [a for n in dead for a in (self.keys.heartbeat(n), n)]
        try:
            with mapped():
                self.r.eval(_REAP, 1, self._instances_key, *args)
        except (UnavailableError, redis.RedisError) as exc:
            logger.debug("dead instances %s not removed now: %s", dead, exc)

    # -- checkpoint reuse (eviction by value: hybridpd/checkpoint_value.py) --------------------
    def record_state_hits(self, hits: Sequence[tuple[BlockHash, float]]) -> None:
        """Count one reuse per ``(state hash, unix time)``: a prefill that hit the
        prefix ending at that hash (locally or from the store). ``hpd:<m>:hit:<H>``
        is a hash of ``n`` (reuses) and ``t`` (the last one's time), expiring
        ``ttl_s`` after its last reuse; the ledgers of the instances that put a
        state object read it to value their objects (``state_hits``)."""
        if not hits:
            return
        with mapped():
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
        with mapped():
            pipe = self.r.pipeline(transaction=False)
            for h in state_hashes:
                pipe.hmget(self.keys.hits(h), "n", "t")
            rows = pipe.execute()
        return [(int(n or 0), float(t or 0.0)) for n, t in rows]


#: arguments of lookup.lua: prefix, num_tokens, unit, eagle, the chain's KV keys, hash length,
#: the decode instances
LOOKUP_ARGC = 7


def _pack_lookup(
    keys: IndexKeys, hashes: Sequence[bytes], num_tokens: int, unit: int, eagle: bool, held_by: Sequence[str] = ()
) -> bytes:
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
    names = "\n".join(held_by).encode()
    out.append(b"$%d\r\n%s\r\n" % (len(names), names))
    return b"".join(out)


def _arg(x: object) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def _result(res: Sequence[Any]) -> tuple[LookupResult, list[str]]:
    """lookup.lua's reply: the hits of the live instances, the decode instances' held
    blocks, and the dead instances (hit -1)."""
    first = 3 + 2 * int(res[2])
    held = {res[i].decode(): int(res[i + 1]) for i in range(3, first, 2)}
    inst, dead = {}, []
    for i in range(first, len(res), 2):
        name, hit = res[i].decode(), int(res[i + 1])
        if hit < 0:
            dead.append(name)
        else:
            inst[name] = hit
    return LookupResult(int(res[0]), inst, int(res[1]), held), dead


def _raw(field: bytes | str) -> bytes:
    return field if isinstance(field, bytes) else field.encode()
