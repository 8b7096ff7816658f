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
    index: PrefixIndex | None, store: CheckpointStore, block_hashes: Sequence[BlockHash], unit: int
) -> tuple[KVExport, StateCheckpoint] | None:
    """The verified checkpoint at ``len(block_hashes) * unit``, or None.

    None means: recompute. A missing or corrupt object is a stale index entry:
    its state entry (and, for a missing/corrupt block, every block entry of the
    chain from there) is removed so later lookups stop promising it.
    """
    try:
        return store.get_checkpoint(block_hashes, unit)
    except (StoreMissError, IntegrityError) as exc:
        logger.warning("stale checkpoint at %d tokens (%s): repairing the index", len(block_hashes) * unit, exc)
        if index is not None:
            present = store.exists([store.key("kv", h) for h in block_hashes])
            first_bad = next((i for i, ok in enumerate(present) if not ok), len(block_hashes))
            try:
                index.remove_store(kv_hashes=block_hashes[first_bad:], state_hashes=[block_hashes[-1]])
            except UnavailableError:
                logger.warning("index unavailable: repair skipped (entries expire by TTL)")
        if isinstance(exc, IntegrityError):
            store.remove([store.key("st", block_hashes[-1])])
        return None
