"""Recurrent-state checkpoint slots: the state half of the prefix cache (tensor-free).

One slot holds the state of every delta layer after exactly ``pos`` tokens of
some prefix, keyed by the chain hash of ``[0, pos)`` (never by a slot column:
see ``PrefixCache.plan``). The tensors are the runner's (``state_slots.py``);
this class decides which slot holds what.

The bookkeeping is a tensor-free :class:`BlockPool` (``pool``; the scheduler
looks hits up in it). A slot is busy from :meth:`store` until :meth:`written`
(within one step: ``PrefixCache.plan`` reserves a step's snapshot slots before
the run, deepest first, and ``commit`` releases them after it, so the snapshots
of one step never evict each other: with every slot busy, the shallower ones
are only exported); then it
is cached and free at once, always evictable (an admission's restore is read at
the start of the step, before any snapshot is written). There is ONE way in, :meth:`store`, for
checkpoints snapshotted during prefill and for checkpoints imported from the
store: it keys a slot and keeps it busy until the caller wrote its tensors
(:meth:`written`; :meth:`abandon` when the write never happened). A restore
at admission is counted by :meth:`restored`.

Eviction is by value (``hybridpd/checkpoint_value.py``), not age: per slot we
keep its position, its hits (each :meth:`restored`, i.e. each admission that
restores it) and its last use (store or restore: seconds on ``clock``, and
``writes``, the slots written so far, for the turnover age); when ``store``
needs a slot the pool takes a free uncached one, else the cached one of
lowest ``value_rank`` (ties: the oldest in the free queue). Every slot holds
the same bytes (``slot_bytes``), so this compares saved FLOPs, reuse and age.
The pool still emits REMOVED for the evicted key. Size: ``slots_for`` a MiB
budget (``state_cache_mb``), at least ``MIN_SLOTS``.

Placed checkpoints (``hybridpd/placement.py``) are stored *speculative*: until
a restore reads them (or a non-speculative store of the same key) they may
hold at most ``max_speculative`` slots (``placement_share`` of them). A
speculative store past that evicts the least valuable speculative slot, or is
skipped when it is worth less than every one of them: a workload that never
reuses placed checkpoints keeps at least the other share for the rest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from hybridpd.checkpoint_value import ComputeModel, checkpoint_value, value_rank
from hybridpd.engine.native.block_pool import BlockPool, EventSink
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.hashing import BlockHash

#: the fewest slots an engine gets, whatever its budget (a slot is busy only within the step that
#: writes it, so any count works; a few keep some reuse when one slot exceeds the budget)
MIN_SLOTS = 4


def slot_bytes(num_delta_layers: int, mcfg: HybridModelConfig) -> int:
    """Bytes of one slot: every delta layer's conv and recurrent state, fp32."""
    m = mcfg
    per_layer = (m.conv_kernel - 1) * m.conv_dim + m.delta_heads * m.delta_key_dim * m.delta_value_dim
    return 4 * num_delta_layers * per_layer


def slots_for(budget_mib: float, num_delta_layers: int, mcfg: HybridModelConfig) -> int:
    """How many slots ``budget_mib`` MiB holds, at least ``MIN_SLOTS``."""
    return max(MIN_SLOTS, int(budget_mib * (1 << 20)) // slot_bytes(num_delta_layers, mcfg))


class StateCache:
    def __init__(
        self,
        num_slots: int,
        num_delta_layers: int,
        mcfg: HybridModelConfig,
        on_event: EventSink | None = None,
        *,
        half_life_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
        speculative_share: float = 0.5,
    ) -> None:
        self.num_delta_layers = num_delta_layers
        self.slot_bytes = slot_bytes(num_delta_layers, mcfg)
        self.compute = ComputeModel.of(mcfg)
        self.half_life_s = half_life_s
        self.clock = clock
        self.pool = BlockPool(num_slots, on_event, choose_victim=self._victim)
        self.writes = 0  # slots written so far: the turnover clock (num_slots writes = 1 turnover)
        # per slot, meaningful while it is cached: position, restores, last use (s, writes), value_rank
        self.position = [0] * num_slots
        self.hits = [0] * num_slots
        self.last_use = [0.0] * num_slots
        self.last_writes = [0] * num_slots
        self.rank = [-math.inf] * num_slots
        self.speculative = [False] * num_slots  # meaningful while cached
        self.max_speculative = max(1, int(speculative_share * num_slots))
        self._evict_speculative = False  # _victim: take the least valuable speculative slot

    def lookup(self, key: BlockHash) -> int | None:
        return self.pool.lookup(key)

    def store(self, key: BlockHash, position: int, speculative: bool = False) -> int | None:
        """Key a slot by ``key`` (its state after ``position`` tokens), evicting the
        least valuable free slot if none is empty (a ``speculative`` one past
        ``max_speculative``: the least valuable speculative slot). Returns the
        slot to write now, busy until :meth:`written`; None when there is
        nothing to write: ``key`` is held already (its last use is refreshed),
        no slot is free (each is being written), or a speculative store is worth
        less than every speculative slot held."""
        held = self.pool.lookup(key)
        if held is not None:
            self.speculative[held] = self.speculative[held] and speculative
            self._used(held)
            return None
        if speculative and self.num_speculative >= self.max_speculative:
            turns = self.writes / self.pool.num_slots
            mine = value_rank(position, self.slot_bytes, 0, self.clock(), self.half_life_s, self.compute, turns)
            held_ranks = [self.rank[s] for s in self._speculative_slots() if s in self.pool.free_queue]
            if not held_ranks or mine <= min(held_ranks):
                return None
            self._evict_speculative = True
        try:
            got = self.pool.allocate(1)
        finally:
            self._evict_speculative = False
        if got is None:
            return None
        slot = got[0]
        self.speculative[slot] = speculative
        self.pool.cache(slot, key)
        self.position[slot], self.hits[slot] = position, 0
        self._used(slot)
        self.writes += 1
        return slot

    def written(self, slot: int) -> None:
        """``store``'s slot holds its state now: cached and evictable."""
        self.pool.free([slot])

    def abandon(self, slot: int) -> None:
        """``store``'s slot was never written (the step failed): forget its key, free it."""
        key = self.pool.hash_of[slot]
        if key is not None:
            self.pool.uncache(key)
        self.pool.free([slot])

    def restored(self, slot: int, hit: bool = True) -> None:
        """An admission restores ``slot`` (the runner reads it this step): its last
        use is now, and it counts as a hit unless ``hit`` is False (an answer
        checkpoint's prefill, whose own checkpoint supersedes this one)."""
        if hit:
            self.hits[slot] += 1
            self.speculative[slot] = False
        self._used(slot)

    def value(self, slot: int) -> float:
        """The value of cached ``slot`` now (``checkpoint_value``; tests, stats)."""
        age = self.clock() - self.last_use[slot]
        turns = (self.writes - self.last_writes[slot]) / self.pool.num_slots
        pos, nbytes, hits = self.position[slot], self.slot_bytes, self.hits[slot]
        return checkpoint_value(pos, nbytes, hits, age, self.half_life_s, self.compute, turns)

    def _used(self, slot: int) -> None:
        self.last_use[slot], self.last_writes[slot] = self.clock(), self.writes
        pos, nbytes, hits = self.position[slot], self.slot_bytes, self.hits[slot]
        turns = self.writes / self.pool.num_slots
        self.rank[slot] = value_rank(pos, nbytes, hits, self.last_use[slot], self.half_life_s, self.compute, turns)

    @property
    def num_speculative(self) -> int:
        """Cached slots no restore has read yet that a placed checkpoint wrote."""
        return len(self._speculative_slots())

    def _speculative_slots(self) -> list[int]:
        hash_of = self.pool.hash_of
        return [s for s in range(self.pool.num_slots) if self.speculative[s] and hash_of[s] is not None]

    def _victim(self, free: Iterable[int]) -> int:
        """The free slot to take: an uncached one, else the lowest rank (the
        first, i.e. oldest, among equals); storing a speculative checkpoint past
        ``max_speculative``: the lowest-rank speculative one. O(free slots) per
        eviction."""
        hash_of, rank = self.pool.hash_of, self.rank
        if self._evict_speculative:
            spec = [s for s in free if hash_of[s] is not None and self.speculative[s]]
            if spec:
                return min(spec, key=lambda s: rank[s])
        return min(free, key=lambda s: -math.inf if hash_of[s] is None else rank[s])
