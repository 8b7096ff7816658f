"""Shape of a native hybrid model; stored as ``config.json`` beside its weights."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

#: The prefill kernel's chunk: state can be exported at multiples of it.
KERNEL_CHUNK = 16


@dataclass(frozen=True, slots=True)
class HybridModelConfig:
    """A decoder whose layers are gated-delta ('D') or attention ('A').

    ``layer_pattern`` is repeated to ``num_layers``: "DDDA" is 3 delta : 1
    attention.
    """

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 8
    layer_pattern: str = "DDDA"
    # attention layers
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    # gated delta layers
    delta_heads: int = 4
    delta_key_dim: int = 64
    delta_value_dim: int = 64
    conv_kernel: int = 4
    rms_eps: float = 1e-6
    max_position: int = 32768
    eos_token_id: int = 2
    # EAGLE draft head
    draft_intermediate_size: int = 512

    def __post_init__(self) -> None:
        if not self.layer_pattern or set(self.layer_pattern) - {"D", "A"}:
            raise ValueError("layer_pattern must be a non-empty string of 'D' and 'A'")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def layer_types(self) -> tuple[str, ...]:
        pat = self.layer_pattern
        return tuple(pat[i % len(pat)] for i in range(self.num_layers))

    @property
    def conv_dim(self) -> int:
        return self.delta_heads * (2 * self.delta_key_dim + self.delta_value_dim)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, path: Path) -> HybridModelConfig:
        return cls(**json.loads(Path(path).read_text()))
