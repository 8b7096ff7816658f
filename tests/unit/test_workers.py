"""The service layer without Ray: ``EngineLoop``, ``PrefillWorker`` and
``DecodeWorker`` driven in-process over a toy engine that satisfies the engine
boundary (``tests/unit/toy_engine.py``); typed counters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridpd.config import HybridPDConfig, load_config
from hybridpd.engine.base import Engine, EngineRequest, FinishReason, RequestId, RequestOutput, SamplingParams
from hybridpd.errors import IntegrityError, InvalidRequestError, UnavailableError
from services.decode.actor import DecodeWorker
from services.prefill.actor import PrefillWorker
from services.worker.engine_loop import EngineLoop
from services.worker.messages import PrefillCommand
from services.worker.metrics import DecodeCounters, PrefillCounters
from tests.unit.toy_engine import ToyEngine, next_token


def _req(rid: str, n: int = 40, max_tokens: int = 6, seed: int = 1) -> EngineRequest:
    prompt = tuple((seed * 97 + i * 13) % 900 + 1 for i in range(n))
    return EngineRequest(RequestId(rid), prompt, SamplingParams(max_tokens=max_tokens))


def _expected(req: EngineRequest) -> list[int]:
    toks = list(req.prompt_token_ids)
    for _ in range(req.sampling.max_tokens):
        toks.append(next_token(toks))
    return toks[len(req.prompt_token_ids) :]


def _cfg(**kw: object) -> HybridPDConfig:
    return load_config(env={}, overrides=kw)


@pytest.fixture
def workers() -> Iterator[tuple[PrefillWorker, DecodeWorker, ToyEngine, ToyEngine]]:
    pe, de = ToyEngine(), ToyEngine()
    cfg = _cfg(fault_injection=True)
    p = PrefillWorker(cfg, "prefill-0", None, None, None, engine=pe)
    d = DecodeWorker(cfg, "decode-0", engine=de)
    yield p, d, pe, de
    p.close()
    d.close()


def test_the_toy_engine_satisfies_the_engine_boundary() -> None:
    assert isinstance(ToyEngine(), Engine)


# -- EngineLoop ------------------------------------------------------------------------------
def test_engine_loop_delivers_outputs_in_order_and_sleeps_when_idle() -> None:
    eng = ToyEngine()
    loop = EngineLoop(eng)
    try:
        req = _req("a")
        q = loop.submit(req.request_id, lambda: eng.add_request(req))
        got = []
        while True:
            out = q.get(timeout=10)
            assert not isinstance(out, BaseException)
            got.extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH
                break
        assert got == _expected(req)
        time.sleep(0.2)
        steps = eng.steps
        time.sleep(0.5)
        assert eng.steps == steps  # idle: no step, no spin
    finally:
        loop.close()


class _Bookkeeping(ToyEngine):
    """Has work but, after its first step, nothing to compute (vLLM waiting on its
    connector): polls every 5 s."""

    def has_work(self) -> bool:
        return True

    stepped_at = 0.0

    def idle_poll_s(self) -> float:
        return 0.0 if self.seqs or self.pending or not self.steps else 5.0

    def step(self) -> list[RequestOutput]:
        rest = self.idle_poll_s() - (time.monotonic() - self.stepped_at)  # as vLLM's engine: never spin
        if rest > 0:
            time.sleep(rest)
        try:
            return super().step()
        finally:
            self.stepped_at = time.monotonic()


def test_engine_loop_waits_out_a_poll_outside_its_lock_and_a_submit_ends_it() -> None:
    eng = _Bookkeeping()
    loop = EngineLoop(eng)
    try:
        deadline = time.monotonic() + 10
        while eng.steps == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.steps >= 1  # it stepped once, and now waits out its 5 s poll
        assert loop.lock.acquire(timeout=2.0)  # not held while it waits
        loop.lock.release()
        req = _req("a")
        t0 = time.monotonic()
        q = loop.submit(req.request_id, lambda: eng.add_request(req))
        out = q.get(timeout=10)
        assert not isinstance(out, BaseException) and out.new_token_ids
        assert time.monotonic() - t0 < 5.0  # the submit ended the wait (else the first output waits 5 s)
    finally:
        loop.close()


def test_engine_loop_abort_gives_the_reader_a_final_abort_and_frees_the_request() -> None:
    eng = ToyEngine()
    loop = EngineLoop(eng)
    try:
        req = _req("a", max_tokens=10_000)
        q = loop.submit(req.request_id, lambda: eng.add_request(req))
        assert not isinstance(q.get(timeout=10), BaseException)
        assert loop.abort(req.request_id)
        while True:
            out = q.get(timeout=10)
            assert not isinstance(out, BaseException)
            if out.finished:
                assert out.finish_reason is FinishReason.ABORT
                break
        with loop.lock:
            assert not eng.seqs
    finally:
        loop.close()


def test_a_duplicate_submit_is_refused_and_the_first_reader_keeps_its_queue() -> None:
    eng = ToyEngine()
    loop = EngineLoop(eng)
    try:
        req = _req("a", max_tokens=10_000)
        q = loop.submit(req.request_id, lambda: eng.add_request(req))
        with pytest.raises(InvalidRequestError, match="already running"):
            loop.submit(req.request_id, lambda: eng.add_request(req))
        with pytest.raises(InvalidRequestError, match="already running"):
            with loop.reserved(req.request_id):
                pass
        assert not isinstance(q.get(timeout=10), BaseException)  # still fed
        loop.abort(req.request_id)
    finally:
        loop.close()


def test_an_abort_before_submit_ends_the_request_at_submit() -> None:
    eng = ToyEngine()
    loop = EngineLoop(eng)
    try:
        req = _req("a")
        with loop.reserved(req.request_id):
            assert loop.abort(req.request_id)  # e.g. while a handoff is fetched
            q = loop.submit(req.request_id, lambda: eng.add_request(req))
        out = q.get(timeout=10)
        assert not isinstance(out, BaseException) and out.finished and out.finish_reason is FinishReason.ABORT
        with loop.lock:
            assert not eng.seqs and eng.steps == 0  # never added, never run
        # the id is free again afterwards, and an abort of an unknown id marks nothing
        assert not loop.abort(req.request_id)
        q2 = loop.submit(req.request_id, lambda: eng.add_request(req))
        assert [
            t
            for o in (q2.get(timeout=10) for _ in range(6))
            if not isinstance(o, BaseException)
            for t in o.new_token_ids
        ] == _expected(req)
    finally:
        loop.close()


def test_an_abort_before_the_request_arrives_ends_it_at_its_reserve() -> None:
    """A threaded actor may run the router's abort before the call sent ahead of it."""
    eng = ToyEngine()
    loop = EngineLoop(eng)
    try:
        req = _req("a")
        assert not loop.abort(req.request_id)  # nothing here yet: remembered
        with loop.reserved(req.request_id):
            assert loop.aborted(req.request_id)
            q = loop.submit(req.request_id, lambda: eng.add_request(req))
        out = q.get(timeout=10)
        assert not isinstance(out, BaseException) and out.finish_reason is FinishReason.ABORT
        with loop.lock:
            assert not eng.seqs and eng.steps == 0
        with loop.reserved(req.request_id):  # consumed: the id runs normally afterwards
            assert not loop.aborted(req.request_id)
        assert not loop.abort(req.request_id)  # a late abort of an id seen here is not remembered
        with loop.reserved(req.request_id):
            assert not loop.aborted(req.request_id)
    finally:
        loop.close()


def test_a_failing_step_fails_its_requests_not_the_loop() -> None:
    eng = ToyEngine()
    loop = EngineLoop(eng)
    try:
        with loop.lock:
            eng.fail_next_step = True
            req = _req("a")
            q = loop.submit(req.request_id, lambda: eng.add_request(req))
        out = q.get(timeout=10)
        assert isinstance(out, RuntimeError)
        with loop.lock:
            assert not eng.seqs  # aborted in the engine
        req2 = _req("b")
        q2 = loop.submit(req2.request_id, lambda: eng.add_request(req2))
        outs = [q2.get(timeout=10) for _ in range(req2.sampling.max_tokens)]
        assert [t for o in outs if not isinstance(o, BaseException) for t in o.new_token_ids] == _expected(req2)
    finally:
        loop.close()


# -- prefill and decode workers ------------------------------------------------------------------
def test_prefill_then_decode_equals_a_local_run(workers) -> None:  # type: ignore[no-untyped-def]
    p, d, _, de = workers
    req = _req("r1", max_tokens=7)
    pr = p.prefill(PrefillCommand(req))
    assert pr.has_handoff and pr.finish_reason is None and len(pr.token_ids) == 1
    chunks = list(d.generate(pr, req))
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert [*pr.token_ids, *(t for c in chunks for t in c.token_ids)] == _expected(req)
    ps, ds = p.stats(), d.stats()
    assert ps["prefill_computed_tokens"] == 40 and ps["handoff_offered_bytes"] == pr.ticket.nbytes > 0
    assert ds["decode_handoffs"] == 1 and ds["decode_tokens"] == 6 and ds["nixl_read_bytes"] == pr.ticket.nbytes
    assert not de.seqs


def test_a_request_finished_at_prefill_has_no_ticket(workers) -> None:  # type: ignore[no-untyped-def]
    p, _, _, _ = workers
    req = _req("r1", max_tokens=1)
    pr = p.prefill(PrefillCommand(req))
    assert pr.ticket is None and pr.finish_reason == "length" and pr.token_ids == tuple(_expected(req))


def test_a_second_prefill_of_the_prompt_reports_the_cached_tokens(workers) -> None:  # type: ignore[no-untyped-def]
    p, _, _, _ = workers
    p.prefill(PrefillCommand(_req("a", n=40)))
    pr = p.prefill(PrefillCommand(_req("b", n=40)))
    assert pr.num_cached_tokens == 32 and p.stats()["prefill_loaded_tokens"] == 32


def test_a_corrupt_handoff_fails_its_checksum_and_is_counted(workers) -> None:  # type: ignore[no-untyped-def]
    p, d, _, de = workers
    p.inject_fault("corrupt_next_handoff")
    req = _req("r1")
    pr = p.prefill(PrefillCommand(req))
    with pytest.raises(IntegrityError):
        list(d.generate(pr, req))
    assert d.stats()["checksum_failures"] == 1 and not de.seqs


def test_fault_injection_needs_the_config_switch() -> None:
    p = PrefillWorker(_cfg(), "prefill-0", None, None, None, engine=ToyEngine())
    try:
        with pytest.raises(PermissionError):
            p.inject_fault("corrupt_next_handoff")
    finally:
        p.close()


def test_a_consumer_going_away_aborts_the_decode(workers) -> None:  # type: ignore[no-untyped-def]
    p, d, _, de = workers
    req = _req("r1", max_tokens=100_000)
    pr = p.prefill(PrefillCommand(req))
    gen = d.generate(pr, req)
    first = next(gen)
    assert first.token_ids and not first.finished
    gen.close()  # what Ray does when the router drops the stream
    with d.loop.lock:
        assert not de.seqs


def test_a_decode_aborted_before_it_starts_pins_and_reads_nothing(workers) -> None:  # type: ignore[no-untyped-def]
    p, d, _, de = workers
    req = _req("r1", max_tokens=100_000)
    pr = p.prefill(PrefillCommand(req))
    d.abort(req.request_id)  # the router's abort ran first (the client cancelled at once)
    chunks = list(d.generate(pr, req))
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].finish_reason == "abort"
    assert d.stats()["decode_handoffs"] == 0
    with d.loop.lock:
        assert not de.seqs


def test_a_prefill_without_token_or_ticket_is_an_error() -> None:
    class NoTicket(ToyEngine):
        def pop_handoff(self, request_id: str) -> None:
            return None

        def step(self):  # type: ignore[no-untyped-def]
            outs = super().step()
            return [type(o)(o.request_id, (), o.finished, o.finish_reason, o.num_prompt_tokens) for o in outs]

    p = PrefillWorker(_cfg(), "prefill-0", None, None, None, engine=NoTicket())
    try:
        with pytest.raises(UnavailableError, match="neither a token nor a handoff"):
            p.prefill(PrefillCommand(_req("r1")))
    finally:
        p.close()


def test_close_closes_the_engine(workers) -> None:  # type: ignore[no-untyped-def]
    p, d, pe, de = workers
    p.close()
    d.close()
    assert pe.closed and de.closed


# -- typed counters --------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [PrefillCounters, DecodeCounters])
def test_an_unknown_counter_name_is_an_error(cls: type) -> None:
    c = cls()
    with pytest.raises(AttributeError):
        c.handoffs += 1


def test_a_worker_answer_of_the_wrong_type_is_refused_under_python_O_too() -> None:
    import subprocess
    import sys

    code = (
        "from services.worker.api import _typed\n"
        "from hybridpd.errors import IntegrityError\n"
        "assert_off = __debug__ is False\n"
        "try:\n"
        "    _typed([1], dict, 'prefill-0')\n"
        "except IntegrityError as e:\n"
        "    print('refused', assert_off, e)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.startswith("refused True prefill-0 answered a list, not a dict"), out.stdout + out.stderr
