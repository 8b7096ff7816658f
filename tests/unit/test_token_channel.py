"""The ZMQ token channel (``services/worker/token_channel.py``): real PUSH/PULL
sockets on loopback; the request's Ray call is an async iterator of awaitables,
as a Ray streaming generator is. Frames carry keyed tags: the sink refuses
(and counts) injected, replayed and oversize frames and serves on."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import zmq

from hybridpd.engine.base import TokenLogprobs
from hybridpd.errors import IntegrityError, UnavailableError
from hybridpd.integrity import TOKEN_FRAME, IntegrityKey
from hybridpd.procs import free_port
from services.worker import token_channel
from services.worker.messages import TokenChunk
from services.worker.token_channel import HARD_CAP, FrameError, SinkStream, TokenSender, TokenSink, decode, encode

pytestmark = pytest.mark.unit

KEY = IntegrityKey(b"the deployment key of these tests")
OTHER = IntegrityKey(b"a key this deployment does not hold")
LIMIT = 1 << 20


def _sink(limit: int = LIMIT, on_refused: Callable[[str], None] | None = None) -> TokenSink:
    return TokenSink("127.0.0.1", KEY, limit, on_refused)


def _sender(limit: int = LIMIT) -> TokenSender:
    return TokenSender(KEY, limit)


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


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` on the event loop (the sink reads there) until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out waiting for %s" % what)
        await asyncio.sleep(0.01)  # a poll interval, not a wait in front of an assertion


def test_a_frame_round_trips_and_anything_else_is_refused_by_reason() -> None:
    t = KEY.tagger(TOKEN_FRAME)
    chunk = TokenChunk((5, 7, 11), True, "stop", (TokenLogprobs(-0.5, 1, ((5, -0.5),)),) * 3)
    assert decode(t, encode(t, "r-1", 3, chunk), LIMIT) == ("r-1", 3, chunk)
    empty = TokenChunk((), False, None)
    assert decode(t, encode(t, "r-2", 0, empty), LIMIT) == ("r-2", 0, empty)
    bodies = (b"not json", b'["r", 0, [1.5], false, null, null]', b"[1, 0, [1], false, null, null]", b'["r", [1]]')
    for bad in bodies:  # tagged with the key, but not frames
        with pytest.raises(FrameError) as exc:
            decode(t, t.tag(bad) + bad, LIMIT)
        assert exc.value.reason == "malformed"
    frame = encode(t, "r-1", 0, chunk)
    forged = encode(OTHER.tagger(TOKEN_FRAME), "r-1", 0, chunk)
    moved = frame.replace(b'"r-1"', b'"r-9"')  # a real frame re-addressed to another stream
    for bad in (frame[32:], forged, moved, b"", b"\x00garbage"):
        with pytest.raises(FrameError) as exc:
            decode(t, bad, LIMIT)
        assert exc.value.reason == "tag"
    with pytest.raises(FrameError) as exc:
        decode(t, frame, len(frame) - 1)
    assert exc.value.reason == "oversize"
    # another purpose's subkey never makes a frame's tag
    body = frame[32:]
    assert not t.valid(KEY.tagger("handoff").tag(body), body)


def test_chunks_reach_their_request_in_order_and_others_are_dropped() -> None:
    async def main() -> tuple[list[TokenChunk], list[TokenChunk], collections.Counter[str]]:
        sink = _sink()
        sender = _sender()
        ended = asyncio.Event()
        a, b = SinkStream(sink, "a"), SinkStream(sink, "b")
        a.attach(_call(ended))
        b.attach(_call(ended))
        try:
            assert a.address == b.address and a.address is not None
            raw = zmq.Context.instance().socket(zmq.PUSH)  # a stranger's bytes on the sink's port
            raw.connect(a.address)
            raw.send(b"\x00garbage")
            out_a, out_b, out_x = (sender.stream(a.address, rid) for rid in ("a", "b", "nobody"))
            for i in range(20):
                out_a.send(TokenChunk((i,)))
                out_x.send(TokenChunk((i,)))
                if i % 2:
                    out_b.send(TokenChunk((100 + i,)))
            out_a.send(TokenChunk((), True, "length"))
            out_b.send(TokenChunk((1,), True, "stop"))
            got = await asyncio.gather(_read_all(a), _read_all(b))
            await _until(lambda: sink.refused["tag"] == 1, "the garbage frame's refusal")
            ended.set()
            raw.close()
            return got[0], got[1], sink.refused
        finally:
            a.close()
            b.close()
            sender.close()
            sink.close()

    got_a, got_b, refused = asyncio.run(main())
    assert [c.token_ids for c in got_a] == [(i,) for i in range(20)] + [()]
    assert got_a[-1] == TokenChunk((), True, "length")
    assert [t for c in got_b for t in c.token_ids] == [100 + i for i in range(1, 20, 2)] + [1]
    assert got_b[-1].finish_reason == "stop"
    assert refused == {"tag": 1}  # the frames for "nobody" are dropped, not refused


def test_injected_replayed_and_oversize_frames_are_refused_counted_and_the_stream_completes() -> None:
    """A peer that reaches the sink but lacks the key injects frames into a live
    stream: none of its tokens reach the stream, each refusal is counted by reason
    (and reported to the router's metric), and the real stream completes exactly."""
    limit = 8192
    reported: list[str] = []

    async def main() -> tuple[list[TokenChunk], collections.Counter[str]]:
        sink = _sink(limit, reported.append)
        sender = _sender(limit)
        ended = asyncio.Event()
        stream = SinkStream(sink, "r")
        stream.attach(_call(ended))
        assert stream.address is not None
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(stream.address)
        good = KEY.tagger(TOKEN_FRAME)
        try:
            out = sender.stream(stream.address, "r")
            out.send(TokenChunk((1,)))
            assert await asyncio.wait_for(stream.next(), 10) == TokenChunk((1,))
            raw.send(b'["r", 1, [666], true, "stop", null]')  # no tag
            raw.send(encode(OTHER.tagger(TOKEN_FRAME), "r", 1, TokenChunk((666,), True, "stop")))  # another key's
            raw.send(encode(good, "r", 0, TokenChunk((1,))))  # a replay of frame 0, byte for byte
            raw.send(encode(good, "r", 1, TokenChunk((666,) * 3000)))  # over the limit (under HARD_CAP x)
            await _until(lambda: sum(sink.refused.values()) == 4, "four refusals")
            raw.send(b"\x00" * (HARD_CAP * limit + 1))  # libzmq drops this connection unread
            for i in range(2, 6):
                out.send(TokenChunk((i,)))
            out.send(TokenChunk((6,), True, "stop"))
            got = [TokenChunk((1,)), *await _read_all(stream)]
            ended.set()
            return got, sink.refused
        finally:
            raw.close()
            stream.close()
            sender.close()
            sink.close()

    got, refused = asyncio.run(main())
    assert [t for c in got for t in c.token_ids] == [1, 2, 3, 4, 5, 6]
    assert got[-1] == TokenChunk((6,), True, "stop")
    assert refused == {"tag": 2, "sequence": 1, "oversize": 1}
    assert collections.Counter(reported) == refused


def test_a_chunk_over_the_limit_is_split_into_frames_that_fit() -> None:
    limit = 4096
    lps = tuple(TokenLogprobs(-0.25, 1, tuple((t, -1.5) for t in range(5))) for _ in range(300))
    chunk = TokenChunk(tuple(range(300)), True, "length", lps)
    sender = _sender(limit)
    try:
        frames = sender.frames("r", 7, chunk)
    finally:
        sender.close()
    assert len(frames) > 1 and all(len(f) <= limit for f in frames)
    t = KEY.tagger(TOKEN_FRAME)
    parts = [decode(t, f, limit) for f in frames]
    assert [p[1] for p in parts] == list(range(7, 7 + len(frames)))
    assert tuple(x for p in parts for x in p[2].token_ids) == chunk.token_ids
    assert tuple(x for p in parts for x in p[2].logprobs or ()) == lps
    assert [p[2].finished for p in parts] == [False] * (len(frames) - 1) + [True]
    assert parts[-1][2].finish_reason == "length"


def test_what_the_call_raises_fails_the_stream() -> None:
    async def main() -> None:
        sink = _sink()
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
        sink = _sink()
        sender = _sender()
        ended = asyncio.Event()
        stream = SinkStream(sink, "r")
        stream.attach(_call(ended))
        try:
            assert stream.address is not None
            sender.stream(stream.address, "r").send(TokenChunk((3,)))
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
        sink = _sink()
        sender = _sender()
        ended = asyncio.Event()
        stream = SinkStream(sink, "r")
        stream.attach(_call(ended))
        try:
            ended.set()
            await asyncio.sleep(0.05)  # the call's end is queued first
            assert stream.address is not None
            sender.stream(stream.address, "r").send(TokenChunk((9,), True, "stop"))
            return await _read_all(stream)
        finally:
            stream.close()
            sender.close()
            sink.close()

    assert asyncio.run(main()) == [TokenChunk((9,), True, "stop")]


def test_a_sink_that_is_gone_fails_the_send_instead_of_blocking() -> None:
    """A PUSH socket blocks while no peer takes its frames; the sender's sends never
    do: once the queue for a sink whose router is gone is full, the request fails."""
    sender = _sender()
    address = "tcp://127.0.0.1:%d" % free_port()  # nothing listens there
    out = sender.stream(address, "r")
    try:
        with pytest.raises(UnavailableError, match="takes no more frames"):
            for i in range(100_000):
                out.send(TokenChunk((i,)))
        assert i >= 1  # the first frames queue (the connection may still come up)
    finally:
        sender.close()
