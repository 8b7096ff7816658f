"""The synthetic content of ``bench index-scale`` and how it is loaded into Redis.

``Population`` generates it deterministically in rounds shaped like traffic
(a system prompt on 48 of 64 instances, eight agent trees, twenty long unique
tails; states every ``STATE_EVERY`` blocks and at each segment's end) and
counts memberships as it goes. The ``load_*`` functions write it in one
encoding each, through ``Loader`` (RESP packed by hand, pipelined: redis-py's
generic packing of 10M fields would dominate the run).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hybridpd.hashing import BlockHash
from hybridpd.index.prefix_index import PrefixIndex

INSTANCES = 64
NAMES = ["prefill-%02d" % i for i in range(INSTANCES)]
STATE_EVERY = 16
#: today's encoding first, then the alternatives measured beside it
ENCODINGS = ("set_per_instance", "hash_per_instance", "set_per_instance_16B", "bitmap_per_block")


@dataclass(slots=True)
class Segment:
    """``n`` consecutive blocks held by ``holders`` (instance indices), in the store or not."""

    hashes: list[bytes]
    holders: list[int]
    store: bool

    def states(self) -> list[bytes]:
        """The blocks a holder keeps a state at: every STATE_EVERY-th and the last."""
        n = len(self.hashes)
        return [self.hashes[i - 1] for i in range(1, n + 1) if i % STATE_EVERY == 0 or i == n]


@dataclass(slots=True)
class Population:
    """The synthetic content, generated deterministically and counted as it goes."""

    seed: int
    memberships: int = 0
    store_entries: int = 0
    blocks: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: {"system": 0, "tree": 0, "tail": 0})
    _rng: random.Random = field(init=False)
    _queue: list[tuple[str, Segment]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def _hashes(self, n: int) -> list[bytes]:
        raw = self._rng.randbytes(32 * n)
        return [raw[i : i + 32] for i in range(0, 32 * n, 32)]

    def _round(self) -> list[tuple[str, Segment]]:
        rng = self._rng
        out = [("system", Segment(self._hashes(32), rng.sample(range(INSTANCES), 48), True))]
        for _ in range(8):
            out.append(("tree", Segment(self._hashes(16), rng.sample(range(INSTANCES), 8), True)))
            out += [("tree", Segment(self._hashes(16), rng.sample(range(INSTANCES), 2), True)) for _ in range(4)]
        for k in range(20):
            n = int(math.exp(rng.uniform(math.log(8), math.log(1281))))
            out.append(("tail", Segment(self._hashes(n), [rng.randrange(INSTANCES)], k % 2 == 0)))
        return out

    def until(self, memberships: int) -> Iterator[Segment]:
        """Segments until the count reaches ``memberships`` (counted as yielded)."""
        while self.memberships < memberships:
            if not self._queue:
                self._queue = self._round()
            kind, seg = self._queue.pop(0)
            m = (len(seg.hashes) + len(seg.states())) * len(seg.holders)
            self.memberships += m
            self.by_kind[kind] += m
            self.blocks += len(seg.hashes)
            if seg.store:
                self.store_entries += len(seg.hashes) + len(seg.states())
            yield seg


def _bulk(x: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(x), x)


def _cmd(*args: bytes) -> bytes:
    return b"*%d\r\n%s" % (len(args), b"".join(map(_bulk, args)))


def _hset(key: bytes, fields: list[bytes], value: bytes = b"1") -> bytes:
    v = _bulk(value)
    return b"*%d\r\n%s%s%s" % (2 + 2 * len(fields), _bulk(b"HSET"), _bulk(key), b"".join(_bulk(f) + v for f in fields))


class Loader:
    """Pipelined raw commands on one connection, flushed every ~1 MB."""

    def __init__(self, index: PrefixIndex) -> None:
        self.conn = index.r.connection_pool.get_connection()
        self.buf: list[bytes] = []
        self.size = 0

    def add(self, packed: bytes) -> None:
        self.buf.append(packed)
        self.size += len(packed)
        if self.size > 1 << 20:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        self.conn.send_packed_command(self.buf)
        for _ in self.buf:
            self.conn.read_response()  # raises on an error reply
        self.buf, self.size = [], 0


def load_today(loader: Loader, keys: Any, segments: Iterator[Segment], ttl_s: int, member_bytes: int = 32) -> None:
    """Today's encoding (schema.py): a set per instance, a key per store entry."""
    ttl = b"%d" % ttl_s
    for seg in segments:
        kv = [h[:member_bytes] for h in seg.hashes]
        st = [h[:member_bytes] for h in seg.states()]
        for i in seg.holders:
            loader.add(_cmd(b"SADD", keys.local_kv(NAMES[i]).encode(), *kv))
            loader.add(_cmd(b"SADD", keys.local_st(NAMES[i]).encode(), *st))
        if seg.store:
            for h in seg.hashes:
                loader.add(_cmd(b"SET", keys.kv(BlockHash(h)), b"1", b"EX", ttl))
            for pos, h in enumerate(seg.states()):
                loader.add(_cmd(b"SET", keys.st(BlockHash(h)), b"%d" % pos, b"EX", ttl))
    loader.flush()


def load_hashes(loader: Loader, keys: Any, segments: Iterator[Segment]) -> None:
    """The encoding until 2026-12: a hash per instance, each field's value ``1``."""
    for seg in segments:
        for i in seg.holders:
            loader.add(_hset(keys.local_kv(NAMES[i]).encode(), seg.hashes))
            loader.add(_hset(keys.local_st(NAMES[i]).encode(), seg.states()))
    loader.flush()


def load_bitmap(loader: Loader, prefix: bytes, segments: Iterator[Segment], ttl_s: int) -> None:
    """The alternative: one string key per block (and per state) holding a 64-bit bitmap
    of its holders; the store's entries as today."""
    ttl = b"%d" % ttl_s
    for seg in segments:
        bits = sum(1 << i for i in seg.holders).to_bytes(8, "little")
        for h in seg.hashes:
            loader.add(_cmd(b"SET", prefix + b"b:" + h, bits))
        for h in seg.states():
            loader.add(_cmd(b"SET", prefix + b"sb:" + h, bits))
        if seg.store:
            for h in seg.hashes:
                loader.add(_cmd(b"SET", prefix + b"kv:" + h, b"1", b"EX", ttl))
            for pos, h in enumerate(seg.states()):
                loader.add(_cmd(b"SET", prefix + b"st:" + h, b"%d" % pos, b"EX", ttl))
    loader.flush()
