"""What one vLLM engine's cache entries let the index claim (``kv_events.py``
feeds it): ``ClaimTier``, one per medium (the engine's cache, the store).

**A unit is claimed** while at least one live entry of every attention group
covers it (reference counts); **a state at H is claimed** while every group
of the model (each Mamba group and each attention group) has a live entry at
H: vLLM's hybrid lookup needs all groups to hit at exactly that length.
Removing any one of them withdraws the claim (a REMOVED event), so the index
never claims a state whose attention entry or any Mamba group's block was
evicted. A claimed unit is held, not always reachable: vLLM's lookup enters
a block through an entry on the prompt's own chain, so a prompt that leaves
a cached block inside it has units claimed that vLLM does not hit for it;
every hit the index promises rests on a state, i.e. on an entry of every
group at exactly that position, which vLLM does hit.

Changes are settled per batch of vLLM events (a batch carries all groups'
events of one step), and only the net transitions are published.

Store entries have no removal events (Mooncake evicts silently): the index
bounds them with its TTL, and a store tier forgets its oldest entries past
:data:`MAX_STORE_ENTRIES` without publishing anything.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.hashing import BlockHash

#: the group kinds vLLM's KV-cache events name
ATTENTION = "full_attention"
MAMBA = "mamba"
#: store entries remembered to combine the groups of one state (no removals ever arrive)
MAX_STORE_ENTRIES = 1 << 18


@dataclass
class ClaimTier:
    """The entries of one medium (the engine's cache, or the store) and what of
    them is claimed; ``settle`` turns the changes since the last call into events."""

    store: bool
    entries: dict[int, set[bytes]] = field(default_factory=dict)
    covers: dict[tuple[int, bytes], tuple[BlockHash, ...]] = field(default_factory=dict)
    unit_refs: dict[int, Counter[bytes]] = field(default_factory=dict)
    claimed_units: set[bytes] = field(default_factory=set)
    claimed_states: set[bytes] = field(default_factory=set)
    touched_units: set[bytes] = field(default_factory=set)
    touched_states: set[bytes] = field(default_factory=set)
    order: OrderedDict[tuple[int, bytes], None] = field(default_factory=OrderedDict)

    def add(self, group: int, h: bytes, units: Sequence[BlockHash] | None) -> None:
        entries = self.entries.setdefault(group, set())
        if h in entries:
            return
        entries.add(h)
        self.touched_states.add(h)
        if units is not None:
            self.covers[(group, h)] = tuple(units)
            refs = self.unit_refs.setdefault(group, Counter())
            for u in units:
                refs[bytes(u)] += 1
                self.touched_units.add(bytes(u))
        if self.store:
            self.order[(group, h)] = None
            while len(self.order) > MAX_STORE_ENTRIES:
                self.forget(*self.order.popitem(last=False)[0])

    def remove(self, group: int, h: bytes) -> None:
        entries = self.entries.get(group)
        if entries is None or h not in entries:
            return
        entries.discard(h)
        self.touched_states.add(h)
        units = self.covers.pop((group, h), ())
        refs = self.unit_refs.get(group)
        for u in units:
            if refs is not None:
                refs[bytes(u)] -= 1
                if refs[bytes(u)] <= 0:
                    del refs[bytes(u)]
            self.touched_units.add(bytes(u))

    def forget(self, group: int, h: bytes) -> None:
        """Drop a store entry from memory only: its index keys live out their TTL."""
        self.entries.get(group, set()).discard(h)
        units = self.covers.pop((group, h), ())
        refs = self.unit_refs.get(group)
        for u in units:
            if refs is not None and refs[bytes(u)] > 0:
                refs[bytes(u)] -= 1
                if refs[bytes(u)] <= 0:
                    del refs[bytes(u)]
        self.claimed_states.discard(h)

    def clear(self) -> None:
        self.entries.clear()
        self.covers.clear()
        self.unit_refs.clear()
        self.claimed_units.clear()
        self.claimed_states.clear()
        self.touched_units.clear()
        self.touched_states.clear()
        self.order.clear()

    def settle(self, kinds: Mapping[int, str]) -> list[CacheEvent]:
        """The net transitions since the last settle, as events (removals first)."""
        attention = [g for g, k in kinds.items() if k == ATTENTION]
        mamba = [g for g, k in kinds.items() if k == MAMBA]
        gone_units: list[BlockHash] = []
        new_units: list[BlockHash] = []
        gone_states: list[BlockHash] = []
        new_states: list[BlockHash] = []
        no_refs: Counter[bytes] = Counter()
        for u in self.touched_units:
            now = bool(attention) and all(self.unit_refs.get(g, no_refs)[u] > 0 for g in attention)
            if now and u not in self.claimed_units:
                self.claimed_units.add(u)
                new_units.append(BlockHash(u))
            elif not now and u in self.claimed_units:
                self.claimed_units.discard(u)
                gone_units.append(BlockHash(u))
        for h in self.touched_states:
            now = bool(mamba) and all(h in self.entries.get(g, ()) for g in kinds)
            if now and h not in self.claimed_states:
                self.claimed_states.add(h)
                new_states.append(BlockHash(h))
            elif not now and h in self.claimed_states:
                self.claimed_states.discard(h)
                gone_states.append(BlockHash(h))
        self.touched_units.clear()
        self.touched_states.clear()
        out = []
        for kind, group, hashes in (
            (CacheEventKind.REMOVED, CacheGroup.STATE, gone_states),
            (CacheEventKind.REMOVED, CacheGroup.KV, gone_units),
            (CacheEventKind.STORED, CacheGroup.KV, new_units),
            (CacheEventKind.STORED, CacheGroup.STATE, new_states),
        ):
            if hashes and not (self.store and kind is CacheEventKind.REMOVED):
                out.append(CacheEvent(kind, group, tuple(sorted(hashes)), store=self.store))
        return out
