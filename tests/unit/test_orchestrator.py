"""The router's request flow (``Orchestrator.stream``) in front of fake actor
handles (``tests/unit/fake_actors.py``: Ray's calling convention, one token
script through the real tokenizer, so texts and token ids are exact). A test
double for unit tests: the e2e tier runs the real stack."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import RayActorError

from hybridpd.config import HybridPDConfig, load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.errors import (
    DeadlineError,
    IntegrityError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    UnavailableError,
)
from hybridpd.transfer.handoff_descriptor import HandoffError
from hybridpd.validation import validate_request
from services.router.metrics import RouterMetrics
from services.router.orchestrator import Orchestrator
from services.router.output import Event, Usage
from services.worker.messages import PrefillCommand
from tests.unit.fake_actors import CACHED, PROMPT, SCRIPT, TOK, FakeDecode, FakePrefill, clients

pytestmark = pytest.mark.unit


# -- helpers --------------------------------------------------------------------------------
def _cfg(**over: Any) -> HybridPDConfig:
    return load_config(env={}, overrides={"max_model_len": 256, **over})


def _orch(prefills: Sequence[FakePrefill], decodes: Sequence[FakeDecode] = (), **cfg: Any) -> Orchestrator:
    pre, dec = clients({p.name: p for p in prefills}, list(decodes) or [FakeDecode()])
    return Orchestrator(_cfg(**cfg), TOK, "m", None, pre, dec, RouterMetrics())


def _req(max_tokens: int = 8, rid: str = "r1") -> EngineRequest:
    return EngineRequest(RequestId(rid), PROMPT, SamplingParams(max_tokens=max_tokens))


async def _collect(orch: Orchestrator, req: EngineRequest, stop: tuple[str, ...] = ()) -> list[Event]:
    return [ev async for ev in orch.stream(req, "test", None, stop)]


def _until_error(orch: Orchestrator, req: EngineRequest) -> tuple[list[Event], BaseException]:
    got: list[Event] = []

    async def go() -> BaseException:
        try:
            async for ev in orch.stream(req, "test"):
                got.append(ev)
        except Exception as exc:
            return exc
        raise AssertionError("the stream finished: %r" % got)

    return got, asyncio.run(go())


def _metric(orch: Orchestrator, name: str, **labels: str) -> float:
    return orch.metrics.registry.get_sample_value(name, labels) or 0.0


def _tokens(events: list[Event]) -> tuple[int, ...]:
    return tuple(t for ev in events for t in ev.token_ids)


def _idle(orch: Orchestrator) -> bool:
    return orch.admission.inflight == 0 and not orch.running


# -- the flow -------------------------------------------------------------------------------
def test_native_shape_first_token_at_prefill_then_decode_chunks() -> None:
    p, d = FakePrefill("prefill-0"), FakeDecode((2, 3))
    orch = _orch([p], [d])
    evs = asyncio.run(_collect(orch, _req(8)))
    assert [ev.token_ids for ev in evs] == [SCRIPT[0:1], SCRIPT[1:3], SCRIPT[3:6], SCRIPT[6:8]]
    assert [ev.text for ev in evs] == [" H", "ell", "o wor", "ld,"]
    assert [ev.finished for ev in evs] == [False, False, False, True]
    assert (evs[-1].finish_reason, evs[-1].usage) == ("length", Usage(3, CACHED, 8))
    assert d.generate.options_seen == [{"num_returns": "streaming", "_generator_backpressure_num_objects": 4}]
    assert p.prefill.calls == [(PrefillCommand(_req(8), 0),)]
    assert p.abort.calls == [] and d.abort.calls == []  # the engines finished it
    assert _metric(orch, "hybridpd_ttft_seconds_count") == 1
    stages = {s: _metric(orch, "hybridpd_ttft_stage_seconds_count", stage=s) for s in ("prefill", "prefill_call")}
    assert stages == {"prefill": 1, "prefill_call": 1}  # the first token came from prefill: no decode stage
    assert _metric(orch, "hybridpd_ttft_stage_seconds_count", stage="decode") == 0
    assert _metric(orch, "hybridpd_inter_token_latency_seconds_count") == 3
    assert _metric(orch, "hybridpd_completion_tokens_total") == 8
    assert _metric(orch, "hybridpd_requests_total", api="test", status="ok") == 1
    assert _idle(orch)


def test_vllm_shape_prefill_tokens_empty_decode_sends_every_token() -> None:
    p, d = FakePrefill("prefill-0", produce=0), FakeDecode((2, 3))
    orch = _orch([p], [d])
    evs = asyncio.run(_collect(orch, _req(8)))
    assert [ev.token_ids for ev in evs] == [SCRIPT[0:2], SCRIPT[2:5], SCRIPT[5:7], SCRIPT[7:8]]  # no empty first event
    assert "".join(ev.text for ev in evs) == TOK.decode(SCRIPT[:8])
    assert evs[-1].usage == Usage(3, CACHED, 8)
    assert d.generate.calls[0][0].token_ids == ()
    assert _metric(orch, "hybridpd_ttft_seconds_count") == 1  # at the first decode chunk
    assert _metric(orch, "hybridpd_ttft_stage_seconds_count", stage="decode") == 1  # decode sampled the first token


def test_request_finished_at_prefill_ends_there() -> None:
    p, d = FakePrefill("prefill-0"), FakeDecode()
    orch = _orch([p], [d])
    evs = asyncio.run(_collect(orch, _req(1)))
    assert evs == [Event(SCRIPT[:1], " H", True, "length", Usage(3, CACHED, 1))]
    assert d.generate.calls == [] and p.abort.calls == []
    assert _idle(orch)


@pytest.mark.parametrize("produce", [1, 0], ids=["native", "vllm"])
def test_request_aborted_at_prefill_ends_with_abort(produce: int) -> None:
    p, d = FakePrefill("prefill-0", produce=produce, finish="abort"), FakeDecode()
    orch = _orch([p], [d])
    evs = asyncio.run(_collect(orch, _req(8)))
    text = TOK.decode(SCRIPT[:produce])
    assert evs == [Event(SCRIPT[:produce], text, True, "abort", Usage(3, CACHED, produce))]
    assert d.generate.calls == [] and p.abort.calls == []  # the engine ended it
    assert _metric(orch, "hybridpd_ttft_seconds_count") == produce


def test_prefill_with_neither_tokens_nor_handoff_is_unavailable() -> None:
    p = FakePrefill("prefill-0", produce=0, ticket=False)
    orch = _orch([p])
    got, exc = _until_error(orch, _req(8))
    assert got == [] and isinstance(exc, UnavailableError)
    assert str(exc) == "prefill of r1 returned neither a token nor a handoff"
    assert p.abort.calls == [("r1",)]


# -- admission ------------------------------------------------------------------------------
def test_validation_is_hybridpd_validation() -> None:
    p = FakePrefill("prefill-0")
    orch = _orch([p])
    bad = [
        EngineRequest(RequestId("a"), PROMPT, SamplingParams(max_tokens=0)),
        EngineRequest(RequestId("b"), (5, 4096), SamplingParams(max_tokens=2)),
        EngineRequest(RequestId("c"), PROMPT, SamplingParams(max_tokens=254)),
    ]
    for req in bad:
        with pytest.raises(InvalidRequestError) as want:
            validate_request(req, TOK.vocab_size, 256)
        with pytest.raises(InvalidRequestError) as got:
            asyncio.run(_collect(orch, req))
        assert str(got.value) == str(want.value)
    assert str(got.value) == "prompt (3 tokens) + max_tokens (254) exceeds the model's context of 256 tokens"
    assert p.prefill.calls == [] and _idle(orch)
    assert _metric(orch, "hybridpd_requests_total", api="test", status="error") == 0


def test_in_flight_limit_refuses_with_overloaded() -> None:
    gate_holder: list[asyncio.Event] = []

    async def go() -> None:
        gate = asyncio.Event()
        gate_holder.append(gate)
        p = FakePrefill("prefill-0", gate=gate)
        orch = _orch([p], max_inflight_requests=1)
        first = asyncio.create_task(_collect(orch, _req(4, "a")))
        while not p.prefill.calls:
            await asyncio.sleep(0)
        with pytest.raises(OverloadedError, match=r"^too many requests in flight \(1\)$") as err:
            await _collect(orch, _req(4, "b"))
        assert err.value.retry_after_s == 1.0
        gate.set()
        assert _tokens(await first) == SCRIPT[:4]
        assert _tokens(await _collect(orch, _req(4, "c"))) == SCRIPT[:4]  # room again
        assert [c[0].request.request_id for c in p.prefill.calls] == ["a", "c"]
        assert _idle(orch)

    asyncio.run(go())
    assert gate_holder


def test_a_request_id_already_in_flight_is_refused() -> None:
    async def go() -> None:
        gate = asyncio.Event()
        p = FakePrefill("prefill-0", gate=gate)
        orch = _orch([p])
        first = asyncio.create_task(_collect(orch, _req(4, "same")))
        while not p.prefill.calls:
            await asyncio.sleep(0)
        with pytest.raises(InvalidRequestError, match="request id same is already in flight"):
            await _collect(orch, _req(4, "same"))
        gate.set()
        assert _tokens(await first) == SCRIPT[:4]  # the first is untouched
        assert _tokens(await _collect(orch, _req(4, "same"))) == SCRIPT[:4]  # reusable once it ended
        assert _idle(orch)

    asyncio.run(go())


def test_unknown_forced_instance_is_not_found() -> None:
    orch = _orch([FakePrefill("prefill-0"), FakePrefill("prefill-1")])

    async def go() -> None:
        async for _ in orch.stream(_req(), "test", "prefill-9"):
            pass

    with pytest.raises(NotFoundError, match=r"no prefill instance 'prefill-9'\"$"):  # and no names of ours
        asyncio.run(go())
    assert _idle(orch)


# -- prefill retry --------------------------------------------------------------------------
@pytest.mark.parametrize("exc", [UnavailableError("prefill-0 is down"), RayActorError()], ids=["unavailable", "dead"])
def test_prefill_retries_once_on_the_next_instance(exc: Exception) -> None:
    bad, good = FakePrefill("prefill-0", fail=exc), FakePrefill("prefill-1")
    orch = _orch([bad, good])
    evs = asyncio.run(_collect(orch, _req(8)))
    assert _tokens(evs) == SCRIPT[:8] and evs[-1].finish_reason == "length"
    assert len(bad.prefill.calls) == 1 and good.prefill.calls == [(PrefillCommand(_req(8), 0),)]
    assert _metric(orch, "hybridpd_retries_total", kind="prefill") == 1
    assert bad.abort.calls == []  # it failed the call: it holds nothing
    assert orch.dispatch.queued == {"prefill-0": 0.0, "prefill-1": 0.0}


def test_prefill_failing_everywhere_is_unavailable() -> None:
    a = FakePrefill("prefill-0", fail=UnavailableError("a down"))
    b = FakePrefill("prefill-1", fail=RayActorError())
    orch = _orch([a, b])
    got, exc = _until_error(orch, _req(8))
    assert got == [] and isinstance(exc, UnavailableError)
    assert str(exc).startswith("prefill of r1 failed: ")
    assert (len(a.prefill.calls), len(b.prefill.calls)) == (1, 1)
    assert _metric(orch, "hybridpd_requests_total", api="test", status="error") == 1
    assert _idle(orch)


# -- handoff retry --------------------------------------------------------------------------
@pytest.mark.parametrize("produce", [1, 0], ids=["native", "vllm"])
@pytest.mark.parametrize(
    "exc",
    [IntegrityError("checksum mismatch"), HandoffError("expired"), RayActorError()],
    ids=lambda e: type(e).__name__,
)
def test_failed_handoff_is_prefilled_again_elsewhere(produce: int, exc: Exception) -> None:
    p0, p1 = FakePrefill("prefill-0", produce=produce), FakePrefill("prefill-1", produce=produce)
    d = FakeDecode((3,), fail_first=exc)
    orch = _orch([p0, p1], [d])
    evs = asyncio.run(_collect(orch, _req(8)))
    assert _tokens(evs) == SCRIPT[:8]  # the prefill's tokens once, nothing lost or repeated
    assert "".join(ev.text for ev in evs) == TOK.decode(SCRIPT[:8])
    assert (len(p0.prefill.calls), len(p1.prefill.calls)) == (1, 1)
    assert [c[0].instance for c in d.generate.calls] == ["prefill-0", "prefill-1"]
    assert _metric(orch, "hybridpd_retries_total", kind="handoff") == 1
    assert _metric(orch, "hybridpd_ttft_seconds_count") == 1


def test_re_prefill_with_other_tokens_fails_the_request() -> None:
    p0 = FakePrefill("prefill-0")
    p1 = FakePrefill("prefill-1", tokens=SCRIPT[1:])  # samples another first token
    d = FakeDecode(fail_first=IntegrityError("checksum mismatch"))
    orch = _orch([p0, p1], [d])
    got, exc = _until_error(orch, _req(8))
    assert [ev.token_ids for ev in got] == [SCRIPT[:1]]  # already sent: cannot be taken back
    assert isinstance(exc, UnavailableError)
    assert str(exc) == "re-prefill of r1 diverged from the token already sent"
    assert len(d.generate.calls) == 1
    assert p0.abort.calls == [("r1",)] and p1.abort.calls == [("r1",)]  # both hold a handoff


def test_decode_failure_after_a_chunk_is_not_retried() -> None:
    p0, p1 = FakePrefill("prefill-0"), FakePrefill("prefill-1")
    d = FakeDecode((2,), fail_after=(1, IntegrityError("checksum mismatch")))
    orch = _orch([p0, p1], [d])
    got, exc = _until_error(orch, _req(8))
    assert [ev.token_ids for ev in got] == [SCRIPT[0:1], SCRIPT[1:3]]
    assert isinstance(exc, UnavailableError) and str(exc).startswith("decode of r1 failed: ")
    assert p1.prefill.calls == [] and _metric(orch, "hybridpd_retries_total", kind="handoff") == 0
    assert _idle(orch)


# -- abort ----------------------------------------------------------------------------------
def test_client_disconnect_aborts_on_both_actors() -> None:
    p, d = FakePrefill("prefill-0"), FakeDecode((1,))
    orch = _orch([p], [d])

    async def go() -> None:
        events = orch.stream(_req(30), "test")
        assert (await anext(events)).token_ids == SCRIPT[:1]
        assert (await anext(events)).token_ids == SCRIPT[1:2]
        assert p.abort.calls == [] and d.abort.calls == []
        await events.aclose()  # type: ignore[attr-defined]  # what _sse's finally does on a disconnect

    asyncio.run(go())
    assert p.abort.calls == [("r1",)] and d.abort.calls == [("r1",)]
    assert _metric(orch, "hybridpd_requests_total", api="test", status="cancelled") == 1
    assert _metric(orch, "hybridpd_completion_tokens_total") == 0  # the client got no last event
    assert _idle(orch)


def test_cancel_during_prefill_aborts_the_prefill() -> None:
    async def go() -> tuple[FakePrefill, Orchestrator]:
        p = FakePrefill("prefill-0", gate=asyncio.Event())
        orch = _orch([p])
        task = asyncio.create_task(_collect(orch, _req(8)))
        while not p.prefill.calls:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return p, orch

    p, orch = asyncio.run(go())
    assert p.abort.calls == [("r1",)]
    assert _metric(orch, "hybridpd_requests_total", api="test", status="cancelled") == 1
    assert _idle(orch)


def test_abort_by_id_reaches_the_holders() -> None:
    p, d = FakePrefill("prefill-0"), FakeDecode((1,))
    orch = _orch([p], [d])

    async def go() -> None:
        assert not orch.abort("r1")
        events = orch.stream(_req(30), "test")
        await anext(events)
        await anext(events)
        assert orch.abort("r1") and not orch.abort("other")
        assert p.abort.calls == [("r1",)] and d.abort.calls == [("r1",)]
        await events.aclose()  # type: ignore[attr-defined]

    asyncio.run(go())


# -- stop strings ---------------------------------------------------------------------------
def test_stop_string_split_over_three_chunks() -> None:
    # chunks: ' H' (prefill) | 'ello world, the S' | 'TO' | 'P here' : "STOP" spans three chunks
    p, d = FakePrefill("prefill-0"), FakeDecode((9, 2, 3, 5))
    orch = _orch([p], [d])
    evs = asyncio.run(_collect(orch, _req(30), ("STOP",)))
    # "S", then "STO", may start the stop string: held back, never sent
    assert [ev.text for ev in evs] == [" H", "ello world, the ", "", ""]
    through = _through("STOP")  # the tokens after the one completing it are dropped (vLLM's rule)
    assert [ev.token_ids for ev in evs] == [SCRIPT[0:1], SCRIPT[1:10], SCRIPT[10:12], SCRIPT[12:through]]
    assert (evs[-1].finished, evs[-1].finish_reason, evs[-1].usage) == (True, "stop", Usage(3, CACHED, through))
    assert p.abort.calls == [("r1",)] and d.abort.calls == [("r1",)]  # decode had not finished
    assert _metric(orch, "hybridpd_requests_total", api="test", status="ok") == 1


def test_stop_string_ending_in_a_chunk_is_cut_from_it() -> None:
    p, d = FakePrefill("prefill-0"), FakeDecode((20,))
    evs = asyncio.run(_collect(_orch([p], [d]), _req(30), ("zz", " here", "STOP")))
    assert [ev.text for ev in evs] == [" H", "ello world, the "]  # the first to complete wins: STOP before here
    assert evs[-1].usage == Usage(3, CACHED, _through("STOP")) and evs[-1].stop_reason == "STOP"


def _through(stop: str) -> int:
    """How many of SCRIPT's tokens it takes for the text to contain ``stop``."""
    return next(k for k in range(1, len(SCRIPT) + 1) if stop in TOK.decode(SCRIPT[:k]))


@pytest.mark.parametrize(
    ("stop", "texts", "count"),
    [
        ((" H",), [""], 1),  # the prefill's token completes it
        (("Hel",), [" ", ""], 3),  # starts in the prefill's token ("H" held back), ends in the first chunk
    ],
)
def test_stop_string_and_the_first_token(stop: tuple[str, ...], texts: list[str], count: int) -> None:
    p, d = FakePrefill("prefill-0"), FakeDecode((2,))
    orch = _orch([p], [d])
    evs = asyncio.run(_collect(orch, _req(30), stop))
    assert [ev.text for ev in evs] == texts
    assert (evs[-1].finish_reason, evs[-1].usage) == ("stop", Usage(3, CACHED, count))
    assert len(d.generate.calls) == len(texts) - 1
    assert p.abort.calls == [("r1",)]  # its handoff is freed


def test_stop_string_in_multibyte_characters() -> None:
    p, d = FakePrefill("prefill-0", produce=0), FakeDecode((1,))
    evs = asyncio.run(_collect(_orch([p], [d]), _req(30), ("日本",)))
    # "日" is held back as the start of the stop string, and "本" completes it
    assert "".join(ev.text for ev in evs) == " Hello world, the STOP here. héllo "
    assert [ev.text for ev in evs[-6:]] == ["", "", "", "", "", ""]  # partial characters held back too
    assert (evs[-1].finish_reason, evs[-1].usage) == ("stop", Usage(3, CACHED, 28))


# -- deadlines ------------------------------------------------------------------------------
def test_deadline_on_a_slow_prefill() -> None:
    p = FakePrefill("prefill-0", delay=30)
    orch = _orch([p], request_timeout_s=0.3)
    got, exc = _until_error(orch, _req(8))
    assert got == [] and isinstance(exc, DeadlineError) and "exceeded its" in str(exc)
    assert p.abort.calls == [("r1",)]  # it still holds the request
    assert _metric(orch, "hybridpd_requests_total", api="test", status="error") == 1
    assert _idle(orch) and orch.dispatch.queued == {"prefill-0": 0.0}


def test_deadline_on_a_stalled_decode_stream() -> None:
    p, d = FakePrefill("prefill-0"), FakeDecode((1,), stall_after=2)
    orch = _orch([p], [d], request_timeout_s=0.5)
    got, exc = _until_error(orch, _req(30))
    assert [ev.token_ids for ev in got] == [SCRIPT[0:1], SCRIPT[1:2], SCRIPT[2:3]]
    assert isinstance(exc, DeadlineError)
    assert p.abort.calls == [("r1",)] and d.abort.calls == [("r1",)]


# -- no engine branch -----------------------------------------------------------------------
def test_router_knows_no_engine() -> None:
    router = Path(__file__).resolve().parents[2] / "services" / "router"
    for path in sorted(router.glob("*.py")):
        text = path.read_text()
        if path.name == "request_fields.py":  # vLLM's public request fields, refused by name
            text = text.replace('"kv_transfer_params"', "").replace('"ec_transfer_params"', "")
        for word in ("hybridpd.engine.native", "hybridpd.engine.vllm", "first_token_id", "transfer_params"):
            assert word not in text, (path.name, word)
