"""Decode tokens to the router over ZMQ, not one Ray object per token.

A Ray streaming generator costs CPU per item on each side (about a
millisecond, by hand: docs/DESIGN.md section 3); on a decode actor that is CPU
the engine's step loses, once per token. With ``token_channel: zmq`` the
router binds one PULL socket (:class:`TokenSink`) and each decode actor keeps
one PUSH socket per router (:class:`TokenSender`). ``DecodeWorker.generate``
is still the request's Ray call (a streaming generator), but it carries only
the request's end: it yields nothing on this path, ends after the last chunk
was sent, and raises what the decode raised (a handoff failure before the
first token, an engine error), so the router's retry and error mapping are
those of the Ray path; a dead actor fails it as before.

A frame is JSON: ``[request_id, [token ids], finished, finish_reason, logprobs]``
(``logprobs``: null, or per token ``[logprob, rank, [[id, logprob], ...]]``). JSON,
not pickle: the sink is a listening socket. Frames of one request arrive in
order (one PUSH socket per actor and router); a frame for a request the sink
does not wait for (aborted, or from an earlier router) is dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import TokenLogprobs
from hybridpd.errors import UnavailableError
from services.worker.messages import TokenChunk

logger = logging.getLogger(__name__)

#: how long the router waits for a request's last frame once its Ray call ended
#: (frames and the call's end travel different connections)
END_GRACE_S = 5.0


def token_sink_host(cfg: HybridPDConfig) -> str:
    """The address the router's sink binds (``token_sink_host``; 'auto': its Ray node IP)."""
    if cfg.token_sink_host != "auto":
        return cfg.token_sink_host
    import ray

    return ray.util.get_node_ip_address()


def encode(request_id: str, chunk: TokenChunk) -> bytes:
    lps = None if chunk.logprobs is None else [[x.logprob, x.rank, x.top] for x in chunk.logprobs]
    return json.dumps([request_id, list(chunk.token_ids), chunk.finished, chunk.finish_reason, lps]).encode()


def decode(frame: bytes) -> tuple[str, TokenChunk]:
    """A frame's request id and chunk; ValueError for anything that is not a frame."""
    try:
        rid, ids, finished, reason, lps = json.loads(frame)
        if not isinstance(rid, str) or not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ValueError("not a token frame")
        logprobs = None
        if lps is not None:
            logprobs = tuple(
                TokenLogprobs(float(lp), int(rank), tuple((int(t), float(v)) for t, v in top))
                for lp, rank, top in lps
            )
            if len(logprobs) != len(ids):
                raise ValueError("logprobs do not match the frame's tokens")
    except (TypeError, ValueError) as exc:  # also a wrong arity or element type
        raise ValueError("not a token frame: %s" % exc) from None
    return rid, TokenChunk(tuple(ids), bool(finished), None if reason is None else str(reason), logprobs)


class TokenSender:
    """A decode actor's end: one PUSH socket per sink address, shared by its
    request threads (a socket is used under its lock only)."""

    def __init__(self) -> None:
        import zmq

        self._zmq = zmq
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sockets: dict[str, Any] = {}

    def send(self, address: str, request_id: str, chunk: TokenChunk) -> None:
        """Queue ``chunk`` for the sink at ``address``; never blocks. UnavailableError
        when that sink takes no more (its router is gone, or ``SNDHWM`` frames behind):
        the request ends there, and the actor's other streams go on."""
        frame = encode(request_id, chunk)
        with self._lock:
            sock = self._sockets.get(address)
            if sock is None:
                sock = self._ctx.socket(self._zmq.PUSH)
                sock.setsockopt(self._zmq.LINGER, 1000)
                sock.connect(address)  # frames queue from here on, before the connection is up
                self._sockets[address] = sock
            try:
                sock.send(frame, self._zmq.NOBLOCK)
            except self._zmq.Again:
                raise UnavailableError("the token sink at %s takes no more frames" % address) from None

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()


class TokenSink:
    """The router's end: one PULL socket and a reader task (started on first use,
    in the router's event loop) that hands each frame to its request's queue."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.address: str | None = None
        self._queues: dict[str, asyncio.Queue[TokenChunk | BaseException | None]] = {}
        self._sock: Any = None
        self._reader: asyncio.Task[None] | None = None

    def _start(self) -> None:
        import zmq
        import zmq.asyncio

        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://%s" % self.host)
        self.address = "tcp://%s:%d" % (self.host, port)
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="token-sink")
        logger.info("decode tokens arrive at %s", self.address)

    async def _read(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                rid, chunk = decode(frame)
            except (ValueError, TypeError):
                logger.warning("token sink dropped a frame that is not one (%d bytes)", len(frame))
                continue
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(chunk)

    def open(self, request_id: str) -> tuple[str, asyncio.Queue[TokenChunk | BaseException | None]]:
        """Start waiting for ``request_id``'s frames: the address to send them to, and their queue."""
        if self._reader is None:
            self._start()
        assert self.address is not None
        q: asyncio.Queue[TokenChunk | BaseException | None] = asyncio.Queue()
        self._queues[request_id] = q
        return self.address, q

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class SinkStream:
    """One request's decode chunks from the sink; its Ray call (``gen``, which yields
    nothing) is watched for the end and for errors."""

    def __init__(self, sink: TokenSink, request_id: str) -> None:
        self._sink = sink
        self._rid = request_id
        self.address, self._queue = sink.open(request_id)
        self._watch: asyncio.Task[None] | None = None
        self._done = False

    def attach(self, gen: AsyncIterator[Any]) -> None:
        """Watch ``gen``, the request's Ray call, made with :attr:`address`."""
        self._watch = asyncio.get_running_loop().create_task(self._watch_call(gen))

    async def _watch_call(self, gen: AsyncIterator[Any]) -> None:
        try:
            async for ref in gen:
                await ref  # nothing is yielded on this path; a stray item is read and dropped
        except BaseException as exc:  # what the decode raised (a dead actor included)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._queue.put_nowait(exc)
            return
        self._queue.put_nowait(None)  # the call ended: the last frame is sent (or the request aborted)

    async def next(self) -> TokenChunk | None:
        """The next chunk, None once the request's last chunk was read; raises what the decode raised."""
        if self._done:
            return None
        item = await self._queue.get()
        if item is None:  # the call ended before its last frame arrived: wait a moment for it
            try:
                item = await asyncio.wait_for(self._queue.get(), END_GRACE_S)
            except TimeoutError:
                raise UnavailableError("decode of %s ended without its last tokens" % self._rid) from None
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        if item.finished:
            self._done = True
        return item

    def close(self) -> None:
        self._sink.release(self._rid)
        if self._watch is not None and not self._watch.done():
            self._watch.cancel()
