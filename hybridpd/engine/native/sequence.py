"""One request's bookkeeping in the native engine (tensor-free): its tokens,
blocks, progress, the checkpoints it snapshots and its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hybridpd.engine.base import EngineRequest, FinishReason, SamplingParams
from hybridpd.hashing import BlockHash


class SeqStatus(enum.Enum):
    WAITING = enum.auto()
    PREFILL = enum.auto()
    DECODE = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    """Bookkeeping of one request (no tensors)."""

    request: EngineRequest
    token_ids: list[int]
    num_prompt: int
    block_hashes: list[BlockHash]
    prefill_only: bool = False
    status: SeqStatus = SeqStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    #: planned checkpoint positions, ascending: the extras, then the tail
    checkpoints: tuple[int, ...] = ()
    #: the tail among them (None: the tail is not valid for this prefill)
    tail_checkpoint: int | None = None
    #: the router's placed positions this prefill writes (``placement.placed_checkpoints``):
    #: snapshotted mid-chunk, never a chunk end of their own
    placed: tuple[int, ...] = ()
    #: the positions the chunk scheduled last snapshots (``ModelRunner.run`` reads them)
    snapshot_at: frozenset[int] = frozenset()
    #: the state slot its hit restores (read by the runner in its first step)
    restore_slot: int | None = None
    #: state slots reserved for this step's snapshots (``PrefixCache.plan``): position ->
    #: slot, or None where none was free (the snapshot is only exported)
    snapshot_slots: dict[int, int | None] = field(default_factory=dict)
    #: positions whose state a finished step of this prefill left cached (``PrefixCache.commit``)
    stored: set[int] = field(default_factory=set)
    #: scheduled at least once (its tensors exist in the runner)
    started: bool = False

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt


def stop_reason(sampling: SamplingParams, eos_token_id: int, token: int, num_output: int) -> FinishReason | None:
    """Why a request stops at ``token``, its ``num_output``-th output token (None: it
    goes on). The one rule: the runner trims a verification's tokens with it, the
    engine's postprocess finishes requests with it."""
    if token in sampling.stop_token_ids or (token == eos_token_id and not sampling.ignore_eos):
        return FinishReason.STOP
    if num_output >= sampling.max_tokens:
        return FinishReason.LENGTH
    return None
