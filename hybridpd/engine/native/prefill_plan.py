"""What a native prefill of a prompt would hit, asked before it runs and without
side effects, by the scheduler's own rule (``Scheduler.hit_length``). Where it
leaves its checkpoints is not predicted here: the output completing the prompt
reports what it stored (``RequestOutput.checkpoints``). Tensor-free.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from hybridpd.engine.base import EngineRequest, RequestId
from hybridpd.engine.native.scheduler import Scheduler
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
