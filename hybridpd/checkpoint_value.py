"""The value of a state checkpoint: what a full cache keeps and what it evicts.

Tensor-free; used by the native engine's checkpoint slots (``StateCache``)
and by the prefill worker's ledger of the state objects it put in
MooncakeStore (``services/prefill/publisher.py``). docs/DESIGN.md, "Checkpoint
value and eviction", gives the reasoning and the comparison with Marconi and
LRU. For a checkpoint at position ``p`` holding ``bytes`` bytes, in a cache
with a budget of ``budget`` bytes::

    value = (1 + hits) * F(p) / bytes * 2 ** -(age_s / half_life_s + age_w)

    F(p)   = linear * p + quadratic * p**2   FLOPs a hit at p saves: the prefill
                                             of [0, p) (``ComputeModel``)
    hits   = restores of the checkpoint so far (a local admission reading its
             slot; for store objects, prefills anywhere that hit the prefix at p)
    age_s  = seconds since its last use (its creation or its last hit)
    age_w  = bytes the cache wrote since that use / budget: cache turnovers

Contract:

* ``value >= 0``; it grows with ``hits`` and ``p`` (at equal bytes) and falls
  with ``bytes`` and either age. It halves after ``half_life_s`` seconds or
  after one turnover (the cache writing its budget's worth of checkpoints)
  without a use, whichever comes first, and exponents add.
* The decay is a factor common to every checkpoint of a cache at a given
  moment (both clocks are shared), so the ORDER of two checkpoints never
  changes while neither is used: :func:`value_rank` (the log2 of the value at
  clock 0) orders like :func:`checkpoint_value` at any moment, and stays fixed
  between uses. Eviction takes the lowest rank; ties go to the checkpoint first
  in the caller's order (the oldest, for both users).
* A checkpoint reused ``n`` times outlives an unused one of the same size and
  position by ``log2(1 + n)`` half-lives after its last use.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from hybridpd.hashing import BlockHash


class HybridShape(Protocol):
    """The model shape ``ComputeModel.of`` reads (``HybridModelConfig`` has it)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def layer_types(self) -> tuple[str, ...]: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def delta_heads(self) -> int: ...
    @property
    def delta_key_dim(self) -> int: ...
    @property
    def delta_value_dim(self) -> int: ...
    @property
    def conv_kernel(self) -> int: ...
    @property
    def conv_dim(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """Prefill FLOPs of a prefix of ``L`` tokens: ``linear * L + quadratic * L**2``."""

    #: per token: every layer's weight matmuls and the delta layers' recurrence
    linear: float
    #: per token pair: the attention layers' QK^T and AV over the causal triangle
    quadratic: float = 0.0

    def __post_init__(self) -> None:
        if self.linear <= 0 or self.quadratic < 0:
            raise ValueError("need linear > 0 and quadratic >= 0, got %s, %s" % (self.linear, self.quadratic))

    def prefix_flops(self, length: int) -> float:
        n = max(length, 0)
        return self.linear * n + self.quadratic * n * n

    @classmethod
    def of(cls, m: HybridShape) -> ComputeModel:
        """The FLOPs (2 per multiply-add) of the native hybrid decoder (layout:
        ``engine/native/weights.py``). Per token: each layer's SwiGLU MLP
        ``6 H I``; an attention layer's QKV and output projections; a delta
        layer's input projection (conv channels, gates, values), causal conv,
        output projection and recurrence (about 3 multiply-adds per state
        element: decay and update, delta correction, read-out). Per token pair
        ``(i, j), j <= i``, an attention layer's ``4 n_heads head_dim`` (QK^T and
        AV): ``2 n_heads head_dim L**2`` over a prefix of L."""
        h = m.hidden_size
        linear = 0.0
        quadratic = 0.0
        for kind in m.layer_types:
            linear += 6.0 * h * m.intermediate_size
            if kind == "A":
                q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
                linear += 2.0 * h * (q + 2 * kv) + 2.0 * q * h
                quadratic += 2.0 * q
            else:
                dh, dk, dv = m.delta_heads, m.delta_key_dim, m.delta_value_dim
                n_in = m.conv_dim + dh * (dk + 1 + dv)
                linear += 2.0 * h * n_in + 2.0 * dh * dv * h + 2.0 * m.conv_dim * m.conv_kernel
                linear += 6.0 * dh * dk * dv
        return cls(linear, quadratic)


#: for callers that know no model shape: saved compute proportional to the prefix length
LINEAR_ONLY = ComputeModel(1.0, 0.0)


def checkpoint_value(
    position: int,
    nbytes: int,
    hits: int,
    age_s: float,
    half_life_s: float,
    compute: ComputeModel,
    age_turnovers: float = 0.0,
) -> float:
    """Saved FLOPs per byte, times ``1 + hits``, halved every ``half_life_s``
    seconds and every cache turnover since the last use."""
    _check(nbytes, half_life_s)
    decay = max(age_s, 0.0) / half_life_s + max(age_turnovers, 0.0)
    return (1 + max(hits, 0)) * compute.prefix_flops(position) / nbytes * 2.0**-decay


def value_rank(
    position: int,
    nbytes: int,
    hits: int,
    last_use_s: float,
    half_life_s: float,
    compute: ComputeModel,
    last_use_turnovers: float = 0.0,
) -> float:
    """``log2`` of the value at clock 0 (``last_use_s`` in seconds and
    ``last_use_turnovers``, the cache's bytes written at that use / its budget,
    on clocks shared by the cache): orders checkpoints like
    :func:`checkpoint_value` at any common moment, and never overflows.
    ``-inf`` for a checkpoint that saves nothing (position 0)."""
    _check(nbytes, half_life_s)
    flops = compute.prefix_flops(position)
    if flops <= 0:
        return -math.inf
    return math.log2(1 + max(hits, 0)) + math.log2(flops / nbytes) + last_use_s / half_life_s + last_use_turnovers


def _check(nbytes: int, half_life_s: float) -> None:
    if nbytes <= 0 or half_life_s <= 0:
        raise ValueError("need nbytes > 0 and half_life_s > 0, got %s, %s" % (nbytes, half_life_s))


class ShareFull(ValueError):
    """A speculative object does not fit the speculative share (:meth:`ValueLedger.victims`)."""


@dataclass(slots=True)
class LedgerEntry:
    nbytes: int
    position: int
    last_use: float  # seconds, the caller's clock
    last_written: int  # the ledger's bytes written at that use
    hits: int = 0
    speculative: bool = False  # a placed checkpoint no prefill reused yet


class ValueLedger:
    """Objects one owner holds against a byte budget, evicted by value.

    Bookkeeping only (the caller removes the objects ``victims`` names, then
    calls ``remove``); one thread at a time. ``now`` and ``last_use`` are on
    the caller's clock (the publisher: wall-clock seconds, since hits arrive
    from other machines); the turnover clock is ``written``, the bytes
    ``add`` recorded. Speculative objects (placed checkpoints no prefill reused
    yet) hold at most ``speculative_share`` of the budget: past it the least
    valuable of them go first."""

    def __init__(
        self, budget_bytes: int, half_life_s: float, compute: ComputeModel, speculative_share: float = 1.0
    ) -> None:
        if budget_bytes <= 0 or half_life_s <= 0 or not 0 < speculative_share <= 1:
            raise ValueError("need budget_bytes > 0, half_life_s > 0 and 0 < speculative_share <= 1")
        self.budget_bytes = budget_bytes
        self.speculative_budget = int(speculative_share * budget_bytes)
        self.half_life_s = half_life_s
        self.compute = compute
        self.entries: dict[BlockHash, LedgerEntry] = {}  # insertion order: oldest first
        self.nbytes = 0  # held now
        self.written = 0  # ever added (re-puts included): the turnover clock

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    @property
    def tokens(self) -> int:
        """Prompt tokens the held checkpoints restore (each counted at its position)."""
        return sum(e.position for e in self.entries.values())

    @property
    def speculative_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.speculative)

    def add(self, key: BlockHash, nbytes: int, position: int, now: float, speculative: bool = False) -> None:
        """Record an object put now (a re-put of a held key refreshes its last use;
        it stays speculative only if both puts are)."""
        old = self.entries.get(key)
        if old is not None:
            self.nbytes += nbytes - old.nbytes
            old.nbytes, old.position = nbytes, position
            old.speculative = old.speculative and speculative
            self._used(old, now)
        else:
            self.entries[key] = LedgerEntry(nbytes, position, now, self.written, speculative=speculative)
            self.nbytes += nbytes
        self.written += nbytes

    def hit(self, key: BlockHash, now: float) -> None:
        """One reuse of ``key`` now (ignored when not held)."""
        e = self.entries.get(key)
        if e is not None:
            e.hits += 1
            e.speculative = False
            self._used(e, now)

    def observe(self, key: BlockHash, hits: int, last_hit: float) -> None:
        """Merge a reuse count seen elsewhere (the index; it includes ours): counts
        only grow, and a count that grew is a use at ``last_hit``, now on the
        turnover clock."""
        e = self.entries.get(key)
        if e is not None and hits > e.hits:
            e.hits = hits
            e.speculative = False
            self._used(e, last_hit)

    def _used(self, e: LedgerEntry, now: float) -> None:
        e.last_use = max(e.last_use, now)
        e.last_written = self.written

    def value(self, key: BlockHash, now: float) -> float:
        e = self.entries[key]
        turns = (self.written - e.last_written) / self.budget_bytes
        return checkpoint_value(e.position, e.nbytes, e.hits, now - e.last_use, self.half_life_s, self.compute, turns)

    def rank(self, key: BlockHash) -> float:
        e = self.entries[key]
        turns = e.last_written / self.budget_bytes
        return value_rank(e.position, e.nbytes, e.hits, e.last_use, self.half_life_s, self.compute, turns)

    def fits(self, need: int, speculative: bool = False) -> bool:
        """Whether ``need`` more bytes (``speculative`` ones: also within their share) fit."""
        if self.nbytes + need > self.budget_bytes:
            return False
        return not speculative or self.speculative_bytes + need <= self.speculative_budget

    def victims(self, need: int = 0, keep: Collection[BlockHash] = (), speculative: bool = False) -> list[BlockHash]:
        """The least valuable held keys (lowest first, never one in ``keep``) whose
        removal brings the bytes held plus ``need`` within the budget; for a
        ``speculative`` put first the least valuable speculative keys, until the
        speculative bytes plus ``need`` fit their share. ValueError if no removal
        can (``need`` exceeds what the budget, or the share, leaves beside ``keep``)."""
        out: list[BlockHash] = []
        order = sorted((k for k in self.entries if k not in keep), key=self.rank)  # stable: oldest first on ties
        if speculative:
            over = self.speculative_bytes + need - self.speculative_budget
            for key in (k for k in order if self.entries[k].speculative):
                if over <= 0:
                    break
                out.append(key)
                over -= self.entries[key].nbytes
            if over > 0:
                raise ShareFull("%d bytes do not fit a speculative share of %d bytes" % (need, self.speculative_budget))
        excess = self.nbytes - sum(self.entries[k].nbytes for k in out) + need - self.budget_bytes
        for key in (k for k in order if k not in out):
            if excess <= 0:
                return out
            out.append(key)
            excess -= self.entries[key].nbytes
        if excess <= 0:
            return out
        raise ValueError("%d bytes do not fit a budget of %d bytes" % (need, self.budget_bytes))

    def remove(self, keys: Iterable[BlockHash]) -> None:
        for key in keys:
            e = self.entries.pop(key, None)
            if e is not None:
                self.nbytes -= e.nbytes
