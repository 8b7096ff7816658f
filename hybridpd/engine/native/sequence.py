"""One request's bookkeeping in the native engine (tensor-free): its tokens,
blocks, progress, the checkpoints it snapshots and its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hybridpd.engine.base import EngineRequest
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
    #: the positions the chunk scheduled last snapshots (``ModelRunner.execute`` reads them)
    snapshot_at: frozenset[int] = frozenset()
    restore_slot: int | None = None

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt
