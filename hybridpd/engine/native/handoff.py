"""The native P/D handoff: what a prefilled request carries to decode, and how it moves.

::

    prefill engine                                    decode engine
    step(): prompt done -> Handoff (owned copies)
    pop_handoff(rid): NIXL offer (checksums, expiry)
        -> NativeTicket --- crosses Ray, via the router --->
                                                      fetch_handoff(req, ticket):
                                                        NIXL READ, verify, "release:<id>"
                                                        -> FetchedHandoff(Handoff)
                                                      add_handoff(req, fetched)

A :class:`Handoff` is three buffer sets: the prompt's attention KV, the final
recurrent state and the EAGLE draft state (the target hidden at the last
prompt position). The ticket carries their metadata, not the bytes: decode
rebuilds the Handoff from the READ buffers by the metas' shape counts, and the
engine checks every shape against its own model before it uses them.

Delta handoffs: the KV buffers are offered in chunks of one block (``unit``
rows, each with its checksum) and the ticket lists the chain hashes of the
prompt's full blocks. A decode engine whose prefix cache holds some of them
(the previous turn of the conversation) pins them before the fetch
(``NativeEngine.prepare_handoff``) and READs only the other blocks, the
partial last one, the state and the draft hidden (:attr:`FetchedHandoff.held`).

Keyed tag: the offer's descriptor is tagged with the deployment key over the
ticket's metadata too (:func:`ticket_context`: request id, first token, cached
tokens, buffer metas, block hashes), so decode refuses a ticket changed on the
way, or one not offered with its key (``TagError``, before any read).

:class:`HandoffTransport` is the engine's NIXL plumbing. Its agents start on
first use (a prefill engine's server on the first offer, a decode engine's
client on the first fetch) and its methods are thread-safe: the workers call
``pop_handoff`` / ``fetch_handoff`` without the engine lock, concurrently with
``step()``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridpd.engine.base import (
    BufferMeta,
    EngineRequest,
    HandoffStats,
    HandoffTicket,
    KVExport,
    StateCheckpoint,
)
from hybridpd.errors import IntegrityError
from hybridpd.hashing import BlockHash
from hybridpd.integrity import HANDOFF, PUBLIC, IntegrityKey
from hybridpd.transfer.handoff_descriptor import HandoffDescriptor, tag_descriptor
from hybridpd.transfer.nixl_handoff import HandoffClient, HandoffServer

logger = logging.getLogger(__name__)

#: request ids whose offer a transport remembers for ``withdraw``
MAX_TRACKED_OFFERS = 4096

#: the faults ``inject_fault`` knows (each hits the next handoff once)
CORRUPT_NEXT = "corrupt_next_handoff"
DELAY_NEXT_READ = "delay_next_handoff_read"
FORGE_NEXT = "forge_next_handoff"
#: the key a forged offer is tagged with (``forge_next_handoff``): not any deployment's
FORGER_KEY = IntegrityKey(b"forge_next_handoff: a key no deployment holds")


@dataclass(frozen=True, slots=True)
class DraftState:
    """What EAGLE needs to continue: the target hidden state at the last
    computed position (``[hidden]``)."""

    meta: BufferMeta
    buffers: tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class Handoff:
    """Everything decode needs to continue a prefilled request."""

    request: EngineRequest
    first_token_id: int
    num_cached_tokens: int
    kv: KVExport
    state: StateCheckpoint
    draft: DraftState

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every buffer, in the order a ticket's descriptor lists them."""
        return (*self.kv.buffers, *self.state.buffers, *self.draft.buffers)


def ticket_context(
    request_id: str,
    first_token_id: int,
    num_cached_tokens: int,
    metas: Sequence[BufferMeta],
    block_hashes: Sequence[BlockHash],
) -> bytes:
    """What a ticket says besides its descriptor, as its descriptor's tag covers it."""
    m = [[x.model_id, x.kind, x.position, x.dtype, [list(s) for s in x.shapes], x.layer_group] for x in metas]
    body = [request_id, first_token_id, num_cached_tokens, m, [h.hex() for h in block_hashes]]
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class NativeTicket(HandoffTicket):
    """A native handoff offered over NIXL: plain data, picklable.

    ``nbytes`` and ``expires_at`` are the descriptor's; the metas describe the
    descriptor's buffers in order (KV, then state, then draft)."""

    descriptor: HandoffDescriptor
    kv_meta: BufferMeta
    state_meta: BufferMeta
    draft_meta: BufferMeta
    first_token_id: int
    num_cached_tokens: int
    #: chain hashes of the prompt's full blocks (KV chunk ``i`` is block ``i``)
    block_hashes: tuple[BlockHash, ...] = ()

    @classmethod
    def offered(cls, handoff: Handoff, desc: HandoffDescriptor) -> NativeTicket:
        return cls(
            request_id=handoff.request.request_id,
            nbytes=desc.nbytes,
            expires_at=desc.expires_at,
            descriptor=desc,
            kv_meta=handoff.kv.meta,
            state_meta=handoff.state.meta,
            draft_meta=handoff.draft.meta,
            first_token_id=handoff.first_token_id,
            num_cached_tokens=handoff.num_cached_tokens,
            block_hashes=tuple(handoff.kv.block_hashes),
        )

    def context(self) -> bytes:
        """The metadata the descriptor's tag covers (:func:`ticket_context`)."""
        metas = (self.kv_meta, self.state_meta, self.draft_meta)
        return ticket_context(self.request_id, self.first_token_id, self.num_cached_tokens, metas, self.block_hashes)

    def rebuild(self, request: EngineRequest, bufs: Sequence[torch.Tensor]) -> Handoff:
        """The Handoff of the READ buffers ``bufs`` (split by the metas' shape counts)."""
        n_kv, n_st = len(self.kv_meta.shapes), len(self.state_meta.shapes)
        want = n_kv + n_st + len(self.draft_meta.shapes)
        if len(bufs) != want:
            raise IntegrityError(
                "handoff %s has %d buffers; its metadata lists %d" % (self.request_id, len(bufs), want)
            )
        return Handoff(
            request=request,
            first_token_id=self.first_token_id,
            num_cached_tokens=self.num_cached_tokens,
            kv=KVExport(self.kv_meta, tuple(bufs[:n_kv])),
            state=StateCheckpoint(self.state_meta, None, tuple(bufs[n_kv : n_kv + n_st])),
            draft=DraftState(self.draft_meta, tuple(bufs[n_kv + n_st :])),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchedHandoff(HandoffTicket):
    """A handoff whose bytes are here (``fetch_handoff``'s result, ``add_handoff``'s
    input); not meant to cross processes. ``nbytes`` is what was read;
    ``held`` the KV blocks that were not (the decode engine's pinned blocks:
    their rows in ``handoff.kv`` are uninitialised), worth ``skipped_bytes``."""

    handoff: Handoff
    held: frozenset[int] = frozenset()
    skipped_bytes: int = 0

    @classmethod
    def of(cls, handoff: Handoff, nbytes: int = 0, expires_at: float | None = None) -> FetchedHandoff:
        """Wrap a Handoff made in this process (tests: P/D without NIXL)."""
        return cls(request_id=handoff.request.request_id, nbytes=nbytes, expires_at=expires_at, handoff=handoff)


class HandoffTransport:
    """The NIXL side of one engine: offers (prefill), fetches (decode), faults, stats."""

    def __init__(self, instance: str, timeout_s: float, device: str, unit: int = 0, key: IntegrityKey = PUBLIC) -> None:
        self.instance = instance
        self.key = key  # the deployment key the descriptors are tagged and checked with
        self.unit = unit  # KV rows per checksummed chunk (one block); 0: whole buffers
        self.timeout_s = timeout_s
        self.device = device
        self._server: HandoffServer | None = None
        self._client: HandoffClient | None = None
        self._server_lock = threading.Lock()  # creation only: the server locks its own agent
        # NOTE: one decode agent, driven by one fetch at a time
        self._client_lock = threading.Lock()
        self._fault_lock = threading.Lock()
        self._corrupt_next = False
        self._delay_next_read = False
        self._forge_next = False
        self._closed = False
        #: request id -> its latest offer's id (for ``withdraw``), oldest first
        self._offered: OrderedDict[str, str] = OrderedDict()

    def _agent_name(self) -> str:
        return "%s-%d" % (self.instance, int(time.time() * 1000) % 100000)

    def _take_fault(self, kind: str) -> bool:
        with self._fault_lock:
            if kind == CORRUPT_NEXT:
                hit, self._corrupt_next = self._corrupt_next, False
            elif kind == FORGE_NEXT:
                hit, self._forge_next = self._forge_next, False
            else:
                hit, self._delay_next_read = self._delay_next_read, False
        return hit

    def inject(self, kind: str) -> None:
        with self._fault_lock:
            if kind == CORRUPT_NEXT:
                self._corrupt_next = True
            elif kind == DELAY_NEXT_READ:
                self._delay_next_read = True
            elif kind == FORGE_NEXT:
                self._forge_next = True
            else:
                raise ValueError("unknown fault %r" % kind)

    # -- prefill side ----------------------------------------------------------------
    def _get_server(self) -> HandoffServer:
        with self._server_lock:
            if self._closed:
                raise RuntimeError("handoff transport of %s is closed" % self.instance)
            if self._server is None:
                self._server = HandoffServer(self._agent_name(), timeout_s=self.timeout_s, key=self.key)
            return self._server

    def offer(self, handoff: Handoff) -> NativeTicket:
        """Register ``handoff``'s buffers with NIXL until decode releases them, they
        expire, or ``withdraw`` frees them. Each offer has its own id (a retried or
        repeated request id never overwrites an outstanding offer)."""
        rid = handoff.request.request_id
        hid = "%s~%s" % (rid, uuid.uuid4().hex[:12])
        chunked = [self.unit] * len(handoff.kv.buffers)  # KV: one chunk per block; state, draft: whole
        metas = (handoff.kv.meta, handoff.state.meta, handoff.draft.meta)
        context = ticket_context(rid, handoff.first_token_id, handoff.num_cached_tokens, metas, handoff.kv.block_hashes)
        desc = self._get_server().offer(handoff.buffers(), hid, chunk_rows=chunked, context=context)
        with self._server_lock:
            self._offered[rid] = hid
            while len(self._offered) > MAX_TRACKED_OFFERS:  # read or expired long ago
                self._offered.popitem(last=False)
        if self._take_fault(CORRUPT_NEXT):  # change a value after the checksum was taken
            logger.warning("fault injection: corrupting handoff %s", handoff.request.request_id)
            # NOTE: in the state, which every read moves (a delta handoff may skip KV block 0)
            with torch.inference_mode():
                handoff.state.buffers[0].view(-1)[0] += 1.0
        if self._take_fault(FORGE_NEXT):  # as a peer without the deployment key would offer it
            logger.warning("fault injection: tagging handoff %s with a key decode does not hold", rid)
            desc = tag_descriptor(desc, FORGER_KEY.tagger(HANDOFF), context)
        return NativeTicket.offered(handoff, desc)

    def withdraw(self, request_id: str) -> bool:
        """Free the outstanding offer of ``request_id`` (aborted before decode read it)."""
        with self._server_lock:
            hid = self._offered.pop(request_id, None)
            server = self._server
        return hid is not None and server is not None and server.withdraw(hid)

    def stats(self) -> HandoffStats:
        server = self._server
        if server is None:
            return HandoffStats()
        with server.lock:  # NOTE: the server's thread appends under this lock
            latencies, server.release_latencies = server.release_latencies, []
        return HandoffStats(server.outstanding(), server.expired, tuple(latencies))

    # -- decode side -----------------------------------------------------------------
    def fetch(self, request: EngineRequest, ticket: NativeTicket, held: frozenset[int] = frozenset()) -> FetchedHandoff:
        """READ and verify ``ticket``'s buffers but KV blocks ``held`` (HandoffError,
        IntegrityError)."""
        desc = ticket.descriptor
        if self._take_fault(DELAY_NEXT_READ):  # arrive after prefill's handoff timeout
            logger.warning("fault injection: reading handoff %s after its expiry", ticket.request_id)
            time.sleep(max(0.0, desc.expires_at - time.time()) + 0.5)
        with self._client_lock:
            if self._closed:
                raise RuntimeError("handoff transport of %s is closed" % self.instance)
            if self._client is None:
                self._client = HandoffClient(self._agent_name(), key=self.key)
            if (ticket.nbytes, ticket.expires_at) != (desc.nbytes, desc.expires_at):
                raise IntegrityError("handoff %s: its ticket and descriptor disagree" % ticket.request_id)
            bufs = self._client.fetch(desc, device=self.device, skip_chunks=held, context=ticket.context())
        handoff = ticket.rebuild(request, bufs)
        read = desc.read_bytes(held)
        return FetchedHandoff(
            request_id=ticket.request_id,
            nbytes=read,
            expires_at=ticket.expires_at,
            handoff=handoff,
            held=held,
            skipped_bytes=ticket.nbytes - read,
        )

    def close(self) -> None:
        with self._server_lock:
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            server.close()
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
