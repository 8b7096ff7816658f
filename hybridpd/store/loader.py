"""Load a checkpoint the index promised, repairing the index when it lied."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hybridpd.engine.base import KVExport, StateCheckpoint
from hybridpd.errors import IntegrityError, UnavailableError
from hybridpd.hashing import BlockHash
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.store.client import CheckpointStore, StoreMissError

logger = logging.getLogger(__name__)


def fetch_checkpoint(
    index: PrefixIndex | None,
    store: CheckpointStore,
    block_hashes: Sequence[BlockHash],
    unit: int,
    position: int | None = None,
) -> tuple[KVExport, StateCheckpoint] | None:
    """The verified KV of ``block_hashes`` and state at ``position`` (default
    the end of those blocks), or None.

    None means: recompute. A missing or corrupt object is a stale index entry:
    its state entry (and, for a missing/corrupt block, every block entry of the
    chain from there) is removed so later lookups stop promising it.
    """
    try:
        return store.get_checkpoint(block_hashes, unit, position)
    except (StoreMissError, IntegrityError) as exc:
        pos = len(block_hashes) * unit if position is None else position
        state_hash = block_hashes[pos // unit - 1]
        logger.warning("stale checkpoint at %d tokens (%s): repairing the index", pos, exc)
        if index is not None:
            present = store.exists([store.key("kv", h) for h in block_hashes])
            first_bad = next((i for i, ok in enumerate(present) if not ok), len(block_hashes))
            try:
                index.remove_store(kv_hashes=block_hashes[first_bad:], state_hashes=[state_hash])
            except UnavailableError:
                logger.warning("index unavailable: repair skipped (entries expire by TTL)")
        if isinstance(exc, IntegrityError):
            store.remove([store.key("st", state_hash)])
        return None
