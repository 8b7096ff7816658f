"""Recurrent-state checkpoint slots: the state half of the prefix cache.

One slot holds the state of every delta layer after exactly ``pos`` tokens of
some prefix, keyed by the chain hash of ``[0, pos)`` (never by a slot column:
see ``PrefixCache.save_checkpoint``)::

    conv: [num_slots, n_delta, conv_kernel - 1, conv_dim]          fp32
    ssm:  [num_slots, n_delta, heads, key_dim, value_dim]          fp32

The bookkeeping is a tensor-free :class:`BlockPool` (``pool``; the scheduler
looks hits up in it). A stored slot is cached and free at once: always
evictable (an admission reads its hit in the same step, before any
``store``). There is ONE write path, :meth:`store`,
for checkpoints saved during prefill and for checkpoints imported from the
store, and one read path, :meth:`read`, for the restore at admission.

Eviction is by value (``hybridpd/checkpoint_value.py``), not age: per slot we
keep its position, its hits (each :meth:`read`, i.e. each admission that
restores it) and its last use (store or read: seconds on ``clock``, and
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
from collections.abc import Callable, Iterable, Sequence

import torch

from hybridpd.checkpoint_value import ComputeModel, checkpoint_value, value_rank
from hybridpd.engine.native.block_pool import BlockPool, EventSink
from hybridpd.engine.native.delta import DeltaState
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.hashing import BlockHash

#: the fewest slots an engine gets, whatever its budget (a slot is busy only while written, so any
#: count works; a few keep some reuse when one slot exceeds the budget)
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
        device: torch.device,
        on_event: EventSink | None = None,
        *,
        half_life_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
        speculative_share: float = 0.5,
    ) -> None:
        m = mcfg
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
        # NOTE: delta states are fp32 in every engine dtype (delta.DeltaState)
        self.conv = torch.zeros(
            num_slots, num_delta_layers, m.conv_kernel - 1, m.conv_dim, dtype=torch.float32, device=device
        )
        self.ssm = torch.zeros(
            num_slots,
            num_delta_layers,
            m.delta_heads,
            m.delta_key_dim,
            m.delta_value_dim,
            dtype=torch.float32,
            device=device,
        )

    def lookup(self, key: BlockHash) -> int | None:
        return self.pool.lookup(key)

    def store(self, key: BlockHash, states: Sequence[DeltaState], position: int, speculative: bool = False) -> bool:
        """Cache ``states`` (one per delta layer, after ``position`` tokens) under
        ``key``, evicting the least valuable free slot if none is empty (a
        ``speculative`` one past ``max_speculative``: the least valuable
        speculative slot). True when ``key`` is cached afterwards (already was:
        its last use is refreshed, or written now); False when no slot is free
        (every slot is being restored: nothing is evicted for it) or a
        speculative store is worth less than every speculative slot held."""
        if len(states) != self.num_delta_layers:
            raise ValueError("expected %d delta states, got %d" % (self.num_delta_layers, len(states)))
        held = self.pool.lookup(key)
        if held is not None:
            self.speculative[held] = self.speculative[held] and speculative
            self._used(held)
            return True
        if speculative and self.num_speculative >= self.max_speculative:
            turns = self.writes / self.pool.num_slots
            mine = value_rank(position, self.slot_bytes, 0, self.clock(), self.half_life_s, self.compute, turns)
            held_ranks = [self.rank[s] for s in self._speculative_slots() if s in self.pool.free_queue]
            if not held_ranks or mine <= min(held_ranks):
                return False
            self._evict_speculative = True
        try:
            got = self.pool.allocate(1)
        finally:
            self._evict_speculative = False
        if got is None:
            return False
        slot = got[0]
        self.speculative[slot] = speculative
        for i, st in enumerate(states):
            self.conv[slot, i] = st.conv
            self.ssm[slot, i] = st.ssm
        self.pool.cache(slot, key)
        self.position[slot], self.hits[slot] = position, 0
        self._used(slot)
        self.writes += 1
        self.pool.free(got)
        return True

    def read(self, slot: int, hit: bool = True) -> list[DeltaState]:
        """Owned copies of the states in ``slot`` (a restore: the slot stays
        cached, and counts as a hit unless ``hit`` is False: an answer checkpoint's
        prefill, whose own checkpoint supersedes this one)."""
        if hit:
            self.hits[slot] += 1
            self.speculative[slot] = False
        self._used(slot)
        return [DeltaState(self.conv[slot, i].clone(), self.ssm[slot, i].clone()) for i in range(self.num_delta_layers)]

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
