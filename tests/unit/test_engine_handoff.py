"""The native P/D handoff through the engine boundary: tickets, real NIXL agents
(both engines in this process), the faults, the accounting, and misuse.

Token equality of the handed-off request with a plain run is
``test_engine_equivalence.py::test_prefill_decode_handoff``."""

from __future__ import annotations

import functools
import pickle
import threading
import time
from collections.abc import Iterator

import pytest

from hybridpd.engine.base import (
    CacheEventKind,
    CacheGroup,
    EngineRequest,
    HandoffStats,
    HandoffTicket,
    RequestOutput,
)
from hybridpd.engine.native import handoff as native_handoff
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.engine.native.handoff import FetchedHandoff, NativeTicket
from hybridpd.errors import IntegrityError, InvalidRequestError, OverloadedError
from hybridpd.transfer.handoff_descriptor import HandoffError
from hybridpd.transfer.nixl_handoff import HandoffClient
from tests.unit.engine_helpers import assert_no_leaks, make_engine, prompt, req

TOKENS = prompt(70, 5)


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[NativeEngine, NativeEngine]]:
    """A prefill and a decode engine; ``indirect`` params override both configs."""
    overrides = getattr(request, "param", {})
    name = request.node.name.replace("[", "-").replace("]", "")[:40]
    prefill = make_engine(role="prefill", instance="p-" + name, **overrides)
    decode = make_engine(role="decode", instance="d-" + name, **overrides)
    yield prefill, decode
    prefill.close()
    decode.close()


def _run(eng: NativeEngine) -> list[RequestOutput]:
    outs = []
    while eng.has_work():
        outs.extend(eng.step())
    return outs


def _prefill(eng: NativeEngine, r: EngineRequest) -> NativeTicket:
    eng.add_request(r, prefill_only=True)
    (out,) = _run(eng)
    assert out.finished and out.finish_reason is None and len(out.new_token_ids) == 1
    ticket = eng.pop_handoff(r.request_id)
    assert isinstance(ticket, NativeTicket)
    return ticket


def _drained(eng: NativeEngine, timeout_s: float = 10.0) -> HandoffStats:
    """Handoff stats once nothing is outstanding (releases arrive asynchronously),
    with the latencies of every poll."""
    deadline = time.monotonic() + timeout_s
    latencies: list[float] = []
    while True:
        stats = eng.handoff_stats()
        latencies += stats.release_latencies
        if not stats.outstanding or time.monotonic() > deadline:
            time.sleep(0.05)  # a release's latency is recorded right after its offer is freed
            stats = eng.handoff_stats()
            return HandoffStats(stats.outstanding, stats.expired, (*latencies, *stats.release_latencies))
        time.sleep(0.01)


def test_ticket_fields_and_pickling(pair: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, decode = pair
    assert prefill.handoff_stats() == HandoffStats()  # no server yet
    r = req("t", TOKENS, 5)
    ticket = _prefill(prefill, r)
    assert isinstance(ticket, HandoffTicket) and ticket.request_id == "t"
    assert ticket.nbytes == ticket.descriptor.nbytes == sum(b.nbytes for b in ticket.descriptor.buffers) > 0
    assert ticket.expires_at == ticket.descriptor.expires_at > time.time()
    assert ticket.kv_meta.position == ticket.state_meta.position == ticket.draft_meta.position == 70
    assert ticket.num_cached_tokens == 0
    copy = pickle.loads(pickle.dumps(ticket))
    assert copy == ticket and type(copy) is NativeTicket
    fetched = decode.fetch_handoff(r, copy)
    assert isinstance(fetched, FetchedHandoff) and fetched.nbytes == ticket.nbytes
    assert fetched.handoff.first_token_id == ticket.first_token_id
    decode.add_handoff(r, fetched)
    outs = _run(decode)
    assert sum(len(o.new_token_ids) for o in outs) == 4 and outs[-1].finish_reason == "length"
    stats = _drained(prefill)
    assert stats.outstanding == 0 and stats.expired == 0 and len(stats.release_latencies) == 1
    assert prefill.handoff_stats().release_latencies == ()  # drained
    # the handed-off prompt's full blocks enter decode's cache (the next turn's delta
    # handoff skips them); the KV decode computed never does
    (ev,) = decode.pop_cache_events()
    full = decode.hasher.chain(list(TOKENS))[: len(TOKENS) // decode.unit]
    assert (ev.kind, ev.group) == (CacheEventKind.STORED, CacheGroup.KV) and len(full) >= 2
    assert list(ev.hashes) == list(ticket.block_hashes) == full
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def test_in_process_handoff_without_nixl() -> None:
    prefill, decode = make_engine(), make_engine()
    r = req("l", TOKENS, 5)
    prefill.add_request(r, prefill_only=True)
    first = _run(prefill)
    fetched = prefill.take_handoff("l")
    assert fetched is not None and prefill.take_handoff("l") is None
    decode.add_handoff(r, fetched)
    tokens = [*first[0].new_token_ids, *(t for o in _run(decode) for t in o.new_token_ids)]
    assert tokens == make_engine().generate([r])["l"]
    assert prefill.transport._server is None and decode.transport._client is None  # no agents started
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def test_a_request_finished_at_its_first_token_has_no_handoff(pair: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, _ = pair
    prefill.add_request(req("one", TOKENS, 1), prefill_only=True)
    (out,) = _run(prefill)
    assert out.finish_reason == "length"
    assert prefill.pop_handoff("one") is None
    assert_no_leaks(prefill)


def test_corrupted_handoff_fails_its_checksum(pair: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, decode = pair
    prefill.inject_fault("corrupt_next_handoff")
    r = req("c", TOKENS, 5)
    with pytest.raises(IntegrityError, match="checksum"):
        decode.fetch_handoff(r, _prefill(prefill, r))
    assert prefill.handoff_stats().outstanding == 1  # never released: prefill keeps it until its timeout
    # the fault hits once: the next handoff is clean
    r2 = req("c2", TOKENS, 5)
    decode.add_handoff(r2, decode.fetch_handoff(r2, _prefill(prefill, r2)))
    _run(decode)
    assert_no_leaks(decode)


@pytest.mark.parametrize("pair", [{"handoff_timeout_s": 0.3}], indirect=True)
def test_a_read_after_the_expiry_fails_and_prefill_frees_it(pair: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, decode = pair
    decode.inject_fault("delay_next_handoff_read")
    r = req("d", TOKENS, 5)
    t0 = time.time()
    ticket = _prefill(prefill, r)
    with pytest.raises(HandoffError, match="expired"):
        decode.fetch_handoff(r, ticket)
    assert time.time() >= ticket.descriptor.expires_at + 0.5 > t0
    stats = _drained(prefill)
    assert stats.outstanding == 0 and stats.expired == 1 and stats.release_latencies == ()


def test_unknown_fault_is_refused() -> None:
    eng = make_engine()
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        eng.inject_fault("explode")


def test_misuse_is_refused(pair: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, decode = pair
    r = req("m", TOKENS, 5)
    ticket = _prefill(prefill, r)
    with pytest.raises(TypeError, match="NativeTicket"):
        decode.fetch_handoff(r, HandoffTicket("m"))
    with pytest.raises(IntegrityError, match="offered for request other"):
        decode.fetch_handoff(req("other", TOKENS, 5), ticket)
    with pytest.raises(TypeError, match="FetchedHandoff"):
        decode.add_handoff(r, ticket)  # not fetched
    fetched = decode.fetch_handoff(r, ticket)
    with pytest.raises(IntegrityError, match="given for other"):
        decode.add_handoff(req("other", TOKENS, 5), fetched)
    with pytest.raises(IntegrityError, match="shapes"):  # another prompt length than the KV's
        decode.add_handoff(req("m", TOKENS[:60], 5), fetched)
    decode.add_handoff(r, fetched)
    with pytest.raises(InvalidRequestError, match="duplicate"):
        decode.add_handoff(r, fetched)
    _run(decode)
    assert_no_leaks(decode)


@pytest.mark.parametrize("pair", [{"num_kv_blocks": 16}], indirect=True)
def test_a_handoff_without_free_blocks_is_refused(pair: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, decode = pair
    r1, r2 = req("b1", TOKENS, 60), req("b2", TOKENS, 60)  # 130 tokens: 9 of the 16 blocks each
    decode.add_handoff(r1, decode.fetch_handoff(r1, _prefill(prefill, r1)))
    fetched = decode.fetch_handoff(r2, _prefill(prefill, r2))
    with pytest.raises(OverloadedError, match="no KV blocks"):
        decode.add_handoff(r2, fetched)
    assert decode.stats().num_running == 1
    with pytest.raises(InvalidRequestError, match="KV blocks"):  # more than the engine has at all
        decode.add_handoff(req("b2", TOKENS, 190), fetched)
    assert decode.abort("b1")
    _run(decode)
    decode.add_handoff(r2, fetched)  # room again
    _run(decode)
    assert_no_leaks(decode)


def test_abort_drops_an_unclaimed_handoff() -> None:
    eng = make_engine()
    eng.add_request(req("u", TOKENS, 5), prefill_only=True)
    _run(eng)
    assert eng.abort("u")
    assert eng.step() == []  # it had finished: no abort output
    assert eng.pop_handoff("u") is None and not eng.abort("u")
    assert_no_leaks(eng)


def test_pop_handoff_runs_concurrently_with_step(pair: tuple[NativeEngine, NativeEngine]) -> None:
    """The workers call pop_handoff without the engine lock while the loop steps."""
    prefill, _ = pair
    n = 6
    for i in range(n):
        prefill.add_request(req("x%d" % i, prompt(40 + 16 * i, i), 4), prefill_only=True)
    tickets: dict[str, NativeTicket] = {}
    done = threading.Event()

    def popper() -> None:
        while len(tickets) < n and not done.is_set():
            for i in range(n):
                rid = "x%d" % i
                if rid not in tickets:
                    t = prefill.pop_handoff(rid)
                    if t is not None:
                        tickets[rid] = t
            time.sleep(0.001)  # NOTE: a bare spin holds the GIL the stepping thread needs

    th = threading.Thread(target=popper)
    th.start()
    try:
        _run(prefill)
    finally:
        th.join(30)
        done.set()
    assert sorted(tickets) == ["x%d" % i for i in range(n)]
    assert prefill.handoff_stats().outstanding == n
    assert_no_leaks(prefill)


def test_an_abort_after_the_offer_withdraws_it(
    pair: tuple[NativeEngine, NativeEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request aborted between its prefill and decode's read (a stop string in the
    first token, a client gone) frees its NIXL offer at once, not at the timeout."""
    prefill, decode = pair
    # NOTE: a READ of a withdrawn offer does not complete: it ends at the client's read
    # timeout (30 s by default, not a config field), 2 s here, a HandoffError all the same
    monkeypatch.setattr(native_handoff, "HandoffClient", functools.partial(HandoffClient, read_timeout_s=2.0))
    r = req("w", TOKENS, 5)
    ticket = _prefill(prefill, r)
    assert prefill.handoff_stats().outstanding == 1
    assert prefill.abort("w")
    assert prefill.handoff_stats().outstanding == 0
    with pytest.raises((HandoffError, IntegrityError)):
        decode.fetch_handoff(r, ticket)  # gone: never silently read
    assert not prefill.abort("w")  # nothing left to withdraw


def test_offers_of_one_request_id_do_not_overwrite_each_other(pair: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, decode = pair
    r = req("same", TOKENS, 5)
    first = _prefill(prefill, r)
    second = _prefill(prefill, r)  # e.g. a handoff retried on the same instance
    assert first.descriptor.handoff_id != second.descriptor.handoff_id
    assert prefill.handoff_stats().outstanding == 2
    for ticket in (first, second):
        got = decode.fetch_handoff(r, ticket)
        assert isinstance(got, FetchedHandoff)
    assert _drained(prefill).outstanding == 0
