"""The router's servers as configured (services/router/server.py): uvicorn's TLS and
limits, the gRPC options, and the guarded h11 protocol on a real loopback socket:
a slow request head is closed within the header timeout, a whole one is served,
connections past the cap are refused."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvicorn

from hybridpd.config import load_config
from hybridpd.procs import free_port
from services.router.server import (
    GuardedH11Protocol,
    _QuietServer,
    grpc_credentials,
    grpc_options,
    guarded_h11,
    http_config,
)
from tests.tls_certs import self_signed

TIMEOUT_S = 0.4


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    out = b"ok:" + body
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


@contextlib.asynccontextmanager
async def _serving(max_connections: int = 64, **kw: Any) -> AsyncIterator[int]:
    port = free_port()
    config = uvicorn.Config(
        _echo,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        http=guarded_h11(TIMEOUT_S, max_connections),
        limit_concurrency=max_connections,
        **kw,
    )
    server = _QuietServer(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), task
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def _closed_after(reader: asyncio.StreamReader, limit_s: float = 5.0) -> tuple[bytes, float]:
    """What the server sent until it closed the connection (an EOF, or a reset or broken
    pipe seen by a write), and when it closed it."""
    t0, got = time.monotonic(), b""
    while True:
        try:
            chunk = await asyncio.wait_for(reader.read(4096), limit_s)
        except ConnectionError:
            chunk = b""
        if not chunk:
            return got, time.monotonic() - t0
        got += chunk


def test_http_config_follows_the_config(tmp_path: Path) -> None:
    pem = self_signed(tmp_path)
    cfg = load_config(
        env={},
        overrides={
            "tls_cert_file": str(pem.cert),
            "tls_key_file": str(pem.key),
            "http_max_connections": 7,
            "http_keepalive_timeout_s": 2.5,
            "http_header_timeout_s": 3.0,
        },
    )
    config = http_config(None, cfg, "127.0.0.1", 8000)  # type: ignore[arg-type]
    assert (config.ssl_certfile, config.ssl_keyfile) == (str(pem.cert), str(pem.key))
    assert config.limit_concurrency == 7 and config.timeout_keep_alive == 2.5
    assert issubclass(config.http, GuardedH11Protocol)  # type: ignore[arg-type]
    assert (config.http.header_timeout_s, config.http.max_connections) == (3.0, 7)  # type: ignore[union-attr]
    plain = http_config(None, load_config(env={}), "127.0.0.1", 8000)  # type: ignore[arg-type]
    assert plain.ssl_certfile is None and not plain.is_ssl


def test_grpc_options_and_credentials(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides={"grpc_max_message_bytes": 65536, "http_header_timeout_s": 2.0})
    opts = dict(grpc_options(cfg))
    assert opts["grpc.max_receive_message_length"] == 65536
    assert opts["grpc.server_handshake_timeout_ms"] == 2000
    assert opts["grpc.max_concurrent_streams"] > 0 and opts["grpc.max_connection_idle_ms"] > 0
    # a stream still open when its connection ages out gets the whole request deadline
    assert opts["grpc.max_connection_age_grace_ms"] >= cfg.request_timeout_s * 1000
    assert grpc_credentials(cfg) is None
    pem = self_signed(tmp_path)
    tls = load_config(env={}, overrides={"tls_cert_file": str(pem.cert), "tls_key_file": str(pem.key)})
    assert isinstance(grpc_credentials(tls), grpc.ServerCredentials)


def test_a_slow_request_head_is_closed_within_the_timeout() -> None:
    async def go() -> None:
        async with _serving() as port:
            # half a request line, then nothing
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v1/mod")
            await writer.drain()
            got, took = await _closed_after(reader)
            assert got == b"" and TIMEOUT_S * 0.8 <= took <= TIMEOUT_S + 2.0, took
            # a connection that sends nothing at all
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            got, took = await _closed_after(reader)
            assert got == b"" and took <= TIMEOUT_S + 2.0, took
            # a byte at a time does not keep it open: the deadline runs from the start
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()
            with contextlib.suppress(ConnectionError):
                for b in b"GET / HTTP/1.1\r\nhost: x\r\n":
                    writer.write(bytes([b]))
                    await writer.drain()
                    await asyncio.sleep(TIMEOUT_S / 8)
            got, _ = await _closed_after(reader)
            assert got == b"" and time.monotonic() - t0 <= TIMEOUT_S + 2.5

    asyncio.run(go())


def test_whole_requests_are_served_and_a_slow_body_is_not_cut() -> None:
    async def go() -> None:
        async with _serving(timeout_keep_alive=30) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(TIMEOUT_S * 2)  # the head is in: only the body is slow
            writer.write(b"hello")
            head = await asyncio.wait_for(reader.readuntil(b"ok:hello"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            # the same keep-alive connection: its next head gets its own deadline from its first byte
            await asyncio.sleep(TIMEOUT_S * 2)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"ok:"), 5)).startswith(b"HTTP/1.1 200")
            writer.write(b"GET / HT")
            got, took = await _closed_after(reader)
            assert got == b"" and took <= TIMEOUT_S + 2.0, took

    asyncio.run(go())


def test_connections_past_the_cap_are_refused() -> None:
    async def go() -> None:
        async with _serving(max_connections=3) as port:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            await asyncio.sleep(0.1)
            reader, _ = await asyncio.open_connection("127.0.0.1", port)
            got, _ = await _closed_after(reader)
            assert got.startswith(b"HTTP/1.1 503"), got
            for _, w in held:
                w.close()
            await asyncio.sleep(0.2)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"ok:"), 5)).startswith(b"HTTP/1.1 200")

    asyncio.run(go())


def test_tls_heads_have_the_same_deadline(tmp_path: Path) -> None:
    pem = self_signed(tmp_path)
    ctx = ssl.create_default_context(cafile=str(pem.cert))

    async def go() -> None:
        async with _serving(ssl_certfile=str(pem.cert), ssl_keyfile=str(pem.key)) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"ok:"), 5)).startswith(b"HTTP/1.1 200")
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
            writer.write(b"GET / HT")
            got, took = await _closed_after(reader)
            assert got == b"" and took <= TIMEOUT_S + 2.0, took

    asyncio.run(go())


@pytest.mark.parametrize("header_timeout_s", [0.5, 10.0])
def test_guarded_h11_makes_a_class_per_limit(header_timeout_s: float) -> None:
    cls = guarded_h11(header_timeout_s, 5)
    assert issubclass(cls, GuardedH11Protocol) and cls.header_timeout_s == header_timeout_s
    assert GuardedH11Protocol.header_timeout_s == 10.0  # the base keeps its default
