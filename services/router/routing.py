"""Routing policy: pick the prefill instance that finishes this prompt first.

For instance ``i``, with ``N`` prompt tokens, ``L_i`` its local hit, ``S`` the
store hit and ``Q_i`` the work already queued or running on it::

    hit_i  = max(L_i, S)                       # it loads S from the store if S > L_i
    cost_i = (N - hit_i)                       # tokens it must compute
           + STORE_LOAD_COST * max(S - L_i, 0) # loading is cheaper than computing, not free
           + Q_i                               # work ahead of us in its queue

The lowest cost wins; ties go to the instance with the least queued work,
then by name. When the index is unavailable, ``L_i = S = 0`` for all: the
policy routes on load alone (counted as decision ``index_unavailable``).

**Queued work** ``Q_i`` is the router's own count over the prefills it
dispatched to ``i`` and that have not returned, each counted as the work it
puts there (:func:`dispatch_work`): the tokens it must compute, ``N_j -
hit_j``, plus ``STORE_LOAD_COST`` per token it loads from the store. Not its
prompt length: an instance running a 6,000-token prompt with a 5,800-token
hit is 200 tokens busy, and counting 6,000 would send the next request of a
stream away from the instance that holds its prefix.

**Publication lag.** A hit must not be lost because the index has not heard
of it yet. Two mechanisms:

1. the prefill actor publishes its local cache entries (KV blocks and the
   state checkpoint this prefill left) in the index *before* its ``prefill``
   call returns, so every request the router dispatches after a prefill
   finished sees that prefill's prefix in the index (native engine; store
   checkpoints follow once their put succeeded, vLLM's state checkpoints
   once its KV events arrive);
2. the router remembers, per instance, the checkpoint each of its own
   finished prefills should have left there (:class:`RecentPrefills`: the
   chain hash at the checkpoint, bounded, expiring after ``ttl_s``) and counts
   it as that instance's local hit when the index does not report it (yet):
   ``L_i = max(index hit, recent hit)``. This covers the asynchronous
   publishers (vLLM KV events). It is a hint, never the source of truth: an
   entry the index confirms is dropped, and another router, which does not
   have it, routes on the index alone (tests: two routers reach the same hit
   rate as one).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from hybridpd.checkpoints import checkpoint_position, is_checkpoint_valid

STORE_LOAD_COST = 0.1


#: why a request went where it went (the ``hybridpd_routing_decisions_total`` label):
#: by the index (local_hit, store_hit, miss), without it (index_unavailable), pinned by
#: the client (forced), prefix caching off (round_robin), or a second try after a failure (retry)
RouteKind = Literal["local_hit", "store_hit", "miss", "index_unavailable", "forced", "round_robin", "retry"]


@dataclass(frozen=True, slots=True)
class RouteDecision:
    instance: str
    expected_hit: int
    store_hit: int
    local_hit: int
    kind: RouteKind


def dispatch_work(num_tokens: int, decision: RouteDecision) -> float:
    """The work a prefill dispatched on ``decision`` queues on its instance:
    tokens to compute plus ``STORE_LOAD_COST`` per token loaded from the store."""
    loaded = decision.store_hit if decision.store_hit > decision.local_hit else 0
    return (num_tokens - decision.expected_hit) + STORE_LOAD_COST * loaded


def choose(
    num_tokens: int,
    instances: list[str],
    local_hits: Mapping[str, int],
    store_hit: int,
    queued: Mapping[str, float],
    index_ok: bool = True,
    spread: bytes = b"",
) -> RouteDecision:
    """The lowest-cost instance; ``queued`` maps instance -> queued work (:func:`dispatch_work`).

    Ties (equal cost and queue) go by rendezvous hashing of ``spread`` (the router
    passes the prompt's first chain hash) with each name: routers that share the
    instances but not their queues (each knows only its own prefills in flight)
    then spread cold prompts over the instances the same way instead of all
    picking the first name, and prompts that start alike still meet on one
    instance. Without ``spread``, ties go by name."""
    if not instances:
        raise ValueError("no prefill instances")

    def tiebreak(name: str) -> bytes:
        if not spread:
            return name.encode()
        return hashlib.blake2b(spread + name.encode(), digest_size=8).digest()

    def cost(name: str) -> tuple[float, float, bytes, str]:
        local = local_hits.get(name, 0)
        hit = max(local, store_hit)
        c = (num_tokens - hit) + STORE_LOAD_COST * max(store_hit - local, 0) + queued.get(name, 0)
        return (c, queued.get(name, 0), tiebreak(name), name)

    best = min(instances, key=cost)
    local = local_hits.get(best, 0)
    kind: RouteKind
    if not index_ok:
        kind = "index_unavailable"
    elif local > 0 and local >= store_hit:
        kind = "local_hit"
    elif store_hit > 0:
        kind = "store_hit"
    else:
        kind = "miss"
    return RouteDecision(best, max(local, store_hit), store_hit, local, kind)


#: why a decode instance was chosen (``hybridpd_decode_routing_decisions_total``)
DecodeKind = Literal["affinity", "overloaded", "round_robin"]


def choose_decode(
    names: Sequence[str], held: Mapping[str, int], active: Mapping[str, int], slack: int, turn: int
) -> tuple[str, DecodeKind]:
    """The decode instance for a request: the one holding the most leading blocks
    of its prompt (``held``: the previous turns of its conversation, so its
    handoff moves only the new blocks), unless it decodes ``slack`` or more
    requests beyond the least busy (``active``); then the least busy. With no
    holder, round robin (``turn``). Ties: fewer active requests, then name."""
    if not names:
        raise ValueError("no decode instances")
    best = max(names, key=lambda n: (held.get(n, 0), -active.get(n, 0), n))
    if held.get(best, 0) <= 0:
        return names[turn % len(names)], "round_robin"
    least = min(names, key=lambda n: (active.get(n, 0), n))
    if active.get(best, 0) >= active.get(least, 0) + slack and best != least:
        return least, "overloaded"
    return best, "affinity"


class RecentPrefills:
    """Checkpoints this router's finished prefills left on their instances,
    until the index reports them (or ``ttl_s`` passes): a best-effort hint.

    A prefill of ``N`` tokens leaves state at the positions ``p`` its engine
    reports it wrote (``PrefillResult.tail_checkpoint``, ``extra_checkpoints``;
    unreported, at ``checkpoint_position(N)`` when the kernel can write it
    there from its hit, ``is_checkpoint_valid``), and KV for every full block. A later prompt
    sharing the chain up to block ``p/u`` (one block more under EAGLE, whose
    hit replays it) hits ``p`` there; the entry is keyed by that block's chain
    hash, which names the whole prefix. Thread-safe.
    """

    def __init__(
        self,
        unit: int,
        mamba_block_size: int,
        alignment: int | None,
        eagle: bool,
        ttl_s: float = 20.0,
        max_entries: int = 4096,
    ) -> None:
        self.unit, self.block, self.alignment, self.eagle = unit, mamba_block_size, alignment, eagle
        self.ttl_s, self.max_entries = ttl_s, max_entries
        # (chain hash of the last block the hit needs, instance) -> (block index, expiry)
        self._entries: OrderedDict[tuple[bytes, str], tuple[int, float]] = OrderedDict()
        self._by_block: dict[int, dict[bytes, set[str]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def record(
        self, instance: str, hashes: Sequence[bytes], num_tokens: int, start: int, position: int | None = None
    ) -> int:
        """Remember what a prefill of ``num_tokens`` (``hashes`` its chain) that
        computed from ``start`` left on ``instance``: the tail checkpoint at
        ``position`` as its engine reported it (``RequestOutput.checkpoints``: a vLLM
        P/D prefill computes N - 1 tokens, so its tail may lie a unit lower), or,
        unreported, where the native rule puts it. Returns the position (0: none)."""
        if position is None:
            position = checkpoint_position(num_tokens, self.unit, self.eagle)
            if position > 0 and not is_checkpoint_valid(
                start, num_tokens, position, self.unit, self.block, self.alignment
            ):
                return 0
        pos = position
        if pos <= 0 or pos % self.unit:
            return 0
        k = pos // self.unit + (1 if self.eagle else 0) - 1  # the last block the hit needs
        if k >= len(hashes):
            return 0
        key = (hashes[k], instance)
        with self._lock:
            self._drop(key)
            self._entries[key] = (k, time.monotonic() + self.ttl_s)
            self._by_block.setdefault(k, {}).setdefault(hashes[k], set()).add(instance)
            while len(self._entries) > self.max_entries:
                self._drop(next(iter(self._entries)))
        return pos

    def hits(self, hashes: Sequence[bytes], num_tokens: int) -> dict[str, int]:
        """Per instance, the deepest remembered hit for a prompt of ``num_tokens``
        with chain ``hashes`` (under the same rule as the index lookup)."""
        if not self._entries:
            return {}
        top = min(len(hashes), (num_tokens - 1) // self.unit)  # blocks a hit may use (one token is computed)
        out: dict[str, int] = {}
        now = time.monotonic()
        with self._lock:
            for k, by_hash in self._by_block.items():
                if k >= top:
                    continue
                for inst in by_hash.get(hashes[k], ()):
                    if self._entries[(hashes[k], inst)][1] < now:
                        continue
                    pos = (k + 1 - (1 if self.eagle else 0)) * self.unit
                    if pos > out.get(inst, 0):
                        out[inst] = pos
        return out

    def merge(self, hashes: Sequence[bytes], num_tokens: int, index_hits: Mapping[str, int]) -> dict[str, int]:
        """``max(index hit, remembered hit)`` per instance; drops what the index
        already reports (confirmed) and what expired."""
        recent = self.hits(hashes, num_tokens)
        merged = dict(index_hits)
        for inst, pos in recent.items():
            if index_hits.get(inst, 0) >= pos:
                self.forget(hashes[pos // self.unit + (1 if self.eagle else 0) - 1], inst)
            else:
                merged[inst] = pos
        if len(self._entries) and next(iter(self._entries.values()))[1] < time.monotonic():
            self._expire()
        return merged

    def forget(self, h: bytes, instance: str) -> None:
        with self._lock:
            self._drop((h, instance))

    def forget_instance(self, instance: str) -> None:
        """The instance lost its cache (restarted, failed): nothing there to hit."""
        with self._lock:
            for key in [key for key in self._entries if key[1] == instance]:
                self._drop(key)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            # entries are in insertion order and share one TTL: the oldest expire first
            while self._entries and next(iter(self._entries.values()))[1] < now:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[bytes, str]) -> None:  # under the lock
        got = self._entries.pop(key, None)
        if got is None:
            return
        by_hash = self._by_block[got[0]]
        insts = by_hash[key[0]]
        insts.discard(key[1])
        if not insts:
            del by_hash[key[0]]
            if not by_hash:
                del self._by_block[got[0]]


class SeenPrefixes:
    """How far this router has sent a prompt's prefix before (for the
    ``evicted`` share of ``hybridpd_prefix_tokens_total``): a bounded set of the
    chain hashes of every full block it routed, oldest dropped first.

    A chain hash names its whole prefix, so while nothing was dropped,
    membership is monotone along a prompt's chain: :meth:`observe` finds the
    seen run by bisection (``O(log n)`` probes), then adds only the blocks
    past it. A chain whose head was dropped counts 0 and is added again whole.
    Once entries are dropped (past ``max_entries`` blocks: 2M tokens at
    u=16 by default) the count is approximate (a diagnostic, like the metric it
    feeds). Thread-safe.
    """

    def __init__(self, max_entries: int = 1 << 17) -> None:
        self.max_entries = max_entries
        self._hashes: dict[bytes, None] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._hashes)

    def observe(self, hashes: Sequence[bytes]) -> int:
        """The number of leading blocks of ``hashes`` seen before; then remember them all."""
        with self._lock:
            known = self._hashes
            lo, hi = 0, len(hashes)  # known[h] for h in hashes[:lo]; not for hashes[hi:]
            if hashes and hashes[0] not in known:
                hi = 0  # a new prefix, or its head was dropped: added again whole, head first
                for h in hashes:
                    known.pop(h, None)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid - 1] in known:
                    lo = mid
                else:
                    hi = mid - 1
            for h in hashes[lo:]:
                known[h] = None
            excess = len(known) - self.max_entries
            if excess > 0:
                for h in list(itertools.islice(known, excess)):
                    del known[h]
            return lo
