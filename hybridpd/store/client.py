"""MooncakeStore client for attention-KV blocks and recurrent-state checkpoints.

Keys (model-scoped; ``H`` is the hex chain hash)::

    hpd/<model>/kv/<H>   KV of one unit block (every attention layer's K, V rows)
    hpd/<model>/st/<H>   state of every delta layer after the prefix ending in block H

A checkpoint at position ``p`` is ``p / u`` KV block objects plus one state
object; blocks already in the store are not written again (chains share
prefixes). Every object is checksummed and tagged with the deployment key
under its own name (``objects.py``); a get verifies it. Errors:
:class:`StoreMissError` (missing object: a stale index entry),
:class:`BadObjectError` (corrupt, or not written with this deployment's key
under that name), ``UnavailableError`` (the store failed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridpd.engine.base import BufferMeta, KVExport, StateCheckpoint
from hybridpd.errors import IntegrityError, NotFoundError, UnavailableError
from hybridpd.hashing import BlockHash
from hybridpd.integrity import PUBLIC, STORE_OBJECT, IntegrityKey, TagError
from hybridpd.procs import port_open
from hybridpd.store import objects

logger = logging.getLogger(__name__)


class StoreMissError(NotFoundError):
    """An object the caller expected is not in the store."""


class BadObjectError(IntegrityError):
    """An object that failed verification. ``name``: its store key; ``forged``: its
    checksum held but its keyed tag failed (written without this deployment's key, or
    moved from another name), not an accident."""

    def __init__(self, name: str, cause: IntegrityError) -> None:
        super().__init__("store object %s: %s" % (name, cause))
        self.name = name
        self.forged = isinstance(cause, TagError)


@dataclass(frozen=True, slots=True)
class PutResult:
    objects_written: int
    bytes_written: int
    seconds: float
    #: of ``bytes_written``, the state object's (it is always written)
    state_bytes: int = 0


def _loopback_env() -> None:
    # NOTE: Mooncake's transfer engine otherwise binds its RPC to the first
    # non-loopback interface; the local stack stays on 127.0.0.1.
    os.environ.setdefault("MC_TE_FILTERS", "lo")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


class CheckpointStore:
    def __init__(
        self,
        master: str,
        metadata_url: str,
        model_id: str,
        *,
        segment_bytes: int = 512 << 20,
        buffer_bytes: int = 128 << 20,
        local_host: str = "127.0.0.1",
        key: IntegrityKey = PUBLIC,
        lazy: bool = False,
    ) -> None:
        """``key``: the deployment key every object is tagged and checked with. ``lazy``: a
        master that cannot be reached now is no error: until it can, every use raises
        UnavailableError (a miss) and connecting is tried again at most every
        ``RECONNECT_S``, so a worker starts while the store is down and uses it once it
        is back."""
        if local_host in ("127.0.0.1", "localhost"):
            _loopback_env()
        self.model_id = model_id
        self._tagger = key.tagger(STORE_OBJECT)
        self._setup_args = (local_host, metadata_url, segment_bytes, buffer_bytes, "tcp", "", master)
        self._master = master
        self._client: Any = None
        self._next_try = 0.0
        self._connecting = threading.Lock()
        try:
            self._connect()
        except UnavailableError as exc:
            if not lazy:
                raise
            logger.warning("%s: serving without the store until it is back", exc)
            self._next_try = time.monotonic() + self.RECONNECT_S

    #: how often a lazy store tries its master again while it cannot reach it
    RECONNECT_S = 10.0

    def _connect(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        # NOTE: Mooncake's setup retries an unreachable master or metadata server for about a minute
        # and a half: look first, so an outage is a quick miss
        meta = urllib.parse.urlsplit(self._setup_args[1])
        host, _, port = self._master.rpartition(":")
        meta_port = meta.port or (443 if meta.scheme == "https" else 80)
        for h, p in ((host, port), (meta.hostname, meta_port)):
            if not h or not p or not port_open(h, int(p), timeout=1.0):
                raise UnavailableError("MooncakeStore: %s:%s (master %s) is not reachable" % (h, p, self._master))
        client = MooncakeDistributedStore()
        rc = client.setup(*self._setup_args)
        if rc != 0:
            with contextlib.suppress(Exception):  # a half-set-up client
                client.close()
            raise UnavailableError("MooncakeStore setup against %s failed (rc %d)" % (self._master, rc))
        self._client = client
        logger.info("connected to the Mooncake master %s", self._master)

    @property
    def store(self) -> Any:
        """The Mooncake client, connected on first use (``lazy``)."""
        if self._client is None:
            with self._connecting:
                if self._client is None:
                    if time.monotonic() < self._next_try:
                        raise UnavailableError("the Mooncake master %s is not reachable (retrying)" % self._master)
                    try:
                        self._connect()
                    except UnavailableError:
                        self._next_try = time.monotonic() + self.RECONNECT_S
                        raise
        return self._client

    def key(self, kind: str, h: BlockHash) -> str:
        return "hpd/%s/%s/%s" % (self.model_id, kind, h.hex())

    # -- generic objects -------------------------------------------------------------
    def put_objects(self, items: Sequence[tuple[str, str, int, Sequence[torch.Tensor]]]) -> int:
        """Put ``(key, kind, position, buffers)`` items; returns bytes written."""
        return sum(self._put(key, self._encode(key, kind, pos, bufs)) for key, kind, pos, bufs in items)

    def _encode(self, key: str, kind: str, pos: int, bufs: Sequence[torch.Tensor]) -> list[memoryview | bytes]:
        return objects.encode(self.model_id, kind, pos, bufs, name=key, tagger=self._tagger)

    def _put(self, key: str, parts: Sequence[memoryview | bytes]) -> int:
        rc = self.store.put_parts(key, *parts)
        if rc != 0:
            raise UnavailableError("store put %s failed (rc %d)" % (key, rc))
        return sum(len(p) for p in parts)

    def get_objects(self, keys: Sequence[str], kind: str) -> list[tuple[objects.ObjectHeader, list[torch.Tensor]]]:
        datas = self.store.get_batch(list(keys))
        out = []
        for key, data in zip(keys, datas, strict=True):
            if not data:
                raise StoreMissError("store has no object %s" % key)
            try:
                out.append(objects.decode(data, self.model_id, kind, name=key, tagger=self._tagger))
            except IntegrityError as exc:
                raise BadObjectError(key, exc) from None
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [r == 1 for r in self.store.batch_is_exist(list(keys))]

    def remove(self, keys: Sequence[str]) -> list[str]:
        """Remove ``keys``; returns those still in the store afterwards (a removal that
        failed for another reason than the object being gone already)."""
        keys = list(keys)
        codes = self.store.batch_remove(keys, True)
        failed = [k for k, c in zip(keys, codes, strict=True) if c != 0]
        return [k for k, there in zip(failed, self.exists(failed), strict=True) if there] if failed else []

    # -- checkpoints -----------------------------------------------------------------
    def put_checkpoint(
        self, kv: KVExport, state: StateCheckpoint, unit: int, make_room: Callable[[int], None] | None = None
    ) -> PutResult:
        """Store state@p and the KV blocks of ``kv`` (``[0, q)``, q >= p) missing
        from the store. KV past ``p`` matters: an EAGLE hit drops the last
        cached block, so a hit at ``p`` needs block ``[p, p + u)`` present.

        ``make_room(n)`` runs first, with the state object's exact size, before
        anything is written (the publisher evicts there to stay within its state
        budget); if it raises, nothing is written."""
        t0 = time.perf_counter()
        pos = state.meta.position
        if state.key is None or len(kv.block_hashes) != kv.meta.position // unit or kv.meta.position < pos:
            raise ValueError("checkpoint must carry KV and the chain hashes of at least [0, %d)" % pos)
        st_key = self.key("st", state.key)
        st_parts = self._encode(st_key, "state", pos, list(state.buffers))
        if make_room is not None:
            make_room(sum(len(p) for p in st_parts))
        keys = [self.key("kv", h) for h in kv.block_hashes]
        present = self.exists(keys)
        items: list[tuple[str, str, int, Sequence[torch.Tensor]]] = []
        for i, (k, there) in enumerate(zip(keys, present, strict=True)):
            if not there:
                rows = slice(i * unit, (i + 1) * unit)
                items.append((k, "kv", (i + 1) * unit, [b[rows] for b in kv.buffers]))
        nbytes = self.put_objects(items)
        st_bytes = self._put(st_key, st_parts)
        return PutResult(len(items) + 1, nbytes + st_bytes, time.perf_counter() - t0, st_bytes)

    def get_checkpoint(
        self, block_hashes: Sequence[BlockHash], unit: int, position: int | None = None
    ) -> tuple[KVExport, StateCheckpoint]:
        """Load (verified) the KV blocks of ``block_hashes`` and the state at
        ``position`` (default: the end of those blocks; EAGLE callers load one
        block past it, the replay block their hit rule drops)."""
        kv_pos = len(block_hashes) * unit
        pos = kv_pos if position is None else position
        if not block_hashes or pos <= 0 or pos % unit or pos > kv_pos:
            raise ValueError("bad checkpoint request: %d blocks, position %s" % (len(block_hashes), position))
        kv_keys = [self.key("kv", h) for h in block_hashes]
        blocks = self.get_objects(kv_keys, "kv")
        for i, (hdr, _) in enumerate(blocks):
            if hdr.position != (i + 1) * unit:
                raise BadObjectError(kv_keys[i], IntegrityError("kv block %d holds position %d" % (i, hdr.position)))
        state_hash = block_hashes[pos // unit - 1]
        st_key = self.key("st", state_hash)
        ((st_hdr, st_bufs),) = self.get_objects([st_key], "state")
        if st_hdr.position != pos:
            raise BadObjectError(
                st_key, IntegrityError("state object holds position %d, expected %d" % (st_hdr.position, pos))
            )
        n_bufs = len(blocks[0][1])
        kv_bufs = tuple(torch.cat([b[1][j] for b in blocks]) for j in range(n_bufs))
        kv_meta = BufferMeta(
            self.model_id, "kv", kv_pos, blocks[0][0].dtype, tuple(tuple(b.shape) for b in kv_bufs), "attention"
        )
        st_meta = BufferMeta(self.model_id, "state", pos, st_hdr.dtype, st_hdr.shapes, "delta")
        return (
            KVExport(kv_meta, kv_bufs, tuple(block_hashes)),
            StateCheckpoint(st_meta, state_hash, tuple(st_bufs)),
        )

    def close(self) -> None:
        if self._client is None:
            return
        try:
            self._client.close()
        except Exception:  # closing a half-set-up client must not mask the real error
            logger.debug("store close failed", exc_info=True)
