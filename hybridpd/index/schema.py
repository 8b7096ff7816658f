"""Redis schema of the global prefix index. Every key starts ``hpd:{<m>}:``:
the braces make the model id a Redis Cluster hash tag, so all of one model's
keys share one hash slot and a lookup (one Lua script) touches one shard of a
cluster; models spread over the shards. In the table ``hpd:<m>:`` stands for
that prefix. ``<m>`` is the model id, ``<H>``
a chain hash as its raw digest bytes (32 for sha256_cbor; binary keys halve
what a 1,282-hash lookup sends and what Redis hashes per probe), ``<i>`` a
prefill instance name.

=========================  ======  ==========================================
key                        type    meaning
=========================  ======  ==========================================
``hpd:<m>:kv:<H>``         string  KV of block H is in MooncakeStore (TTL)
``hpd:<m>:st:<H>``         string  state after the prefix ending in block H is
                                   in MooncakeStore; value = its position (TTL)
``hpd:<m>:ikv:<i>``        set     members H: KV of block H is in instance i's
                                   local cache (key TTL refreshed by heartbeat;
                                   a decode instance: by ``refresh_local``)
``hpd:<m>:ist:<i>``        set     members H: state at H in instance i's cache
``hpd:<m>:hb:<i>``         string  instance i is alive (value ``1``); expires
                                   unless heartbeats refresh it
``hpd:<m>:instances``      set     instances that ever heartbeated (the lookup
                                   drops members whose ``hb`` key expired)
``hpd:<m>:hit:<H>``        hash    ``n``: reuses of the state at H (any
                                   instance, local or store hit), ``t``: the
                                   last one's unix time (TTL after the last);
                                   read by the ledgers that value store state
=========================  ======  ==========================================

Rules: store entries are published only after the store put succeeded, and
deleted when a load finds the object missing or corrupt. A lookup is one
EVALSHA of ``lookup.lua`` with its arguments packed here, not by redis-py's
generic packing; the chain travels as ONE argument, its store KV keys back to
back, which the script cuts at a fixed stride (Redis parses 6 arguments, not
one per block). The leading run of each group is read in chunks
(EXISTS counts for store keys, SMISMEMBER for instance sets) and stops at the
first absent block, so holes anywhere in a chain are handled exactly (tests
compare with a brute-force reference) and a short hit costs a short scan.

Instance entries are sets (Redis >= 6.2 for SMISMEMBER), not hashes: a set
member carries no value, so it costs less memory per membership at the same
exact lookup (``bench index-scale`` compares the encodings side by side). The
keys are named ``ikv``/``ist``, not the hashes' ``lkv``/``lst``, so a rolling
upgrade never meets a hash where it expects a set. Small sets in Redis 7.2+ are listpacks
up to ``set-max-listpack-entries`` (128) members: a scan that short costs
less than a probe of a hash table.
"""

from __future__ import annotations

from hybridpd.hashing import BlockHash


class IndexKeys:
    def __init__(self, model_id: str) -> None:
        # NOTE: a "}" in the id would end the hash tag early (an empty tag hashes the whole key)
        tag = model_id.replace("%", "%25").replace("}", "%7D")
        self.prefix = "hpd:{%s}:" % tag
        self._kv = (self.prefix + "kv:").encode()
        self._st = (self.prefix + "st:").encode()

    def kv(self, h: BlockHash) -> bytes:
        return self._kv + h

    def st(self, h: BlockHash) -> bytes:
        return self._st + h

    def local_kv(self, instance: str) -> str:
        return "%sikv:%s" % (self.prefix, instance)

    def local_st(self, instance: str) -> str:
        return "%sist:%s" % (self.prefix, instance)

    def hits(self, h: BlockHash) -> bytes:
        return self.prefix.encode() + b"hit:" + h

    def heartbeat(self, instance: str) -> str:
        return "%shb:%s" % (self.prefix, instance)

    @property
    def instances(self) -> str:
        return self.prefix + "instances"
