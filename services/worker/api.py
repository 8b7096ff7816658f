"""The router-to-worker channel, typed: one client class per worker kind.

The router never touches a Ray actor handle: it calls these clients, whose
methods name every actor method it uses (``PrefillWorker`` and
``DecodeWorker``) with typed arguments and results (``messages.py``). Instance
names are built here only (``prefill-<i>``, ``decode-<j>``, the Ray actor
names in namespace ``hybridpd``).

A handle is anything with Ray's calling convention (``handle.method.remote``
returns an awaitable; ``generate`` streams): a Ray ``ActorHandle`` in the
stack, a test double in the router's unit tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from hybridpd.engine.base import EngineRequest
from hybridpd.errors import IntegrityError
from services.worker.messages import PrefillCommand, PrefillResult, TokenChunk
from services.worker.token_channel import SinkStream, TokenSink, cancel_call

#: chunks a decode stream may run ahead of the router; past that the decode
#: actor waits and merges what the engine produced meanwhile into one chunk
STREAM_AHEAD = 4


def prefill_name(i: int) -> str:
    return "prefill-%d" % i


def decode_name(j: int) -> str:
    return "decode-%d" % j


class ActorHandle(Protocol):
    """Ray's calling convention, as much of it as the clients use (``ray.actor.ActorHandle``)."""

    def __getattr__(self, method: str) -> RemoteMethod: ...


class RemoteMethod(Protocol):
    def remote(self, *args: object) -> Awaitable[object]: ...

    def options(self, **options: object) -> RemoteMethod: ...


T = TypeVar("T")


def _typed(got: object, kind: type[T], source: str) -> T:
    """``got`` if it is a ``kind`` (what the worker's method returns), else IntegrityError:
    a check that holds under ``python -O`` too, where an ``assert`` vanishes."""
    if not isinstance(got, kind):
        raise IntegrityError("%s answered a %s, not a %s" % (source, type(got).__name__, kind.__name__))
    return got


class WorkerClient:
    """What every worker answers: abort, stats, the fault hook, a ping."""

    def __init__(self, name: str, handle: ActorHandle) -> None:
        self.name = name
        self.handle = handle

    def abort(self, request_id: str) -> None:
        """Free ``request_id`` on this worker if it holds it (fire and forget)."""
        self.handle.abort.remote(request_id)

    async def serving(self) -> bool:
        """Whether the worker takes new work (``WorkerBase.serving``: no engine lock taken;
        False while it drains); raises what Ray raises for a dead one."""
        return bool(await self.handle.serving.remote())

    async def stats(self) -> dict[str, object]:
        """Identity, pools and counters (``WorkerBase._base_stats`` and the worker's own)."""
        return _typed(await self.handle.stats.remote(), dict, self.name)

    async def inject_fault(self, kind: str) -> None:
        """Test hook (``fault_injection``): the worker's engine injects ``kind``."""
        await self.handle.inject_fault.remote(kind)


class PrefillClient(WorkerClient):
    async def prefill(self, cmd: PrefillCommand) -> PrefillResult:
        """Prefill ``cmd.request`` (``PrefillWorker.prefill``)."""
        return _typed(await self.handle.prefill.remote(cmd), PrefillResult, self.name)

    def answer(self, req: EngineRequest) -> None:
        """Prefill ``req`` (prompt + answer) at low priority, fire and forget
        (``PrefillWorker.answer``)."""
        self.handle.answer.remote(req)


class DecodeStream:
    """One request's decode chunks, read one at a time (Ray streaming generator: the
    chunks, the end and the error all travel as its items)."""

    def __init__(self, gen: object) -> None:
        self._gen = gen
        self._ended = False

    def close(self) -> None:
        """Stop reading; a stream that has not ended has its Ray call cancelled (the
        actor's generator stops at its next yield and frees the request; the router's
        abort reaches the actor too)."""
        if not self._ended:
            self._ended = True
            cancel_call(self._gen)

    async def next(self) -> TokenChunk | None:
        """The next chunk, None at the stream's end; raises what the decode raised."""
        if self._ended:
            return None
        try:
            ref = await self._gen.__anext__()  # type: ignore[attr-defined]
            chunk = _typed(await ref, TokenChunk, "a decode stream")
        except StopAsyncIteration:
            self._ended = True
            return None
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):  # a deadline's cancel: the stream runs on
                self._ended = True
            raise
        self._ended = chunk.finished  # the generator's end follows
        return chunk


class DecodeClient(WorkerClient):
    """``sink``: the router's token sink (``token_channel: zmq``); None streams every
    chunk as a Ray object (``token_channel: ray``)."""

    def __init__(self, name: str, handle: ActorHandle, sink: TokenSink | None = None) -> None:
        super().__init__(name, handle)
        self.sink = sink

    def generate(self, pr: PrefillResult, req: EngineRequest) -> DecodeStream | SinkStream:
        """Decode ``req`` from ``pr``'s handoff (``DecodeWorker.generate``): its chunks
        through the sink, or as Ray objects at most :data:`STREAM_AHEAD` ahead of the reader."""
        if self.sink is not None:
            method = self.handle.generate.options(num_returns="streaming")
            stream = SinkStream(self.sink, req.request_id)
            stream.attach(method.remote(pr, req, stream.address, stream.key))  # type: ignore[arg-type]  # a Ray generator
            return stream
        method = self.handle.generate.options(num_returns="streaming", _generator_backpressure_num_objects=STREAM_AHEAD)
        return DecodeStream(method.remote(pr, req))
