"""Decode tokens to the router over ZMQ, not one Ray object per token.

A Ray streaming generator costs CPU per item on each side; on a decode actor
that is CPU the engine's step loses, once per token. With ``token_channel: zmq`` the
router binds one PULL socket (:class:`TokenSink`) and each decode actor keeps
one PUSH socket per router (:class:`TokenSender`). The whole stream travels
there as typed frames (``frames.py``): its tokens, then one ``end`` frame (its
last tokens and finish reason) or one ``error`` frame (the error's class and
public message, raised again by the router as the same class: a handoff failure
before the first token is retried on another decode, as on the Ray path).
``DecodeWorker.generate`` is still the request's Ray call (a streaming
generator), but it only starts the work and yields nothing: the router watches
it for a failure (a dead actor, or an end it could not send) and never waits
for its normal end. A stream whose frames stop is bounded by its request's
deadline (the router's ``Deadline``).

The sink checks each frame (``frames.decode``: its size, ``max_token_frame_bytes``,
decode splitting a chunk that would not fit; its tag, ``hybridpd/integrity.py``;
its version and kind; its body), then that ``seq`` is the next one its request
waits for; a frame failing any of them is refused and counted
(:attr:`TokenSink.refused`, ``hybridpd_token_frames_refused_total{reason}``, the
reasons of ``frames.REFUSALS``), and the sink reads on. A frame whose request the
sink does not wait for (closed, ended, or from an earlier router) is dropped.
Since the request id and ``seq`` are tagged, a captured frame cannot be replayed
into another stream or twice into its own. A frame over :data:`HARD_CAP` times
the limit is never buffered: libzmq drops that peer's connection
(``MAXMSGSIZE``). Frames of one request arrive in order (one PUSH socket per
actor and router).

Closing a stream (:meth:`SinkStream.close`, the router's ``finally``) stops
waiting for its frames and, if it had not ended, cancels its Ray call
(:func:`cancel_call`: the decode actor sees the cancel between chunks and
frees the request; the router's abort reaches it too).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from hybridpd.config import HybridPDConfig
from hybridpd.errors import UnavailableError
from hybridpd.integrity import TOKEN_FRAME, IntegrityKey
from services.worker.frames import FrameError, StreamFailure, decode, encode
from services.worker.messages import TokenChunk

logger = logging.getLogger(__name__)

#: libzmq drops the connection of a peer whose frame is over this many times the limit, unread
HARD_CAP = 4
#: a stream's key is its request id, this, and a nonce (``SinkStream.key``)
STREAM_SEPARATOR = "~"


def token_sink_host(cfg: HybridPDConfig) -> str:
    """The address the router's sink binds (``token_sink_host``; 'auto': its Ray node IP)."""
    if cfg.token_sink_host != "auto":
        return cfg.token_sink_host
    import ray

    return ray.util.get_node_ip_address()


def cancel_call(call: object) -> None:
    """Cancel a request's Ray call (``ray.cancel``) that has not ended: Ray stops a
    streaming generator at its next yield and flags one that yields nothing, which
    ``DecodeWorker`` reads between chunks. Anything but a Ray generator (a test
    double) is left to its reader."""
    import ray

    if isinstance(call, ray.ObjectRefGenerator):
        ray.cancel(call)


def split(chunk: TokenChunk) -> tuple[TokenChunk, TokenChunk]:
    """``chunk`` as two chunks of about half its tokens each (the second ends it)."""
    n = len(chunk.token_ids) // 2
    lps = chunk.logprobs
    first = TokenChunk(chunk.token_ids[:n], False, None, None if lps is None else lps[:n])
    return first, TokenChunk(chunk.token_ids[n:], chunk.finished, chunk.finish_reason, None if lps is None else lps[n:])


class TokenSender:
    """A decode actor's end: one PUSH socket per sink address, shared by its
    request threads (a socket is used under its lock only). Each request sends
    through its own :class:`FrameStream` (its sequence numbers)."""

    def __init__(self, key: IntegrityKey, max_frame_bytes: int) -> None:
        import zmq

        self._zmq = zmq
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sockets: dict[str, Any] = {}
        self.tagger = key.tagger(TOKEN_FRAME)
        self.max_frame_bytes = max_frame_bytes

    def stream(self, address: str, key: str, request_id: str | None = None) -> FrameStream:
        """The frames of stream ``key`` (``SinkStream.key``) of ``request_id`` (``key`` if
        None) to the sink at ``address``, numbered from 0."""
        return FrameStream(self, address, key, request_id or key)

    def frames(self, key: str, seq: int, body: TokenChunk | StreamFailure) -> list[bytes]:
        """``body`` as frames numbered from ``seq``, each within ``max_frame_bytes`` (a
        chunk that would not fit is split); UnavailableError if one token does not fit."""
        frame = encode(self.tagger, key, seq, body)
        if len(frame) <= self.max_frame_bytes:
            return [frame]
        if isinstance(body, StreamFailure) or len(body.token_ids) < 2:
            raise UnavailableError("a token frame of %d bytes exceeds max_token_frame_bytes" % len(frame))
        first, rest = split(body)
        head = self.frames(key, seq, first)
        return head + self.frames(key, seq + len(head), rest)

    def send(self, address: str, frames: list[bytes]) -> None:
        """Queue ``frames`` for the sink at ``address``; never blocks. UnavailableError
        when that sink takes no more (its router is gone, or ``SNDHWM`` frames behind):
        the request ends there, and the actor's other streams go on."""
        with self._lock:
            sock = self._sockets.get(address)
            if sock is None:
                sock = self._ctx.socket(self._zmq.PUSH)
                sock.setsockopt(self._zmq.LINGER, 1000)
                sock.connect(address)  # frames queue from here on, before the connection is up
                self._sockets[address] = sock
            try:
                for frame in frames:
                    sock.send(frame, self._zmq.NOBLOCK)
            except self._zmq.Again:
                raise UnavailableError("the token sink at %s takes no more frames" % address) from None

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()


class FrameStream:
    """One request's frames: tagged, numbered, sent in order (one thread uses it)."""

    def __init__(self, sender: TokenSender, address: str, key: str, request_id: str) -> None:
        self.sender = sender
        self.address = address
        self.key = key
        self.request_id = request_id
        self.seq = 0

    def send(self, body: TokenChunk | StreamFailure) -> None:
        """Send a chunk (the last one, ``finished``, as the end frame) or the stream's failure."""
        frames = self.sender.frames(self.key, self.seq, body)
        self.seq += len(frames)
        self.sender.send(self.address, frames)

    def fail(self, exc: BaseException) -> None:
        """End the stream with ``exc`` (an error frame: ``StreamFailure.of``)."""
        self.send(StreamFailure.of(exc, self.request_id))


@dataclass(slots=True)
class _Waiting:
    """A request the sink waits for: its queue and the sequence number it takes next."""

    queue: asyncio.Queue[TokenChunk | BaseException] = field(default_factory=asyncio.Queue)
    seq: int = 0


class TokenSink:
    """The router's end: one PULL socket and a reader task (started on first use,
    in the router's event loop) that checks each frame (module docstring) and hands
    what it carries to its request's queue. ``refused`` counts the frames it refused,
    by reason; ``on_refused(reason)`` is called for each (the router's metric)."""

    def __init__(
        self,
        host: str,
        key: IntegrityKey,
        max_frame_bytes: int,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.host = host
        self.address: str | None = None
        self.tagger = key.tagger(TOKEN_FRAME)
        self.max_frame_bytes = max_frame_bytes
        self.refused: collections.Counter[str] = collections.Counter()
        self._on_refused = on_refused
        self._waiting: dict[str, _Waiting] = {}
        self._sock: Any = None
        self._reader: asyncio.Task[None] | None = None

    def _start(self) -> None:
        import zmq
        import zmq.asyncio

        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, HARD_CAP * self.max_frame_bytes)
        port = self._sock.bind_to_random_port("tcp://%s" % self.host)
        self.address = "tcp://%s:%d" % (self.host, port)
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="token-sink")
        logger.info("decode tokens arrive at %s", self.address)

    async def _read(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                self._take(frame)
            except FrameError as exc:
                self._refuse(exc.reason, str(exc))
            except Exception as exc:  # the reader serves every stream: it never stops on one frame
                self._refuse("malformed", "%s: %s" % (type(exc).__name__, exc))

    def _take(self, data: bytes) -> None:
        frame = decode(self.tagger, data, self.max_frame_bytes)
        w = self._waiting.get(frame.request_id)
        if w is None:
            return  # closed, ended, or a frame for an earlier router: dropped
        if frame.seq != w.seq:
            what = "frame %d of %s where %d was due (replayed?)" % (frame.seq, frame.request_id, w.seq)
            raise FrameError("sequence", what)
        w.seq += 1
        if frame.kind != "tokens":  # its end or error: nothing more is due
            del self._waiting[frame.request_id]
        w.queue.put_nowait(frame.item())

    def _refuse(self, reason: str, message: str) -> None:
        self.refused[reason] += 1
        n = self.refused[reason]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... of each reason: a flood does not flood the log
            logger.warning("token sink refused a frame (%s, %d so far): %s", reason, n, message)
        if self._on_refused is not None:
            self._on_refused(reason)

    def open(self, key: str) -> tuple[str, asyncio.Queue[TokenChunk | BaseException]]:
        """Start waiting for the frames of stream ``key`` (``SinkStream.key``, from number
        0): the address to send them to, and their queue (a chunk or the stream's error
        per frame)."""
        if self._reader is None:
            self._start()
        if self.address is None:
            raise UnavailableError("the token sink did not bind")
        w = self._waiting[key] = _Waiting()
        return self.address, w.queue

    def release(self, key: str, queue: asyncio.Queue[TokenChunk | BaseException]) -> None:
        """Stop waiting for stream ``key``'s frames, if ``queue`` (from :meth:`open`) still takes them."""
        w = self._waiting.get(key)
        if w is not None and w.queue is queue:
            del self._waiting[key]

    def waiting(self) -> int:
        """How many streams the sink waits for."""
        return len(self._waiting)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class SinkStream:
    """One request's decode stream from the sink: its chunks, then its end or error
    (frames); its Ray call (``call``, which yields nothing) is watched for a failure only.
    Its frames name :attr:`key`, the request id and a nonce of this stream: a retry on
    another decode instance is another stream, so a late frame of the first one (a
    decode that was given up on) is dropped, never read as the retry's."""

    def __init__(self, sink: TokenSink, request_id: str) -> None:
        self._sink = sink
        #: the id its frames carry (``DecodeWorker.generate``'s ``stream``)
        self.key = "%s%s%s" % (request_id, STREAM_SEPARATOR, secrets.token_hex(4))
        self.address, self._queue = sink.open(self.key)
        self._call: object = None
        self._watch: asyncio.Task[None] | None = None
        self._ended = False

    def attach(self, call: AsyncIterator[Any]) -> None:
        """Watch ``call``, the request's Ray call, made with :attr:`address`."""
        self._call = call
        self._watch = asyncio.get_running_loop().create_task(self._watch_call(call))

    async def _watch_call(self, call: AsyncIterator[Any]) -> None:
        try:
            async for ref in call:
                await ref  # nothing is yielded on this path; a stray item is read and dropped
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a dead actor, or an end the actor could not send
            self._queue.put_nowait(exc)
        # NOTE: its normal end says nothing: the frames say how the stream ended

    async def next(self) -> TokenChunk | None:
        """The next chunk, None once the stream's last chunk was read; raises its error."""
        if self._ended:
            return None
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        self._ended = item.finished
        return item

    def close(self) -> None:
        """Stop waiting for frames; cancel the Ray call of a stream that has not ended."""
        self._sink.release(self.key, self._queue)
        if self._watch is not None and not self._watch.done():
            self._watch.cancel()
            if not self._ended:
                cancel_call(self._call)
        self._ended = True
