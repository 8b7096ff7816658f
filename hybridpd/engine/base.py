"""The engine protocol both engines implement (native now, vLLM later).

Lifecycle of one request in one engine::

    add_request(req) --> WAITING --(admitted: blocks reserved, cache hit
                                    restored)--> PREFILL --(last chunk)-->
    DECODE --(stop / length / abort)--> FINISHED (blocks freed at once)

``step()`` advances every running request by one scheduling step and
returns the new tokens. Disaggregated serving splits the lifecycle:

* the prefill engine runs :meth:`Engine.prefill_for_handoff`; it computes the
  prompt (restoring any hit), samples the first token, and returns a
  :class:`Handoff`: the request's attention KV (:class:`KVExport`), its final
  recurrent state (:class:`StateCheckpoint`) and the EAGLE draft state
  (:class:`DraftState`), each a set of contiguous CPU/GPU buffers that NIXL can
  register and MooncakeStore can store, plus metadata;
* the decode engine runs :meth:`Engine.add_handoff` and continues from there.

Partial-prefix checkpoints the prefill exported (positions decided by
``hybridpd.checkpoints``) are returned by :meth:`Engine.pop_exports` so the
caller can put them in the store and publish them in the index.

Every exported buffer is a contiguous tensor; ``meta`` fields identify what it
is, so a receiver can verify shape and dtype before use.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType, Protocol

import torch

from hybridpd.hashing import BlockHash

RequestId = NewType("RequestId", str)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (exact)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """New tokens of one request after a step (or a handoff)."""

    request_id: RequestId
    new_token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


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

    def buffers(self) -> Sequence[torch.Tensor]:
        return (*self.kv.buffers, *self.state.buffers, *self.draft.buffers)


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


class Engine(Protocol):
    """What the prefill/decode actors need from an engine."""

    model_id: str

    def add_request(self, request: EngineRequest) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: RequestId) -> bool: ...

    def has_work(self) -> bool: ...

    def prefill_for_handoff(self, request: EngineRequest) -> Handoff: ...

    def add_handoff(self, handoff: Handoff) -> None: ...

    def pop_exports(self) -> list[tuple[KVExport, StateCheckpoint]]: ...

    def import_checkpoint(self, kv: KVExport, state: StateCheckpoint, token_ids: Sequence[int]) -> bool: ...

    def stats(self) -> PoolStats: ...
