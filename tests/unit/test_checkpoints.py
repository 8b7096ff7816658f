"""The checkpoint protocol: DESIGN.md worked examples and properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpd.checkpoints import (
    MAX_REQUESTED_CHECKPOINTS,
    checkpoint_position,
    checkpoint_slot_column,
    extra_slot_column,
    is_checkpoint_valid,
    is_extra_checkpoint_valid,
    junction_position,
    leading_blocks,
    longest_usable_hit,
    natural_position,
    needs_rekey,
    planned_checkpoint,
    requested_checkpoints,
)
from hybridpd.prefix_outcomes import prefix_token_split

# -- worked examples (DESIGN.md) ---------------------------------------------


def test_example_start0_end100_u8_b64_a16() -> None:
    pos = checkpoint_position(100, 8, drop_eagle_block=False)
    assert pos == 96
    assert is_checkpoint_valid(0, 100, pos, 8, 64, 16)
    eagle_pos = checkpoint_position(100, 8, drop_eagle_block=True)
    assert eagle_pos == 88
    assert not is_checkpoint_valid(0, 100, eagle_pos, 8, 64, 16)  # 88 % 16 != 0


def test_alignment_none_never_valid() -> None:
    assert not is_checkpoint_valid(0, 100, 96, 8, 64, None)
    for start, end, pos in [(0, 64, 48), (16, 200, 96), (0, 1000, 512)]:
        assert not is_checkpoint_valid(start, end, pos, 16, 64, None)


@pytest.mark.parametrize("u", [8, 16, 128, 1024])
def test_example_n_19u_plus_7(u: int) -> None:
    n = 19 * u + 7
    assert checkpoint_position(n, u, False) == 19 * u
    assert checkpoint_position(n, u, True) == 18 * u


def test_example_b16_batch_rows() -> None:
    u = b = a = 16
    seq_lens, query_lens = [50, 32], [50, 16]
    offsets, valid = [], []
    for seq, q in zip(seq_lens, query_lens, strict=True):
        start = seq - q
        pos = checkpoint_position(seq, u, False)
        offsets.append(pos - start)
        valid.append(is_checkpoint_valid(start, seq, pos, u, b, a))
    assert offsets == [48, 0]
    assert valid == [True, False]  # row 1: 16 < 16 fails


def test_example_unaligned_start_no_checkpoint() -> None:
    # seq 50, query 49: starts at 1, not on a unit boundary
    pos = checkpoint_position(50, 16, False)
    assert pos == 48
    assert not is_checkpoint_valid(1, 50, pos, 16, 16, 16)
    assert planned_checkpoint(1, 50, 50, 16, 16, 16, False) is None
    # the same request computed from 0 does get it
    assert planned_checkpoint(0, 50, 50, 16, 16, 16, False) == 48


def test_example_rekey_u32_b32_n104_eagle() -> None:
    u = b = 32
    pos = checkpoint_position(104, u, True)
    assert pos == 64
    col = checkpoint_slot_column(104, b)
    assert col == 2
    assert natural_position(col, b) == 96
    assert needs_rekey(pos, 104, b)
    # Without EAGLE the position is 96, which is the natural key: no re-key.
    assert checkpoint_position(104, u, False) == 96
    assert not needs_rekey(96, 104, b)


@pytest.mark.parametrize("eagle", [False, True])
def test_cross_check_long_prompts(eagle: bool) -> None:
    """Published checkpoint == lookup boundary == allocation decision."""
    u, b, a = 1024, 4096, 64
    for n in range(8192, 12289, 64):
        published = planned_checkpoint(0, n, n, u, b, a, eagle)
        pos = checkpoint_position(n, u, eagle)
        # Allocation decision: the slot column exists only if valid.
        allocated = is_checkpoint_valid(0, n, pos, u, b, a)
        assert (published is not None) == allocated
        if published is None:
            continue
        # A later request extending this prompt: the first request's full KV
        # blocks and its state checkpoint are cached.
        later = n + 3 * u
        hit = longest_usable_hit(later, u, n // u, {published}, eagle)
        assert hit == published, (n, hit, published)


# -- hit function --------------------------------------------------------------


def test_hit_capped_below_whole_prompt() -> None:
    # Everything cached, state at every unit: the hit leaves >= 1 token.
    assert longest_usable_hit(64, 16, [True] * 4, {16, 32, 48, 64}, False) == 48
    assert longest_usable_hit(65, 16, [True] * 4, {16, 32, 48, 64}, False) == 64


def test_hit_needs_state_at_exact_boundary() -> None:
    # KV for 4 blocks but state only at 40 (not a unit boundary) and 16.
    assert longest_usable_hit(200, 16, [True] * 4, {40, 16}, False) == 16
    assert longest_usable_hit(200, 16, [True] * 4, set(), False) == 0


def test_hit_eagle_drops_last_block_once() -> None:
    states = {16, 32, 48, 64}
    assert longest_usable_hit(200, 16, [True] * 4, states, True) == 48
    # with states only at the drop position, the hit is exactly there
    assert longest_usable_hit(200, 16, [True] * 4, {48}, True) == 48


def test_hit_stops_at_hole() -> None:
    assert leading_blocks([True, True, False, True]) == 2
    assert longest_usable_hit(200, 16, [True, True, False, True], {16, 32, 64}, False) == 32


def _brute_hit(n: int, u: int, blocks: list[bool], states: set[int], eagle: bool) -> int:
    """Reference: try every candidate length, keep the longest usable one."""
    lead = 0
    while lead < len(blocks) and blocks[lead]:
        lead += 1
    att_blocks = min(lead, (n - 1) // u) if n > 0 else 0
    if eagle and att_blocks > 0:
        att_blocks -= 1
    best = 0
    for length in range(0, n):
        usable = (
            length % u == 0
            and length > 0
            and length // u <= att_blocks
            and all(blocks[i] for i in range(length // u))
            and length in states
        )
        if usable:
            best = length
    return best


@settings(max_examples=400, deadline=None)
@given(
    u=st.sampled_from([1, 2, 4, 8, 16]),
    n=st.integers(0, 200),
    blocks=st.lists(st.booleans(), max_size=60),
    states=st.sets(st.integers(0, 220), max_size=30),
    eagle=st.booleans(),
)
def test_hit_matches_brute_force(u: int, n: int, blocks: list[bool], states: set[int], eagle: bool) -> None:
    got = longest_usable_hit(n, u, blocks, states, eagle)
    assert got == _brute_hit(n, u, blocks, states, eagle)
    assert got == 0 or (got % u == 0 and got in states and got < n)


# -- properties ----------------------------------------------------------------


@settings(max_examples=600, deadline=None)
@given(
    u=st.sampled_from([1, 4, 8, 16, 32, 64, 128]),
    b_mult=st.integers(1, 8),
    a=st.one_of(st.none(), st.sampled_from([1, 2, 4, 8, 16, 64])),
    start_blocks=st.integers(0, 40),
    start_extra=st.integers(0, 3),
    length=st.integers(1, 3000),
    pos=st.integers(0, 6000),
)
def test_valid_checkpoint_is_aligned_and_strictly_inside(
    u: int, b_mult: int, a: int | None, start_blocks: int, start_extra: int, length: int, pos: int
) -> None:
    b = u * b_mult
    start = start_blocks * u + start_extra
    end = start + length
    if is_checkpoint_valid(start, end, pos, u, b, a):
        assert a is not None
        assert start % u == 0
        assert start < pos < end
        assert pos - start >= u
        assert (pos - start) % a == 0
        # the written column never overwrites the initial-state column
        assert math.ceil(end / b) - 2 > (start - 1) // b


@settings(max_examples=600, deadline=None)
@given(u=st.integers(1, 512), n=st.integers(0, 100_000))
def test_eagle_position_one_unit_below(u: int, n: int) -> None:
    plain = checkpoint_position(n, u, False)
    eagle = checkpoint_position(n, u, True)
    assert plain % u == 0 and eagle % u == 0
    assert plain <= max(n - 1, 0)
    if plain >= u:
        assert eagle == plain - u
    else:
        assert eagle == 0


def test_formula_rejects_wrong_variants() -> None:
    # The upstream review fixed num_tokens // u * u to (num_tokens - 1) // u * u:
    # at an exact multiple the checkpoint must not sit at the end of the prompt.
    assert checkpoint_position(128, 16, False) == 112
    assert checkpoint_position(1, 16, False) == 0
    with pytest.raises(ValueError):
        checkpoint_position(10, 0, False)


# -- extra (requested) checkpoints: DESIGN.md worked examples ---------------------------


def test_extra_example_u8_b64_a16_rounding_and_alignment() -> None:
    # junctions 20, 41, 90 of a 100-token prompt from 0: 20 -> 16; 41 -> 40 -> 32
    # (40 % 16 != 0); 90 -> 88 -> 80; the tail 96 is planned on its own
    assert requested_checkpoints([20, 41, 90], 0, 100, 8, 64, 16, False) == (16, 32, 80)
    assert planned_checkpoint(0, 100, 100, 8, 64, 16, False) == 96


def test_extra_example_eagle() -> None:
    # one unit lower first: 20 -> 8 -> 0 (dropped), 41 -> 32, 90 -> 80; the tail 88 is invalid
    assert [junction_position(r, 8, True) for r in (20, 41, 90)] == [8, 32, 80]
    assert requested_checkpoints([20, 41, 90], 0, 100, 8, 64, 16, True) == (32, 80)
    assert planned_checkpoint(0, 100, 100, 8, 64, 16, True) is None
    # a later request sharing [0, 90): 11 blocks, EAGLE drops one -> 80
    assert longest_usable_hit(150, 8, 90 // 8, {32, 80}, True) == 80


def test_extra_example_junction_inside_mamba_block() -> None:
    # u=16, B=64: junction 100 lies inside block [64, 128): state@96 takes column 1,
    # whose natural key is state@128, so the slot is keyed by the hash at 96
    assert requested_checkpoints([100], 0, 200, 16, 64, 16, False) == (96,)
    assert extra_slot_column(96, 64) == 1
    assert natural_position(1, 64) == 128
    # a later request sharing [0, 100) hits 96
    assert longest_usable_hit(180, 16, 100 // 16, {96}, False) == 96


def test_extra_example_junction_in_initial_state_column() -> None:
    # a hit of 32 restores state@32 from column 0 (B=64): junction 60 -> 48 needs
    # column 0 too (dropped, as are 64 and the hit itself); 100 -> 96 takes column 1
    assert (32 - 1) // 64 == 0 and extra_slot_column(48, 64) == 0
    assert is_checkpoint_valid(32, 200, 48, 16, 64, 16)  # the tail's rule alone would allow it
    assert not is_extra_checkpoint_valid(32, 200, 48, 16, 64, 16)
    assert requested_checkpoints([40, 60, 64, 100], 32, 200, 16, 64, 16, False) == (96,)
    assert planned_checkpoint(32, 200, 200, 16, 64, 16, False) == 192


@pytest.mark.parametrize(
    ("eagle", "hit", "n", "want"),
    [
        (False, 0, 12288, (2048, 4096, 5120, 8192, 9216)),
        (True, 0, 12288, (1024, 3072, 4096, 7168, 8192)),
        (False, 5120, 12288, ()),  # the query itself fails the column rule (tail too)
        (False, 5120, 16384, (9216, 11264)),  # 9000 -> 8192 is in the initial state's column 1
    ],
)
def test_extra_example_u1024_b4096_a64(eagle: bool, hit: int, n: int, want: tuple[int, ...]) -> None:
    u, b, a = 1024, 4096, 64
    junctions = [3000, 5000, 6000, 9000, 10000, 11500]
    assert requested_checkpoints(junctions, hit, n, u, b, a, eagle) == want
    tail = planned_checkpoint(hit, n, n, u, b, a, eagle)
    assert tail is None or all(p < tail for p in want)
    if hit == 5120 and n == 12288:
        assert tail is None


def test_extra_cap_keeps_deepest_and_dedupes() -> None:
    junctions = list(range(20, 1000, 16))
    got = requested_checkpoints(junctions, 0, 1024, 16, 64, 16, False, max_extra=3)
    assert got == (960, 976, 992)
    assert requested_checkpoints([33, 40, 47], 0, 1024, 16, 64, 16, False) == (32,)
    assert requested_checkpoints([500], 0, 1024, 16, 64, None, False) == ()
    assert requested_checkpoints([500], 0, 1024, 16, 64, 16, False, max_extra=0) == ()
    assert MAX_REQUESTED_CHECKPOINTS == 8


@settings(max_examples=500, deadline=None)
@given(
    u=st.sampled_from([8, 16, 32, 64]),
    b_mult=st.integers(1, 8),
    a=st.sampled_from([16, 32, 64]),
    hit_blocks=st.integers(0, 20),
    n=st.integers(1, 3000),
    junctions=st.lists(st.integers(1, 3000), max_size=12),
    eagle=st.booleans(),
)
def test_extra_checkpoints_properties(
    u: int, b_mult: int, a: int, hit_blocks: int, n: int, junctions: list[int], eagle: bool
) -> None:
    b = u * b_mult
    hit = min(hit_blocks * u, (n - 1) // u * u)
    got = requested_checkpoints(junctions, hit, n, u, b, a, eagle)
    tail = checkpoint_position(n, u, eagle)
    assert list(got) == sorted(set(got)) and len(got) <= MAX_REQUESTED_CHECKPOINTS
    for p in got:
        assert p % u == 0 and hit + u <= p < tail and (p - hit) % a == 0
        assert is_extra_checkpoint_valid(hit, n, p, u, b, a)
        assert is_checkpoint_valid(hit, n, p, u, b, a)
        # rounded down from some junction, and a later request sharing that
        # junction's prefix hits exactly p when only p is cached
        r = min(r for r in junctions if junction_position(min(r, n), u, eagle) >= p)
        assert longest_usable_hit(r + u, u, r // u, {p}, eagle) == p


def test_docstring_examples() -> None:
    import doctest

    import hybridpd.checkpoint_stages
    import hybridpd.checkpoints
    import hybridpd.prefix_outcomes

    for module, examples in ((hybridpd.checkpoints, 5), (hybridpd.checkpoint_stages, 5), (hybridpd.prefix_outcomes, 2)):
        res = doctest.testmod(module)
        assert res.failed == 0 and res.attempted >= examples, module.__name__


def test_prefix_token_split_with_a_prefill_that_stops_short() -> None:
    """vLLM's P/D prefill computes N - 1 tokens: no hit past (N - 2) // u * u; the
    split still partitions the prompt."""
    split = prefix_token_split(1345, 16, False, hit=1328, known=1344, seen=1344, backoff=1)
    want = {"hit": 1328, "checkpoint_missing": 0, "evicted": 0, "no_shared_prefix": 0, "eagle_replay": 0}
    assert split == {**want, "below_unit": 17}
    assert sum(split.values()) == 1345
    assert prefix_token_split(1345, 16, False, hit=0, known=0, seen=0)["no_shared_prefix"] == 1344
