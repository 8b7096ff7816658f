"""Checkpoint placement: extra state checkpoints along a prompt, chosen by value.

Tensor-free; the router places (``services/router/prefill_checkpoints.py``), the native
engine snapshots (``EngineRequest.placement``), ``bench/placement.py`` replays.
docs/DESIGN.md, "Checkpoint placement", gives the reasoning.

A prompt's tail, junction and message-boundary checkpoints serve the requests
that share ALL of it, or a prefix the index already saw diverge. The *second*
request to share a prefix of a prompt diverges somewhere nobody has seen yet:
it finds no state unless the first prefill left one not far before that point.
Placement leaves ``count`` more checkpoints, where they are expected to save
the most prefill compute:

    E[saved] = sum over divergence depths D of  P(D) * F(best(D))

    D        the prefix length a future request shares with this prompt, less
             EAGLE's replayed unit (the deepest state it could restore)
    best(D)  the deepest checkpoint at or below D (the hit, the tail, the
             requested positions and the placed ones; 0 if none)
    F(p)     the FLOPs a hit at p saves (``checkpoint_value.ComputeModel``)

At a fixed count this is the saved compute per state byte. ``P(D)`` comes from what the router saw:
the suffix lengths ``q = N' - known'`` of earlier prompts (``known'``: how far
their KV was cached anywhere, i.e. where they left every known prefix), as
``D = N - q``, mixed with a scale-free prior (``q`` log-uniform on
``[unit, N]``) that dominates while few were seen (``divergence.DivergenceHistory``).

:func:`value_positions` solves the choice exactly (the dynamic program of
Sparse Prefix Caching, arXiv 2605.05219, over the candidate positions);
:func:`geometric_positions` is the simple rule it is compared with (the tail
less ``2u, 4u, 8u, ...``: dense near the tail, where chat, RAG and agent
prompts diverge); :func:`interval_positions` is vLLM's fixed retention
interval. The candidates are the positions the engine can write past the hit
(``checkpoints.is_extra_checkpoint_valid``, the alignment), below the tail.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from hybridpd.checkpoint_value import LINEAR_ONLY, ComputeModel
from hybridpd.checkpoints import checkpoint_position, is_extra_checkpoint_valid, planned_checkpoint
from hybridpd.divergence import DivergenceHistory

#: placement policies (``checkpoint_placement``)
PLACEMENTS = ("value", "geometric", "interval", "off")
#: the most candidate positions the dynamic program weighs (a longer prompt's are thinned evenly)
MAX_CANDIDATES = 192
#: the most placed checkpoints one prefill writes
MAX_PLACED = 8


def candidates(
    hit: int, num_tokens: int, unit: int, mamba_block_size: int, alignment: int | None, drop_eagle_block: bool
) -> range:
    """The positions a prefill of ``[hit, num_tokens)`` can write an extra
    checkpoint at, ascending: unit multiples, ``hit + k * a``, valid extras
    (``is_extra_checkpoint_valid``), below the tail (``checkpoint_position``).
    Every condition but the slot-column rule is the same for every such
    position, and that one holds from some position on: a range, O(1).

    >>> candidates(0, 100, 16, 16, 16, False)
    range(16, 96, 16)
    """
    tail = checkpoint_position(num_tokens, unit, drop_eagle_block)
    if alignment is None:
        return range(0)
    step = alignment * unit // math.gcd(alignment, unit)
    first = hit + step
    while first < tail and not is_extra_checkpoint_valid(hit, num_tokens, first, unit, mamba_block_size, alignment):
        if hit % unit or first - hit > mamba_block_size + step:  # a position-independent rule fails
            return range(0)
        first += step
    return range(first, tail, step)


def thinned(cands: Sequence[int], limit: int = MAX_CANDIDATES) -> list[int]:
    """At most ``limit`` of ``cands`` (ascending) for the dynamic program: the
    deepest ``limit // 2`` all kept (where prompts diverge most often, at their
    last message), the rest evenly spaced.

    >>> thinned(range(16, 16 * 11, 16), 6)
    [16, 48, 80, 128, 144, 160]
    """
    if len(cands) <= limit:
        return list(cands)
    dense = limit // 2
    head = cands[: len(cands) - dense]
    stride = len(head) / (limit - dense)
    return [head[int(i * stride)] for i in range(limit - dense)] + list(cands[len(cands) - dense :])


def value_positions(
    cands: Sequence[int],
    fixed: Iterable[int],
    count: int,
    cdf: Callable[[np.ndarray], np.ndarray],
    compute: ComputeModel = LINEAR_ONLY,
    min_gain: float = 0.0,
) -> tuple[int, ...]:
    """The at most ``count`` positions of ``cands`` that maximise the expected
    saved FLOPs, given the checkpoints in ``fixed`` (the hit, the tail,
    requested ones) and ``cdf`` (``P(D < x)`` for an array of positions).

    How many: the most ``k <= count`` such that each of the first ``k``
    optimal placements adds at least ``min_gain`` expected FLOPs to the one
    before (``E*(k) - E*(k-1) >= min_gain``, stopping at the first that does
    not): a state is written only where it is expected to pay for itself.

    Exact: a dynamic program over the sorted points ``p_0 < ... < p_m-1``
    (candidates and fixed): every fixed point is chosen; a chosen point saves
    ``F(p_i) * P(p_i <= D < p_next)`` up to the next chosen one (the highest:
    to infinity); below the lowest nothing is saved. ``best[k, i]``: the most
    the chosen points below ``p_i`` save when ``p_i`` is chosen and ``k``
    candidates are chosen up to it. ``O(count * m**2)`` in numpy rows.

    One placement over ``D`` in ``[32, 48)`` (0.9) or beyond (0.1): 32 saves
    ``32 * 1.0``, 48 only ``48 * 0.1``:

    >>> cdf = lambda xs: np.interp(xs, [0, 32, 48, 64], [0, 0, 0.9, 0.9])
    >>> value_positions([16, 32, 48], [0], 1, cdf)
    (32,)
    """
    fx = set(fixed) - set(cands)
    points = sorted({*cands, *fx})
    if count <= 0 or not cands:
        return ()
    m = len(points)
    xs = np.asarray(points, dtype=np.float64)
    c = np.append(np.asarray(cdf(xs), dtype=np.float64), 1.0)  # c[m] = P(D < infinity)
    f = np.array([compute.prefix_flops(p) for p in points])
    is_fixed = [p in fx for p in points]
    fixed_idx = [i for i in range(m) if is_fixed[i]]
    lowest_fixed = fixed_idx[0] if fixed_idx else m
    best = np.full((count + 1, m), -np.inf)
    back = np.full((count + 1, m), -1, dtype=np.int64)
    prev_fixed = -1
    for i in range(m):
        k0 = 0 if is_fixed[i] else 1
        if i <= lowest_fixed:  # p_i may be the lowest chosen point
            best[k0, i] = 0.0
        lo = max(prev_fixed, 0)  # the previous chosen point: no fixed point skipped
        if i > lo:
            gain = f[lo:i] * (c[i] - c[lo:i])
            for k in range(k0, count + 1):
                row = best[k - k0, lo:i] + gain
                j = int(np.argmax(row))
                if row[j] > best[k, i]:
                    best[k, i], back[k, i] = row[j], lo + j
        if is_fixed[i]:
            prev_fixed = i
    total = best + (f * (1.0 - c[:m]))[None, :]
    if fixed_idx:
        total[:, : fixed_idx[-1]] = -np.inf  # the highest chosen point lies at or above every fixed one
    rows = total.max(axis=1)
    if not fixed_idx:  # no fixed point: placing none saves nothing (row 0 has no path)
        rows[0] = 0.0
    opt = np.maximum.accumulate(rows)  # E*(k): the most k or fewer placements save
    k = 0
    while k < count and opt[k + 1] - opt[k] > 1e-9 * abs(opt[k + 1]) and opt[k + 1] - opt[k] >= min_gain:
        k += 1
    if k == 0:
        return ()
    i = int(np.argmax(total[k]))
    chosen: list[int] = []
    while i >= 0:
        if not is_fixed[i]:
            chosen.append(points[i])
        k, i = k - (0 if is_fixed[i] else 1), int(back[k, i])
    return tuple(sorted(chosen))


def geometric_positions(cands: Sequence[int], tail: int, count: int, unit: int) -> tuple[int, ...]:
    """The simple rule: for ``k = 1..count`` the deepest candidate at or below
    ``tail - 2**k * unit`` (distinct).

    >>> geometric_positions(list(range(16, 400, 16)), 400, 3, 16)
    (272, 336, 368)
    """
    out: set[int] = set()
    for k in range(1, count + 1):
        i = bisect.bisect_right(cands, tail - (2**k) * unit) - 1
        if i >= 0:
            out.add(cands[i])
    return tuple(sorted(out))


def interval_positions(cands: Sequence[int], interval: int) -> tuple[int, ...]:
    """vLLM-style: every candidate that is a multiple of ``interval``.

    >>> interval_positions(list(range(16, 200, 16)), 64)
    (64, 128, 192)
    """
    return tuple(p for p in cands if interval > 0 and p % interval == 0)


@dataclass(frozen=True, slots=True)
class PlacementAsk:
    """One placement question (``place``): a prefill of ``[hit, num_tokens)`` under
    ``policy`` that writes the checkpoints in ``fixed`` anyway, at most ``count``
    placed, on the engine's checkpoint geometry (``unit``, ``mamba_block_size``,
    ``alignment``, ``drop_eagle_block``); the rest tune ``value`` and ``interval``."""

    policy: str
    num_tokens: int
    hit: int
    fixed: tuple[int, ...]
    count: int
    unit: int
    mamba_block_size: int
    alignment: int | None
    drop_eagle_block: bool
    history: DivergenceHistory | None = None
    compute: ComputeModel = LINEAR_ONLY
    interval: int = 0
    min_gain: float = 0.0
    step_tokens: int = 0
    known: int = 0
    staged: bool = False


def place(ask: PlacementAsk) -> tuple[int, ...]:
    """The positions ``ask.policy`` (:data:`PLACEMENTS`) places for a prefill of
    ``[hit, num_tokens)`` that writes the checkpoints in ``fixed`` anyway
    (requested ones; the hit and the tail are added here), ascending, at most
    ``count`` (``interval``: every multiple, the deepest :data:`MAX_PLACED`),
    each one the engine can write (:func:`candidates`). ``value`` places one
    more only while it adds ``min_gain`` of the prompt's prefill FLOPs to the
    expected saving; where each costs an engine step (vLLM's staged prefixes:
    ``step_tokens``) also the prefill of ``step_tokens``, the saving counted
    once per later sharer expected (``history.followers()``, at least one where
    the prompt shares ``known`` tokens with an earlier one). ``staged`` (vLLM):
    none unless one later sharer is expected, so a stream that shares nothing
    stops paying steps after its first prompt. Native (no step, bounded
    bytes): the value for one sharer decides."""
    policy, num_tokens, hit, fixed, count = ask.policy, ask.num_tokens, ask.hit, ask.fixed, ask.count
    unit, mamba_block_size, alignment, drop_eagle_block = (
        ask.unit,
        ask.mamba_block_size,
        ask.alignment,
        ask.drop_eagle_block,
    )
    history, compute, interval, min_gain = ask.history, ask.compute, ask.interval, ask.min_gain
    step_tokens, known, staged = ask.step_tokens, ask.known, ask.staged
    if policy not in PLACEMENTS:
        raise ValueError("unknown placement %r (have %s)" % (policy, ", ".join(PLACEMENTS)))
    if policy == "off" or (count <= 0 and policy != "interval"):
        return ()
    cands = candidates(hit, num_tokens, unit, mamba_block_size, alignment, drop_eagle_block)
    tail = planned_checkpoint(hit, num_tokens, num_tokens, unit, mamba_block_size, alignment, drop_eagle_block)
    taken = set(fixed)
    if policy == "interval":
        if not cands or interval <= 0:
            return ()
        multiples = range(cands.start + (-cands.start) % interval, cands.stop, interval)
        kept = [p for p in multiples if (p - cands.start) % cands.step == 0 and p not in taken]
        return tuple(kept[-MAX_PLACED:])
    if policy == "geometric":
        return geometric_positions([p for p in cands if p not in taken], cands.stop, count, unit)
    hist = history if history is not None else DivergenceHistory()
    drop = unit if drop_eagle_block else 0

    followers = hist.followers(known >= unit)
    if followers <= 0.0 or (staged and followers < 1.0):
        return ()
    followers = followers if step_tokens > 0 else 1.0

    def cdf(xs: np.ndarray) -> np.ndarray:
        return hist.depth_cdf(num_tokens, drop, unit, xs)

    free = [p for p in thinned(cands) if p not in taken]
    fixed_all = {hit, *taken} | ({tail} if tail is not None else set())
    floor = (min_gain * compute.prefix_flops(num_tokens) + compute.prefix_flops(step_tokens)) / followers
    return value_positions(free, fixed_all, min(count, MAX_PLACED), cdf, compute, floor)


def worth_a_step(positions: Iterable[int], hit: int, step_tokens: int) -> tuple[int, ...]:
    """The router-chosen ``positions`` (message boundaries, a junction) worth
    staging on vLLM, ascending: each at least ``step_tokens`` past the hit or
    the position kept before it. A staged checkpoint costs an engine step (worth
    ``step_tokens`` of prefill) now; a later request that branches there saves
    at most the tokens since the checkpoint below it. 0: all of them.

    >>> worth_a_step([300, 337], 0, 128)  # a system prompt's end is; a short turn after it is not
    (300,)
    >>> worth_a_step([960, 1001], 900, 128)  # a turn just past the hit: neither
    ()
    """
    if step_tokens <= 0:
        return tuple(sorted(set(positions)))
    kept: list[int] = []
    below = hit
    for p in sorted(set(positions)):
        if p - below >= step_tokens:
            kept.append(p)
            below = p
    return tuple(kept)


def placed_checkpoints(
    placement: Iterable[int],
    hit: int,
    num_tokens: int,
    unit: int,
    mamba_block_size: int,
    alignment: int | None,
    drop_eagle_block: bool,
    exclude: Iterable[int] = (),
) -> tuple[int, ...]:
    """The positions of ``placement`` (the router's, from a lookup that may
    have expected another hit) a prefill of ``[hit, num_tokens)`` writes:
    those the engine can write (unit multiples, ``hit + k * a``, valid extras
    below the tail), not in ``exclude`` (its other checkpoints), ascending, at
    most :data:`MAX_PLACED` (the deepest).

    >>> placed_checkpoints([40, 64, 96, 112, 200], 32, 120, 16, 16, 16, False)
    (64, 96)
    """
    if alignment is None:
        return ()
    tail = checkpoint_position(num_tokens, unit, drop_eagle_block)
    skip = set(exclude)
    kept = {
        p
        for p in placement
        if p % unit == 0
        and (p - hit) % alignment == 0
        and p < tail
        and p not in skip
        and is_extra_checkpoint_valid(hit, num_tokens, p, unit, mamba_block_size, alignment)
    }
    return tuple(sorted(kept)[-MAX_PLACED:])
