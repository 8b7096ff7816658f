"""Issue #50's errors and health: a failure on the server's side reaches a client as a
generic message with the request id (the engine's or Ray's text only in the log),
and the router's readiness (``/ready``, the gRPC health status) is false while no
prefill or no decode instance is live, or while it drains; ``/health`` is liveness."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from ray.exceptions import RayActorError

from hybridpd.config import load_config
from hybridpd.errors import (
    DeadlineError,
    EngineError,
    IntegrityError,
    InvalidRequestError,
    UnavailableError,
    public_message,
    public_type,
    server_side,
)
from hybridpd.procs import free_port
from hybridpd.v1 import generate_pb2 as pb
from services.router.grpc_api import GENERATION_SERVICE, GenerationServicer, ReadinessHealth
from services.router.metrics import RouterMetrics
from services.router.openai_api import create_app
from services.router.orchestrator import Orchestrator
from services.router.server import RouterServer
from tests.unit.fake_actors import TOK, FakeDecode, FakePrefill, clients

pytestmark = pytest.mark.unit

SECRET = "engine failure on prefill-0: AssertionError: kernel state at 0x7f3a"


def test_public_messages_keep_what_a_client_can_act_on() -> None:
    assert public_message(InvalidRequestError("stop: too long"), "r1") == "stop: too long"
    assert public_message(DeadlineError("request exceeded its 600s deadline"), "r1").startswith("request exceeded")
    told = {
        EngineError(SECRET): "an engine failed while serving the request (request r1)",
        UnavailableError("prefill of r1 failed: " + SECRET): "no instance could serve the request now; retry later"
        " (request r1)",
        IntegrityError("checksum of block 3"): "a transfer failed verification (request r1)",
        RuntimeError("boom"): "internal error (request r1)",
    }
    for exc, message in told.items():
        assert server_side(exc) and public_message(exc, "r1") == message
    wrapped = RuntimeError("ray wrapper")
    wrapped.cause = EngineError(SECRET)  # type: ignore[attr-defined]  # as RayTaskError carries it
    assert "0x7f3a" not in public_message(wrapped, "r1")
    assert public_type(EngineError("x")) == "EngineError" and public_type(RayActorError()) == "internal_error"
    assert not server_side(InvalidRequestError("x")) and not server_side(DeadlineError("x"))


def _orch(prefills: list[FakePrefill], decode: FakeDecode | None = None) -> Orchestrator:
    cfg = load_config(env={}, overrides={"max_model_len": 256})
    pre, dec = clients({p.name: p for p in prefills}, [decode or FakeDecode()])
    return Orchestrator(cfg, TOK, "m", None, pre, dec, RouterMetrics())


async def _stats() -> dict:
    return {}


def _calls(orch: Orchestrator, *calls: tuple[str, str, dict[str, Any] | None]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(orch, "tiny", _stats))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return [await c.request(method, path, json=body) for method, path, body in calls]

    return asyncio.run(go())


BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8}


def test_an_engine_failure_is_a_generic_503_naming_the_request_the_log_has_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing = [FakePrefill("prefill-0", fail=EngineError(SECRET)), FakePrefill("prefill-1", fail=EngineError(SECRET))]
    with caplog.at_level(logging.WARNING, logger="hybridpd.errors"):
        (r,) = _calls(_orch(failing), ("POST", "/v1/completions", BODY))
    err = r.json()["error"]
    rid = r.headers["x-request-id"]  # no client id: the server's
    assert r.status_code == 503 and err["type"] == "UnavailableError"
    assert err["message"] == "no instance could serve the request now; retry later (request %s)" % rid
    assert "0x7f3a" not in r.text and "prefill-" not in r.text
    logged = [rec.getMessage() for rec in caplog.records]
    assert any(rid in line and "0x7f3a" in line for line in logged), logged


def test_a_failure_mid_stream_is_generic_too() -> None:
    decode = FakeDecode(fail_after=(1, EngineError("engine failure on decode-0: AssertionError: x at 0x7f3a")))
    (r,) = _calls(_orch([FakePrefill("prefill-0")], decode), ("POST", "/v1/completions", {**BODY, "stream": True}))
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err == {
        "message": "an engine failed while serving the request (request %s)" % r.headers["x-request-id"],
        "type": "EngineError",
        "code": 503,
    }
    assert "0x7f3a" not in r.text and lines[-1] != "data: [DONE]"


def test_an_unknown_instance_names_none_of_ours() -> None:
    (r,) = _calls(
        _orch([FakePrefill("prefill-0")]), ("POST", "/v1/completions", {**BODY, "hybridpd_prefill_instance": "x"})
    )
    assert r.status_code == 404 and "prefill-0" not in r.text


class _Context:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise RuntimeError("aborted")


def test_grpc_engine_failure_is_generic() -> None:
    orch = _orch(
        [FakePrefill("prefill-0", fail=EngineError(SECRET)), FakePrefill("prefill-1", fail=EngineError(SECRET))]
    )
    servicer, ctx = GenerationServicer(orch, "tiny"), _Context()
    msg = pb.GenerateRequest(request_id="mine", token_ids=pb.TokenIds(ids=[5, 6, 7]))

    async def go() -> None:
        with pytest.raises(RuntimeError, match="aborted"):
            async for _ in servicer.Generate(msg, ctx):  # type: ignore[arg-type]
                pass

    asyncio.run(go())
    assert ctx.aborted is not None
    code, details = ctx.aborted
    assert code == grpc.StatusCode.UNAVAILABLE and details.startswith("no instance could serve the request")
    assert "0x7f3a" not in details and "(request " in details and "mine" not in details


def test_ready_needs_a_live_prefill_and_decode_and_no_drain() -> None:
    p0, p1, d = FakePrefill("prefill-0"), FakePrefill("prefill-1"), FakeDecode()
    orch = _orch([p0, p1], d)
    health = ReadinessHealth(orch)

    async def grpc_status() -> int:
        got = await health.Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), _Context())  # type: ignore[arg-type]
        return int(got.status)

    def state() -> tuple[int, str, int]:
        orch.dispatch.liveness._live = None  # the next check pings again (answers are reused for a second)
        ready, live = _calls(orch, ("GET", "/ready", None), ("GET", "/health", None))
        assert live.status_code == 200  # liveness: whatever the actors do
        message = ready.json()["error"]["message"] if ready.status_code != 200 else ""
        return ready.status_code, message, asyncio.run(grpc_status())

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert state() == (200, "", serving)
    p0.down = True  # one prefill instance left: still ready
    assert state() == (200, "", serving)
    p1.down = True
    assert state() == (503, "not ready: no live prefill instance", not_serving)
    d.down = True
    assert state() == (503, "not ready: no live prefill or decode instance", not_serving)
    p0.down = p1.down = d.down = False
    assert state() == (200, "", serving)
    orch.drain()
    assert state() == (503, "not ready: draining", not_serving)


def test_a_hung_instance_is_not_live() -> None:
    d = FakeDecode()
    orch = _orch([FakePrefill("prefill-0")], d)

    async def never() -> None:
        await asyncio.sleep(60)

    d.serving.fn = never  # type: ignore[method-assign]
    missing = asyncio.run(asyncio.wait_for(orch.dispatch.liveness._ping_all(0.05), 5))
    assert missing == ["decode"]


@contextlib.asynccontextmanager
async def _one_in_flight(gate: asyncio.Event) -> AsyncIterator[tuple[RouterServer, httpx.AsyncClient, asyncio.Task]]:
    """A router whose one prefill instance waits for ``gate``, with a request admitted
    and held there: (the server, a client of its app, that request)."""
    orch = _orch([FakePrefill("prefill-0", gate=gate)])
    server = RouterServer(orch, "tiny", "127.0.0.1", free_port(), free_port(), _stats)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://router") as c:
        running = asyncio.create_task(c.post("/v1/completions", json=BODY))
        while orch.admission.inflight == 0:
            await asyncio.sleep(0.01)
        yield server, c, running


def test_drain_refuses_new_requests_and_waits_for_those_in_flight() -> None:
    async def go() -> None:
        gate = asyncio.Event()
        async with _one_in_flight(gate) as (server, c, running):
            drain = asyncio.create_task(server.drain(asyncio.Event()))
            await asyncio.sleep(0)  # the drain's first step: nothing new is admitted from here on
            refused = await c.post("/v1/completions", json=BODY)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "DrainingError" and "shutting down" in refused.text
            ready = await c.get("/ready")
            assert ready.status_code == 503 and "draining" in ready.text
            assert not drain.done() and server.orch.admission.inflight == 1  # it waits for the one in flight
            gate.set()
            done = await running
            await asyncio.wait_for(drain, 10)
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == BODY["max_tokens"]

    asyncio.run(go())


def test_a_forced_drain_ends_with_requests_in_flight() -> None:
    async def go() -> None:
        async with _one_in_flight(asyncio.Event()) as (server, _, running):
            force = asyncio.Event()
            drain = asyncio.create_task(server.drain(force))
            await asyncio.sleep(0.2)
            assert not drain.done()
            force.set()
            await asyncio.wait_for(drain, 10)
            assert server.orch.admission.inflight == 1
            running.cancel()

    asyncio.run(go())


def test_routing_leaves_out_a_draining_instance_while_another_serves() -> None:
    p0, p1, d0, d1 = FakePrefill("prefill-0"), FakePrefill("prefill-1"), FakeDecode(), FakeDecode()
    orch = _orch([p0, p1], d0)
    _, dec = clients({"prefill-0": p0, "prefill-1": p1}, [d0, d1])
    orch.dispatch.decode_actors.update(dec)  # the caller's collection: shared with the pings
    p0.draining = d0.draining = True
    assert asyncio.run(orch.dispatch.liveness._ping_all(1.0)) == []  # one of each kind still serves: ready
    assert orch.dispatch.liveness.draining == {"prefill-0", "decode-0"}
    assert orch.dispatch.liveness.routable(["prefill-0", "prefill-1"]) == ["prefill-1"]
    p1.draining = d1.draining = True
    assert asyncio.run(orch.dispatch.liveness._ping_all(1.0)) == ["prefill", "decode"]  # not ready
    # they refuse: a 503
    assert orch.dispatch.liveness.routable(["prefill-0", "prefill-1"]) == ["prefill-0", "prefill-1"]


@pytest.mark.parametrize("taken", ["http", "grpc"])
def test_a_port_lost_before_the_bind_fails_before_ready(taken: str) -> None:
    """`hybridpd up` checks its ports before anything starts (e2e test_startup_failure);
    a port taken after that check still fails the router's serve before ``ready``
    (never a stack that says it is up and refuses every connection), with an error
    of its own, not uvicorn's exit of the whole process."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        ports = [free_port(), free_port()]
        ports[0 if taken == "http" else 1] = holder.getsockname()[1]
        server = RouterServer(_orch([FakePrefill("prefill-0")]), "tiny", "127.0.0.1", *ports, _stats)
        ready = asyncio.Event()
        expected = UnavailableError if taken == "http" else RuntimeError  # grpc: "Failed to bind"
        with pytest.raises(expected, match="did not start" if taken == "http" else "(?i)failed to bind"):
            asyncio.run(asyncio.wait_for(server.serve(asyncio.Event(), ready), 30))
    assert not ready.is_set()
