"""Runs the router: the OpenAI HTTP API (uvicorn) and gRPC in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

import uvicorn

from hybridpd.errors import UnavailableError
from services.router.grpc_api import create_grpc_server, mark_serving
from services.router.openai_api import create_app
from services.router.orchestrator import Orchestrator

logger = logging.getLogger(__name__)


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal capture: ``hybridpd up`` owns Ctrl-C."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class RouterServer:
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
        self.http = _QuietServer(
            uvicorn.Config(
                self.app, host=host, port=http_port, log_level="warning", lifespan="off", timeout_graceful_shutdown=5
            )
        )
        self.orch = orch
        self.served_model = served_model
        self.grpc_address = "%s:%d" % (host, grpc_port)

    async def serve(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Serve until ``stop`` is set (or uvicorn exits on a signal). ``ready`` is set
        once both servers listen; a port that cannot be bound raises before it is."""
        # NOTE: grpc.aio servers bind to the loop they are created in: create it here
        self.grpc = create_grpc_server(self.orch, self.served_model, self.grpc_address)
        await self.grpc.start()
        await mark_serving(self.grpc)
        http_task = asyncio.create_task(self.http.serve())
        stop_task = asyncio.create_task(stop.wait())
        while not self.http.started and not http_task.done() and not stop.is_set():
            await asyncio.sleep(0.05)
        if http_task.done() and not stop.is_set():  # uvicorn gave up: most likely the port is taken
            stop_task.cancel()
            await self.grpc.stop(grace=0)
            http_task.result()
            raise UnavailableError("the HTTP server on %s did not start" % self.http.config.port)
        if ready is not None:
            ready.set()
        try:
            await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.http.should_exit = True
            await asyncio.gather(http_task, return_exceptions=True)
            stop_task.cancel()
            await self.grpc.stop(grace=2)
