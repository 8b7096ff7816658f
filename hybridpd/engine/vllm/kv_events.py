"""A vLLM engine's KV-cache events, as our cache events (``engine.base.CacheEvent``).

vLLM publishes ``KVEventBatch`` messages (msgpack over ZMQ PUB) when blocks
are stored, removed or all cleared. With ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``
the hashes are the full block-hash bytes, which equal our chain
(``tests/vllm/test_hash_equality.py``). The index may claim for an instance
only what vLLM can deliver, so the mapping follows vLLM's cache entries, not
its events one by one (vLLM 0.32, align mode; ``tests/vllm/test_kv_events.py``):

* **Two media.** The engine's block pool tags its events ``medium="GPU"`` (on
  every device) and names each group's kind (``kv_cache_spec_kind``);
  MooncakeStoreConnector tags its store puts ``medium="cpu"`` with a group
  index and no kind. A store event never changes what a local group is: group
  kinds come from the engine's KV-cache config (``GroupSpec``) or from the
  first local event that names one, and store events become store entries
  (``CacheEvent.store``), never local ones. On our P/D prefill engine none
  arrive: its connector is a MultiConnector (Nixl + Mooncake store), which in
  vLLM 0.32 does not pass its sub-connectors' events on
  (``get_kv_connector_kv_cache_events`` is a TODO there). Where they do arrive
  (with them forwarded) they name attention blocks only: a prompt's Mamba states reach the store as
  boundary puts, which publish no event, so the store tier claims KV and no
  state, i.e. no store hit; and a put of a prompt's first block names no cache
  salt, so for a salted prompt its tokens do not prove its hash (a mismatch,
  counted) and only the registered prompt names its units
  (``tests/vllm/test_index_truth.py``).
* **An entry ends at a hash.** An attention entry is a full block (its hash
  at the block end) or a *partial* entry at a unit boundary inside a block
  (the prompt tail vLLM registers: its event carries only the last unit's
  tokens). Either way the entry makes the KV of its block from the block
  start to its end usable, so it covers those units; the units' hashes come
  from the event's tokens, or, for a partial entry, from the prompt the engine
  registered (``PromptRegistry``: the engine registers every prompt's chain
  when it adds the request, before vLLM can publish anything of it).
* **Claims** (``cache_claims.py``): a unit is claimed while a live entry of
  every attention group covers it, a state at H while every group of the
  model has a live entry at H; changes are settled per batch of vLLM events
  (a batch carries all groups' events of one step), and only the net
  transitions are published.

Store entries have no removal events (Mooncake evicts silently): the index
bounds them with its TTL, and the store tier forgets the oldest entries
without publishing anything (``cache_claims.py``). ``AllBlocksCleared`` and a
gap in vLLM's sequence numbers (ZMQ drops silently) become CLEARED.
``KVEventFeed.apply`` is the pure mapping; ``KVEventFeed.start`` runs it on a
ZMQ subscriber thread. The engine drains the result with ``pop_cache_events``.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import uuid
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.engine.vllm import adapter
from hybridpd.engine.vllm.cache_claims import ATTENTION, ClaimTier
from hybridpd.engine.vllm.prompt_registry import PromptRegistry
from hybridpd.hashing import BlockHash, BlockHasher

logger = logging.getLogger(__name__)

#: the medium MooncakeStoreConnector's store puts carry (the block pool's is "GPU" on every device)
STORE_MEDIUM = "cpu"
#: how long the feed thread waits for a batch before it looks at its stop flag: an idle
#: engine wakes it once a second (``close`` joins it within that)
POLL_MS = 1000


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


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group of the engine: its kind (``full_attention``, ``mamba``, ...)
    and block size in tokens."""

    kind: str
    block_size: int


class KVEventFeed:
    """Turns one engine's KV events into cache events (``pop`` drains them; thread-safe).

    ``groups``: the engine's KV-cache groups (index -> ``GroupSpec``), from its
    config; without them kinds and block sizes are learned from local events."""

    def __init__(self, hasher: BlockHasher, groups: Mapping[int, GroupSpec] | None = None) -> None:
        self.events: deque[CacheEvent] = deque()
        self.hasher = hasher
        self.kinds: dict[int, str] = {g: s.kind for g, s in (groups or {}).items()}
        self.block_sizes: dict[int, int] = {g: s.block_size for g, s in (groups or {}).items()}
        self.prompts = PromptRegistry()
        self.local = ClaimTier(store=False)
        self.store = ClaimTier(store=True)
        self.last_seq: int | None = None
        self.gaps = 0
        self.published_kv = 0
        self.published_states = 0
        self.store_entries = 0
        self.removed = 0
        self.mismatches = 0
        self.uncovered = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register_prompt(self, chain: Sequence[BlockHash]) -> None:
        """A prompt the engine is about to compute (its chain at ``hasher``'s unit)."""
        self.prompts.register(chain)

    # -- the mapping -----------------------------------------------------------------
    def _learn(self, ev: Any) -> int:
        group = int(ev.group_idx or 0)
        kind = str(ev.kv_cache_spec_kind or "")  # None on a store put (no kind)
        if kind and group not in self.kinds:
            self.kinds[group] = kind
        elif kind and self.kinds[group] != kind:
            logger.warning("KV event names group %d %r, known as %r: kept %r", group, kind, self.kinds[group], kind)
        if kind:  # a partial entry's event is shorter than the group's block: the largest seen is it
            self.block_sizes[group] = max(self.block_sizes.get(group, 0), int(ev.block_size or 0))
        return group

    def _event_units(self, ev: Any, hashes: list[bytes]) -> list[tuple[BlockHash, ...] | None]:
        """Per hash of the event, the units its tokens prove (None where they do not)."""
        bs, u = int(ev.block_size or 0), self.hasher.unit
        tokens = list(ev.token_ids or ())
        if not tokens or bs % u or len(tokens) != bs * len(hashes):
            return [None] * len(hashes)
        parent = bytes(ev.parent_block_hash) if ev.parent_block_hash is not None else None
        extra = list(ev.extra_keys or [])
        salt = _salt(extra[0]) if parent is None and extra else None
        units = self.hasher.chain(
            tokens,
            cache_salt=salt,
            parent=BlockHash(parent) if parent else None,
            first_block_index=0 if parent is None else 1,
        )
        per = bs // u
        out: list[tuple[BlockHash, ...] | None] = []
        for i, end in enumerate(hashes):
            chunk = tuple(units[i * per : (i + 1) * per])
            if len(chunk) == per and chunk[-1] == end:
                out.append(chunk)
                continue
            self.mismatches += 1
            logger.warning("KV event block %d does not match our hash chain: not indexed", i)
            out.append(None)
        return out

    def _covers(self, group: int, h: bytes, proven: tuple[BlockHash, ...] | None) -> tuple[BlockHash, ...] | None:
        """The units an attention entry ending at ``h`` makes usable: from its block's
        start to ``h``. The registered prompt knows them all; the event's tokens may
        prove only the tail (a partial entry), and must agree with the prompt."""
        size = self.block_sizes.get(group)
        found = self.prompts.units_before(h, size, self.hasher.unit) if size else None
        if found is not None:
            units = found[1]
            if proven is not None and tuple(units[-len(proven) :]) != proven:
                self.mismatches += 1
                return None
            return units
        if proven is None:
            self.uncovered += 1
        return proven

    def _stored(self, ev: Any) -> None:
        is_store = ev.medium == STORE_MEDIUM
        group = int(ev.group_idx or 0) if is_store else self._learn(ev)
        kind = self.kinds.get(group, "")
        hashes = [bytes(h) for h in ev.block_hashes]
        tier = self.store if is_store else self.local
        if kind == ATTENTION:
            for h, proven in zip(hashes, self._event_units(ev, hashes), strict=True):
                units = self._covers(group, h, proven)
                if units is not None:
                    tier.add(group, h, units)
        elif kind:
            for h in hashes:
                tier.add(group, h, None)
        if is_store:
            self.store_entries += len(hashes)

    def _removed(self, ev: Any) -> None:
        if ev.medium == STORE_MEDIUM:
            return  # the store does not report evictions; its entries live out their TTL
        group = int(ev.group_idx or 0)
        for h in ev.block_hashes:
            self.local.remove(group, bytes(h))
        self.removed += len(ev.block_hashes)

    def _clear(self) -> None:
        self.events.append(CacheEvent(CacheEventKind.CLEARED, None))
        self.local.clear()

    def apply(self, events: Iterable[Any]) -> None:
        """Translate one batch of vLLM's events; publish the net changes it made."""
        with self._lock:
            for ev in events:
                name = type(ev).__name__
                if name == "BlockStored":
                    self._stored(ev)
                elif name == "BlockRemoved":
                    self._removed(ev)
                elif name == "AllBlocksCleared":
                    self._clear()
            for tier in (self.local, self.store):
                for out in tier.settle(self.kinds):
                    self.events.append(out)
                    if out.kind is CacheEventKind.STORED and not out.store:
                        if out.group is CacheGroup.KV:
                            self.published_kv += len(out.hashes)
                        else:
                            self.published_states += len(out.hashes)

    def check_sequence(self, seq: int) -> None:
        """ZMQ PUB/SUB drops messages silently (a slow subscriber, a full queue): a gap
        in vLLM's sequence numbers means removals may be lost, so everything this
        engine published is withdrawn (CLEARED) and rebuilt from later events: the
        index may under-claim for a while, never claim what is gone."""
        with self._lock:
            if self.last_seq is not None and seq != self.last_seq + 1:
                logger.warning(
                    "KV events %d..%d lost: the index forgets this engine's entries", self.last_seq + 1, seq - 1
                )
                self.gaps += 1
                self._clear()
            self.last_seq = seq

    def pop(self) -> list[CacheEvent]:
        """Every event translated so far, in order (the subscriber keeps appending)."""
        with self._lock:
            out = list(self.events)
            self.events.clear()
        return out

    # -- the subscriber ----------------------------------------------------------------
    def start(self, endpoint: str) -> None:
        """Subscribe to ``endpoint`` (vLLM's publisher) on a daemon thread."""
        self._thread = threading.Thread(target=self._run, args=(endpoint,), name="kv-events", daemon=True)
        self._thread.start()

    def _run(self, endpoint: str) -> None:
        import msgspec
        import zmq

        decoder = msgspec.msgpack.Decoder(type=adapter.kv_event_batch_type())
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            while not self._stop.is_set():
                if not sub.poll(POLL_MS):
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
