"""A decode engine's pins for delta handoffs: the cached KV blocks of a prompt
it is about to receive, held from ``prepare_handoff`` until ``add_handoff``
hands them to the request or ``abort`` releases them.

A block is pinned when its chain hash, the request's (the router's chain, carried
by ``EngineRequest.block_hashes``; hashed here when it came without), equals
the ticket's and the prefix cache holds it: the fetch skips those blocks
(``FetchedHandoff.held``) and no admission evicts them meanwhile. A pin is a
reference on a ``BlockPool`` slot (``touch``); released pins are freed tail
first, so the head of the prompt stays cached longest. Tensor-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpd.engine.base import EngineRequest
from hybridpd.engine.native.block_pool import BlockPool
from hybridpd.errors import IntegrityError
from hybridpd.hashing import BlockHash, BlockHasher


class HandoffPins:
    """Per request id, ``{block index: cached pool block}`` pinned for its handoff."""

    def __init__(self, kv_pool: BlockPool, hasher: BlockHasher) -> None:
        self.kv_pool = kv_pool
        self.hasher = hasher
        self._pins: dict[str, dict[int, int]] = {}

    def pin(self, request: EngineRequest, block_hashes: Sequence[BlockHash]) -> int:
        """Pin the blocks of ``request``'s prompt whose chain hash equals the ticket's
        (``block_hashes``) and that the pool holds, replacing earlier pins of the
        request. Returns the pinned count."""
        self.release(request.request_id)
        if not block_hashes:
            return 0
        mine = request.chain(self.hasher)
        pins: dict[int, int] = {}
        for i, (theirs, h) in enumerate(zip(block_hashes, mine, strict=False)):
            slot = self.kv_pool.lookup(h) if theirs == h else None
            if slot is not None:
                self.kv_pool.touch([slot])
                pins[i] = slot
        if pins:
            self._pins[request.request_id] = pins
        return len(pins)

    def release(self, request_id: str) -> bool:
        """Free ``request_id``'s pins (tail first); False if it had none."""
        pins = self._pins.pop(request_id, None)
        if pins:
            self.kv_pool.free([pins[i] for i in sorted(pins, reverse=True)])  # tail first: the head stays longest
        return bool(pins)

    def held(self, request_id: str) -> frozenset[int]:
        """The block indices pinned for ``request_id`` (the fetch skips them)."""
        return frozenset(self._pins.get(request_id, {}))

    def check(self, request_id: str, held: frozenset[int]) -> None:
        """IntegrityError (and the pins released) when a fetch skipped blocks not
        pinned here: their rows were never read, so they must never be used."""
        if not held <= self._pins.get(request_id, {}).keys():
            self.release(request_id)
            raise IntegrityError("handoff %s skipped blocks this engine did not pin" % request_id)

    def covering(self, request_id: str, held: frozenset[int]) -> dict[int, int]:
        """The pins of ``request_id`` the fetch skipped: the blocks its request takes over."""
        return {i: b for i, b in self._pins.get(request_id, {}).items() if i in held}

    def hand_over(self, request_id: str, held: frozenset[int]) -> None:
        """The request was admitted holding the pins in ``held``: forget them, and free
        the pins it does not hold (pinned, but read anyway by a fetch without them)."""
        extra = {i: b for i, b in self._pins.pop(request_id, {}).items() if i not in held}
        if extra:
            self.kv_pool.free([extra[i] for i in sorted(extra, reverse=True)])
