"""Continuous-batching scheduler for the native engine (tensor-free).

Each ``schedule()`` call builds one step under a token budget:

1. every decoding sequence gets its pending token (plus k EAGLE drafts);
2. prefilling sequences continue, in admission order;
3. waiting sequences are admitted (FCFS) while blocks and seats remain;
4. background requests (``EngineRequest.background``: answer checkpoints)
   continue, then are admitted, only on the budget steps 1-3 left, only
   while no other request waits, and only while a seat and a quarter of the
   KV blocks stay free for the next one (nothing preempts a running one): a
   foreground request never waits for their step budget, and for their seats
   or blocks only when it needs more than that reserve.

A request prefilled elsewhere enters with ``admit_handoff``, straight into
DECODE (its KV arrives with the handoff).

A prefill chunk starts and ends on multiples of the kernel chunk (16), except
at the prompt's end: budgets are rounded down, so every budget yields the same
chunks. Admission finds the hybrid hit (``checkpoints.longest_usable_hit``:
leading cached KV blocks AND a state checkpoint at exactly the boundary),
shares the hit blocks, reserves blocks for the whole request (prompt +
max_tokens + drafts, so a running request never needs preemption), and plans
the checkpoints this prefill snapshots: the tail (``checkpoints.planned_checkpoint``)
and the extra positions the request names (``EngineRequest.checkpoints``, made
positions by ``checkpoints.requested_checkpoints``). A chunk snapshots at most
one of them: a chunk that would contain two ends at the first (a multiple of
16 like every chunk end, so the arithmetic is unchanged). The positions the
router placed (``EngineRequest.placement``, kept by
``placement.placed_checkpoints``) are snapshotted mid-chunk, any number per
chunk (the native kernel holds the state at every multiple of 16 of a chunk):
they never add a step.
"""

from __future__ import annotations

import logging
from collections import deque

from hybridpd.checkpoints import longest_usable_hit, planned_checkpoint, requested_checkpoints
from hybridpd.engine.native.block_pool import BlockPool
from hybridpd.engine.native.model_config import KERNEL_CHUNK
from hybridpd.engine.native.scheduler_config import SchedulerConfig
from hybridpd.engine.native.sequence import SeqStatus, Sequence
from hybridpd.engine.native.step import ScheduledWork
from hybridpd.placement import placed_checkpoints

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv_pool: BlockPool, state_pool: BlockPool) -> None:
        self.cfg = cfg
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        #: background requests not admitted yet (FCFS among themselves)
        self.background: deque[Sequence] = deque()

    def blocks_needed(self, seq: Sequence) -> int:
        extra = (
            0 if seq.prefill_only else seq.request.sampling.max_tokens + (self.cfg.num_spec if self.cfg.eagle else 0)
        )
        return -(-(seq.num_prompt + extra) // self.cfg.unit)

    def add(self, seq: Sequence) -> None:
        (self.background if seq.request.background else self.waiting).append(seq)

    def schedule(self) -> list[ScheduledWork]:
        budget = self.cfg.max_num_batched_tokens
        out: list[ScheduledWork] = []
        for seq in self.running:
            if seq.status is SeqStatus.DECODE:
                n = 1 + (self.cfg.num_spec if self.cfg.eagle else 0)
                out.append(self._work(seq, n, True))
                budget -= n
        for background in (False, True):
            for seq in self.running:
                if seq.status is SeqStatus.PREFILL and seq.request.background is background:
                    n = self._chunk(seq, budget)
                    if n:
                        out.append(self._work(seq, n, False))
                        budget -= n
            queue = self.background if background else self.waiting
            if background and self.waiting:
                break  # a waiting request (no seat or blocks now) goes first
            budget = self._admit_from(queue, budget, out, background)
        return out

    def _admit_from(self, queue: deque[Sequence], budget: int, out: list[ScheduledWork], background: bool) -> int:
        """Admit from ``queue`` (FCFS) while seats, blocks and budget remain (for
        background requests: beyond the reserve); returns the budget left."""
        seats = self.cfg.max_num_seqs - (1 if background else 0)
        while queue and len(self.running) < seats:
            seq = queue[0]
            if background and self.kv_pool.num_free - self.blocks_needed(seq) < self.kv_pool.num_slots // 4:
                break
            if self._chunk_len(seq.num_prompt - 0, budget) == 0 or not self._admit(seq):
                break
            queue.popleft()
            self.running.append(seq)
            seq.status = SeqStatus.PREFILL
            n = self._chunk(seq, budget)
            if n:
                out.append(self._work(seq, n, False))
                budget -= n
        return budget

    @staticmethod
    def _work(seq: Sequence, n: int, decode: bool) -> ScheduledWork:
        """``seq``'s share of this step; ``admitted`` the first time it runs."""
        work = ScheduledWork(seq, n, decode, admitted=not seq.started)
        seq.started = True
        return work

    @staticmethod
    def _chunk_len(remaining: int, budget: int) -> int:
        if remaining <= budget:
            return max(remaining, 0)
        return max(budget, 0) // KERNEL_CHUNK * KERNEL_CHUNK

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The next chunk's length; sets the checkpoint it snapshots."""
        start = seq.num_computed
        n = self._chunk_len(seq.num_prompt - start, budget)
        due = [p for p in seq.checkpoints if start < p <= start + n]
        if len(due) > 1:
            # NOTE: one snapshot per chunk: end it at the first (start and due[0]
            # are both hit + multiples of 16, so the chunk stays kernel-aligned)
            n = due[0] - start
        placed = [p for p in seq.placed if start < p <= start + n]
        seq.snapshot_at = frozenset(due[:1] + placed)
        return n

    def hit_length(self, seq: Sequence) -> int:
        """The hybrid hit for ``seq`` against the local caches."""
        if not self.cfg.enable_caching:
            return 0
        lead = 0
        while lead < len(seq.block_hashes) and self.kv_pool.lookup(seq.block_hashes[lead]) is not None:
            lead += 1
        states = {
            (i + 1) * self.cfg.unit for i in range(lead) if self.state_pool.lookup(seq.block_hashes[i]) is not None
        }
        return longest_usable_hit(seq.num_prompt, self.cfg.unit, lead, states, self.cfg.drop_eagle_block)

    def _admit(self, seq: Sequence) -> bool:
        cfg = self.cfg
        hit = self.hit_length(seq)
        hit_ids = [self.kv_pool.cached[h] for h in seq.block_hashes[: hit // cfg.unit]]
        self.kv_pool.touch(hit_ids)  # before allocate, so the hit cannot be evicted
        fresh = self.kv_pool.allocate(self.blocks_needed(seq) - len(hit_ids))
        if fresh is None:
            self.kv_pool.free(reversed(hit_ids))
            return False
        seq.block_ids = hit_ids + fresh
        seq.num_computed = seq.num_cached = hit
        seq.restore_slot = self.state_pool.cached[seq.block_hashes[hit // cfg.unit - 1]] if hit else None
        if cfg.enable_caching:
            n, b, a = seq.num_prompt, cfg.mamba_block_size, cfg.alignment
            tail = planned_checkpoint(hit, n, n, cfg.unit, b, a, cfg.drop_eagle_block)
            drop = cfg.drop_eagle_block
            extra = requested_checkpoints(seq.request.checkpoints, hit, n, cfg.unit, b, a, drop, cfg.max_extra)
            seq.tail_checkpoint = tail
            seq.checkpoints = extra + (() if tail is None else (tail,))
            seq.placed = placed_checkpoints(seq.request.placement, hit, n, cfg.unit, b, a, drop, seq.checkpoints)
        logger.debug(
            "admit %s: prompt %d, hit %d, checkpoints %s, placed %s",
            seq.rid,
            seq.num_prompt,
            hit,
            seq.checkpoints,
            seq.placed,
        )
        return True

    def admit_handoff(self, seq: Sequence, pinned: dict[int, int] | None = None) -> bool:
        """Admit a request prefilled elsewhere straight into DECODE: reserve its
        blocks (prompt + output + drafts; the caller writes the handed-off KV
        into them) and run it from the next step. ``pinned`` maps block index ->
        a cached pool block already holding it (referenced for this request:
        ``NativeEngine.prepare_handoff``); they take their places in the table
        and fresh blocks fill the rest. False (nothing taken; the pins stay the
        caller's) when too few blocks are free."""
        pinned = pinned or {}
        need = self.blocks_needed(seq)
        fresh = self.kv_pool.allocate(need - len(pinned))
        if fresh is None:
            return False
        it = iter(fresh)
        seq.block_ids = [pinned[i] if i in pinned else next(it) for i in range(need)]
        seq.num_computed = seq.num_prompt
        seq.started = True  # its tensors come with the handoff (ModelRunner.load_handoff)
        seq.status = SeqStatus.DECODE
        self.running.append(seq)
        logger.debug("admit handoff %s: prompt %d, cached %d", seq.rid, seq.num_prompt, seq.num_cached)
        return True

    def finish(self, seq: Sequence) -> None:
        """Release everything ``seq`` holds (any state, abort included)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.background:
            self.background.remove(seq)
        if seq.block_ids:
            self.kv_pool.free(reversed(seq.block_ids))
            seq.block_ids = []
        seq.status = SeqStatus.FINISHED
