"""The engine exports checkpoints exactly where DESIGN.md's examples say,
re-keys the EAGLE slot, writes the extra checkpoints a request names (and
stays exact: equal greedy tokens and logits ``torch.equal`` to a no-cache
run, at B = 64 and at the default B = u), and frees everything, aborts
included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridpd.checkpoints import checkpoint_position
from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup, WrittenCheckpoints
from hybridpd.hashing import BlockHash
from hybridpd.placement import placed_checkpoints
from tests.unit.engine_helpers import (
    BLOCKS,
    assert_no_leaks,
    block_id,
    bundled_model_fixture,  # noqa: F401  (autouse: both bundled models)
    make_engine,
    prompt,
    req,
)

#: exactness tests: only where fp32 matmul rows are batch-invariant (checked)
pytestmark = pytest.mark.usefixtures("fp32_row_exact")


def _exported(eng, toks, max_tokens: int = 1) -> list[int]:  # type: ignore[no-untyped-def]
    eng.generate([req("r%d" % len(toks), toks, max_tokens)])
    return [st.meta.position for _, st in eng.pop_exports()]


def test_example_u8_b64_a16_n100() -> None:
    toks = prompt(100, 1)
    assert _exported(make_engine(prefix_match_unit=8, export_checkpoints=True), toks) == [96]
    # the protocol's EAGLE position, 88, is 16-unaligned (nothing exported) where EAGLE
    # replays (test_checkpoints.py); the native draft head does not: 96 with EAGLE too
    eng = make_engine(prefix_match_unit=8, eagle=True, export_checkpoints=True)
    assert not eng.scheduler.cfg.drop_eagle_block and _exported(eng, toks) == [96]


@pytest.mark.parametrize("block", BLOCKS, ids=block_id)
@pytest.mark.parametrize("eagle", [False, True])
def test_example_19u_plus_7(eagle: bool, block: int | None) -> None:
    u = 16
    eng = make_engine(eagle=eagle, export_checkpoints=True, mamba_block_size=block)
    assert _exported(eng, prompt(19 * u + 7, 2)) == [19 * u]  # the native EAGLE head replays nothing


def test_example_b16_rows() -> None:
    # u = B = a = 16: a 50-token prompt exports at 48; a 32-token prompt whose
    # first 16 tokens hit computes [16, 32): 16 < 16 fails, nothing exported.
    eng = make_engine(mamba_block_size=16, export_checkpoints=True)
    assert _exported(eng, prompt(50, 3)) == [48]
    base = prompt(32, 4)
    assert _exported(eng, base[:20]) == [16]
    eng.add_request(req("row1", base, 1))
    outs = []
    while eng.has_work():
        outs.extend(eng.step())
    assert outs[0].num_cached_tokens == 16
    assert eng.pop_exports() == []
    assert_no_leaks(eng)


def test_rekey_u32_b64_n104() -> None:
    """Position 96 goes into slot column ceil(104/64) - 2 = 0, whose natural key is
    state@64: the slot is keyed by the hash at 96."""
    toks = prompt(104, 5)
    eng = make_engine(prefix_match_unit=32, mamba_block_size=64, export_checkpoints=True)
    eng.generate([req("e", toks, 1)])
    ((kv, st),) = eng.pop_exports()
    chain = eng.hasher.chain(list(toks))
    assert st.meta.position == 96 and kv.meta.position == 96  # every full prompt block
    assert st.key == chain[2]  # hash of [0, 96), not the slot's natural state@64
    assert eng.state_pool.lookup(chain[2]) is not None
    assert eng.state_pool.lookup(chain[1]) is None
    # the bytes are the true state@96: equal to a run whose column's natural key is 96
    plain = make_engine(prefix_match_unit=32, mamba_block_size=32, export_checkpoints=True)
    plain.generate([req("p", toks[:100], 1)])
    ((_, st96),) = plain.pop_exports()
    assert st96.meta.position == 96
    for a, b in zip(st.buffers, st96.buffers, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("eagle", [False, True])
def test_cross_check_long_prompts(eagle: bool) -> None:
    """u=1024, B=4096, a=64: published == lookup boundary == allocation.

    Prompts past one Mamba block, prefilled in chunks of B: B + 100, whose
    checkpoint is its slot column's natural boundary and the first chunk's end
    (at B), and exactly 2B, whose checkpoint sits inside the second Mamba block
    and chunk (at 2B - u: the slot re-keyed). The same two cases one block
    further (2B + 100 and 3B, chunks of 2B) cost 1.6x the tokens."""
    u = 1024
    for n in (4096 + 100, 8192):
        eng = make_engine(
            prefix_match_unit=u,
            mamba_block_size=4096,
            checkpoint_alignment=64,
            eagle=eagle,
            export_checkpoints=True,
            num_kv_blocks=64,
            max_num_batched_tokens=4096,
            max_model_len=32768,
        )
        toks = prompt(n + 2 * u, n)
        published = _exported(eng, toks[:n])
        assert published == [checkpoint_position(n, u, eng.scheduler.cfg.drop_eagle_block)]
        eng.add_request(req("ext", toks, 1))
        outs = []
        while eng.has_work():
            outs.extend(eng.step())
        assert outs[0].num_cached_tokens == published[0]
        assert_no_leaks(eng)


def test_abort_frees_everything() -> None:
    eng = make_engine(max_num_batched_tokens=64, eagle=True)
    for i, n in enumerate([300, 40, 900, 5]):
        eng.add_request(req("a%d" % i, prompt(n, 10 + i), 50))
    for _ in range(6):  # some prefilling, some decoding, some waiting
        eng.step()
    assert eng.stats().num_running > 0
    for i in range(4):
        assert eng.abort("a%d" % i)
    assert not eng.abort("a0")
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == ["a0", "a1", "a2", "a3"]
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert_no_leaks(eng)


def test_invalid_requests_rejected() -> None:
    from hybridpd.errors import InvalidRequestError

    eng = make_engine()
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        eng.add_request(req("x", ()))
    with pytest.raises(InvalidRequestError, match="token ids"):
        eng.add_request(req("x", (1, 99999)))
    with pytest.raises(InvalidRequestError, match="context of"):
        eng.add_request(req("x", (5,) * 16000, 1000))
    eng.add_request(req("x", (5, 6)))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        eng.add_request(req("x", (5, 6)))
    eng.abort("x")
    eng.step()
    assert_no_leaks(eng)


def test_corrupt_checkpoint_rejected() -> None:
    from hybridpd.errors import IntegrityError

    toks = prompt(300, 8)
    src = make_engine(export_checkpoints=True)
    src.generate([req("w", toks, 1)])
    ((kv, st),) = src.pop_exports()
    other = list(prompt(300, 9))
    with pytest.raises(IntegrityError, match="chain hash"):
        make_engine().import_checkpoint(kv, st, other)


# -- extra checkpoints (EngineRequest.checkpoints) ----------------------------------------


def _run(eng, rid: str, toks, checkpoints=(), max_tokens: int = 6):  # type: ignore[no-untyped-def]
    """Tokens, logits, num_cached_tokens and the reported checkpoints (on the output
    completing the prompt; every other output reports none) of one request run alone
    to completion."""
    eng.add_request(dataclasses.replace(req(rid, toks, max_tokens), checkpoints=tuple(checkpoints)))
    tokens: list[int] = []
    cached, written = [], []
    while eng.has_work():
        for o in eng.step():
            tokens.extend(o.new_token_ids)
            cached.append(o.num_cached_tokens)
            written.append(o.checkpoints)
    assert all(w == WrittenCheckpoints() for w in written[1:])
    return tokens, list(eng.logit_log[rid]), cached[0], written[0]


def _no_cache(toks, eagle: bool):  # type: ignore[no-untyped-def]
    return _run(make_engine(enable_prefix_caching=False, record_logits=True, eagle=eagle), "ref", toks)[:2]


def _same(got, want) -> None:  # type: ignore[no-untyped-def]
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


def _stored_states(events: list[CacheEvent]) -> set[BlockHash]:
    return {h for e in events if e.kind is CacheEventKind.STORED and e.group is CacheGroup.STATE for h in e.hashes}


def _indexed_states(events: list[CacheEvent], chain: list[BlockHash], u: int) -> list[int]:
    """The state positions of ``chain`` the index holds after mirroring ``events``
    (stored, less what was removed since), ascending."""
    held: set[BlockHash] = set()
    for e in events:
        if e.group is CacheGroup.STATE and e.kind is CacheEventKind.STORED:
            held |= set(e.hashes)
        elif e.group is CacheGroup.STATE and e.kind is CacheEventKind.REMOVED:
            held -= set(e.hashes)
    return sorted((i + 1) * u for i, h in enumerate(chain) if h in held)


@pytest.mark.parametrize(
    ("eagle", "budget", "block"),
    [(eagle, budget, block) for block in BLOCKS for eagle, budget in ((False, 4096), (False, 48), (True, 4096))],
    ids=["4096-B64", "48-B64", "eagle-4096-B64", "4096-Bu", "48-Bu", "eagle-4096-Bu"],
)
def test_extra_checkpoints_exact_and_hit(eagle: bool, budget: int, block: int | None) -> None:
    """u=16, B=64 or B=u, a=16; junctions 70, 100, 150, 250 of a 300-token prompt:
    64, 96, 144, 240 and the tail 288, with EAGLE too (the native head replays
    nothing), and an EAGLE hit at the junction equals a no-cache EAGLE run."""
    u = 16
    base = prompt(300, 21)
    want = (64, 96, 144, 240, 288)
    eng = make_engine(
        eagle=eagle, export_checkpoints=True, record_logits=True, max_num_batched_tokens=budget, mamba_block_size=block
    )
    got = _run(eng, "base", base, (70, 100, 150, 250))
    _same(got, _no_cache(base, eagle))
    exported = eng.pop_exports()
    assert [st.meta.position for _, st in exported] == list(want)
    assert {kv.meta.position for kv, _ in exported} == {288}  # every full prompt block, shared
    chain = eng.hasher.chain(list(base))
    assert _stored_states(eng.pop_cache_events()) == {chain[p // u - 1] for p in want}
    assert got[3] == WrittenCheckpoints(288, want[:-1])  # what the engine reports it wrote
    # a request sharing only [0, 150) hits the checkpoint of junction 150, and stays exact
    branch = base[:150] + prompt(120, 22)
    got = _run(eng, "branch", branch)
    assert got[2] == want[2]
    _same(got, _no_cache(branch, eagle))
    assert_no_leaks(eng)


@pytest.mark.parametrize("where", ["tail", "junction", "answer"])
def test_an_eagle_hit_is_taken_where_a_plain_one_is_and_stays_exact(where: str) -> None:
    """The native draft head is attention-free: it chains from the target hidden at
    the last computed position, which the prefill after any hit computes. So its
    state at a checkpoint is empty, an EAGLE hit restores the same position as a
    plain hit (no replay unit), and tokens and logits equal a no-cache EAGLE run's:
    at a tail, a junction and an answer checkpoint (prompt + answer, prefilled in
    the background)."""
    u = 16
    eng = make_engine(eagle=True, record_logits=True, mamba_block_size=None)
    assert not eng.scheduler.cfg.drop_eagle_block
    base = prompt(300, 51)
    if where == "tail":
        _run(eng, "first", base)
        nxt, want = base + prompt(40, 52), checkpoint_position(300, u, False)
    elif where == "junction":
        _run(eng, "first", base, (150,))
        nxt, want = base[:150] + prompt(80, 53), 144
    else:
        answer = _run(eng, "first", base, max_tokens=12)[0]
        answered = base + tuple(answer)
        eng.generate([dataclasses.replace(req("answer", answered, 1), background=True)])
        nxt, want = answered + prompt(30, 54), checkpoint_position(len(answered), u, False)
    got = _run(eng, "next", nxt)
    assert got[2] == want
    _same(got, _no_cache(nxt, True))
    assert_no_leaks(eng)


def test_extra_checkpoint_in_initial_state_column_not_promised() -> None:
    """u=16, B=64: a hit of 32 restores state@32 (column 0); junction 60 -> 48 also
    needs column 0 and is not written; junction 100 -> 96 is."""
    u = 16
    base = prompt(200, 23)
    eng = make_engine(export_checkpoints=True, record_logits=True)
    _run(eng, "a", base[:100], (32,))
    assert [st.meta.position for _, st in eng.pop_exports()] == [32, 96]
    branch = base[:40] + prompt(160, 24)
    got = _run(eng, "b", branch, (60, 100))
    assert got[2] == 32
    _same(got, _no_cache(branch, False))
    assert [st.meta.position for _, st in eng.pop_exports()] == [96, 192]
    chain = eng.hasher.chain(list(branch))
    assert eng.state_pool.lookup(chain[48 // u - 1]) is None  # nothing cached at 48
    assert eng.state_pool.lookup(chain[96 // u - 1]) is not None
    # a request sharing [0, 60) of the branch is not promised 48: it hits 32
    later = branch[:60] + prompt(50, 25)
    got = _run(eng, "c", later)
    assert got[2] == 32
    _same(got, _no_cache(later, False))
    assert_no_leaks(eng)


# -- placed checkpoints (EngineRequest.placement) ------------------------------------------------


def _steps(eng, rid: str, toks, placement=()) -> int:  # type: ignore[no-untyped-def]
    eng.add_request(dataclasses.replace(req(rid, toks, 2), placement=tuple(placement)))
    n = 0
    while eng.has_work():
        eng.step()
        n += 1
    return n


@pytest.mark.parametrize(
    ("eagle", "budget", "block"),
    [(eagle, budget, block) for block in BLOCKS for eagle, budget in ((False, 4096), (False, 48), (True, 4096))],
    ids=["4096-B64", "48-B64", "eagle-4096-B64", "4096-Bu", "48-Bu", "eagle-4096-Bu"],
)
def test_placed_checkpoints_are_exact_add_no_step_and_hit(eagle: bool, budget: int, block: int | None) -> None:
    """Eight placed positions of a 300-token prompt (and two it cannot write: off a
    unit, past the tail) are snapshotted mid-chunk: the same steps as without them,
    exported speculative, and a request sharing [0, S) for several S hits the deepest
    one at or below S (with EAGLE too) with outputs equal to a no-cache run."""
    u = 16
    base = prompt(300, 31)
    placed = (32, 64, 96, 128, 160, 192, 224, 256)
    kw = dict(eagle=eagle, max_num_batched_tokens=budget, mamba_block_size=block)
    plain = make_engine(**kw)
    eng = make_engine(export_checkpoints=True, record_logits=True, **kw)
    assert _steps(eng, "steps", base, (*placed, 40, 296)) == _steps(plain, "steps", base)
    exported = eng.pop_exports()
    tail = checkpoint_position(300, u, False)
    b = eng.scheduler.cfg.mamba_block_size
    writable = placed_checkpoints((*placed, 40, 296), 0, 300, u, b, 16, False, (tail,))
    assert 40 not in writable and 296 not in writable and len(writable) >= 7
    got_positions = [st.meta.position for _, st in exported]
    assert got_positions == [*writable, tail]
    assert [st.speculative for _, st in exported] == [True] * len(writable) + [False]
    assert eng.cache.state_cache.num_speculative == len(writable)
    for i, shared in enumerate((100, 170, 250)):
        branch = base[:shared] + prompt(60, 40 + i)
        got = _run(eng, "branch%d" % i, branch)
        usable = max(p for p in got_positions if p <= shared)
        assert got[2] == usable
        _same(got, _no_cache(branch, eagle))
    assert_no_leaks(eng)


def test_a_step_short_of_slots_keeps_its_deepest_snapshots() -> None:
    """Four state slots, two of them for placed (speculative) checkpoints; one chunk
    snapshots eight placed positions and the tail. A step's slots stay busy until it
    ends, so its snapshots cannot evict each other: reserved deepest first, the tail
    (288) and the two deepest placed ones (256, 224) are cached, and a request
    sharing [0, 260) hits 256, exactly."""
    u = 16
    base = prompt(300, 61)
    eng = make_engine(num_state_slots=4, record_logits=True, placement_share=0.5)
    _steps(eng, "first", base, (32, 64, 96, 128, 160, 192, 224, 256))
    chain = eng.hasher.chain(list(base))
    cached = sorted((i + 1) * u for i, h in enumerate(chain) if eng.state_pool.lookup(h) is not None)
    assert cached == [224, 256, 288]
    branch = base[:260] + prompt(40, 62)
    got = _run(eng, "branch", branch)
    assert got[2] == 256
    _same(got, _no_cache(branch, False))
    assert_no_leaks(eng)


def _prefill(eng, r, prefill_only: bool):  # type: ignore[no-untyped-def]
    """Run ``r`` alone; the checkpoints its first output reports, the exported positions."""
    eng.add_request(r, prefill_only)
    outs = [o for _ in range(30) if eng.has_work() for o in eng.step()]
    eng.take_handoff(r.request_id)
    return outs[0].checkpoints, [st.meta.position for _, st in eng.pop_exports()]


@pytest.mark.parametrize("prefill_only", [False, True], ids=["local", "prefill"])
def test_the_reported_checkpoints_are_what_the_cache_holds(prefill_only: bool) -> None:
    """Four state slots. One chunk snapshots eight placed positions and the tail, but
    only the tail and the two deepest placed ones get a slot (the rest are only
    exported); over 48-token chunks the five junction and tail snapshots of another
    prompt outnumber the slots, so a later one evicts an earlier one. Each prefill
    reports exactly what its cache holds at its end, the index's state entries for
    that prompt: never a position the plan names whose slot it did not keep."""
    u = 16
    eng = make_engine(num_state_slots=4, export_checkpoints=True, placement_share=0.5)
    base = prompt(300, 63)
    placed = (32, 64, 96, 128, 160, 192, 224, 256)
    reported, exported = _prefill(eng, dataclasses.replace(req("placed", base, 2), placement=placed), prefill_only)
    assert {192, 224, 256, 288} <= set(exported)  # written (and exported), not all of them kept
    assert reported == WrittenCheckpoints(288, (224, 256))
    assert list(reported.positions) == _indexed_states(eng.pop_cache_events(), eng.hasher.chain(list(base)), u)
    assert_no_leaks(eng)
    # junctions 70, 100, 150, 250 and the tail: 64, 96, 144, 240, 288, over seven chunks
    eng = make_engine(num_state_slots=4, export_checkpoints=True, max_num_batched_tokens=48)
    other = prompt(300, 64)
    r = dataclasses.replace(req("junctions", other, 2), checkpoints=(70, 100, 150, 250))
    reported, exported = _prefill(eng, r, prefill_only)
    assert exported == [64, 96, 144, 240, 288]
    assert reported.tail == 288 and len(reported.positions) == 4  # one evicted within the prefill
    assert list(reported.positions) == _indexed_states(eng.pop_cache_events(), eng.hasher.chain(list(other)), u)
    assert_no_leaks(eng)


def test_the_routers_placement_lets_the_second_sharer_hit() -> None:
    """Router and engine together, no index: a first request carries the (at
    most two) positions the router's default placement (value) chose from its
    prior; the second request sharing its 1,000-token document (not its
    45-token question) restores the deepest of them below the document's end,
    at least 0.75 of the document, exactly. Once the router has seen that
    divergence, the next pair's second restores more."""
    from tests.unit.test_branch_checkpoints import _dispatcher, _route

    d = _dispatcher()
    eng = make_engine(record_logits=True)
    hits = []
    for pair in (0, 1):
        doc = prompt(1000, 50 + pair)
        first, second = doc + prompt(45, 60 + pair), doc + prompt(45, 70 + pair)
        routed = d.with_junction(req("a%d" % pair, first, 2), _route(0, 0))
        assert 1 <= len(routed.placement) <= 2 and routed.placement[0] <= 992
        eng.generate([routed])
        d.with_junction(req("b%d" % pair, second, 2), _route(0, 992))  # the router sees it diverge
        got = _run(eng, "b%d" % pair, second)
        assert got[2] == max(p for p in routed.placement if p <= 992) and got[2] >= 0.75 * 992
        _same(got, _no_cache(second, False))
        hits.append(got[2])
    assert hits[1] > hits[0]
    assert_no_leaks(eng)
