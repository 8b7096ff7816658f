"""`hybridpd up --tls-cert-file/--tls-key-file`: both APIs serve TLS only (a
self-signed certificate made at test time), with their limits: the openai client
over HTTPS, grpcio over TLS, plain-text clients refused, a slow request head
closed within the header timeout, a gRPC message over the size limit refused."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI

from hybridpd.v1 import generate_pb2 as pb
from hybridpd.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import Stack
from tests.tls_certs import SelfSigned, self_signed

pytestmark = pytest.mark.e2e

HEADER_TIMEOUT_S = 1.0
GRPC_MAX_BYTES = 64 << 10


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> SelfSigned:
    return self_signed(Path(tmp_path_factory.mktemp("pem")))


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory, pem: SelfSigned) -> Iterator[Stack]:
    args = [
        *("--tls-cert-file", str(pem.cert), "--tls-key-file", str(pem.key)),
        *("--http-header-timeout-s", str(HEADER_TIMEOUT_S), "--grpc-max-message-bytes", str(GRPC_MAX_BYTES)),
        *("--num-prefill", "1"),
    ]
    s = Stack(Path(tmp_path_factory.mktemp("tls")), args)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _trusting(pem: SelfSigned) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pem.cert))


def _secure_channel(stack: Stack, pem: SelfSigned) -> grpc.Channel:
    return grpc.secure_channel(stack.grpc, grpc.ssl_channel_credentials(root_certificates=pem.cert.read_bytes()))


def test_the_banner_prints_https_and_that_the_api_is_open_on_loopback(tls_stack: Stack) -> None:
    assert tls_stack.http.startswith("https://")
    assert tls_stack.banner("OpenAI HTTP") == tls_stack.http + "/v1"
    assert tls_stack.banner("Metrics") == tls_stack.http + "/metrics"
    assert tls_stack.banner("gRPC") == tls_stack.grpc + " (TLS)"
    assert "loopback only" in tls_stack.banner("Auth")


def test_the_openai_client_over_https(tls_stack: Stack, pem: SelfSigned) -> None:
    with httpx.Client(verify=_trusting(pem), timeout=60) as http:
        client = OpenAI(base_url=tls_stack.http + "/v1", api_key="unused", http_client=http, max_retries=0)
        out = client.completions.create(model="tiny", prompt="The delta rule", max_tokens=4, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 4
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True
        )
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1
        assert http.get(tls_stack.http + "/health").status_code == 200


def test_plain_http_and_untrusted_clients_are_refused(tls_stack: Stack) -> None:
    plain = "http://127.0.0.1:%d/health" % tls_stack.http_port
    with pytest.raises(httpx.TransportError):
        httpx.get(plain, timeout=10)
    with pytest.raises(httpx.ConnectError):  # the system CAs do not vouch for this certificate
        httpx.get(tls_stack.http + "/health", timeout=10)


def test_grpc_over_tls(tls_stack: Stack, pem: SelfSigned) -> None:
    with _secure_channel(tls_stack, pem) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        req = pb.GenerateRequest(model="tiny", text="The delta rule", sampling=pb.SamplingParams(max_tokens=4))
        got = list(pb_grpc.GenerationStub(ch).Generate(req, timeout=60))
        assert sum(len(m.token_ids) for m in got) == 4 and got[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_plain_grpc_is_refused(tls_stack: Stack) -> None:
    req = pb.GenerateRequest(model="tiny", text="hi", sampling=pb.SamplingParams(max_tokens=2))
    with grpc.insecure_channel(tls_stack.grpc) as ch, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.GenerationStub(ch).Generate(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value


def test_a_grpc_message_over_the_limit_is_resource_exhausted(tls_stack: Stack, pem: SelfSigned) -> None:
    big = pb.GenerateRequest(model="tiny", text="x" * (GRPC_MAX_BYTES + 1), sampling=pb.SamplingParams(max_tokens=2))
    with _secure_channel(tls_stack, pem) as ch:
        stub = pb_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(big, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        small = pb.GenerateRequest(model="tiny", text="hi", sampling=pb.SamplingParams(max_tokens=2))
        assert sum(len(m.token_ids) for m in stub.Generate(small, timeout=60)) == 2  # the channel still serves


def test_a_slow_request_head_is_closed_within_the_header_timeout(tls_stack: Stack, pem: SelfSigned) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", tls_stack.http_port), timeout=30) as raw:
        with _trusting(pem).wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            conn.sendall(b"POST /v1/completions HT")  # half a request line, then nothing
            t0 = time.monotonic()
            try:
                got = conn.recv(4096)
            except ConnectionError:
                got = b""
            took = time.monotonic() - t0
    assert got == b"" and HEADER_TIMEOUT_S * 0.5 <= took <= HEADER_TIMEOUT_S + 5, (got, took)
