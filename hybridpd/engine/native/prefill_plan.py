"""What a native prefill of a prompt will do, asked before it runs and without
side effects: the hit its admission would get now, and where it leaves its
tail and extra checkpoints, by the scheduler's own rules in its geometry
(``SchedulerConfig``). The router remembers those positions on the instance
until the index reports them (``RecentPrefills``). Tensor-free.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from hybridpd.checkpoints import planned_checkpoint, requested_checkpoints
from hybridpd.engine.base import EngineRequest, RequestId
from hybridpd.engine.native.scheduler import Scheduler
from hybridpd.engine.native.scheduler_config import SchedulerConfig
from hybridpd.engine.native.sequence import Sequence
from hybridpd.hashing import BlockHash, BlockHasher


def probe_hit(
    scheduler: Scheduler,
    hasher: BlockHasher,
    token_ids: Seq[int],
    cache_salt: str | None,
    hashes: Seq[BlockHash] = (),
) -> int:
    """The hit an admission of ``token_ids`` would get now (``Scheduler.hit_length``
    of a probe that is never queued; ``hashes``: the chain of a prefix, already known)."""
    tokens = list(token_ids)
    probe = Sequence(
        EngineRequest(RequestId("probe"), tuple(tokens)),
        tokens,
        len(tokens),
        hasher.extend(hashes, tokens, cache_salt=cache_salt),
    )
    return scheduler.hit_length(probe)


def tail_checkpoint(cfg: SchedulerConfig, request: EngineRequest, num_cached: int) -> int:
    """The scheduler's tail: ``checkpoints.planned_checkpoint`` of the prompt's query
    ``[num_cached, N)`` (0 where the protocol forbids it or caching is off)."""
    if not cfg.enable_caching:
        return 0
    n = len(request.prompt_token_ids)
    pos = planned_checkpoint(num_cached, n, n, cfg.unit, cfg.mamba_block_size, cfg.alignment, cfg.drop_eagle_block)
    return pos or 0


def extra_checkpoints(cfg: SchedulerConfig, request: EngineRequest, num_cached: int) -> tuple[int, ...]:
    """The scheduler's extra positions: ``checkpoints.requested_checkpoints`` of the
    prompt's query ``[num_cached, N)`` (none with caching off). Not the placed ones
    (``EngineRequest.placement``): a full speculative share may skip them
    (``StateCache.store``), so only the index (the cache events) reports them."""
    if not cfg.enable_caching or not request.checkpoints:
        return ()
    n, b, a, drop = len(request.prompt_token_ids), cfg.mamba_block_size, cfg.alignment, cfg.drop_eagle_block
    return requested_checkpoints(request.checkpoints, num_cached, n, cfg.unit, b, a, drop, cfg.max_extra)
