"""Redis schema of the global prefix index. ``<m>`` is the model id, ``<H>``
a chain hash as its raw digest bytes (32 for sha256_cbor; binary keys halve
what a 1,282-hash lookup sends and what Redis hashes per probe), ``<i>`` a
prefill instance name.

=========================  ======  ==========================================
key                        type    meaning
=========================  ======  ==========================================
``hpd:<m>:kv:<H>``         string  KV of block H is in MooncakeStore (TTL)
``hpd:<m>:st:<H>``         string  state after the prefix ending in block H is
                                   in MooncakeStore; value = its position (TTL)
``hpd:<m>:lkv:<i>``        hash    fields H: KV of block H is in instance i's
                                   local cache (key TTL refreshed by heartbeat;
                                   a decode instance: by ``refresh_local``)
``hpd:<m>:lst:<i>``        hash    fields H: state at H in instance i's cache
``hpd:<m>:hb:<i>``         string  instance i is alive; value = its load (JSON),
                                   expires unless heartbeats refresh it
``hpd:<m>:instances``      set     instances that ever heartbeated (the lookup
                                   drops members whose ``hb`` key expired)
``hpd:<m>:hit:<H>``        hash    ``n``: reuses of the state at H (any
                                   instance, local or store hit), ``t``: the
                                   last one's unix time (TTL after the last);
                                   read by the ledgers that value store state
=========================  ======  ==========================================

Rules: store entries are published only after the store put succeeded, and
deleted when a load finds the object missing or corrupt. A lookup is one
EVALSHA of ``lookup.lua`` (packed by hand: redis-py's generic packing cost
more than the lookup itself); the chain travels as ONE argument, its store KV
keys back to back, which the script cuts at a fixed stride (Redis parses 6
arguments, not 1,285). The leading run of each group is read in chunks
(EXISTS counts for store keys, HMGET for instance hashes) and stops at the
first absent block, so holes anywhere in a chain are handled exactly (tests
compare with a brute-force reference) and a short hit costs a short scan.

For an external Redis set ``hash-max-ziplist-entries 64`` (``hash-max-listpack-
entries`` on Redis 7+): instance hashes hold thousands of fields and a
compact encoding makes every HMGET field a linear scan.
"""

from __future__ import annotations

from hybridpd.hashing import BlockHash


class IndexKeys:
    def __init__(self, model_id: str) -> None:
        self.prefix = "hpd:%s:" % model_id
        self._kv = (self.prefix + "kv:").encode()
        self._st = (self.prefix + "st:").encode()

    def kv(self, h: BlockHash) -> bytes:
        return self._kv + h

    def st(self, h: BlockHash) -> bytes:
        return self._st + h

    def local_kv(self, instance: str) -> str:
        return "%slkv:%s" % (self.prefix, instance)

    def local_st(self, instance: str) -> str:
        return "%slst:%s" % (self.prefix, instance)

    def hits(self, h: BlockHash) -> bytes:
        return self.prefix.encode() + b"hit:" + h

    def heartbeat(self, instance: str) -> str:
        return "%shb:%s" % (self.prefix, instance)

    @property
    def instances(self) -> str:
        return self.prefix + "instances"
