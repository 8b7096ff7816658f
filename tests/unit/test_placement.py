"""Checkpoint placement (#27): the dynamic program is exact (brute force on random
instances), the prior and the seen divergences shape it, every placed position is
one the engine can write, and placed checkpoints stay within their share of the
local state cache and of the store ledger."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from hybridpd.checkpoint_value import LINEAR_ONLY, ComputeModel, ShareFull, ValueLedger
from hybridpd.checkpoints import checkpoint_position, is_extra_checkpoint_valid
from hybridpd.divergence import DivergenceHistory
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.engine.native.state_cache import StateCache
from hybridpd.hashing import BlockHash
from hybridpd.placement import (
    PlacementAsk,
    candidates,
    geometric_positions,
    interval_positions,
    place,
    placed_checkpoints,
    thinned,
    value_positions,
)

pytestmark = pytest.mark.unit


def _saved(chosen, fixed, depths, compute) -> float:  # type: ignore[no-untyped-def]
    points = sorted({*chosen, *fixed})
    return sum(compute.prefix_flops(max((p for p in points if p <= d), default=0)) for d in depths)


@pytest.mark.parametrize("seed", range(4))
def test_the_dynamic_program_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        cands = sorted(rng.sample(range(16, 480, 16), rng.randint(1, 8)))
        fixed = set(rng.sample(range(0, 496, 16), rng.randint(0, 3))) - set(cands)
        count = rng.randint(0, 4)
        depths = [rng.uniform(0, 520) for _ in range(rng.randint(1, 8))]
        compute = ComputeModel(1.0, rng.choice([0.0, 0.02]))

        def cdf(xs: np.ndarray, depths: list[float] = depths) -> np.ndarray:
            return np.array([np.mean([d < x for d in depths]) for x in xs])

        got = value_positions(cands, fixed, count, cdf, compute)
        assert len(got) <= count and set(got) <= set(cands)
        best = max(
            _saved(c, fixed, depths, compute) for k in range(count + 1) for c in itertools.combinations(cands, k)
        )
        assert _saved(got, fixed, depths, compute) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_min_gain_stops_at_the_first_placement_that_does_not_pay(seed: int) -> None:
    """Brute force: ``E*(k)`` for every ``k``; the program places ``k*`` = the
    most ``k`` whose every step adds at least ``min_gain``, and saves ``E*(k*)``."""
    rng = random.Random(100 + seed)
    stopped_early = 0
    for _ in range(60):
        cands = sorted(rng.sample(range(16, 480, 16), rng.randint(1, 7)))
        fixed = {0}
        count = rng.randint(1, 4)
        depths = [rng.uniform(0, 520) for _ in range(rng.randint(1, 8))]
        compute = ComputeModel(1.0, 0.0)

        def cdf(xs: np.ndarray, depths: list[float] = depths) -> np.ndarray:
            return np.array([np.mean([d < x for d in depths]) for x in xs])

        e = [
            max(_saved(c, fixed, depths, compute) for c in itertools.combinations(cands, k)) / len(depths)
            for k in range(min(count, len(cands)) + 1)
        ]
        min_gain = rng.choice([0.0, 5.0, 20.0, 60.0])
        k_star = 0
        while k_star + 1 < len(e) and e[k_star + 1] - e[k_star] >= max(min_gain, 1e-6):
            k_star += 1
        got = value_positions(cands, fixed, count, cdf, compute, min_gain)
        assert len(got) <= k_star
        assert _saved(got, fixed, depths, compute) / len(depths) == pytest.approx(e[k_star], rel=1e-9, abs=1e-9)
        stopped_early += k_star < len(e) - 1
    assert stopped_early > 0  # the threshold bound somewhere


def test_min_gain_holds_without_fixed_points_too() -> None:
    """Nothing fixed (not even a hit at 0): placing none saves 0, so a first
    placement must pay like any other."""
    cdf = lambda xs: np.interp(xs, [0, 32, 48, 64], [0, 0, 0.9, 0.9])  # noqa: E731
    assert value_positions([16, 32, 48], [], 1, cdf) == (32,)
    assert value_positions([16, 32, 48], [], 1, cdf, min_gain=1e6) == ()


def test_a_concentrated_history_places_only_what_pays() -> None:
    """Every earlier prompt diverged 35 tokens before its end: one placement
    there pays, a second would only serve the prior's residue."""
    h = DivergenceHistory()
    for _ in range(200):
        h.observe(3000, 2965, 16)
    assert len(place(PlacementAsk("value", 2000, 0, (), 4, 16, 16, 16, False, h, min_gain=0.0))) == 4
    assert place(PlacementAsk("value", 2000, 0, (), 4, 16, 16, 16, False, h, min_gain=0.05)) == (1952,)
    assert place(PlacementAsk("value", 2000, 0, (), 4, 16, 16, 16, False, h, min_gain=0.99)) == ()


def test_the_prior_alone_places_along_the_prompt_and_seen_divergences_pull_to_them() -> None:
    h = DivergenceHistory()
    xs = np.arange(0, 2001, 16, dtype=np.float64)
    cdf = h.depth_cdf(2000, 0, 16, xs)
    assert cdf[0] == 0.0 and np.all(np.diff(cdf) >= 0) and cdf[-1] == 1.0
    prior = place(PlacementAsk("value", 2000, 0, (), 2, 16, 16, 16, False, h))
    assert len(prior) == 2 and all(0 < p < 1984 for p in prior)
    for _ in range(40):
        h.observe(3000, 2965, 16)  # suffixes of 35 tokens
    h.observe(3000, 8, 16)  # below a unit: no divergence seen
    assert len(h) == 40
    seen = place(PlacementAsk("value", 2000, 0, (), 2, 16, 16, 16, False, h))
    assert max(seen) == 1952 > max(prior)  # the deepest state at or below 2000 - 35


def test_every_placed_position_is_one_the_engine_writes() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n, hit = rng.randint(20, 3000), rng.choice([0, 16, 64, 128])
        b, a, eagle = rng.choice([16, 64]), rng.choice([16, 32]), rng.random() < 0.5
        for policy in ("value", "geometric", "interval"):
            got = place(PlacementAsk(policy, n, hit, (), 4, 16, b, a, eagle, interval=256))
            assert placed_checkpoints(got, hit, n, 16, b, a, eagle) == got
            assert all(is_extra_checkpoint_valid(hit, n, p, 16, b, a) for p in got)


def test_simple_rules_and_bad_policy() -> None:
    cands = candidates(0, 1000, 16, 16, 16, False)
    assert cands[0] == 16 and cands[-1] == 976 and len(cands) == 61
    assert geometric_positions(cands, 992, 3, 16) == (864, 928, 960)
    assert interval_positions(cands, 256) == (256, 512, 768)
    assert place(PlacementAsk("off", 1000, 0, (), 4, 16, 16, 16, False)) == ()
    assert place(PlacementAsk("value", 1000, 0, (), 4, 16, 16, None, False)) == ()  # the kernel cannot export
    with pytest.raises(ValueError, match="unknown placement"):
        place(PlacementAsk("everywhere", 1000, 0, (), 4, 16, 16, 16, False))
    long = candidates(0, 100_000, 16, 16, 16, False)
    assert len(long) == 6248 and long[-1] == 99_968
    dp = thinned(long)
    assert len(dp) == 192 and dp[-96:] == list(long[-96:]) and dp[0] == 16  # the deepest kept densely
    # the simple rules see every position, however long the prompt
    assert place(PlacementAsk("interval", 100_000, 0, (), 1, 16, 16, 16, False, interval=1024))[-1] == 99_328
    assert place(PlacementAsk("geometric", 100_000, 0, (), 3, 16, 16, 16, False)) == (99_856, 99_920, 99_952)
    # candidates equal the validity rule's, position by position (the range is exact)
    for hit, n, b in ((0, 300, 64), (32, 300, 64), (64, 200, 64), (48, 1000, 16), (16, 40, 64)):
        want = [p for p in range(hit + 16, n) if p < checkpoint_position(n, 16, False)]
        want = [p for p in want if is_extra_checkpoint_valid(hit, n, p, 16, b, 16)]
        assert list(candidates(hit, n, 16, b, 16, False)) == want, (hit, n, b)


# -- the share placed checkpoints may hold --------------------------------------------------------
MCFG = HybridModelConfig(num_layers=4)


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def _store(sc: StateCache, key: BlockHash, position: int, speculative: bool = False) -> bool:
    """Store and write at once (as ``PrefixCache.plan``, then ``commit``): True when written."""
    slot = sc.store(key, position, speculative=speculative)
    if slot is not None:
        sc.written(slot)
    return slot is not None


def test_the_state_cache_holds_placed_checkpoints_within_their_share() -> None:
    """8 slots, share 0.5: at most 4 speculative; a fifth evicts the least valuable
    speculative one (never a tail), or is skipped when worth less than all of them;
    a restore makes one an ordinary checkpoint."""
    sc = StateCache(8, 3, MCFG, speculative_share=0.5, clock=lambda: 0.0)
    assert sc.max_speculative == 4
    for i in range(4):
        assert _store(sc, _h(i), 1000 + 16 * i, speculative=True)
    assert _store(sc, _h(100), 64)  # a tail: ordinary, in an empty slot
    assert sc.num_speculative == 4
    assert _store(sc, _h(4), 2000, speculative=True)  # evicts the least valuable: position 1000
    assert sc.lookup(_h(0)) is None and sc.lookup(_h(100)) is not None and sc.num_speculative == 4
    assert not _store(sc, _h(5), 32, speculative=True)  # worth less than every speculative one
    slot = sc.lookup(_h(1))
    assert slot is not None
    sc.restored(slot)
    assert sc.num_speculative == 3 and _store(sc, _h(6), 32, speculative=True)
    assert sc.pool.num_cached == 6  # 4 speculative, the reused one, the tail: two slots still empty
    sc.pool.check_consistent()


def test_the_store_ledger_evicts_speculative_objects_first_within_their_share() -> None:
    led = ValueLedger(1000, 1800.0, LINEAR_ONLY, speculative_share=0.5)
    led.add(_h(1), 100, 500, 0.0)
    led.add(_h(2), 200, 900, 0.0, speculative=True)
    led.add(_h(3), 200, 500, 0.0, speculative=True)
    assert led.speculative_bytes == 400 and not led.fits(200, speculative=True) and led.fits(200)
    assert led.victims(200, speculative=True) == [_h(3)]  # the lower of the two, not the ordinary one
    led.hit(_h(2), 1.0)
    assert led.speculative_bytes == 200 and led.fits(200, speculative=True)
    assert led.victims(800) == [_h(3), _h(1)]  # over the whole budget: by value, kinds alike
    with pytest.raises(ShareFull, match="speculative share"):
        led.victims(600, speculative=True)


def test_the_interval_must_be_a_unit_multiple_only_when_used() -> None:
    from hybridpd.config import load_config
    from hybridpd.errors import ConfigError

    assert load_config(env={}, overrides={"prefix_match_unit": 48}).placement_interval == 1024
    with pytest.raises(ConfigError, match="placement_interval"):
        load_config(env={}, overrides={"prefix_match_unit": 48, "checkpoint_placement": "interval"})


def _history(shared: int, alone: int) -> DivergenceHistory:
    h = DivergenceHistory()
    for _ in range(shared):
        h.observe(3000, 2965, 16)  # left a known prefix 35 tokens before its end
    for _ in range(alone):
        h.observe(3000, 0, 16)  # shared nothing
    return h


def test_a_step_per_checkpoint_is_paid_by_the_sharers_expected() -> None:
    """``step_tokens`` (vLLM: each placed checkpoint is a staged prefix, an engine
    step): a placement must also save that much prefill, counted once per later
    sharer expected (``followers``: ``s / (1 - s)``). One sharer per prompt: a
    short prompt pays for none, a long one for both; four: the short one for one;
    one in five: only the long one's first. Without a step cost the count is the
    value for one sharer's (native)."""

    def count(h: DivergenceHistory, n: int, step: int = 128) -> int:
        return len(place(PlacementAsk("value", n, 0, (), 2, 16, 16, 16, False, h, min_gain=0.05, step_tokens=step)))

    one, four, rare = _history(1, 2), _history(3, 1), _history(0, 5)
    assert (one.share(), one.followers()) == (0.5, 1.0) and rare.followers() < 0.25 < 3.9 < four.followers()
    assert [count(one, n) for n in (200, 1024, 8192)] == [0, 1, 2]
    assert [count(four, n) for n in (200, 1024, 8192)] == [1, 2, 2]
    assert [count(rare, n) for n in (200, 1024, 8192)] == [0, 0, 1]
    assert all(count(h, n, 0) == 2 for h in (one, four, rare) for n in (200, 1024, 8192))


def test_where_steps_cost_a_stream_that_shares_nothing_stops_being_placed() -> None:
    """Prompts that share no prefix (``known < unit``) lower the sharing share,
    hence the sharers expected; sharing prompts raise it. Without a step cost
    the value for one sharer decides (native: no step, bounded bytes)."""
    h = DivergenceHistory()
    counts, free = [], []
    for _ in range(12):
        h.observe(4096, 0, 16)
        counts.append(
            len(place(PlacementAsk("value", 4096, 0, (), 2, 16, 16, 16, False, h, min_gain=0.05, step_tokens=16)))
        )
        free.append(len(place(PlacementAsk("value", 4096, 0, (), 2, 16, 16, 16, False, h, min_gain=0.05))))
    assert counts[0] == 2 and counts[-1] == 0 and counts == sorted(counts, reverse=True)
    assert free == [2] * 12
    assert h.share() == 1 / 13 and len(h) == 0 and DivergenceHistory().followers() == 8.0
    staged = {
        k: place(PlacementAsk("value", 4096, 0, (), 2, 16, 16, 16, False, h, known=k, staged=True)) for k in (0, 2048)
    }
    assert staged[0] == () and len(staged[2048]) == 2  # staged (vLLM): one later sharer expected, or none
    for _ in range(12):
        h.observe(4096, 2048, 16)
    assert h.share() == 13 / 25 and len(h) == 12
    assert place(PlacementAsk("value", 4096, 0, (), 2, 16, 16, 16, False, h, min_gain=0.05, step_tokens=16)) != ()
