"""The ZMQ token channel (``services/worker/token_channel.py``): real PUSH/PULL
sockets on loopback; the request's Ray call is an async iterator of awaitables,
as a Ray streaming generator is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

import pytest
import zmq

from hybridpd.errors import IntegrityError, UnavailableError
from hybridpd.procs import free_port
from services.worker import token_channel
from services.worker.messages import TokenChunk
from services.worker.token_channel import SinkStream, TokenSender, TokenSink, decode, encode

pytestmark = pytest.mark.unit


async def _call(wait: asyncio.Event, error: BaseException | None = None) -> AsyncIterator[Awaitable[object]]:
    """The request's Ray call on the sink path: yields nothing, ends (or raises) once ``wait`` is set."""
    await wait.wait()
    if error is not None:
        raise error
    return
    yield  # pragma: no cover  (an async generator)


async def _read_all(stream: SinkStream) -> list[TokenChunk]:
    out = []
    while (chunk := await asyncio.wait_for(stream.next(), 10)) is not None:
        out.append(chunk)
    return out


def test_a_frame_round_trips_and_garbage_is_refused() -> None:
    chunk = TokenChunk((5, 7, 11), True, "stop")
    assert decode(encode("r-1", chunk)) == ("r-1", chunk)
    assert decode(encode("r-2", TokenChunk((), False, None))) == ("r-2", TokenChunk((), False, None))
    for bad in (b"not json", b'["r", [1.5], false, null]', b"[1, [1], false, null]", b'["r", [1], false]'):
        with pytest.raises((ValueError, TypeError)):
            decode(bad)


def test_chunks_reach_their_request_in_order_and_others_are_dropped() -> None:
    async def main() -> tuple[list[TokenChunk], list[TokenChunk]]:
        sink = TokenSink("127.0.0.1")
        sender = TokenSender()
        ended = asyncio.Event()
        a, b = SinkStream(sink, "a"), SinkStream(sink, "b")
        a.attach(_call(ended))
        b.attach(_call(ended))
        try:
            assert a.address == b.address and a.address is not None
            raw = zmq.Context.instance().socket(zmq.PUSH)  # a stranger's bytes on the sink's port
            raw.connect(a.address)
            raw.send(b"\x00garbage")
            for i in range(20):
                sender.send(a.address, "a", TokenChunk((i,)))
                sender.send(a.address, "nobody", TokenChunk((i,)))
                if i % 2:
                    sender.send(a.address, "b", TokenChunk((100 + i,)))
            sender.send(a.address, "a", TokenChunk((), True, "length"))
            sender.send(a.address, "b", TokenChunk((1,), True, "stop"))
            got = await asyncio.gather(_read_all(a), _read_all(b))
            ended.set()
            raw.close()
            return got[0], got[1]
        finally:
            a.close()
            b.close()
            sender.close()
            sink.close()

    got_a, got_b = asyncio.run(main())
    assert [c.token_ids for c in got_a] == [(i,) for i in range(20)] + [()]
    assert got_a[-1] == TokenChunk((), True, "length")
    assert [t for c in got_b for t in c.token_ids] == [100 + i for i in range(1, 20, 2)] + [1]
    assert got_b[-1].finish_reason == "stop"


def test_what_the_call_raises_fails_the_stream() -> None:
    async def main() -> None:
        sink = TokenSink("127.0.0.1")
        failed = asyncio.Event()
        stream = SinkStream(sink, "r")
        stream.attach(_call(failed, IntegrityError("checksum mismatch in block 3")))
        failed.set()
        try:
            with pytest.raises(IntegrityError, match="checksum"):
                await asyncio.wait_for(stream.next(), 10)
        finally:
            stream.close()
            sink.close()

    asyncio.run(main())


def test_a_call_that_ends_without_the_last_frame_fails_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_channel, "END_GRACE_S", 0.2)

    async def main() -> None:
        sink = TokenSink("127.0.0.1")
        sender = TokenSender()
        ended = asyncio.Event()
        stream = SinkStream(sink, "r")
        stream.attach(_call(ended))
        try:
            assert stream.address is not None
            sender.send(stream.address, "r", TokenChunk((3,)))
            assert await asyncio.wait_for(stream.next(), 10) == TokenChunk((3,))
            ended.set()
            with pytest.raises(UnavailableError, match="without its last tokens"):
                await asyncio.wait_for(stream.next(), 10)
        finally:
            stream.close()
            sender.close()
            sink.close()

    asyncio.run(main())


def test_the_last_frame_may_arrive_after_the_call_ended() -> None:
    async def main() -> list[TokenChunk]:
        sink = TokenSink("127.0.0.1")
        sender = TokenSender()
        ended = asyncio.Event()
        stream = SinkStream(sink, "r")
        stream.attach(_call(ended))
        try:
            ended.set()
            await asyncio.sleep(0.05)  # the call's end is queued first
            assert stream.address is not None
            sender.send(stream.address, "r", TokenChunk((9,), True, "stop"))
            return await _read_all(stream)
        finally:
            stream.close()
            sender.close()
            sink.close()

    assert asyncio.run(main()) == [TokenChunk((9,), True, "stop")]


def test_a_sink_that_is_gone_fails_the_send_instead_of_blocking() -> None:
    """A PUSH socket blocks while no peer takes its frames; the sender's sends never
    do: once the queue for a sink whose router is gone is full, the request fails."""
    sender = TokenSender()
    address = "tcp://127.0.0.1:%d" % free_port()  # nothing listens there
    try:
        with pytest.raises(UnavailableError, match="takes no more frames"):
            for i in range(100_000):
                sender.send(address, "r", TokenChunk((i,)))
        assert i >= 1  # the first frames queue (the connection may still come up)
    finally:
        sender.close()
