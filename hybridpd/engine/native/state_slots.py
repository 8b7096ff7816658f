"""The tensors of the recurrent-state checkpoint slots (the runner's half of
``StateCache``, which keeps the tensor-free bookkeeping: keys, values, eviction).

One slot holds the state of every delta layer after one position::

    conv: [num_slots, n_delta, conv_kernel - 1, conv_dim]          fp32
    ssm:  [num_slots, n_delta, heads, key_dim, value_dim]          fp32

NOTE: delta states are fp32 in every engine dtype (``delta.DeltaState``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridpd.engine.native.delta import DeltaState
from hybridpd.engine.native.model_config import HybridModelConfig


class StateSlots:
    def __init__(self, num_slots: int, num_delta_layers: int, mcfg: HybridModelConfig, device: torch.device) -> None:
        m = mcfg
        self.num_slots = num_slots
        self.num_delta_layers = num_delta_layers
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

    def write(self, slot: int, states: Sequence[DeltaState]) -> None:
        """Copy ``states`` (one per delta layer) into ``slot``."""
        if len(states) != self.num_delta_layers:
            raise ValueError("expected %d delta states, got %d" % (self.num_delta_layers, len(states)))
        for i, st in enumerate(states):
            self.conv[slot, i] = st.conv
            self.ssm[slot, i] = st.ssm

    def read(self, slot: int) -> list[DeltaState]:
        """Owned copies of the states in ``slot`` (a restore)."""
        return [DeltaState(self.conv[slot, i].clone(), self.ssm[slot, i].clone()) for i in range(self.num_delta_layers)]
