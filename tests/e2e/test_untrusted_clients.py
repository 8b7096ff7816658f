"""Issue #50 from outside, on the shared stack (no keys; --max-inflight-requests 4):
what a client that means harm finds. Oversize bodies (with and without
Content-Length) and oversize fields on both APIs are refused before any work; a
non-streaming request whose client went away is aborted."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from hybridpd.v1 import generate_pb2 as pb
from hybridpd.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt
from tests.wait import Pending, wait_until

pytestmark = pytest.mark.e2e

MIB = 1 << 20


def _post(stack: Stack, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(stack.http + path, json=body, timeout=120)


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    message: str = r.json()["error"]["message"]
    return message


def test_oversize_bodies_are_413_with_and_without_content_length(stack: Stack) -> None:
    raw = b'{"model": "tiny", "prompt": "' + b"x" * (9 * MIB) + b'"}'

    def chunks():  # type: ignore[no-untyped-def]
        for i in range(0, len(raw), MIB):
            yield raw[i : i + MIB]

    headers = {"content-type": "application/json"}
    chunked = httpx.post(stack.http + "/v1/completions", content=chunks(), headers=headers, timeout=60)
    assert chunked.request.headers.get("transfer-encoding") == "chunked"
    assert "over 8388608 bytes" in _error(chunked, 413)
    sized = httpx.post(stack.http + "/v1/completions", content=raw, headers=headers, timeout=60)
    assert "over 8388608 bytes" in _error(sized, 413)


def test_oversize_fields_are_400s_naming_them(stack: Stack) -> None:
    base = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    assert "stop: at most 4 stop strings, got 5" in _error(_post(stack, {**base, "stop": ["a"] * 5}), 400)
    huge = _error(_post(stack, {**base, "stop": ["s" * 200_000]}), 400)
    assert "stop: at most 256 characters a stop string, got 200000" in huge
    assert "prompt: at most 4194304 characters" in _error(_post(stack, {**base, "prompt": "y" * (4 * MIB + 1)}), 400)
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}] * 2049}
    assert "messages: at most 2048" in _error(_post(stack, chat, "/v1/chat/completions"), 400)
    # n: each choice holds one of the stack's 4 in-flight slots
    assert "n: at most 4 choices" in _error(_post(stack, {**base, "n": 5, "temperature": 1.0}), 400)
    bias = {str(i): 1 for i in range(301)}
    assert "logit_bias: at most 300" in _error(_post(stack, {**base, "logit_bias": bias}), 400)
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for sampling, what in (
            (pb.SamplingParams(max_tokens=2, stop=["a"] * 5), "stop strings"),
            (pb.SamplingParams(max_tokens=2, stop=["s" * 200_000]), "characters a stop string"),
            (pb.SamplingParams(max_tokens=2, n=17, temperature=1.0), "choices"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(pb.GenerateRequest(text="hello", sampling=sampling), timeout=60))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in (info.value.details() or "")


def _cancelled(stack: Stack) -> float:
    for line in httpx.get(stack.http + "/metrics", timeout=10).text.splitlines():
        if line.startswith('hybridpd_requests_total{api="completions",status="cancelled"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_non_streaming_request_is_aborted_when_its_client_goes(stack: Stack) -> None:
    before = _cancelled(stack)
    body = {"model": "tiny", "prompt": list(prompt(200, 31)), "max_tokens": 3000, "ignore_eos": True}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.http + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))

    def counted() -> float | Pending:
        got = _cancelled(stack)
        return got if got > before else Pending(got)

    wait_until(counted, 20, 0.1, "the router counted the request cancelled")
    stats = stack.wait_all_free()
    assert all(s["pool"]["num_running"] == 0 for s in stats.values())
    assert time.monotonic() - t0 < 25  # not the 3000 tokens it asked for


def test_equal_client_ids_never_collide(stack: Stack) -> None:
    import concurrent.futures

    body = {"model": "tiny", "prompt": list(prompt(64, 41)), "max_tokens": 40, "ignore_eos": True}

    def http_one(_: int) -> httpx.Response:
        return httpx.post(stack.http + "/v1/completions", json=body, headers={"x-request-id": "dup"}, timeout=120)

    def grpc_one(_: int) -> list[pb.GenerateResponse]:
        with grpc.insecure_channel(stack.grpc) as channel:
            req = pb.GenerateRequest(
                request_id="dup", text="The delta rule", sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True)
            )
            return list(pb_grpc.GenerationStub(channel).Generate(req, timeout=120))

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        https = list(ex.map(http_one, range(2)))
        grpcs = list(ex.map(grpc_one, range(2)))
    assert [r.status_code for r in https] == [200, 200], [r.text for r in https]
    assert [r.headers["x-request-id"] for r in https] == ["dup", "dup"]
    assert https[0].json()["id"] != https[1].json()["id"]
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in https)
    for replies in grpcs:
        assert {m.request_id for m in replies} == {"dup"} and replies[-1].usage.completion_tokens == 40
    stack.wait_all_free()


def test_health_is_liveness_ready_is_readiness(stack: Stack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert httpx.get(stack.http + "/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(stack.http + "/ready", timeout=10).json() == {"status": "ready"}
    with grpc.insecure_channel(stack.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "hybridpd.v1.Generation"):
            got = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, service


def test_errors_name_no_instance_of_ours(stack: Stack) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "hybridpd_prefill_instance": "prefill-9"}
    r = _post(stack, body)
    assert r.status_code == 404 and "prefill-0" not in r.text
