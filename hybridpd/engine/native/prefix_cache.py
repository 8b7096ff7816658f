"""The native engine's local prefix cache: what it caches, exports and imports.

Two tensor-free pools keyed by chain hashes (``hybridpd.hashing``)::

    kv_pool     attention KV blocks, one per ``unit`` tokens (tensors: ModelRunner)
    state_pool  recurrent-state checkpoints, keyed by the hash at their
                position (StateCache, evicted by value, not age; tensors:
                the runner's StateSlots)

What enters them, and when:

* a completed prompt's full blocks (``register_prompt``; never decode's KV),
  and a handed-off prompt's (``register_handoff``: the next turn's delta handoff);
* the checkpoints a prefill snapshots: ``plan`` reserves and keys a slot for
  each position a scheduled chunk snapshots (the tail, the extra positions the
  request named, the router's placed ones; ``hybridpd.checkpoints``) before
  the runner runs the step and writes them; ``commit`` releases them after it
  (``abandon`` forgets them when the step failed). The runner exports them
  with the prompt's full KV when the prompt completes if the engine exports
  checkpoints; ``register_prompt`` queues those for ``pop_exports`` (the
  store writes the KV blocks it lacks, so the shared blocks go in once);
* a verified store checkpoint (``import_checkpoint``).

Every change of either pool goes to the :class:`CacheEventLog`
(``pop_events``), which the index mirrors. The scheduler reads the pools for
hits; only this class and the scheduler's admission/finish change them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq

from hybridpd.checkpoints import checkpoint_slot_column, extra_slot_column, natural_position
from hybridpd.engine.base import CacheEvent, CacheGroup, KVExport, StateCheckpoint, WrittenCheckpoints
from hybridpd.engine.native import exports
from hybridpd.engine.native.block_pool import BlockPool
from hybridpd.engine.native.cache_events import CacheEventLog
from hybridpd.engine.native.model_runner import ModelRunner
from hybridpd.engine.native.sequence import Sequence
from hybridpd.engine.native.state_cache import StateCache
from hybridpd.engine.native.step import ScheduledWork
from hybridpd.errors import IntegrityError
from hybridpd.hashing import BlockHash, BlockHasher

logger = logging.getLogger(__name__)


class PrefixCache:
    def __init__(
        self,
        runner: ModelRunner,
        hasher: BlockHasher,
        *,
        num_kv_blocks: int,
        mamba_block_size: int,
        enabled: bool,
        half_life_s: float = 1800.0,
        placement_share: float = 0.5,
    ) -> None:
        self.runner = runner  # only to write what import_checkpoint enters
        self.model_id = runner.model_id
        self.hasher = hasher
        self.unit = hasher.unit
        self.mamba_block_size = mamba_block_size
        self.enabled = enabled
        num_state_slots = runner.slots.num_slots
        # NOTE: the limit exceeds what the pools can hold, so a resync always fits in it
        self.events = CacheEventLog(4 * (num_kv_blocks + num_state_slots), self._cached_now)
        self.kv_pool = BlockPool(num_kv_blocks, self.events.sink(CacheGroup.KV))
        self.state_cache = StateCache(
            num_state_slots,
            runner.num_delta_layers,
            runner.mcfg,
            self.events.sink(CacheGroup.STATE),
            half_life_s=half_life_s,
            speculative_share=placement_share,
        )
        self.state_pool = self.state_cache.pool
        self.exports: list[tuple[KVExport, StateCheckpoint]] = []

    def _cached_now(self) -> list[tuple[CacheGroup, list[BlockHash]]]:
        return [(CacheGroup.KV, list(self.kv_pool.cached)), (CacheGroup.STATE, list(self.state_pool.cached))]

    # -- a step's snapshots, a prefill's blocks and exports --------------------------------
    def plan(self, scheduled: list[ScheduledWork]) -> None:
        """Before the runner runs ``scheduled``: count each admission's restore, then
        reserve and key a slot for each position a chunk snapshots
        (``seq.snapshot_slots``; None where no slot is free or the key is held)."""
        for sw in scheduled:
            seq = sw.seq
            if sw.admitted and seq.restore_slot is not None:
                self.state_cache.restored(seq.restore_slot, hit=not seq.request.background)
        for sw in scheduled:
            seq = sw.seq
            # deepest first: when slots run short (each stays busy for the step), the
            # shallower, less valuable snapshots are the ones left uncached
            deepest_first = sorted(seq.snapshot_at, reverse=True)
            seq.snapshot_slots = {} if sw.decode else {p: self._reserve(seq, p) for p in deepest_first}

    def _reserve(self, seq: Sequence, pos: int) -> int | None:
        """A slot for state@pos keyed by the chain hash of ``[0, pos)``.

        NOTE: vLLM writes the tail's state into slot column ceil(N/B) - 2 (an
        extra checkpoint: ceil(pos/B) - 1), whose natural key is
        state@(col+1)*B; when that is not ``pos`` the slot must be re-keyed, or
        a restore would return state@pos as another boundary. Our slots are
        keyed explicitly by the hash at ``pos``.
        """
        b = self.mamba_block_size
        col = checkpoint_slot_column(seq.num_prompt, b) if pos == seq.tail_checkpoint else extra_slot_column(pos, b)
        if natural_position(col, b) != pos:
            logger.debug(
                "%s: slot column %d re-keyed from state@%d to state@%d", seq.rid, col, natural_position(col, b), pos
            )
        key = seq.block_hashes[pos // self.unit - 1]
        return self.state_cache.store(key, pos, speculative=pos in seq.placed)  # placed: speculative until read

    def commit(self, scheduled: list[ScheduledWork]) -> None:
        """After the runner wrote the step's snapshots: their slots are evictable, and
        each sequence records the positions whose state the cache holds now (a slot
        written, or the key held already; not one that found no slot: only exported)."""
        for sw in scheduled:
            seq = sw.seq
            seq.stored.update(p for p in seq.snapshot_slots if self._holds(seq, p))
        self._release(scheduled, self.state_cache.written)

    def _holds(self, seq: Sequence, pos: int) -> bool:
        return self.state_pool.lookup(seq.block_hashes[pos // self.unit - 1]) is not None

    def written(self, seq: Sequence) -> WrittenCheckpoints:
        """The checkpoints ``seq``'s prefill stored that the cache still holds (a later
        snapshot of the same prefill may have evicted an earlier one): what the index
        hears of, reported on the output that completes the prompt."""
        held = sorted(p for p in seq.stored if self._holds(seq, p))
        tail = seq.tail_checkpoint if seq.tail_checkpoint in held else None
        return WrittenCheckpoints(tail or 0, tuple(p for p in held if p != tail))

    def abandon(self, scheduled: list[ScheduledWork]) -> None:
        """The step failed: forget the slots ``plan`` keyed (none was written)."""
        self._release(scheduled, self.state_cache.abandon)

    @staticmethod
    def _release(scheduled: list[ScheduledWork], release: Callable[[int], None]) -> None:
        for sw in scheduled:
            for slot in sw.seq.snapshot_slots.values():
                if slot is not None:
                    release(slot)
            sw.seq.snapshot_slots = {}

    def register_prompt(self, seq: Sequence, exported: list[tuple[KVExport, StateCheckpoint]]) -> None:
        """Cache the full blocks of ``seq``'s completed prompt; queue its exports."""
        if self.enabled:
            for i in range(seq.num_prompt // self.unit):
                self.kv_pool.cache(seq.block_ids[i], seq.block_hashes[i])
        self.exports.extend(exported)

    def register_handoff(self, seq: Sequence) -> None:
        """Cache the full prompt blocks of a handed-off request (prefill computed
        them: exactly what a local prefill would), so the conversation's next
        turn READs only what is new (a delta handoff). Decode's own KV (the
        answer) never enters the cache."""
        if self.enabled:
            for i in range(min(seq.num_prompt // self.unit, len(seq.block_hashes))):
                self.kv_pool.cache(seq.block_ids[i], seq.block_hashes[i])

    # -- the streams the prefill worker drains -------------------------------------------
    def pop_exports(self) -> list[tuple[KVExport, StateCheckpoint]]:
        out, self.exports = self.exports, []
        return out

    def pop_events(self) -> list[CacheEvent]:
        return self.events.drain()

    # -- store hits ----------------------------------------------------------------------
    def import_checkpoint(
        self,
        kv: KVExport,
        state: StateCheckpoint,
        token_ids: Seq[int],
        cache_salt: str | None = None,
        known: Seq[BlockHash] = (),
    ) -> bool:
        """Enter a checkpoint loaded from the store (``known``: the chain of a prefix
        of ``token_ids`` already computed, the router's).

        Verifies that it belongs to ``token_ids`` (chain hash at its position;
        IntegrityError otherwise). True if its KV blocks and state are cached
        now (a later admission hits them); False if the pools are full.
        """
        pos, kv_pos = state.meta.position, kv.meta.position
        kv_shapes, _ = self.runner.expected_shapes(kv_pos)
        _, st_shapes = self.runner.expected_shapes(pos)
        exports.check_meta(kv.meta, self.model_id, "kv", kv_shapes)
        exports.check_meta(state.meta, self.model_id, "state", st_shapes)
        if pos % self.unit or kv_pos % self.unit or not 0 < pos <= kv_pos <= len(token_ids):
            raise IntegrityError("checkpoint at %d / KV to %d do not fit unit %d" % (pos, kv_pos, self.unit))
        hashes = self.hasher.extend(known, list(token_ids[:kv_pos]), cache_salt=cache_salt)
        key = hashes[pos // self.unit - 1]
        if state.key != key:
            raise IntegrityError("checkpoint key does not match the prompt's chain hash at %d" % pos)
        for i, h in enumerate(hashes):
            if self.kv_pool.lookup(h) is not None:
                continue
            got = self.kv_pool.allocate(1)
            if got is None:
                return False
            self.runner.write_kv_block(got[0], i, kv)
            self.kv_pool.cache(got[0], h)
            self.kv_pool.free(got)
        if self.state_cache.lookup(key) is None:
            slot = self.state_cache.store(key, pos)
            if slot is None:
                return False
            try:
                self.runner.write_state(slot, state)
            except BaseException:
                self.state_cache.abandon(slot)
                raise
            self.state_cache.written(slot)
        return True
