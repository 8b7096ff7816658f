"""A small in-process engine that satisfies the engine boundary (``engine/base.py``).

A test double for the service-layer unit tests: it drives ``PrefillWorker``,
``DecodeWorker`` and ``EngineLoop`` without Ray, a model or NIXL. Its "model"
is a pure function of the tokens so far (``next_token``), so a P/D run must
produce exactly what a local run produces. Its cache is a dict of chain
hashes with an LRU bound (each block with a "state" at its end, so every
block boundary is a usable hit); it records cache events like a real engine. The
e2e tiers keep running the real engines.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridpd.checkpoint_value import LINEAR_ONLY, ComputeModel
from hybridpd.engine.base import (
    CacheEvent,
    CacheEventKind,
    CacheGroup,
    EngineRequest,
    FinishReason,
    HandoffStats,
    HandoffTicket,
    KVExport,
    PoolStats,
    RequestId,
    RequestOutput,
    SpecStats,
    StateCheckpoint,
    WrittenCheckpoints,
)
from hybridpd.errors import IntegrityError, InvalidRequestError
from hybridpd.hashing import BlockHash, BlockHasher

VOCAB = 1000


def next_token(tokens: Sequence[int]) -> int:
    """The toy model: a deterministic function of every token so far."""
    return (sum(tokens) * 31 + len(tokens) * 7 + 11) % VOCAB


@dataclass(frozen=True, slots=True)
class ToyTicket(HandoffTicket):
    tokens: tuple[int, ...] = ()
    checksum: int = 0


@dataclass
class _Seq:
    request: EngineRequest
    tokens: list[int]
    prefill_only: bool
    cached: int = 0
    prompt_done: bool = False


@dataclass
class ToyEngine:
    """One token per request per step; ``fail_next_step`` raises inside a step."""

    unit: int = 16
    capacity: int = 8  # cached blocks kept (LRU)
    model_id: str = "toy@1"
    imports_checkpoints: bool = False
    compute_model: ComputeModel = LINEAR_ONLY
    spec: SpecStats = field(default_factory=SpecStats)
    fail_next_step: bool = False
    corrupt_next: bool = False
    steps: int = 0

    def __post_init__(self) -> None:
        self.hasher = BlockHasher(unit=self.unit)
        self.seqs: dict[str, _Seq] = {}
        self.pending: list[RequestOutput] = []
        self.cache: OrderedDict[BlockHash, None] = OrderedDict()
        self.events: list[CacheEvent] = []
        self.tickets: dict[str, ToyTicket] = {}
        self.closed = False
        self.lock = threading.Lock()

    # -- requests -------------------------------------------------------------------
    def add_request(self, request: EngineRequest, prefill_only: bool = False) -> None:
        if request.request_id in self.seqs:
            raise InvalidRequestError("duplicate request id %s" % request.request_id)
        self.seqs[request.request_id] = _Seq(request, list(request.prompt_token_ids), prefill_only)

    def abort(self, request_id: RequestId | str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.pending.append(RequestOutput(seq.request.request_id, (), True, FinishReason.ABORT))
        return True

    def has_work(self) -> bool:
        return bool(self.seqs or self.pending)

    def idle_poll_s(self) -> float:
        return 0.0

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("toy step failed")
        outputs, self.pending = self.pending, []
        for rid, seq in list(self.seqs.items()):
            written = WrittenCheckpoints()
            if not seq.prompt_done:
                seq.cached = self.local_hit(seq.request.prompt_token_ids, seq.request.cache_salt)
                self._store(seq.request)
                seq.prompt_done = True
                written = WrittenCheckpoints((len(seq.request.prompt_token_ids) - 1) // self.unit * self.unit)
            tok = next_token(seq.tokens)
            seq.tokens.append(tok)
            n_out = len(seq.tokens) - len(seq.request.prompt_token_ids)
            done = seq.prefill_only or n_out >= seq.request.sampling.max_tokens
            reason = None
            if n_out >= seq.request.sampling.max_tokens:
                reason = FinishReason.LENGTH
            if seq.prefill_only and reason is None:
                self.tickets[rid] = ToyTicket(rid, 8 * len(seq.tokens), None, tuple(seq.tokens), sum(seq.tokens))
            n_prompt = len(seq.request.prompt_token_ids)
            rid_out = seq.request.request_id
            outputs.append(RequestOutput(rid_out, (tok,), done, reason, n_prompt, seq.cached, None, written))
            if done:
                del self.seqs[rid]
        return outputs

    # -- handoffs ---------------------------------------------------------------------
    def pop_handoff(self, request_id: str) -> HandoffTicket | None:
        ticket = self.tickets.pop(request_id, None)
        if ticket is not None and self.corrupt_next:
            self.corrupt_next = False
            ticket = ToyTicket(ticket.request_id, ticket.nbytes, None, ticket.tokens, ticket.checksum + 1)
        return ticket

    def prepare_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> int:
        return 0

    def fetch_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> HandoffTicket:
        if not isinstance(ticket, ToyTicket):
            raise InvalidRequestError("not a toy ticket")
        if sum(ticket.tokens) != ticket.checksum:
            raise IntegrityError("toy checksum mismatch for %s" % request.request_id)
        return ticket

    def add_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> None:
        assert isinstance(ticket, ToyTicket)
        if request.request_id in self.seqs:
            raise InvalidRequestError("duplicate request id %s" % request.request_id)
        self.seqs[request.request_id] = _Seq(request, list(ticket.tokens), False, prompt_done=True)

    # -- cache --------------------------------------------------------------------------
    def _store(self, req: EngineRequest) -> None:
        chain = req.chain(self.hasher)
        new = tuple(h for h in chain if h not in self.cache)
        for h in chain:
            self.cache[h] = None
            self.cache.move_to_end(h)
        # a block and the toy "state" at its end are cached (and evicted) together
        if new:
            self.events.append(CacheEvent(CacheEventKind.STORED, CacheGroup.KV, new))
            self.events.append(CacheEvent(CacheEventKind.STORED, CacheGroup.STATE, new))
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        if evicted:
            self.events.append(CacheEvent(CacheEventKind.REMOVED, CacheGroup.KV, tuple(evicted)))
            self.events.append(CacheEvent(CacheEventKind.REMOVED, CacheGroup.STATE, tuple(evicted)))

    def pop_cache_events(self) -> list[CacheEvent]:
        out, self.events = self.events, []
        return out

    def pop_exports(self) -> list[tuple[KVExport, StateCheckpoint]]:
        return []

    def import_checkpoint(
        self,
        kv: KVExport,
        state: StateCheckpoint,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        hashes: Sequence[BlockHash] = (),
    ) -> bool:
        return False

    def local_hit(
        self, token_ids: Sequence[int], cache_salt: str | None = None, hashes: Sequence[BlockHash] = ()
    ) -> int:
        hit = 0
        for h in self.hasher.extend(hashes, token_ids, cache_salt=cache_salt):
            if h not in self.cache:
                break
            hit += self.unit
        return hit

    def queued_prompt_tokens(self) -> int:
        return sum(len(s.request.prompt_token_ids) for s in self.seqs.values() if not s.prompt_done)

    def handoff_stats(self) -> HandoffStats:
        return HandoffStats(outstanding=len(self.tickets))

    def inject_fault(self, kind: str) -> None:
        if kind != "corrupt_next_handoff":
            raise ValueError("unknown fault %r" % kind)
        self.corrupt_next = True

    def stats(self) -> PoolStats:
        return PoolStats(self.capacity, self.capacity - len(self.cache), len(self.cache), 0, 0, len(self.seqs), 0)

    def close(self) -> None:
        self.closed = True
