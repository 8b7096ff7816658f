"""Issue #50's ids: the server makes the id that keys a request's work; a client's
own id (``X-Request-Id``, the body's or gRPC's ``request_id``) is only echoed back
and logged escaped, so two clients' equal ids never collide, and gRPC ``Abort``
reaches only the caller's own requests."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import httpx
import pytest

from hybridpd.config import load_config
from hybridpd.v1 import generate_pb2 as pb
from services.router.grpc_api import GenerationServicer
from services.router.metrics import RouterMetrics
from services.router.openai_api import create_app
from services.router.orchestrator import Orchestrator
from tests.unit.fake_actors import TOK, FakeDecode, FakePrefill, clients

pytestmark = pytest.mark.unit


def _orch(decode: FakeDecode | None = None, **over: Any) -> Orchestrator:
    cfg = load_config(env={}, overrides={"max_model_len": 256, **over})
    pre, dec = clients({"prefill-0": FakePrefill("prefill-0")}, [decode or FakeDecode()])
    return Orchestrator(cfg, TOK, "m", None, pre, dec, RouterMetrics())


async def _stats() -> dict:
    return {}


def _post(orch: Orchestrator, bodies: list[dict[str, Any]], headers: dict[str, str]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(orch, "tiny", _stats))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return list(await asyncio.gather(*(c.post("/v1/completions", json=b, headers=headers) for b in bodies)))

    return asyncio.run(go())


def test_equal_client_ids_never_collide_and_are_only_echoed() -> None:
    orch = _orch()
    prefill = orch.prefill["prefill-0"].handle
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
    same = _post(orch, [body, body], {"x-request-id": "mine"})
    assert [r.status_code for r in same] == [200, 200], [r.text for r in same]
    assert [r.headers["x-request-id"] for r in same] == ["mine", "mine"]
    ids = [r.json()["id"] for r in same]
    assert ids[0] != ids[1] and all(i.startswith("cmpl-") and "mine" not in i for i in ids)
    sent = {c[0].request.request_id for c in prefill.prefill.calls}  # type: ignore[attr-defined]
    assert sent == {i.removeprefix("cmpl-") for i in ids}  # the server's ids key the work
    plain = _post(orch, [body], {})[0]
    assert plain.headers["x-request-id"] == plain.json()["id"].removeprefix("cmpl-")  # none sent: ours
    body_id = _post(orch, [{**body, "request_id": "from-body"}], {"x-request-id": "from-header"})[0]
    assert body_id.headers["x-request-id"] == "from-body"
    long = _post(orch, [body], {"x-request-id": "x" * 129})[0]
    assert long.status_code == 200 and long.headers["x-request-id"] != "x" * 129  # not echoed
    assert orch.admission.inflight == 0 and not orch.running


def test_a_client_id_is_logged_escaped(caplog: pytest.LogCaptureFixture) -> None:
    orch = _orch()
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "request_id": "a\nINFO forged line\x1b[2J"}
    with caplog.at_level(logging.INFO, logger="services.router.choices"):
        r = _post(orch, [body], {})[0]
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if "client request id" in rec.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "\x1b" not in lines[0]
    assert r"'a\nINFO forged line\x1b[2J'" in lines[0]


class _Context:
    """What the servicer uses of a ``grpc.aio.ServicerContext``."""

    def __init__(self, key: str) -> None:
        self.meta = (("authorization", "Bearer " + key),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.meta

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError("%s: %s" % (code, details))


def test_grpc_abort_reaches_only_the_callers_own_requests() -> None:
    decode = FakeDecode(stall_after=1)  # both requests run until aborted
    orch = _orch(decode, api_keys=["alpha", "beta", "gamma"])
    servicer = GenerationServicer(orch, "tiny")
    msg = pb.GenerateRequest(request_id="same", token_ids=pb.TokenIds(ids=[5, 6, 7]))

    async def go() -> list[bool]:
        async def run(key: str) -> list[pb.GenerateResponse]:
            return [r async for r in servicer.Generate(msg, _Context(key))]  # type: ignore[arg-type]

        tasks = [asyncio.ensure_future(run("alpha")), asyncio.ensure_future(run("beta"))]
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(decode.generate.calls) == 2:
                break
        found = []
        for key, rid in (("gamma", "same"), ("alpha", "same")):  # gamma has no request of that id
            resp = await servicer.Abort(pb.AbortRequest(request_id=rid), _Context(key))  # type: ignore[arg-type]
            found.append(resp.found)
        aborted = {c[0] for c in decode.abort.calls}  # type: ignore[attr-defined]
        assert len(aborted) == 1  # alpha's only: beta's runs on under the same client id
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return found

    assert asyncio.run(go()) == [False, True]
    assert servicer.known == {} and orch.admission.inflight == 0
