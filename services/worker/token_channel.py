"""Decode tokens to the router over ZMQ, not one Ray object per token.

A Ray streaming generator costs CPU per item on each side; on a decode actor
that is CPU the engine's step loses, once per token. With ``token_channel: zmq`` the
router binds one PULL socket (:class:`TokenSink`) and each decode actor keeps
one PUSH socket per router (:class:`TokenSender`). ``DecodeWorker.generate``
is still the request's Ray call (a streaming generator), but it carries only
the request's end: it yields nothing on this path, ends after the last chunk
was sent, and raises what the decode raised (a handoff failure before the
first token, an engine error), so the router's retry and error mapping are
those of the Ray path; a dead actor fails the Ray call.

A frame is a keyed tag and a JSON body::

    tag (32 bytes) | [request_id, seq, [token ids], finished, finish_reason, logprobs]
    tag = HMAC-SHA256 (the deployment key's token-frame subkey) of the body

(``logprobs``: null, or per token ``[logprob, rank, [[id, logprob], ...]]``;
``seq``: 0, 1, 2, ... per request). JSON, not pickle: the sink is a listening
socket. The sink checks, in order and before parsing anything: the size
(``max_token_frame_bytes``; decode splits a chunk that would not fit), the
tag (``hybridpd/integrity.py``), then the body, then that ``seq`` is the next
one its request waits for; a frame failing any of them is refused and
counted (:attr:`TokenSink.refused`, ``hybridpd_token_frames_refused_total``),
and the sink reads on. A frame whose request the sink does not wait for
(aborted, or from an earlier router) is dropped. Since the request id and
``seq`` are tagged, a captured frame cannot be replayed into another stream
or twice into its own. A frame over :data:`HARD_CAP` times the limit is never
buffered: libzmq drops that peer's connection (``MAXMSGSIZE``). Frames of one
request arrive in order (one PUSH socket per actor and router).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import TokenLogprobs
from hybridpd.errors import UnavailableError
from hybridpd.integrity import TAG_BYTES, TOKEN_FRAME, IntegrityKey, Tagger
from services.worker.messages import TokenChunk

logger = logging.getLogger(__name__)

#: how long the router waits for a request's last frame once its Ray call ended
#: (frames and the call's end travel different connections)
END_GRACE_S = 5.0
#: libzmq drops the connection of a peer whose frame is over this many times the limit, unread
HARD_CAP = 4
#: why the sink refuses a frame (the counter's labels)
REFUSALS = ("oversize", "tag", "malformed", "sequence")


def token_sink_host(cfg: HybridPDConfig) -> str:
    """The address the router's sink binds (``token_sink_host``; 'auto': its Ray node IP)."""
    if cfg.token_sink_host != "auto":
        return cfg.token_sink_host
    import ray

    return ray.util.get_node_ip_address()


class FrameError(ValueError):
    """A frame the sink refuses; ``reason`` is one of :data:`REFUSALS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def encode(tagger: Tagger, request_id: str, seq: int, chunk: TokenChunk) -> bytes:
    """The tagged frame of ``request_id``'s chunk number ``seq``."""
    lps = None if chunk.logprobs is None else [[x.logprob, x.rank, x.top] for x in chunk.logprobs]
    body = json.dumps([request_id, seq, list(chunk.token_ids), chunk.finished, chunk.finish_reason, lps]).encode()
    return tagger.tag(body) + body


def decode(tagger: Tagger, frame: bytes, max_bytes: int) -> tuple[str, int, TokenChunk]:
    """A frame's request id, sequence number and chunk; FrameError for a frame over
    ``max_bytes``, one whose tag is not this key's, or one that is not a frame (checked
    in that order: nothing is parsed before the tag held)."""
    if len(frame) > max_bytes:
        raise FrameError("oversize", "a frame of %d bytes, over the limit of %d" % (len(frame), max_bytes))
    body = memoryview(frame)[TAG_BYTES:]
    if len(frame) < TAG_BYTES or not tagger.valid(frame[:TAG_BYTES], body):
        raise FrameError("tag", "a frame without this deployment's tag (%d bytes)" % len(frame))
    try:
        rid, seq, ids, finished, reason, lps = json.loads(bytes(body))
        if not isinstance(rid, str) or type(seq) is not int or not isinstance(ids, list):
            raise ValueError("not a token frame")
        if not all(type(t) is int for t in ids):
            raise ValueError("token ids must be ints")
        logprobs = None
        if lps is not None:
            logprobs = tuple(
                TokenLogprobs(float(lp), int(rank), tuple((int(t), float(v)) for t, v in top)) for lp, rank, top in lps
            )
            if len(logprobs) != len(ids):
                raise ValueError("logprobs do not match the frame's tokens")
    except (TypeError, ValueError) as exc:  # also a wrong arity or element type
        raise FrameError("malformed", "not a token frame: %s" % exc) from None
    return rid, seq, TokenChunk(tuple(ids), bool(finished), None if reason is None else str(reason), logprobs)


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

    def stream(self, address: str, request_id: str) -> FrameStream:
        """The frames of ``request_id`` to the sink at ``address``, numbered from 0."""
        return FrameStream(self, address, request_id)

    def frames(self, request_id: str, seq: int, chunk: TokenChunk) -> list[bytes]:
        """``chunk`` as frames numbered from ``seq``, each within ``max_frame_bytes`` (a
        chunk that would not fit is split); UnavailableError if one token does not fit."""
        frame = encode(self.tagger, request_id, seq, chunk)
        if len(frame) <= self.max_frame_bytes:
            return [frame]
        if len(chunk.token_ids) < 2:
            raise UnavailableError("a token frame of %d bytes exceeds max_token_frame_bytes" % len(frame))
        first, rest = split(chunk)
        head = self.frames(request_id, seq, first)
        return head + self.frames(request_id, seq + len(head), rest)

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

    def __init__(self, sender: TokenSender, address: str, request_id: str) -> None:
        self.sender = sender
        self.address = address
        self.request_id = request_id
        self.seq = 0

    def send(self, chunk: TokenChunk) -> None:
        frames = self.sender.frames(self.request_id, self.seq, chunk)
        self.seq += len(frames)
        self.sender.send(self.address, frames)


@dataclass(slots=True)
class _Waiting:
    """A request the sink waits for: its queue and the sequence number it takes next."""

    queue: asyncio.Queue[TokenChunk | BaseException | None] = field(default_factory=asyncio.Queue)
    seq: int = 0


class TokenSink:
    """The router's end: one PULL socket and a reader task (started on first use,
    in the router's event loop) that checks each frame (module docstring) and hands
    it to its request's queue. ``refused`` counts the frames it refused, by reason;
    ``on_refused(reason)`` is called for each (the router's metric)."""

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

    def _take(self, frame: bytes) -> None:
        rid, seq, chunk = decode(self.tagger, frame, self.max_frame_bytes)
        w = self._waiting.get(rid)
        if w is None:
            return  # aborted, or a frame for an earlier router: dropped
        if seq != w.seq:
            raise FrameError("sequence", "frame %d of %s where %d was due (replayed?)" % (seq, rid, w.seq))
        w.seq += 1
        w.queue.put_nowait(chunk)

    def _refuse(self, reason: str, message: str) -> None:
        self.refused[reason] += 1
        n = self.refused[reason]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... of each reason: a flood does not flood the log
            logger.warning("token sink refused a frame (%s, %d so far): %s", reason, n, message)
        if self._on_refused is not None:
            self._on_refused(reason)

    def open(self, request_id: str) -> tuple[str, asyncio.Queue[TokenChunk | BaseException | None]]:
        """Start waiting for ``request_id``'s frames (from number 0): the address to send
        them to, and their queue."""
        if self._reader is None:
            self._start()
        assert self.address is not None
        w = self._waiting[request_id] = _Waiting()
        return self.address, w.queue

    def release(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

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
