"""The engine boundary: what the prefill and decode workers call, and nothing else.

Both engines (``engine/native``, ``engine/vllm``) implement :class:`Engine`;
``make_engine`` returns it typed as such, so mypy checks the workers against
this protocol, and ``tests/unit/test_engine_protocol.py`` checks both classes
against it at runtime. Engine-specific data crosses the boundary only as an
opaque :class:`HandoffTicket` subclass owned by the engine's package.

Threading: an engine is not thread-safe. The worker's engine loop
(``services/worker/engine_loop.py``) calls every member under its lock, and
only the loop thread calls ``step()``, EXCEPT :meth:`Engine.pop_handoff` and
:meth:`Engine.fetch_handoff`, which move bytes and are called without the
lock (they touch only the engine's handoff plumbing).

Lifecycle of one request in one engine::

    add_request(req) --> WAITING --(admitted: blocks reserved, cache hit
                                    restored)--> PREFILL --(last chunk)-->
    DECODE --(stop / length / abort)--> FINISHED (blocks freed at once)

``step()`` advances every running request by one scheduling step and
returns the new tokens. Disaggregated serving splits the lifecycle:

* prefill: ``add_request(req, prefill_only=True)``; the request finishes at
  the end of its prompt (its output carries the tokens sampled there: the
  first output token for the native engine, none for vLLM, whose decode
  samples it), and ``pop_handoff(request_id)`` returns the ticket decode needs;
* decode: ``prepare_handoff(req, ticket)`` (under the lock) holds what the
  engine has of the prompt already, ``fetch_handoff(req, ticket)`` moves the
  rest (native: NIXL READ of the blocks it lacks, and checksums; vLLM:
  nothing, its connector pulls during steps), then ``add_handoff(req,
  fetched)`` continues the request from there.

Cache bookkeeping leaves the engine in two streams the prefill worker drains
after every step: ``pop_exports()`` (partial-prefix checkpoints to put in
MooncakeStore; positions from ``hybridpd.checkpoints``) and
``pop_cache_events()`` (what the engine's local cache stored and removed,
as chain hashes: the index mirrors it). ``import_checkpoint`` enters a
store hit into the local cache before admission. The output that completes a
prompt's prefill says which state checkpoints it left in the local cache
(``RequestOutput.checkpoints``), as the engine recorded them while it ran.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType, Protocol, runtime_checkable

from hybridpd.checkpoint_value import ComputeModel
from hybridpd.engine.sampling import SamplingParams, StructuredOutput, TokenLogprobs
from hybridpd.hashing import BlockHash, BlockHasher

if TYPE_CHECKING:  # NOTE: only the type: the router imports this module and must not load torch
    import torch

__all__ = ["SamplingParams", "StructuredOutput", "TokenLogprobs"]  # re-exported: the boundary's types

RequestId = NewType("RequestId", str)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    #: the engine failed the request (vLLM's "error": a grammar that failed at run time, a
    #: failed KV load): never an answer, the router fails the request (EngineError)
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    #: extra checkpoint positions (token counts, ascending) the prefill should
    #: export besides the tail, e.g. junctions; see ``checkpoints.requested_checkpoints``
    #: (the vLLM engine: ``checkpoint_stages.staged_checkpoints``).
    checkpoints: tuple[int, ...] = ()
    #: checkpoint positions the router placed along the prompt (``hybridpd/placement.py``):
    #: snapshotted mid-chunk by the native engine, and held as speculative (``placement_share``)
    #: until a request reuses them; the vLLM engine ignores them
    placement: tuple[int, ...] = ()
    #: low priority: never holds up foreground work (answer checkpoints). The native
    #: engine runs it on the step budget and seats the others leave; vLLM only while
    #: no foreground request is live, aborted and re-queued when one arrives
    background: bool = False
    #: the chain of (a prefix of) the prompt as the router hashed it, for the prompt's
    #: whole life (prefill, store load, publisher, decode): the engines and workers extend
    #: it (``BlockHasher.extend``) and never hash those blocks again. Empty: hashed where
    #: needed (a request that did not come through the router, or caching off)
    block_hashes: tuple[BlockHash, ...] = ()

    def chain(self, hasher: BlockHasher) -> list[BlockHash]:
        """The prompt's chain: ``block_hashes`` extended by ``hasher`` to every full block."""
        return hasher.extend(self.block_hashes, self.prompt_token_ids, cache_salt=self.cache_salt)


@dataclass(frozen=True, slots=True)
class WrittenCheckpoints:
    """The state checkpoints a request's prefill left in its engine's cache, as the
    engine recorded them while it ran (native: the snapshot slots it wrote, still held
    when the prompt completed; vLLM: its tail and the checkpoint prefixes it ran). The
    router remembers them on the instance until the index reports them
    (``RecentPrefills``)."""

    #: the prompt's tail checkpoint (0: none)
    tail: int = 0
    #: the others (junctions, boundaries, client and placed positions), ascending, below the tail
    extra: tuple[int, ...] = ()

    @property
    def positions(self) -> tuple[int, ...]:
        """Every position, ascending."""
        return self.extra + ((self.tail,) if self.tail else ())


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """New tokens of one request after a step (or a handoff)."""

    request_id: RequestId
    new_token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    #: per new token (same order), when the request asked for ``logprobs``
    logprobs: tuple[TokenLogprobs, ...] | None = None
    #: on the output that completes the prompt's prefill: the checkpoints it wrote (none on others)
    checkpoints: WrittenCheckpoints = WrittenCheckpoints()


@dataclass(frozen=True, slots=True)
class BufferMeta:
    """Identity of one exported buffer set."""

    model_id: str
    kind: str  # "kv" | "state" | "draft"
    position: int  # tokens covered: KV [0, position), state after `position` tokens
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    layer_group: str  # "attention" | "delta" | "draft"


@dataclass(frozen=True, slots=True)
class KVExport:
    """Attention KV of tokens ``[0, meta.position)``: per attention layer, K then V,
    each ``[position, n_kv_heads, head_dim]``. ``block_hashes`` is the chain of
    the full blocks covered (empty when not published)."""

    meta: BufferMeta
    buffers: tuple[torch.Tensor, ...]
    block_hashes: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class StateCheckpoint:
    """Recurrent state after exactly ``meta.position`` tokens: per delta layer,
    the conv state then the recurrent matrix state.

    ``key`` is the chain hash of the prefix ``[0, position)`` (None for a
    final state that is not position-aligned and never published)."""

    meta: BufferMeta
    key: BlockHash | None
    buffers: tuple[torch.Tensor, ...]
    #: a placed checkpoint (``EngineRequest.placement``): the store ledger holds it within
    #: ``placement_share`` of its budget until a prefill reuses it
    speculative: bool = False


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Accounting a test (or an operator) can check for leaks."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_state_slots: int
    num_free_state_slots: int
    num_running: int
    num_waiting: int
    #: bytes of one pool block (a page: vLLM pads every group's block to one size), 0 if not known
    block_bytes: int = 0


@dataclass(frozen=True, slots=True)
class HandoffTicket:
    """What decode needs to continue a request prefilled elsewhere: opaque to the
    workers and the router, picklable (it crosses Ray), subclassed by each engine
    package (``engine/native/handoff.py``: NIXL descriptor and buffer metadata;
    ``engine/vllm/outputs.py``: vLLM's ``kv_transfer_params``). Only the engine
    kind that made it can use it."""

    request_id: str
    #: bytes decode will move for it (0 when the engine moves them itself)
    nbytes: int = 0
    #: wall-clock time after which the prefill side frees it (None: no deadline)
    expires_at: float | None = None


class CacheGroup(enum.StrEnum):
    KV = "kv"  # attention KV blocks, one per prefix_match_unit tokens
    STATE = "state"  # recurrent-state checkpoints, keyed by the chain hash at their position


class CacheEventKind(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"  # every entry of this engine (``group`` and ``hashes`` unused)


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """A change to an engine's local prefix cache, in chain hashes
    (``hybridpd.hashing``): the index entries of this instance follow it.
    ``store``: a change to the shared store instead (an engine whose own
    connector writes MooncakeStore reports its puts so; the index's store
    entries follow them, and their removals are never reported)."""

    kind: CacheEventKind
    group: CacheGroup | None
    hashes: tuple[BlockHash, ...] = ()
    store: bool = False


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding counters (an engine without its own keeps zeros)."""

    steps: int = 0
    emitted: int = 0
    #: tokens emitted by each verification step since the last drain (metrics)
    recent: list[int] = field(default_factory=list)

    def drain(self) -> list[int]:
        out, self.recent = self.recent, []
        return out

    @property
    def mean_acceptance_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


@dataclass(frozen=True, slots=True)
class HandoffStats:
    """The prefill side's handoffs: offered and not yet read, freed unread by
    timeout, and the offer-to-release latencies (seconds) since the last call."""

    outstanding: int = 0
    expired: int = 0
    release_latencies: tuple[float, ...] = ()


@runtime_checkable
class Engine(Protocol):
    """What the prefill/decode workers call (see the module docstring)."""

    #: names the weights: caches and handoffs of another model_id are refused
    model_id: str
    #: prefix_match_unit: tokens per KV block hash
    unit: int
    #: the chain hasher (same algorithm and seed as the router's)
    hasher: BlockHasher
    #: True when store checkpoints enter through ``import_checkpoint`` (vLLM: its connector loads them)
    imports_checkpoints: bool
    #: prefill FLOPs of a prefix by its length (values state checkpoints:
    #: ``hybridpd/checkpoint_value.py``); an engine whose exports we do not hold
    #: may answer ``LINEAR_ONLY``
    compute_model: ComputeModel
    spec: SpecStats

    def add_request(self, request: EngineRequest, prefill_only: bool = False) -> None:
        """Queue ``request``; raise InvalidRequestError for what it cannot serve."""
        ...

    def step(self) -> list[RequestOutput]:
        """One scheduling step; the outputs of every request that advanced."""
        ...

    def abort(self, request_id: RequestId | str) -> bool:
        """Free ``request_id`` now; False if the engine does not know it."""
        ...

    def has_work(self) -> bool:
        """Whether ``step()`` has anything to do (the loop sleeps otherwise)."""
        ...

    def idle_poll_s(self) -> float:
        """How long the loop may wait before the next ``step()`` while there is work:
        0 when there is something to compute; the polling interval when only
        bookkeeping is left (vLLM: its connector's acknowledgements). The loop waits
        it out outside its lock, woken early by a submit or an abort; ``step()``
        called directly sleeps what is left of it itself, so no caller spins."""
        ...

    def pop_handoff(self, request_id: str) -> HandoffTicket | None:
        """The ticket of a finished ``prefill_only`` request (None if it has none:
        it finished at its first token). Called without the engine lock."""
        ...

    def prepare_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> int:
        """Before ``fetch_handoff``, under the engine lock: hold what this engine
        already has of ``ticket``'s prompt, so the fetch moves only the rest (the
        native engine pins the KV blocks its prefix cache holds: a delta
        handoff; vLLM: nothing). ``abort`` releases what it holds. Returns how
        many blocks it holds."""
        ...

    def fetch_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> HandoffTicket:
        """Make ``ticket`` ready for ``add_handoff`` (moves and verifies its bytes;
        raises IntegrityError or HandoffError). Called without the engine lock."""
        ...

    def add_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> None:
        """Continue a request prefilled elsewhere from a fetched ticket."""
        ...

    def pop_exports(self) -> list[tuple[KVExport, StateCheckpoint]]:
        """Checkpoints exported since the last call, for MooncakeStore."""
        ...

    def pop_cache_events(self) -> list[CacheEvent]:
        """Local cache changes since the last call, in order."""
        ...

    def import_checkpoint(
        self,
        kv: KVExport,
        state: StateCheckpoint,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        hashes: Sequence[BlockHash] = (),
    ) -> bool:
        """Enter a verified store checkpoint of ``token_ids`` into the local cache;
        False when it could not (pools full, or the engine loads store hits itself).
        ``hashes``: the chain of (a prefix of) ``token_ids`` as the router hashed it."""
        ...

    def local_hit(
        self, token_ids: Sequence[int], cache_salt: str | None = None, hashes: Sequence[BlockHash] = ()
    ) -> int:
        """The hit an admission of this prompt would get now (no side effects;
        ``hashes`` as in ``import_checkpoint``)."""
        ...

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens waiting to be computed (load for routing)."""
        ...

    def handoff_stats(self) -> HandoffStats:
        """The prefill side's handoff accounting (drains the latencies)."""
        ...

    def inject_fault(self, kind: str) -> None:
        """Test hook (the worker checks the config allows it): ``corrupt_next_handoff``,
        ``forge_next_handoff`` (prefill) or ``delay_next_handoff_read`` (decode);
        ValueError for others."""
        ...

    def stats(self) -> PoolStats:
        """Pool accounting (leak checks, metrics)."""
        ...

    def close(self) -> None:
        """Free what the engine holds outside its memory (agents, threads, sockets)."""
        ...
