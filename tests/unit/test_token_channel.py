"""The ZMQ token channel (``services/worker/token_channel.py``, its frames
``frames.py``): real PUSH/PULL sockets on loopback; the request's Ray call is an
async iterator of awaitables, as a Ray streaming generator is. Frames are typed
and versioned and carry keyed tags: the sink refuses (and counts) injected,
replayed, oversize and unknown frames and serves on; a stream ends with its end
or error frame, whatever its Ray call does."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import zmq
from ray.exceptions import RayActorError

from hybridpd.config import load_config
from hybridpd.engine.base import TokenLogprobs
from hybridpd.errors import EngineError, IntegrityError, OverloadedError, UnavailableError
from hybridpd.integrity import TOKEN_FRAME, IntegrityKey, TagError, load_key
from hybridpd.procs import free_port
from hybridpd.transfer.handoff_descriptor import HandoffError
from services.decode.actor import DecodeWorker
from services.prefill.actor import PrefillWorker
from services.worker import api, token_channel
from services.worker.api import DecodeStream
from services.worker.frames import REFUSALS, VERSION, Frame, FrameError, StreamFailure, decode, encode
from services.worker.messages import PrefillCommand, TokenChunk
from services.worker.token_channel import HARD_CAP, SinkStream, TokenSender, TokenSink
from tests.unit.engine_helpers import prompt, req
from tests.unit.toy_engine import ToyEngine

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


async def _chunks(*chunks: TokenChunk) -> AsyncIterator[Awaitable[object]]:
    """A Ray path call (a streaming generator of ``chunks``)."""
    for chunk in chunks:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(chunk)
        yield fut


async def _read_all(stream: SinkStream | DecodeStream) -> list[TokenChunk]:
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


def _tagged(t: object, obj: object) -> bytes:
    """``obj`` as JSON under this key's tag: a frame only if ``obj`` is one."""
    data = json.dumps(obj).encode()
    return t.tag(data) + data  # type: ignore[attr-defined]


def test_a_typed_frame_round_trips_by_kind() -> None:
    t = KEY.tagger(TOKEN_FRAME)
    lps = (TokenLogprobs(-0.5, 1, ((5, -0.5),)),) * 3
    end = TokenChunk((5, 7, 11), True, "stop", lps)
    got = decode(t, encode(t, "r-1", 3, end), LIMIT)
    assert got == Frame(VERSION, "end", "r-1", 3, (5, 7, 11), lps, "stop")
    assert got.item() == end
    tokens = TokenChunk((9,), False, None)
    got = decode(t, encode(t, "r-2", 0, tokens), LIMIT)
    assert (got.kind, got.item()) == ("tokens", tokens)
    last = TokenChunk((), True, "length")
    assert decode(t, encode(t, "r-2", 1, last), LIMIT).item() == last
    failure = StreamFailure("HandoffError", "the handoff expired")
    got = decode(t, encode(t, "r-3", 4, failure), LIMIT)
    assert got == Frame(VERSION, "error", "r-3", 4, failure=failure)
    err = got.item()
    assert type(err) is HandoffError and str(err) == "the handoff expired"


def test_an_error_frame_names_the_class_the_router_raises_again() -> None:
    """The decode's error class survives the channel (a handoff failure is retried by
    the router as it is on the Ray path); what a client may not see is not sent."""
    cases = [
        (HandoffError("expired"), HandoffError, "internal error"),  # server-side: a generic message
        (TagError("forged"), TagError, "failed verification"),  # an IntegrityError: the router retries it
        (OverloadedError("no KV blocks"), OverloadedError, "no KV blocks"),
        (EngineError("engine failure on decode-0: secret details"), EngineError, "an engine failed"),
        (RuntimeError("not one of ours"), EngineError, "internal error"),
    ]
    for exc, cls, text in cases:
        failure = StreamFailure.of(exc, "r-1")
        raised = failure.exception()
        assert type(raised) is cls and text in str(raised)
        assert "secret" not in failure.message
    assert isinstance(StreamFailure("IntegrityError", "x").exception(), IntegrityError)
    assert type(StreamFailure("SomeNewError", "x").exception()) is EngineError  # a name it does not know


def test_an_unknown_version_or_kind_and_anything_else_is_refused_by_reason() -> None:
    t = KEY.tagger(TOKEN_FRAME)
    ok = {"v": VERSION, "kind": "tokens", "id": "r", "seq": 0, "tokens": [1], "logprobs": None}
    decode(t, _tagged(t, ok), LIMIT)
    unknown = [{**ok, "v": VERSION + 1}, {**ok, "v": True}, {**ok, "v": None}, {**ok, "kind": "pause"}]
    unknown += [{**ok, "kind": None}, {k: v for k, v in ok.items() if k != "v"}]
    for obj in unknown:  # tagged with the key: a frame this router does not speak
        with pytest.raises(FrameError) as exc:
            decode(t, _tagged(t, obj), LIMIT)
        assert exc.value.reason == "version", obj
    malformed: list[object] = [["r", 0, [1], False, None, None], {**ok, "tokens": [1.5]}, {**ok, "id": 1}]
    malformed += [{**ok, "seq": "0"}, {**ok, "logprobs": [[0.0, 1, []]] * 2}, {**ok, "kind": "end"}]
    malformed += [{**ok, "kind": "error"}, {**ok, "kind": "error", "error": "E", "message": 3}, [1, 2]]
    for obj in malformed:
        with pytest.raises(FrameError) as exc:
            decode(t, _tagged(t, obj), LIMIT)
        assert exc.value.reason == "malformed", obj
    with pytest.raises(FrameError) as exc:
        decode(t, t.tag(b"not json") + b"not json", LIMIT)
    assert exc.value.reason == "malformed"
    chunk = TokenChunk((5, 7, 11), True, "stop")
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
            out_a, out_b, out_x = (sender.stream(a.address, key) for key in (a.key, b.key, "nobody"))
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
            k = stream.key
            out = sender.stream(stream.address, k)
            out.send(TokenChunk((1,)))
            assert await asyncio.wait_for(stream.next(), 10) == TokenChunk((1,))
            raw.send(b'["r", 1, [666], true, "stop", null]')  # no tag
            raw.send(encode(OTHER.tagger(TOKEN_FRAME), k, 1, TokenChunk((666,), True, "stop")))  # another key's
            raw.send(encode(good, k, 0, TokenChunk((1,))))  # a replay of frame 0, byte for byte
            raw.send(encode(good, k, 1, TokenChunk((666,) * 3000)))  # over the limit (under HARD_CAP x)
            newer = {"v": VERSION + 1, "kind": "end", "id": k, "seq": 1, "tokens": [666], "logprobs": None}
            raw.send(_tagged(good, newer))  # tagged, but of a version this router does not read
            await _until(lambda: sum(sink.refused.values()) == 5, "five refusals")
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
    assert refused == {"tag": 2, "sequence": 1, "oversize": 1, "version": 1}
    assert collections.Counter(reported) == refused and set(refused) <= set(REFUSALS)


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
    assert [p.seq for p in parts] == list(range(7, 7 + len(frames)))
    assert tuple(x for p in parts for x in p.token_ids) == chunk.token_ids
    assert tuple(x for p in parts for x in p.logprobs or ()) == lps
    assert [p.kind for p in parts] == ["tokens"] * (len(frames) - 1) + ["end"]
    assert parts[-1].finish_reason == "length"


def test_a_retry_is_another_stream_and_a_late_frame_of_the_first_is_dropped() -> None:
    """A handoff retried on another decode instance opens a new stream for the same
    request: a late frame of the first attempt (numbered 0, as the retry's first is)
    never reaches the retry's reader."""

    async def main() -> tuple[list[TokenChunk], collections.Counter[str]]:
        sink = _sink()
        sender = _sender()
        never = asyncio.Event()
        first = SinkStream(sink, "r")
        first.attach(_call(never))
        first.close()  # given up on (its decode failed over)
        retry = SinkStream(sink, "r")
        retry.attach(_call(never))
        try:
            assert first.key != retry.key and first.key.startswith("r") and retry.address is not None
            sender.stream(retry.address, first.key, "r").send(TokenChunk((666,), True, "stop"))  # late
            await asyncio.sleep(0.2)  # the sink reads it meanwhile
            out = sender.stream(retry.address, retry.key, "r")
            out.send(TokenChunk((1,)))
            out.send(TokenChunk((2,), True, "length"))
            return await _read_all(retry), sink.refused
        finally:
            retry.close()
            sender.close()
            sink.close()

    got, refused = asyncio.run(main())
    assert got == [TokenChunk((1,)), TokenChunk((2,), True, "length")] and not refused


def test_a_call_that_fails_with_an_actor_error_fails_the_stream() -> None:
    async def main() -> None:
        sink = _sink()
        failed = asyncio.Event()
        stream = SinkStream(sink, "r")
        stream.attach(_call(failed, RayActorError()))
        failed.set()
        try:
            with pytest.raises(RayActorError):
                await asyncio.wait_for(stream.next(), 10)
            assert await stream.next() is None
        finally:
            stream.close()
            sink.close()

    asyncio.run(main())


def test_the_frames_end_the_stream_whatever_its_call_does() -> None:
    """No reconciliation of two channels: a call that ended says nothing (its stream
    waits on, bounded by its request's deadline, here a wait_for, and takes the frames
    that come later); the end frame ends a stream whose call still runs."""

    async def main() -> None:
        sink = _sink()
        sender = _sender()
        ended, never = asyncio.Event(), asyncio.Event()
        early, late = SinkStream(sink, "early"), SinkStream(sink, "late")
        early.attach(_call(ended))
        late.attach(_call(never))
        try:
            assert early.address is not None
            ended.set()  # early's call ends before any frame
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(early.next(), 0.3)  # the deadline bounds a stream whose frames stop
            out = sender.stream(early.address, early.key)
            out.send(TokenChunk((3,)))
            out.send(TokenChunk((9,), True, "stop"))
            assert await _read_all(early) == [TokenChunk((3,)), TokenChunk((9,), True, "stop")]
            sender.stream(early.address, late.key).send(TokenChunk((4,), True, "length"))
            assert await _read_all(late) == [TokenChunk((4,), True, "length")]  # its call never ended
            assert sink.waiting() == 0  # an end frame: nothing more is due
        finally:
            early.close()
            late.close()
            sender.close()
            sink.close()

    asyncio.run(main())


def test_an_error_frame_ends_the_stream_with_its_error() -> None:
    async def main() -> None:
        sink = _sink()
        sender = _sender()
        never = asyncio.Event()
        streams = {rid: SinkStream(sink, rid) for rid in ("handoff", "overloaded", "engine")}
        for stream in streams.values():
            stream.attach(_call(never))
        try:
            address = streams["handoff"].address
            assert address is not None
            sender.stream(address, streams["handoff"].key).fail(HandoffError("handoff r expired"))
            out = sender.stream(address, streams["overloaded"].key)
            out.send(TokenChunk((1, 2)))
            out.fail(OverloadedError("no KV blocks for 30 s"))
            sender.stream(address, streams["engine"].key).fail(RuntimeError("a kernel assertion"))
            with pytest.raises(HandoffError):  # before any token: the router's handoff retry
                await asyncio.wait_for(streams["handoff"].next(), 10)
            assert await asyncio.wait_for(streams["overloaded"].next(), 10) == TokenChunk((1, 2))
            with pytest.raises(OverloadedError, match="no KV blocks"):
                await asyncio.wait_for(streams["overloaded"].next(), 10)
            with pytest.raises(EngineError, match="internal error"):
                await asyncio.wait_for(streams["engine"].next(), 10)
            assert [await s.next() for s in streams.values()] == [None] * 3
            assert sink.waiting() == 0
        finally:
            for stream in streams.values():
                stream.close()
            sender.close()
            sink.close()

    asyncio.run(main())


def test_close_releases_the_stream_and_cancels_a_call_that_has_not_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """An aborted client stream: its waiter goes (later frames are dropped, not
    refused), its call is cancelled; a stream that ended has nothing to cancel."""
    cancelled: list[object] = []
    monkeypatch.setattr(token_channel, "cancel_call", cancelled.append)
    monkeypatch.setattr(api, "cancel_call", cancelled.append)

    async def main() -> None:
        sink = _sink()
        sender = _sender()
        never = asyncio.Event()
        open_, done = SinkStream(sink, "open"), SinkStream(sink, "done")
        calls = _call(never), _call(never)
        open_.attach(calls[0])
        done.attach(calls[1])
        try:
            assert open_.address is not None
            sender.stream(open_.address, done.key).send(TokenChunk((1,), True, "stop"))
            assert await _read_all(done) == [TokenChunk((1,), True, "stop")]
            done.close()
            out = sender.stream(open_.address, open_.key)
            out.send(TokenChunk((1,)))
            assert await asyncio.wait_for(open_.next(), 10) == TokenChunk((1,))
            open_.close()
            assert cancelled == [calls[0]] and sink.waiting() == 0
            out.send(TokenChunk((2,), True, "stop"))  # after the close: dropped
            await asyncio.sleep(0.2)  # the sink reads it meanwhile
            assert not sink.refused and await open_.next() is None
            # the Ray path's stream: cancelled unless it ended
            ray_open, ray_done = DecodeStream(calls[0]), DecodeStream(_chunks(TokenChunk((5,), True, "stop")))
            assert await ray_done.next() == TokenChunk((5,), True, "stop")
            ray_done.close()
            ray_open.close()
            assert cancelled == [calls[0], calls[0]]
        finally:
            open_.close()
            sender.close()
            sink.close()

    asyncio.run(main())


def test_the_decode_actor_sends_its_end_or_its_error_as_frames() -> None:
    """``DecodeWorker.generate`` with a sink: every chunk and the end as frames, and
    a failed handoff as an error frame; the call itself yields nothing and ends."""
    cfg = load_config(env={})
    key = load_key(cfg)
    pe, de = ToyEngine(), ToyEngine()
    p = PrefillWorker(cfg, "prefill-0", None, None, None, engine=pe)
    d = DecodeWorker(cfg, "decode-0", engine=de)

    async def main() -> tuple[list[TokenChunk], BaseException | None]:
        sink = TokenSink("127.0.0.1", key, LIMIT)
        good, bad = SinkStream(sink, "r1"), SinkStream(sink, "r2")
        try:
            r1, r2 = req("r1", prompt(40, 3), 6), req("r2", prompt(40, 4), 6)
            pr1, pr2 = p.prefill(PrefillCommand(r1)), p.prefill(PrefillCommand(r2))
            assert good.address is not None
            assert await asyncio.to_thread(lambda: list(d.generate(pr1, r1, good.address, good.key))) == []
            chunks = [TokenChunk(pr1.token_ids), *await _read_all(good)]

            def forged(request, ticket):  # type: ignore[no-untyped-def]
                raise TagError("handoff %s: its keyed tag fails" % request.request_id)

            de.fetch_handoff = forged  # type: ignore[method-assign]
            assert await asyncio.to_thread(lambda: list(d.generate(pr2, r2, good.address, bad.key))) == []
            try:
                await _read_all(bad)
            except TagError as exc:
                return chunks, exc
            return chunks, None
        finally:
            good.close()
            bad.close()
            sink.close()

    try:
        chunks, error = asyncio.run(main())
    finally:
        p.close()
        d.close()
    assert sum(len(c.token_ids) for c in chunks) == 6 and chunks[-1].finished
    assert isinstance(error, TagError) and not de.seqs


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
