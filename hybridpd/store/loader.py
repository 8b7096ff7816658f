"""Load a checkpoint the index promised, repairing the index when it lied."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from hybridpd.engine.base import KVExport, StateCheckpoint
from hybridpd.errors import IntegrityError, UnavailableError
from hybridpd.hashing import BlockHash
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.store.client import BadObjectError, CheckpointStore, StoreMissError

logger = logging.getLogger(__name__)


def fetch_checkpoint(
    index: PrefixIndex | None,
    store: CheckpointStore,
    block_hashes: Sequence[BlockHash],
    unit: int,
    position: int | None = None,
    on_refused: Callable[[IntegrityError], None] | None = None,
) -> tuple[KVExport, StateCheckpoint] | None:
    """The verified KV of ``block_hashes`` and state at ``position`` (default
    the end of those blocks), or None.

    None means: recompute. A missing or bad object is a stale index entry: its
    state entry (and, for a missing or bad block, every block entry of the chain
    from there) is removed so later lookups stop promising it. A bad object
    (corrupt, or failing its keyed tag: :class:`BadObjectError`) is deleted from the
    store with the state object, and handed to ``on_refused`` (the caller counts it).
    """
    try:
        return store.get_checkpoint(block_hashes, unit, position)
    except (StoreMissError, IntegrityError) as exc:
        pos = len(block_hashes) * unit if position is None else position
        state_hash = block_hashes[pos // unit - 1]
        logger.warning("stale checkpoint at %d tokens (%s): repairing the index", pos, exc)
        bad = exc.name if isinstance(exc, BadObjectError) else None
        if index is not None:
            kv_keys = [store.key("kv", h) for h in block_hashes]
            present = store.exists(kv_keys)
            first_bad = next(
                (i for i, (k, ok) in enumerate(zip(kv_keys, present, strict=True)) if not ok or k == bad),
                len(block_hashes),
            )
            try:
                index.remove_store(kv_hashes=block_hashes[first_bad:], state_hashes=[state_hash])
            except UnavailableError:
                logger.warning("index unavailable: repair skipped (entries expire by TTL)")
        if isinstance(exc, IntegrityError):
            st_key = store.key("st", state_hash)
            store.remove([st_key] if bad in (None, st_key) else [st_key, bad])
            if on_refused is not None:
                on_refused(exc)
        return None
