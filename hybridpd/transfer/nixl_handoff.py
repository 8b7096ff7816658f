"""NIXL handoff: prefill offers buffers, decode READs them, verifies, notifies.

Lifecycle of one handoff::

    prefill: offer(id, tensors, chunk_rows, context) -> HandoffDescriptor
             (memory registered, xxh3 checksum per buffer, or per chunk of
             ``chunk_rows`` rows; expiry = now + timeout; a keyed tag)
    decode:  fetch(desc, skip_chunks, context) -> check the tag -> READ every
             buffer but the skipped chunks -> verify what was read -> send
             "release:<id>" -> tensors
    prefill: on "release:<id>" or at expiry: scrub (zero) and deregister.

Chunks and the keyed tag: ``handoff_descriptor.py``. A reader may skip the
chunks it holds (a *delta* handoff; the skipped rows of the returned tensors
are left uninitialised); the tag is checked before the remote agent is
touched (``TagError`` for a descriptor not offered with this deployment's key).

A decode that comes after the expiry gets ``HandoffError`` (checked before
reading; and since expired buffers are zeroed before they are released, a
read that races the expiry fails verification instead of returning stale
bytes). Corrupted bytes raise ``IntegrityError`` and are never returned.

DRAM on CPU (UCX, cross-memory-attach on loopback); VRAM for CUDA tensors.

Progress: the agents run without NIXL's UCX progress thread (the Python API
starts it with no delay between iterations: a core per agent, busy or idle).
UCX then progresses only inside agent calls: decode's ``check_xfer_state``
drives its READ, and the server's loop drives its side (notifications, and
the target half of a READ over transports that need it, e.g. TCP) by polling
every ``poll_s`` while offers are outstanding; with none it blocks until the
next ``offer()``. An idle server makes no calls at all.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from hybridpd.errors import IntegrityError
from hybridpd.integrity import HANDOFF, PUBLIC, IntegrityKey
from hybridpd.store.objects import DTYPES, raw_bytes
from hybridpd.transfer.handoff_descriptor import (
    BufferSpec,
    HandoffDescriptor,
    HandoffError,
    check_descriptor,
    tag_descriptor,
)

logger = logging.getLogger(__name__)


def _digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(raw_bytes(t.cpu()))


def _spec(t: torch.Tensor, chunk_rows: int) -> BufferSpec:
    """The spec of an owned, contiguous tensor (chunked along dim 0 if ``chunk_rows``)."""
    nbytes = t.numel() * t.element_size()
    dtype = str(t.dtype).removeprefix("torch.")
    dev = t.device.index or 0
    if chunk_rows and t.dim() and t.shape[0]:
        host = t.cpu()  # one device-to-host copy, then a digest per chunk
        chunks = tuple(_digest(host[r : r + chunk_rows]) for r in range(0, t.shape[0], chunk_rows))
        return BufferSpec(tuple(t.shape), dtype, nbytes, "", t.data_ptr(), dev, chunk_rows, chunks)
    return BufferSpec(tuple(t.shape), dtype, nbytes, _digest(t), t.data_ptr(), dev)


def _mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    # NOTE: no progress thread: nixl_agent runs it with pthrDelay=0, a free spin (see the module docstring)
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


@dataclass(slots=True)
class _Offer:
    tensors: list[torch.Tensor]
    reg: object
    expires_at: float


class HandoffServer:
    """Prefill side. A background thread frees offers on release
    notifications and at expiry; ``close()`` frees everything. It polls
    every ``poll_s`` while offers are outstanding and sleeps otherwise."""

    def __init__(
        self, name: str | None = None, timeout_s: float = 30.0, poll_s: float = 0.001, key: IntegrityKey = PUBLIC
    ) -> None:
        self.name = name or "prefill-%s" % uuid.uuid4().hex[:8]
        self.timeout_s = timeout_s
        self._tagger = key.tagger(HANDOFF)
        self.agent = _agent(self.name)
        self.offers: dict[str, _Offer] = {}
        # NOTE: one lock for the offers AND every agent call: the poll thread
        # and offer() must not drive the NIXL agent concurrently.
        self.lock = threading.RLock()
        self.released = 0
        self.expired = 0
        #: offer-to-release seconds of recently released handoffs (drained by metrics)
        self.release_latencies: list[float] = []
        self._stop = threading.Event()
        self._work = threading.Event()  # set by offer() and close(): the loop has something to do
        self._thread = threading.Thread(target=self._loop, args=(poll_s,), name="nixl-handoff", daemon=True)
        self._thread.start()

    def offer(
        self,
        tensors: Sequence[torch.Tensor],
        handoff_id: str | None = None,
        chunk_rows: Sequence[int] = (),
        context: bytes = b"",
    ) -> HandoffDescriptor:
        """Offer ``tensors`` (one device); ``chunk_rows[i]`` > 0 checksums buffer ``i``
        in chunks of that many rows, which a reader may skip (missing entries: 0). The
        descriptor's tag also covers ``context``, which the reader must present again."""
        hid = handoff_id or uuid.uuid4().hex
        owned = [t.detach().contiguous() for t in tensors]
        rows = list(chunk_rows) + [0] * (len(owned) - len(chunk_rows))
        specs = tuple(_spec(t, r) for t, r in zip(owned, rows, strict=True))
        with self.lock:  # NOTE: metadata carries the registrations: take it after registering
            reg = self.agent.register_memory(owned)
            metadata = self.agent.get_agent_metadata()
            expires = time.time() + self.timeout_s
            self.offers[hid] = _Offer(owned, reg, expires)
        self._work.set()
        mem = _mem_type(owned[0].device) if owned else "DRAM"
        return tag_descriptor(HandoffDescriptor(hid, self.name, metadata, mem, specs, expires), self._tagger, context)

    def outstanding(self) -> int:
        with self.lock:
            return len(self.offers)

    def withdraw(self, hid: str) -> bool:
        """Free offer ``hid`` now (zeroed, deregistered): its request was aborted
        before decode read it. False if it is gone already (read or expired)."""
        return self._free(hid, scrub=True) is not None

    def _free(self, hid: str, scrub: bool, outcome: str | None = None) -> float | None:
        """Free one offer; returns when it was offered (None if unknown).

        ``outcome`` ("released" or "expired") is counted under the same lock
        that removes the offer, so once ``outstanding()`` no longer sees it
        the counters and ``release_latencies`` already do."""
        with self.lock:
            offer = self.offers.pop(hid, None)
            if offer is None:
                return None
            offered = offer.expires_at - self.timeout_s
            if outcome == "expired":
                self.expired += 1
            elif outcome == "released":
                self.released += 1
                if len(self.release_latencies) < 10_000:
                    self.release_latencies.append(time.time() - offered)
            if scrub:
                # NOTE: engine buffers are inference tensors: in-place writes need inference mode
                with torch.inference_mode():
                    for t in offer.tensors:
                        t.zero_()
            self.agent.deregister_memory(offer.reg)
        return offered

    def _loop(self, poll_s: float) -> None:
        while not self._stop.is_set():
            self._work.clear()
            with self.lock:
                idle = not self.offers
            if idle:  # nothing to release or expire: no agent calls until the next offer()
                self._work.wait()
                continue
            try:
                with self.lock:
                    notifs = self.agent.get_new_notifs()
                for _agent_name, msgs in notifs.items():
                    for msg in msgs:
                        if msg.startswith(b"release:"):
                            self._free(msg[8:].decode(), scrub=False, outcome="released")
                now = time.time()
                with self.lock:
                    late = [h for h, o in self.offers.items() if o.expires_at <= now]
                for hid in late:
                    logger.warning("handoff %s not read within %.1fs: freeing it", hid, self.timeout_s)
                    self._free(hid, scrub=True, outcome="expired")
            except Exception:  # keep freeing on timeouts even if one notification is malformed
                logger.exception("handoff server loop error")
            self._stop.wait(poll_s)

    def close(self) -> None:
        self._stop.set()
        self._work.set()
        self._thread.join(2)
        with self.lock:
            ids = list(self.offers)
        for hid in ids:
            self._free(hid, scrub=True)


def _verified(t: torch.Tensor, spec: BufferSpec, skip: frozenset[int]) -> bool:
    """Whether what was read of ``t`` matches ``spec``'s checksums."""
    if not spec.chunk_rows:
        return _digest(t) == spec.xxh3
    r = spec.chunk_rows
    host = t.cpu()  # one device-to-host copy, then a digest per chunk
    return all(c in skip or _digest(host[c * r : (c + 1) * r]) == d for c, d in enumerate(spec.chunk_xxh3))


class HandoffClient:
    """Decode side."""

    def __init__(self, name: str | None = None, read_timeout_s: float = 30.0, key: IntegrityKey = PUBLIC) -> None:
        self.name = name or "decode-%s" % uuid.uuid4().hex[:8]
        self._tagger = key.tagger(HANDOFF)
        self.agent = _agent(self.name)
        self.read_timeout_s = read_timeout_s
        self.remotes: dict[str, tuple[str, bytes]] = {}

    def _remote(self, desc: HandoffDescriptor) -> str:
        """The remote agent, (re)loaded when its metadata (registrations) changed."""
        known = self.remotes.get(desc.agent_name)
        if known is not None and known[1] == desc.agent_metadata:
            return known[0]
        if known is not None:
            self.agent.remove_remote_agent(known[0])
        name = self.agent.add_remote_agent(desc.agent_metadata)
        self.remotes[desc.agent_name] = (name, desc.agent_metadata)
        return name

    def fetch(
        self,
        desc: HandoffDescriptor,
        device: str = "cpu",
        skip_chunks: frozenset[int] = frozenset(),
        context: bytes = b"",
    ) -> list[torch.Tensor]:
        """Check the tag (with the offer's ``context``), READ, verify and release one
        handoff; returns owned tensors. Chunks ``skip_chunks`` of every chunked buffer
        are neither read nor verified (their rows are uninitialised: the caller holds
        them)."""
        check_descriptor(desc, self._tagger, context)  # before anything of it is used
        if time.time() >= desc.expires_at:
            raise HandoffError("handoff %s expired before it was read" % desc.handoff_id)
        remote = self._remote(desc)
        dst = [torch.empty(b.shape, dtype=DTYPES[b.dtype], device=device) for b in desc.buffers]
        reg = self.agent.register_memory(dst)
        handle = None
        try:
            pairs = [
                ((t.data_ptr() + a, b - a, t.device.index or 0), (spec.addr + a, b - a, spec.dev_id))
                for t, spec in zip(dst, desc.buffers, strict=True)
                for a, b in spec.kept_ranges(skip_chunks)
            ]
            if not pairs:  # the reader holds every byte
                raise HandoffError("handoff %s: nothing left to read" % desc.handoff_id)
            local = self.agent.get_xfer_descs([p[0] for p in pairs], _mem_type(torch.device(device)))
            remote_descs = self.agent.get_xfer_descs([p[1] for p in pairs], desc.mem_type)
            handle = self.agent.initialize_xfer("READ", local, remote_descs, remote)
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.read_timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise HandoffError("NIXL read of %s timed out" % desc.handoff_id)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise HandoffError("NIXL read of %s failed" % desc.handoff_id)
        except HandoffError:
            raise
        except Exception as exc:  # NIXL raises its own error types (remote gone, bad descriptors)
            raise HandoffError("NIXL read of %s failed: %s" % (desc.handoff_id, exc)) from exc
        finally:
            if handle is not None:
                self.agent.release_xfer_handle(handle)
            self.agent.deregister_memory(reg)
        for i, (t, spec) in enumerate(zip(dst, desc.buffers, strict=True)):
            if not _verified(t, spec, skip_chunks):
                raise IntegrityError("handoff %s buffer %d failed its checksum" % (desc.handoff_id, i))
        try:
            self.agent.send_notif(remote, b"release:" + desc.handoff_id.encode())
        except Exception:  # prefill frees on its timeout anyway
            logger.warning("could not notify %s to release %s", desc.agent_name, desc.handoff_id)
        return dst

    def close(self) -> None:
        for name, _ in self.remotes.values():
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # already gone
                logger.debug("remove_remote_agent %s failed", name, exc_info=True)
        self.remotes.clear()
