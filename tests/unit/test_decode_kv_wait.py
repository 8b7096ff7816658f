"""A full decode engine makes a handoff wait for KV blocks (bounded) instead of
failing a started stream: the second request continues once the first frees its
blocks, with the tokens of a plain run, and the wait is counted."""

from __future__ import annotations

import threading
import time

import pytest

from hybridpd.engine.base import RequestOutput
from hybridpd.engine.native.engine import NativeEngine
from services.decode import actor as decode_actor
from services.decode.actor import DecodeWorker
from services.worker.messages import PrefillResult
from tests.unit.engine_helpers import make_engine, prompt, req

pytestmark = pytest.mark.unit

TOKENS, OTHER = prompt(70, 5), prompt(70, 6)  # no shared blocks: the second pins nothing


def _prefill(eng: NativeEngine, r) -> PrefillResult:  # type: ignore[no-untyped-def]
    eng.add_request(r, prefill_only=True)
    outs: list[RequestOutput] = []
    while eng.has_work():
        outs.extend(eng.step())
    ticket = eng.pop_handoff(r.request_id)
    return PrefillResult(r.request_id, "p", outs[0].new_token_ids, None, len(r.prompt_token_ids), 0, 0, ticket)


class _Hold:
    """Holds the engine loop after its first step (it sees no work), so the first
    request keeps its blocks until ``release``: the verdicts hang on no timing."""

    def __init__(self, worker: DecodeWorker, engine: NativeEngine) -> None:
        self.worker, self.held, self.stepped = worker, threading.Event(), threading.Event()
        self.held.set()
        real_step, real_has_work = engine.step, engine.has_work

        def step() -> list[RequestOutput]:
            outs = real_step()
            self.stepped.set()
            return outs

        engine.step = step  # type: ignore[method-assign]
        engine.has_work = lambda: real_has_work() and not (self.held.is_set() and self.stepped.is_set())  # type: ignore[method-assign]

    def release(self) -> None:
        self.held.clear()
        self.worker.loop._wake.set()


def test_a_handoff_waits_for_blocks_then_continues(monkeypatch: pytest.MonkeyPatch) -> None:
    prefill = make_engine(role="prefill", instance="p-kvwait", num_kv_blocks=16)
    engine = make_engine(role="decode", instance="d-kvwait", num_kv_blocks=16)
    worker = DecodeWorker(engine.cfg, "decode-kvwait", engine=engine)
    hold = _Hold(worker, engine)
    try:
        r1, r2 = req("w1", TOKENS, 60), req("w2", OTHER, 60)  # 130 tokens: 9 of the 16 blocks each
        want = make_engine().generate([r2])["w2"]
        p1, p2 = _prefill(prefill, r1), _prefill(prefill, r2)
        first = worker.generate(p1, r1)
        got1 = [next(first)]  # w1 holds its blocks now, and the loop is held
        got2: list[int] = []

        def second() -> None:
            got2.extend(t for c in worker.generate(p2, r2) for t in c.token_ids)

        t = threading.Thread(target=second)
        t.start()
        deadline = time.monotonic() + 30
        while worker.counters.kv_waits == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert t.is_alive() and worker.counters.kv_waits == 1  # waiting for room, not failed
        hold.release()
        got1 += list(first)
        t.join(30)
        assert not t.is_alive()
        assert [*p2.token_ids, *got2] == want
        assert engine.stats().num_free_blocks == engine.stats().num_blocks
    finally:
        worker.close()
        prefill.close()


def test_the_wait_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridpd.errors import OverloadedError

    monkeypatch.setattr(decode_actor, "KV_WAIT_S", 0.2)
    prefill = make_engine(role="prefill", instance="p-kvbound", num_kv_blocks=16)
    engine = make_engine(role="decode", instance="d-kvbound", num_kv_blocks=16)
    worker = DecodeWorker(engine.cfg, "decode-kvbound", engine=engine)
    hold = _Hold(worker, engine)
    try:
        r1, r2 = req("b1", TOKENS, 60), req("b2", OTHER, 60)
        p1, p2 = _prefill(prefill, r1), _prefill(prefill, r2)
        first = worker.generate(p1, r1)
        next(first)
        with pytest.raises(OverloadedError, match="no KV blocks"):
            list(worker.generate(p2, r2))
        hold.release()
        list(first)
        assert engine.stats().num_free_blocks == engine.stats().num_blocks  # nothing left pinned
    finally:
        worker.close()
        prefill.close()
