"""The native scheduler's settings, read from ``HybridPDConfig`` in one place."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.config import HybridPDConfig
from hybridpd.engine.profile import native_profile


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    unit: int
    mamba_block_size: int
    alignment: int | None
    eagle: bool
    num_spec: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_caching: bool
    #: extra checkpoints per prefill (the deepest of the requested are kept)
    max_extra: int = 4
    #: an EAGLE hit drops (replays) one unit (``EngineProfile.eagle_drop``; the native head does not)
    drop_eagle_block: bool = False

    @classmethod
    def of(cls, cfg: HybridPDConfig, role: str = "local") -> SchedulerConfig:
        """The settings of a native engine in ``role`` ("local", "prefill" or "decode")."""
        return cls(
            unit=cfg.prefix_match_unit,
            mamba_block_size=cfg.mamba_block_size,
            alignment=cfg.checkpoint_alignment,
            eagle=cfg.eagle,
            num_spec=cfg.num_speculative_tokens,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            enable_caching=cfg.enable_prefix_caching,
            max_extra=cfg.max_extra_checkpoints,
            drop_eagle_block=native_profile(cfg).eagle_drop(role),
        )
