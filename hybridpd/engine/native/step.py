"""What one step passes between its three phases (tensor-free)::

    Scheduler.schedule() -> [ScheduledWork]   which requests advance, by how many tokens
    ModelRunner.run()    -> [RowResult]       the tokens each row produced (and its exports)
    NativeEngine         postprocess          appends, stops, caches, finishes

A ``RowResult`` carries tokens and counts; the only tensors that leave the
runner are the boundary's own products (``KVExport`` / ``StateCheckpoint``
exports for the store, a ``Handoff`` for decode), owned copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridpd.engine.base import KVExport, StateCheckpoint, TokenLogprobs
from hybridpd.engine.native.handoff import Handoff
from hybridpd.engine.native.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledWork:
    """One request's share of a step."""

    seq: Sequence
    num_tokens: int
    decode: bool
    #: the request's first step: the runner starts its tensors (from ``seq.restore_slot``)
    admitted: bool = False


@dataclass(slots=True)
class RowResult:
    """What the runner produced for one ``ScheduledWork``."""

    #: the new tokens: the first at the prompt's end, a decode row's emitted ones
    #: up to and including a stop; empty mid-prompt
    tokens: tuple[int, ...] = ()
    #: per token of ``tokens``, when the request asked for logprobs
    logprobs: tuple[TokenLogprobs, ...] | None = None
    #: EAGLE drafts this decode row verified (0: none)
    drafts: int = 0
    #: tokens the verification emitted before trimming at a stop (the state kept
    #: is after the last of them: ``num_computed`` advances by this much)
    emitted: int = 0
    #: at the prompt's end, with ``export_checkpoints``: every checkpoint the
    #: prompt snapshotted, each with the prompt's full KV (one copy shared)
    exports: list[tuple[KVExport, StateCheckpoint]] = field(default_factory=list)
    #: at a ``prefill_only`` prompt's end, unless its first token stops it
    handoff: Handoff | None = None
