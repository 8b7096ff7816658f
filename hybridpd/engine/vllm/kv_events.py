"""A vLLM engine's KV-cache events, as our cache events (``engine.base.CacheEvent``).

vLLM publishes ``KVEventBatch`` messages (msgpack over ZMQ PUB) when blocks
are stored, removed or all cleared. With ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``
the hashes are the full block-hash bytes, which equal our chain
(``tests/vllm/test_hash_equality.py``). For a hybrid model each event names
its KV-cache group kind:

* ``full_attention``: attention KV of the blocks' tokens. vLLM's blocks can be
  larger than ``prefix_match_unit`` (640 tokens for the tiny Qwen3-Next), but
  the index keeps a hash per unit, so the unit hashes inside each block are
  recomputed from the event's parent hash and token ids; the hash at each
  block end must equal the event's (checked: a mismatch is skipped and
  counted, never published);
* ``mamba``: a recurrent-state checkpoint at each block end (the state keyed by
  the chain hash at that position); the several Mamba groups of one model
  report the same hashes and are published once.

Removed blocks become REMOVED events (of the unit hashes they covered);
``AllBlocksCleared`` becomes CLEARED. ``KVEventFeed.apply`` is the pure
mapping; ``KVEventFeed.start`` runs it on a ZMQ subscriber thread. The engine
drains the result with ``pop_cache_events``, like the native engine's, and
the prefill worker's publisher writes the index: one stream for both engines.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.hashing import BlockHash, BlockHasher

logger = logging.getLogger(__name__)


def kv_events_endpoint() -> str:
    """A fresh machine-local endpoint (IPC socket) for one engine's event publisher to bind."""
    return "ipc://%s/hybridpd-kv-%s.sock" % (tempfile.gettempdir(), uuid.uuid4().hex[:12])


def _salt(block_keys: Any) -> str | None:
    """The cache salt among a first block's extra keys (vLLM's events carry it as
    the bare string; its hash input as ``("cache_salt", salt)``)."""
    for key in block_keys or ():
        if isinstance(key, str):
            return key
        if isinstance(key, (tuple, list)) and len(key) == 2 and key[0] == "cache_salt":
            return str(key[1])
    return None


class KVEventFeed:
    """Turns one engine's KV events into cache events (``pop`` drains them; thread-safe)."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.events: deque[CacheEvent] = deque()
        self.hasher = hasher
        self.last_seq: int | None = None
        self.gaps = 0
        self.group_kind: dict[int, str] = {}
        #: attention block end hash -> the unit hashes it covers (to remove them later)
        self.units_of: dict[bytes, list[BlockHash]] = {}
        self.published_kv = 0
        self.published_states = 0
        self.removed = 0
        self.mismatches = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the mapping -----------------------------------------------------------------
    def _stored(self, ev: Any) -> None:
        kind = str(getattr(ev, "kv_cache_spec_kind", "") or "")
        self.group_kind[int(ev.group_idx or 0)] = kind
        hashes = [bytes(h) for h in ev.block_hashes]
        if kind == "mamba":
            new = [BlockHash(h) for h in hashes]
            self.events.append(CacheEvent(CacheEventKind.STORED, CacheGroup.STATE, tuple(new)))
            self.published_states += len(new)
            return
        if kind != "full_attention":
            return
        bs, u = int(ev.block_size), self.hasher.unit
        if bs % u:
            self.mismatches += 1
            logger.warning("vLLM block size %d is not a multiple of prefix_match_unit %d: not indexed", bs, u)
            return
        parent = bytes(ev.parent_block_hash) if ev.parent_block_hash is not None else None
        extra = list(ev.extra_keys or [])
        salt = _salt(extra[0]) if parent is None and extra else None
        units = self.hasher.chain(
            list(ev.token_ids),
            cache_salt=salt,
            parent=BlockHash(parent) if parent else None,
            first_block_index=0 if parent is None else 1,
        )
        per = bs // u
        publish: list[BlockHash] = []
        for i, end in enumerate(hashes):
            chunk = units[i * per : (i + 1) * per]
            if len(chunk) != per or chunk[-1] != end:
                self.mismatches += 1
                logger.warning("KV event block %d does not match our hash chain: skipped", i)
                break
            self.units_of[end] = chunk
            publish.extend(chunk)
        if publish:
            self.events.append(CacheEvent(CacheEventKind.STORED, CacheGroup.KV, tuple(publish)))
            self.published_kv += len(publish)

    def _removed(self, ev: Any) -> None:
        kind = self.group_kind.get(int(ev.group_idx or 0), "")
        hashes = [bytes(h) for h in ev.block_hashes]
        if kind == "mamba":
            self.events.append(CacheEvent(CacheEventKind.REMOVED, CacheGroup.STATE, tuple(map(BlockHash, hashes))))
        else:
            units = [u for h in hashes for u in self.units_of.pop(h, [])]
            if units:
                self.events.append(CacheEvent(CacheEventKind.REMOVED, CacheGroup.KV, tuple(units)))
        self.removed += len(hashes)

    def apply(self, events: Iterable[Any]) -> None:
        """Translate a batch's events in order."""
        for ev in events:
            name = type(ev).__name__
            if name == "BlockStored":
                self._stored(ev)
            elif name == "BlockRemoved":
                self._removed(ev)
            elif name == "AllBlocksCleared":
                self.events.append(CacheEvent(CacheEventKind.CLEARED, None))
                self.units_of.clear()

    def check_sequence(self, seq: int) -> None:
        """ZMQ PUB/SUB drops messages silently (a slow subscriber, a full queue): a gap
        in vLLM's sequence numbers means removals may be lost, so everything this
        engine published is withdrawn (CLEARED) and rebuilt from later events: the
        index may under-claim for a while, never claim what is gone."""
        if self.last_seq is not None and seq != self.last_seq + 1:
            logger.warning("KV events %d..%d lost: the index forgets this engine's entries", self.last_seq + 1, seq - 1)
            self.gaps += 1
            self.events.append(CacheEvent(CacheEventKind.CLEARED, None))
            self.units_of.clear()
        self.last_seq = seq

    def add(self, event: CacheEvent) -> None:
        """An event the engine itself knows of (see ``VllmEngine.pop_handoff``)."""
        self.events.append(event)

    def pop(self) -> list[CacheEvent]:
        """Every event translated so far, in order (the subscriber keeps appending)."""
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out

    # -- the subscriber ----------------------------------------------------------------
    def start(self, endpoint: str) -> None:
        """Subscribe to ``endpoint`` (vLLM's publisher) on a daemon thread."""
        self._thread = threading.Thread(target=self._run, args=(endpoint,), name="kv-events", daemon=True)
        self._thread.start()

    def _run(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                parts: Sequence[bytes] = sub.recv_multipart()
                if len(parts) == 3:  # (topic, sequence number, payload)
                    self.check_sequence(int.from_bytes(parts[1], "big"))
                self.apply(decoder.decode(parts[-1]).events)
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
