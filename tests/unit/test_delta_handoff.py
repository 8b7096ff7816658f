"""Delta handoffs: decode keeps the conversation, and a turn's handoff moves only
what decode lacks; outputs stay exactly those of a no-cache run.

A conversation runs turn after turn through a prefill and a decode engine with
real NIXL agents (both in this process), the ticket pickled as it is across
Ray: each turn's prompt is the previous prompt, the answer decode produced and
a new user message. Decode's prefix cache holds the previous turns' handed-off
prompt blocks, so the next turn READs only the rest: the new blocks, the
partial last one, the final state and the draft hidden. Tokens and the logits
that chose them are ``torch.equal`` to a fresh no-cache run's (fp32), after two
and after ten turns, with EAGLE on and off, and when decode lost a block
between turns (it must READ that block, not fail).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from hybridpd.engine.base import EngineRequest
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.engine.native.handoff import FetchedHandoff, NativeTicket
from tests.unit.engine_helpers import (
    assert_no_leaks,
    bundled_model_fixture,  # noqa: F401  (autouse: both bundled models)
    make_engine,
    prompt,
    req,
)
from tests.wait import wait_until

#: exactness tests: only where fp32 matmul rows are batch-invariant (checked)
pytestmark = pytest.mark.usefixtures("fp32_row_exact")

MAX_TOKENS = 6


@dataclass
class Turn:
    tokens: list[int]
    logits: list[torch.Tensor]
    ticket: NativeTicket
    fetched: FetchedHandoff
    held: int


@pytest.fixture
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[NativeEngine, NativeEngine]]:
    eagle = getattr(request, "param", False)
    name = request.node.name.replace("[", "-").replace("]", "")[:40]
    kw = {"eagle": eagle, "record_logits": True, "mamba_block_size": None}
    prefill = make_engine(role="prefill", instance="p-" + name, **kw)
    decode = make_engine(role="decode", instance="d-" + name, **kw)
    yield prefill, decode
    prefill.close()
    decode.close()


def _offer(prefill: NativeEngine, rid: str, toks: tuple[int, ...]) -> tuple[EngineRequest, NativeTicket]:
    """Prefill ``toks`` as the prefill worker does; its request and NIXL ticket."""
    r = req(rid, toks, MAX_TOKENS)
    prefill.add_request(r, prefill_only=True)
    while prefill.has_work():
        prefill.step()
    ticket = prefill.pop_handoff(rid)
    assert isinstance(ticket, NativeTicket)
    return r, ticket


def _turn(prefill: NativeEngine, decode: NativeEngine, rid: str, toks: tuple[int, ...]) -> Turn:
    """One turn as the workers run it: prefill, offer, prepare (decode lock), fetch, add, decode."""
    r, ticket = _offer(prefill, rid, toks)
    ticket = pickle.loads(pickle.dumps(ticket))
    held = decode.prepare_handoff(r, ticket)
    fetched = decode.fetch_handoff(r, ticket)
    decode.add_handoff(r, fetched)
    tokens = [ticket.first_token_id]
    while decode.has_work():
        for o in decode.step():
            tokens.extend(o.new_token_ids)
    assert prefill.logit_log is not None and decode.logit_log is not None
    logits = [*prefill.logit_log[rid], *decode.logit_log[rid]]
    return Turn(tokens, logits, ticket, fetched, held)


def _no_cache(toks: tuple[int, ...], eagle: bool) -> tuple[list[int], list[torch.Tensor]]:
    eng = make_engine(enable_prefix_caching=False, record_logits=True, eagle=eagle, mamba_block_size=None)
    got = eng.generate([req("ref", toks, MAX_TOKENS)])
    assert eng.logit_log is not None
    return got["ref"], eng.logit_log["ref"]


def _same(turn: Turn, toks: tuple[int, ...], eagle: bool) -> None:
    want_tokens, want_logits = _no_cache(toks, eagle)
    assert turn.tokens == want_tokens
    assert len(turn.logits) == len(want_logits)
    for a, b in zip(turn.logits, want_logits, strict=True):
        assert torch.equal(a, b)


def _kv_bytes_per_token(ticket: NativeTicket) -> int:
    n_kv = len(ticket.kv_meta.shapes)
    return sum(spec.row_bytes for spec in ticket.descriptor.buffers[:n_kv])


def _fixed_bytes(ticket: NativeTicket) -> int:
    """The final state and the draft hidden: they move whole every turn."""
    n_kv = len(ticket.kv_meta.shapes)
    return sum(spec.nbytes for spec in ticket.descriptor.buffers[n_kv:])


def _conversation(
    prefill: NativeEngine, decode: NativeEngine, turns: int, eagle: bool, lose_block: bool = False
) -> None:
    u = decode.unit
    toks = prompt(90, 7)
    prev = 0  # the previous turn's prompt length
    for k in range(turns):
        if lose_block and k == 1:  # decode lost a block of the conversation between turns
            lost = decode.hasher.chain(list(toks))[1]
            assert decode.kv_pool.lookup(lost) is not None
            decode.kv_pool.uncache(lost)
        t = _turn(prefill, decode, "turn%d" % k, toks)
        _same(t, toks, eagle)
        n = len(toks)
        if k == 0:
            assert t.held == 0 and t.fetched.nbytes == t.ticket.nbytes and t.fetched.skipped_bytes == 0
        else:
            lost_now = 1 if lose_block and k == 1 else 0
            held = prev // u - lost_now
            assert t.held == held > 0 and len(t.fetched.held) == held
            new = n - prev
            per_token = _kv_bytes_per_token(t.ticket)
            # the done-when bound: (new tokens + u) x KV bytes per token + the state and draft
            # hidden, and the lost block once more
            assert t.fetched.nbytes <= (new + u + lost_now * u) * per_token + _fixed_bytes(t.ticket)
            assert t.fetched.nbytes == t.ticket.nbytes - held * u * per_token
            assert t.fetched.skipped_bytes == held * u * per_token
        prev = n
        toks = toks + tuple(t.tokens) + prompt(37, 100 + k)  # the answer, then the next user message
    assert_no_leaks(prefill)
    assert_no_leaks(decode)
    assert decode.kv_pool.num_cached >= prev // u  # the last turn's prompt stays for the next
    wait_until(lambda: prefill.handoff_stats().outstanding == 0, 10, 0.01, "prefill to see the releases")


@pytest.mark.parametrize("engines", [False, True], ids=["plain", "eagle"], indirect=True)
def test_a_delta_handoff_after_two_turns_is_exact(engines: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, decode = engines
    _conversation(prefill, decode, 2, prefill.cfg.eagle)


def test_a_delta_handoff_after_ten_turns_is_exact(engines: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, decode = engines
    _conversation(prefill, decode, 10, False)


def test_a_block_decode_lost_between_turns_is_read(engines: tuple[NativeEngine, NativeEngine]) -> None:
    prefill, decode = engines
    _conversation(prefill, decode, 3, False, lose_block=True)


def test_a_pinned_block_survives_admissions_until_the_handoff_takes_it(
    engines: tuple[NativeEngine, NativeEngine],
) -> None:
    """Between prepare_handoff and add_handoff other handoffs may be admitted: the
    pinned blocks are not free, so no admission evicts them; an abort in between
    releases them."""
    prefill, decode = engines
    toks = prompt(130, 9)
    first = _turn(prefill, decode, "a", toks)
    nxt = toks + tuple(first.tokens) + prompt(20, 10)
    r, ticket = _offer(prefill, "b", nxt)
    assert decode.prepare_handoff(r, ticket) == 130 // decode.unit
    # take every free block, as concurrent admissions would: the pinned ones are not among them
    free = decode.kv_pool.allocate(decode.kv_pool.num_free)
    assert free is not None
    assert all(decode.kv_pool.lookup(h) is not None for h in ticket.block_hashes[: 130 // decode.unit])
    decode.kv_pool.free(free)
    assert decode.abort("b")  # the pins are released
    assert decode.stats().num_free_blocks == decode.stats().num_blocks
    decode.fetch_handoff(r, ticket)  # read whole (nothing pinned), then dropped
    assert_no_leaks(decode)


def test_a_fetch_that_skipped_blocks_never_pinned_is_refused(engines: tuple[NativeEngine, NativeEngine]) -> None:
    """add_handoff never uses rows that were not read: a fetched handoff claiming
    held blocks this engine does not hold pinned is an IntegrityError."""
    import dataclasses

    from hybridpd.errors import IntegrityError

    prefill, decode = engines
    toks = prompt(100, 11)
    r, ticket = _offer(prefill, "x", toks)
    fetched = decode.fetch_handoff(r, ticket)
    with pytest.raises(IntegrityError, match="did not pin"):
        decode.add_handoff(r, dataclasses.replace(fetched, held=frozenset({0})))
    assert_no_leaks(decode)


def test_an_abort_before_the_pins_releases_them_at_submit(engines: tuple[NativeEngine, NativeEngine]) -> None:
    """The decode worker pins, fetches and submits inside ``EngineLoop.reserved``; an
    abort that arrived before the pins were taken ends the request at submit, and
    the pins go with it (no block stays referenced)."""
    from hybridpd.engine.base import FinishReason
    from services.worker.engine_loop import EngineLoop

    prefill, decode = engines
    toks = prompt(130, 12)
    first = _turn(prefill, decode, "a", toks)
    nxt = toks + tuple(first.tokens) + prompt(20, 13)
    r, ticket = _offer(prefill, "b", nxt)
    loop = EngineLoop(decode)
    try:
        with loop.reserved("b"):
            assert loop.abort("b")  # the client went away before the worker pinned anything
            with loop.lock:
                assert decode.prepare_handoff(r, ticket) == 130 // decode.unit
            fetched = decode.fetch_handoff(r, ticket)
            q = loop.submit("b", lambda: decode.add_handoff(r, fetched))
        out = q.get(timeout=10)
        assert isinstance(out, object) and getattr(out, "finish_reason", None) is FinishReason.ABORT
        with loop.lock:
            assert_no_leaks(decode)
    finally:
        loop.close()


def test_a_corrupted_delta_handoff_fails_its_checksum(engines: tuple[NativeEngine, NativeEngine]) -> None:
    """The fault hook corrupts what every read moves (the state): a delta handoff,
    which skips the blocks decode holds, still fails its checksum, and the worker's
    abort releases the pins."""
    from hybridpd.engine.native.handoff import CORRUPT_NEXT
    from hybridpd.errors import IntegrityError

    prefill, decode = engines
    toks = prompt(130, 14)
    first = _turn(prefill, decode, "a", toks)
    prefill.inject_fault(CORRUPT_NEXT)
    r, ticket = _offer(prefill, "b", toks + tuple(first.tokens) + prompt(20, 15))
    assert decode.prepare_handoff(r, ticket) == 130 // decode.unit
    with pytest.raises(IntegrityError, match="checksum"):
        decode.fetch_handoff(r, ticket)
    assert decode.abort("b")  # as DecodeWorker._fetch does after a failed fetch
    assert_no_leaks(decode)
