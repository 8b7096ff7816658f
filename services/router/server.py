"""Runs the router: the OpenAI HTTP API (uvicorn) and gRPC in one event loop.

Both servers serve TLS when ``tls_cert_file`` / ``tls_key_file`` are set, and
both bound what one client can hold:

* HTTP: at most ``http_max_connections`` open connections (uvicorn answers 503
  at that many; a connection past it is closed at once), idle keep-alive
  connections close after ``http_keepalive_timeout_s``, and a connection that
  has not sent a whole request head (request line and headers) within
  ``http_header_timeout_s`` of its first byte (or of its start) is closed: the
  slow-header attack. Heads are at most h11's 16 KiB.
* gRPC: messages up to ``grpc_max_message_bytes`` (RESOURCE_EXHAUSTED past it),
  ``GRPC_STREAMS_PER_CONNECTION`` concurrent streams per connection, at most
  ``http_max_connections`` RPCs at once, the TLS and HTTP/2 handshake within
  ``http_header_timeout_s``, idle connections closed, and connections aged
  out (their streams get the request deadline to finish).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridpd.config import HybridPDConfig
from hybridpd.errors import UnavailableError
from services.router.grpc_api import create_grpc_server, mark_serving
from services.router.openai_api import create_app
from services.router.orchestrator import Orchestrator

logger = logging.getLogger(__name__)

#: HTTP/2 streams one gRPC connection may have open at once
GRPC_STREAMS_PER_CONNECTION = 100
#: a gRPC connection with no open stream is closed after this long
GRPC_IDLE_MS = 5 * 60 * 1000
#: a gRPC connection is asked to go away after this long (a client reconnects; load spreads over replicas)
GRPC_MAX_AGE_MS = 30 * 60 * 1000

#: what a connection past ``http_max_connections`` is sent before it is closed
_REFUSED = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for the request head and a hard cap on
    open connections. Subclassed per server by :func:`guarded_h11` with its limits."""

    header_timeout_s: float = 10.0
    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            transport.write(_REFUSED)
            transport.close()
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._await_head()

    def _await_head(self) -> None:
        """Arm the head deadline while a request head is awaited (never re-armed by more of the
        same head: a byte a second does not keep a connection), cancel it once a head is in.
        A keep-alive connection waiting for its next request is uvicorn's keep-alive timeout's;
        its first byte starts the deadline of that head."""
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._cancel_head_timer()
        elif self._header_timer is None and self.timeout_keep_alive_task is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _head_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.debug("closing a connection whose request head took over %.1fs", self.header_timeout_s)
            self.transport.close()


def guarded_h11(header_timeout_s: float, max_connections: int | None) -> type[GuardedH11Protocol]:
    """:class:`GuardedH11Protocol` with these limits (uvicorn makes one per connection)."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
    )


def http_config(app: FastAPI, cfg: HybridPDConfig, host: str, port: int) -> uvicorn.Config:
    """uvicorn's config for the HTTP API: TLS when configured, and the connection limits."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=5,
        http=guarded_h11(cfg.http_header_timeout_s, cfg.http_max_connections),
        limit_concurrency=cfg.http_max_connections,
        # NOTE: uvicorn hands the keep-alive timeout to loop.call_later: seconds as a float work
        timeout_keep_alive=cfg.http_keepalive_timeout_s,  # type: ignore[arg-type]
        ssl_certfile=cfg.tls_cert_file,
        ssl_keyfile=cfg.tls_key_file,
    )


def grpc_options(cfg: HybridPDConfig) -> list[tuple[str, int]]:
    """grpc.aio server options: message size, streams per connection, handshake deadline,
    idle and aged-out connections (a stream open at the age limit gets the request deadline)."""
    return [
        ("grpc.max_receive_message_length", cfg.grpc_max_message_bytes),
        ("grpc.max_concurrent_streams", GRPC_STREAMS_PER_CONNECTION),
        ("grpc.server_handshake_timeout_ms", max(1, int(cfg.http_header_timeout_s * 1000))),
        ("grpc.max_connection_idle_ms", GRPC_IDLE_MS),
        ("grpc.max_connection_age_ms", GRPC_MAX_AGE_MS),
        ("grpc.max_connection_age_grace_ms", int(cfg.request_timeout_s * 1000) + 5000),
    ]


def grpc_credentials(cfg: HybridPDConfig) -> grpc.ServerCredentials | None:
    """The server's TLS credentials (None: plain text)."""
    if cfg.tls_cert_file is None or cfg.tls_key_file is None:
        return None
    key, chain = Path(cfg.tls_key_file).read_bytes(), Path(cfg.tls_cert_file).read_bytes()
    return grpc.ssl_server_credentials([(key, chain)])


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal capture: ``hybridpd up`` owns Ctrl-C."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class RouterServer:
    #: how often a drain says how many requests it still waits for
    DRAIN_LOG_S = 5.0

    def __init__(
        self,
        orch: Orchestrator,
        served_model: str,
        host: str,
        http_port: int,
        grpc_port: int,
        stats: Callable[[], Awaitable[dict]],
    ) -> None:
        self.app = create_app(orch, served_model, stats)
        self.http = _QuietServer(http_config(self.app, orch.cfg, host, http_port))
        self.orch = orch
        self.served_model = served_model
        self.grpc_address = "%s:%d" % (host, grpc_port)
        self.grpc_credentials = grpc_credentials(orch.cfg)  # the TLS files are read here, before anything serves

    async def serve(
        self, stop: asyncio.Event, ready: asyncio.Event | None = None, force: asyncio.Event | None = None
    ) -> None:
        """Serve until ``stop`` is set (or uvicorn exits on a signal), then drain
        (:meth:`drain`, cut short by ``force``) and stop both servers. ``ready`` is set
        once both servers listen; a port that cannot be bound raises before it is."""
        # NOTE: grpc.aio servers bind to the loop they are created in: create it here
        self.grpc = create_grpc_server(
            self.orch,
            self.served_model,
            self.grpc_address,
            options=grpc_options(self.orch.cfg),
            credentials=self.grpc_credentials,
            maximum_concurrent_rpcs=self.orch.cfg.http_max_connections,
        )
        await self.grpc.start()
        health_task = await mark_serving(self.grpc)
        http_task = asyncio.create_task(self._serve_http())
        stop_task = asyncio.create_task(stop.wait())
        while not self.http.started and not http_task.done() and not stop.is_set():
            await asyncio.sleep(0.05)
        if http_task.done() and not stop.is_set():  # uvicorn gave up: most likely the port is taken
            stop_task.cancel()
            health_task.cancel()
            await self.grpc.stop(grace=0)
            http_task.result()
            raise UnavailableError("the HTTP server on %s did not start" % self.http.config.port)
        if ready is not None:
            ready.set()
        try:
            await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set() and not http_task.done():
                await self.drain(force or asyncio.Event())
        finally:
            self.http.should_exit = True
            await asyncio.gather(http_task, return_exceptions=True)
            stop_task.cancel()
            health_task.cancel()
            await self.grpc.stop(grace=2)

    async def _serve_http(self) -> None:
        """uvicorn's serve; its exit when it cannot start (a port taken: it logs why and
        calls sys.exit, which would leave the event loop at once) as UnavailableError."""
        try:
            await self.http.serve()
        except SystemExit as exc:
            raise UnavailableError(
                "the HTTP server on %s:%d did not start (uvicorn exited, status %s; it logged why)"
                % (self.http.config.host, self.http.config.port, exc.code)
            ) from None

    async def drain(self, force: asyncio.Event) -> None:
        """Stop admitting (``Orchestrator.drain``: ``/ready`` and gRPC health false, new
        requests 503 with Retry-After) and wait until the requests in flight finish,
        for at most ``drain_grace_s`` or until ``force`` is set; the servers keep
        serving those requests meanwhile. What is left when the grace ends is cut."""
        self.orch.drain()
        grace, t0 = self.orch.cfg.drain_grace_s, time.monotonic()
        said = t0
        admission = self.orch.admission
        if admission.inflight:
            logger.warning("draining: %d requests in flight, for at most %.0fs", admission.inflight, grace)
        while admission.inflight and time.monotonic() - t0 < grace and not force.is_set():
            await asyncio.sleep(0.05)
            if time.monotonic() - said >= self.DRAIN_LOG_S:
                said = time.monotonic()
                logger.warning("draining: %d requests in flight, %.0fs left", admission.inflight, grace - (said - t0))
        if admission.inflight:
            logger.warning("drain ended with %d requests in flight: they are cut", admission.inflight)
        else:
            logger.info("drained in %.1fs", time.monotonic() - t0)
