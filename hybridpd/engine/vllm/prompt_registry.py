"""Recent prompts' chains, so a KV event's hash names its position and the
units before it: a partial attention entry's event carries only its last
unit's tokens (``kv_events.py``). The engine registers every prompt's chain
when it adds the request, before vLLM can publish anything of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from hybridpd.hashing import BlockHash

#: prompt-chain hashes the registry keeps (about 20 prompts of 164K tokens at unit 16)
MAX_REGISTERED_HASHES = 1 << 18


class PromptRegistry:
    """Recent prompts' chains, so a hash names its position and the units before it.
    Bounded (oldest prompts forgotten first); thread-safe."""

    def __init__(self, max_hashes: int = MAX_REGISTERED_HASHES) -> None:
        self.max_hashes = max_hashes
        self._chains: OrderedDict[int, tuple[BlockHash, ...]] = OrderedDict()
        self._where: dict[bytes, tuple[int, int]] = {}
        self._count = 0
        self._next = 0
        self._lock = threading.Lock()

    def register(self, chain: Sequence[BlockHash]) -> None:
        if not chain:
            return
        with self._lock:
            cid = self._next
            self._next += 1
            self._chains[cid] = tuple(chain)
            for i, h in enumerate(chain):
                self._where[bytes(h)] = (cid, i)
            self._count += len(chain)
            while self._count > self.max_hashes and len(self._chains) > 1:
                old_id, old = self._chains.popitem(last=False)
                self._count -= len(old)
                for h in old:
                    if self._where.get(bytes(h), (None,))[0] == old_id:
                        del self._where[bytes(h)]

    def units_before(self, h: bytes, block_size: int, unit: int) -> tuple[int, tuple[BlockHash, ...]] | None:
        """(position of ``h``, the unit hashes from its block's start to it), or None."""
        with self._lock:
            where = self._where.get(bytes(h))
            if where is None:
                return None
            chain = self._chains[where[0]]
        end = where[1] + 1
        pos = end * unit
        start = (pos - 1) // block_size * block_size // unit
        return pos, chain[start:end]
