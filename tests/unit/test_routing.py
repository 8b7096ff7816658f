"""Routing policy: the documented cost formula, exactly; queued work and recent prefills."""

from __future__ import annotations

import pytest

from hybridpd.checkpoints import longest_usable_hit
from hybridpd.hashing import BlockHasher
from services.router import routing
from services.router.routing import (
    STORE_LOAD_COST,
    RecentPrefills,
    RouteDecision,
    choose,
    choose_decode,
    dispatch_work,
)

NAMES = ["prefill-0", "prefill-1"]


def test_local_hit_wins_over_miss() -> None:
    d = choose(1000, NAMES, {"prefill-1": 800}, 0, {})
    assert (d.instance, d.kind, d.expected_hit) == ("prefill-1", "local_hit", 800)


def test_store_hit_loads_where_queue_is_short() -> None:
    # both can load 600 from the store; prefill-0 is busy
    d = choose(1000, NAMES, {}, 600, {"prefill-0": 500})
    assert (d.instance, d.kind, d.expected_hit) == ("prefill-1", "store_hit", 600)


def test_load_outweighs_a_small_hit() -> None:
    # prefill-0 has 64 cached but 2,000 queued tokens: compute elsewhere
    d = choose(1000, NAMES, {"prefill-0": 64}, 0, {"prefill-0": 2000})
    assert d.instance == "prefill-1" and d.kind == "miss"


def test_cost_formula_values() -> None:
    # cost_0 = (1000 - 500) + 0.1 * (700 - 500) + 100 = 620 ; cost_1 = (1000 - 700) + 0.1 * 700 + 300 = 670
    d = choose(1000, NAMES, {"prefill-0": 500}, 700, {"prefill-0": 100, "prefill-1": 300})
    assert STORE_LOAD_COST == 0.1
    assert d.instance == "prefill-0" and d.kind == "store_hit"


def test_index_unavailable_routes_on_load_only() -> None:
    d = choose(1000, NAMES, {}, 0, {"prefill-0": 10, "prefill-1": 0}, index_ok=False)
    assert (d.instance, d.kind) == ("prefill-1", "index_unavailable")
    # ties break by name
    assert choose(10, NAMES, {}, 0, {}, index_ok=False).instance == "prefill-0"


def test_no_instances() -> None:
    with pytest.raises(ValueError):
        choose(10, [], {}, 0, {})


# -- queued work: what a dispatched prefill really costs its instance --------------------


def test_dispatch_work_is_tokens_to_compute_plus_store_loads() -> None:
    local = RouteDecision("prefill-0", 1984, 0, 1984, "local_hit")
    assert dispatch_work(2200, local) == 216
    store = RouteDecision("prefill-1", 1984, 1984, 0, "store_hit")
    assert dispatch_work(2200, store) == pytest.approx(216 + STORE_LOAD_COST * 1984)
    # a local hit at least as long as the store's: nothing is loaded
    both = RouteDecision("prefill-0", 2000, 1984, 2000, "local_hit")
    assert dispatch_work(2200, both) == 200
    assert dispatch_work(2200, RouteDecision("prefill-1", 0, 0, 0, "miss")) == 2200


def _route_round(n: int, hits: dict[str, dict[str, int]], store: dict[str, int]) -> dict[str, RouteDecision]:
    """Route one request per stream, all in flight at once (none returns in between),
    keeping the queued work as the orchestrator does."""
    queued = dict.fromkeys(NAMES, 0.0)
    out = {}
    for stream, local in hits.items():
        d = choose(n, NAMES, local, store.get(stream, 0), queued)
        queued[d.instance] += dispatch_work(n, d)
        out[stream] = d
    return out


def test_streams_in_flight_keep_their_hits_when_the_store_lags() -> None:
    # four streams of 2,200 tokens, each holding 1,984 on one instance; the store has
    # not published yet (its publisher runs after the put): every stream must stay
    # where its prefix is, since only 216 tokens each are queued there.
    hits = {
        "a": {"prefill-0": 1984},
        "b": {"prefill-0": 1984},
        "c": {"prefill-0": 1984},
        "d": {"prefill-1": 1984},
    }
    got = _route_round(2200, hits, {})
    assert {s: d.instance for s, d in got.items()} == {
        "a": "prefill-0",
        "b": "prefill-0",
        "c": "prefill-0",
        "d": "prefill-1",
    }
    assert all(d.expected_hit == 1984 for d in got.values())
    # what counting prompt tokens as queued work did: the second stream on prefill-0 was
    # sent to prefill-1 with nothing to hit there (2,200 recomputed instead of 216)
    queued = {"prefill-0": 2200.0, "prefill-1": 0.0}
    assert choose(2200, NAMES, hits["b"], 0, queued).kind == "miss"


def test_streams_in_flight_spread_over_store_loads() -> None:
    # with the store published, a busy instance's stream may load elsewhere:
    # still a hit (recompute 216), and the load is spread
    hits = {s: {"prefill-0": 1984} for s in "abcd"}
    got = _route_round(2200, hits, dict.fromkeys("abcd", 1984))
    assert all(d.expected_hit == 1984 for d in got.values())
    assert {d.instance for d in got.values()} == set(NAMES)
    assert sum(d.kind == "store_hit" for d in got.values()) >= 1


def test_queued_work_outweighs_a_hit_only_when_it_should() -> None:
    # prefill-0 holds 1,984 but has 3,000 tokens of real work queued: computing all
    # 2,200 on the idle instance finishes first
    d = choose(2200, NAMES, {"prefill-0": 1984}, 0, {"prefill-0": 3000.0, "prefill-1": 0.0})
    assert (d.instance, d.kind) == ("prefill-1", "miss")


# -- recent prefills: a hint until the index reports them ----------------------------------

U, B, A = 16, 64, 16
H = BlockHasher(unit=U, seed="routing-test")
STREAM = list(range(100, 100 + 4000))


def test_recent_prefill_is_a_local_hit_for_the_next_request_of_the_stream() -> None:
    rp = RecentPrefills(U, B, A, eagle=False)
    first = H.chain(STREAM[:2000])
    assert rp.record("prefill-1", first, 2000, 0) == 1984  # checkpoint_position(2000, 16)
    nxt = H.chain(STREAM[:2200])
    assert rp.hits(nxt, 2200) == {"prefill-1": 1984}
    # another stream shares nothing
    assert rp.hits(H.chain(list(range(5000, 7200))), 2200) == {}
    # a prompt that ends at the checkpoint cannot hit all of it (one token is computed)
    assert rp.hits(H.chain(STREAM[:1984]), 1984) == {}
    assert rp.hits(H.chain(STREAM[:1985]), 1985) == {"prefill-1": 1984}


def test_recent_prefill_under_eagle_needs_the_replay_block() -> None:
    rp = RecentPrefills(U, B, A, eagle=True)
    first = H.chain(STREAM[:2000])
    assert rp.record("prefill-0", first, 2000, 0) == 1968  # one unit lower under EAGLE
    assert rp.hits(H.chain(STREAM[:2200]), 2200) == {"prefill-0": 1968}
    # the hit replays block 1968..1984, so the prompt must go past 1984 (+1 computed)
    assert rp.hits(H.chain(STREAM[:1984]), 1984) == {}
    assert rp.hits(H.chain(STREAM[:1985]), 1985) == {"prefill-0": 1968}


def test_recent_prefill_agrees_with_the_index_rule() -> None:
    # the hint promises exactly what the index lookup promises once published
    for eagle in (False, True):
        rp = RecentPrefills(U, B, A, eagle=eagle)
        first = H.chain(STREAM[:2000])
        pos = rp.record("prefill-0", first, 2000, 0)
        for n in (1984, 1985, 2000, 2001, 2016, 2017, 2600):
            want = longest_usable_hit(n, U, [True] * len(first) + [False] * 200, {pos}, eagle)
            assert rp.hits(H.chain(STREAM[:n]), n).get("prefill-0", 0) == want, (eagle, n)


def test_recent_prefill_remembers_where_the_engine_said_it_checkpointed() -> None:
    """A vLLM P/D prefill of 2001 tokens computes 2000: its tail lies at 1984, not
    at checkpoint_position(2001) = 2000, and the engine reports it (tail_checkpoint)."""
    rp = RecentPrefills(U, B, A, eagle=False)
    first = H.chain(STREAM[:2001])
    assert rp.record("prefill-0", first, 2001, 0, position=1984) == 1984
    assert rp.hits(H.chain(STREAM[:2200]), 2200) == {"prefill-0": 1984}  # never the 2000 it did not write
    assert rp.record("prefill-1", first, 2001, 0, position=0) == 0  # the engine left none
    assert rp.record("prefill-1", first, 2001, 0, position=1990) == 0  # not on a unit boundary: refused
    assert "prefill-1" not in rp.hits(H.chain(STREAM[:2200]), 2200)


def test_recent_prefill_without_a_valid_checkpoint_is_not_remembered() -> None:
    rp = RecentPrefills(U, B, A, eagle=False)
    # started from a hit at 1984, computing 16 tokens: no unit before the checkpoint
    assert rp.record("prefill-0", H.chain(STREAM[:2000]), 2000, 1984) == 0
    assert RecentPrefills(U, B, None, eagle=False).record("prefill-0", H.chain(STREAM[:2000]), 2000, 0) == 0
    assert len(rp) == 0


def test_recent_prefill_merge_index_wins_then_forgets() -> None:
    rp = RecentPrefills(U, B, A, eagle=False)
    rp.record("prefill-1", H.chain(STREAM[:2000]), 2000, 0)
    nxt = H.chain(STREAM[:2200])
    # the index has not heard of it yet: the hint fills in
    assert rp.merge(nxt, 2200, {"prefill-0": 64, "prefill-1": 0}) == {"prefill-0": 64, "prefill-1": 1984}
    # the index reports it: index value kept, the hint dropped
    assert rp.merge(nxt, 2200, {"prefill-0": 64, "prefill-1": 1984}) == {"prefill-0": 64, "prefill-1": 1984}
    assert len(rp) == 0


def test_recent_prefill_expires_is_bounded_and_forgets_failed_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(routing.time, "monotonic", lambda: now[0])
    rp = RecentPrefills(U, B, A, eagle=False, ttl_s=5.0, max_entries=3)
    chains = {s: H.chain([s] * 7 + STREAM[: 2000 - 7]) for s in range(5)}
    for s, c in chains.items():
        rp.record("prefill-%d" % (s % 2), c, 2000, 0)
    assert len(rp) == 3  # the two oldest were dropped
    assert rp.hits(chains[0], 2100) == {} and rp.hits(chains[4], 2100) == {"prefill-0": 1984}
    rp.forget_instance("prefill-0")
    assert rp.hits(chains[4], 2100) == {} and rp.hits(chains[3], 2100) == {"prefill-1": 1984}
    now[0] += 6.0
    assert rp.hits(chains[3], 2100) == {}
    rp.merge(chains[3], 2100, {})
    assert len(rp) == 0


def test_the_next_turn_goes_to_the_decode_holder_unless_it_is_overloaded() -> None:
    names = ["d0", "d1", "d2"]
    assert choose_decode(names, {}, {}, 4, 5) == ("d2", "round_robin")
    assert choose_decode(names, {"d1": 3}, {}, 4, 0) == ("d1", "affinity")
    assert choose_decode(names, {"d1": 3, "d2": 5}, {"d2": 3, "d0": 0}, 4, 0) == ("d2", "affinity")
    assert choose_decode(names, {"d1": 3, "d2": 5}, {"d2": 4, "d0": 0}, 4, 0) == ("d0", "overloaded")
    assert choose_decode(["d0"], {"d0": 3}, {"d0": 9}, 0, 0) == ("d0", "affinity")  # nowhere else to go
    with pytest.raises(ValueError):
        choose_decode([], {}, {}, 4, 0)


def test_ties_spread_by_the_prompt_not_by_name() -> None:
    """Routers that know only their own queues: cold prompts spread over the instances
    (rendezvous hashing of the first chain hash), the same prompt start always to the
    same instance, and without a spread key the first name, as before."""
    names = ["prefill-%d" % i for i in range(4)]
    picks = [choose(100, names, {}, 0, {}, spread=b"prompt-%d" % k).instance for k in range(200)]
    counts = {n: picks.count(n) for n in names}
    assert all(30 <= c <= 70 for c in counts.values()), counts
    assert {choose(100, names, {}, 0, {}, spread=b"same").instance for _ in range(5)} == {
        choose(100, list(reversed(names)), {}, 0, {}, spread=b"same").instance
    }
    assert choose(100, names, {}, 0, {}).instance == "prefill-0"
    # cost and queue still come first: a hit or a shorter queue wins over the hash
    assert choose(100, names, {"prefill-3": 64}, 0, {}, spread=b"x").instance == "prefill-3"
    assert choose(100, names, {}, 0, {n: 10.0 for n in names[1:]}, spread=b"x").instance == "prefill-0"
