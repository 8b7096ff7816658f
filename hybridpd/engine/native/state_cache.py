"""Recurrent-state checkpoint slots: the state half of the prefix cache.

One slot holds the state of every delta layer after exactly ``pos`` tokens of
some prefix, keyed by the chain hash of ``[0, pos)`` (never by a slot column:
see ``PrefixCache.save_checkpoint``)::

    conv: [num_slots, n_delta, conv_kernel - 1, conv_dim]          fp32
    ssm:  [num_slots, n_delta, heads, key_dim, value_dim]          fp32

The bookkeeping is a tensor-free :class:`BlockPool` (``pool``; the scheduler
looks hits up in it). A stored slot is cached and free at once: evictable,
LRU, until an admission restores it. There is ONE write path, :meth:`store`,
for checkpoints saved during prefill and for checkpoints imported from the
store, and one read path, :meth:`read`, for the restore at admission.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridpd.engine.native.block_pool import BlockPool, EventSink
from hybridpd.engine.native.delta import DeltaState
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.hashing import BlockHash


class StateCache:
    def __init__(
        self,
        num_slots: int,
        num_delta_layers: int,
        mcfg: HybridModelConfig,
        device: torch.device,
        on_event: EventSink | None = None,
    ) -> None:
        m = mcfg
        self.num_delta_layers = num_delta_layers
        self.pool = BlockPool(num_slots, on_event)
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

    def store(self, key: BlockHash, states: Sequence[DeltaState]) -> bool:
        """Cache ``states`` (one per delta layer) under ``key``. True when ``key``
        is cached afterwards (already was, or written now); False when no slot
        is free (every slot is being restored: nothing is evicted for it)."""
        if len(states) != self.num_delta_layers:
            raise ValueError("expected %d delta states, got %d" % (self.num_delta_layers, len(states)))
        if self.pool.lookup(key) is not None:
            return True
        got = self.pool.allocate(1)
        if got is None:
            return False
        slot = got[0]
        for i, st in enumerate(states):
            self.conv[slot, i] = st.conv
            self.ssm[slot, i] = st.ssm
        self.pool.cache(slot, key)
        self.pool.free(got)
        return True

    def read(self, slot: int) -> list[DeltaState]:
        """Owned copies of the states in ``slot`` (a restore: the slot stays cached)."""
        return [DeltaState(self.conv[slot, i].clone(), self.ssm[slot, i].clone()) for i in range(self.num_delta_layers)]
