"""Token frames: the typed, versioned message of a decode stream, and its wire.

A decode stream (``token_channel: zmq``) is a sequence of :class:`Frame`, numbered
``seq`` 0, 1, 2, ... per stream, of three kinds (``id``: the stream's key,
``SinkStream.key``: its request id and a nonce, so a retry is another stream):

    tokens  some of the stream's tokens (and their logprobs)
    end     its last tokens (possibly none) and why it finished: the stream's end
    error   why it failed: the error's class name (one of :data:`ERRORS`) and the
            message a client may be told (``errors.public_message``): its end

On the wire a frame is a keyed tag and a JSON object (never pickle: the sink is a
listening socket)::

    tag (32 bytes) | {"v": 1, "kind": "tokens", "id": request_id, "seq": n, "tokens": [ids], "logprobs": lps}
                     {"v": 1, "kind": "end", ..., "tokens": [ids], "logprobs": lps, "finish": reason}
                     {"v": 1, "kind": "error", "id": request_id, "seq": n, "error": "HandoffError", "message": text}
    tag = HMAC-SHA256 (the deployment key's token-frame subkey) of the JSON

(``lps``: null, or per token ``[logprob, rank, [[id, logprob], ...]]``.) :func:`encode`
and :func:`decode` are the only code that writes or reads it. :func:`decode` checks,
in order and before parsing anything, the size, then the tag; then it refuses an
object of another version or an unknown kind (``version``), then anything that is
not a frame of its kind (``malformed``): :class:`FrameError` with one of
:data:`REFUSALS`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from hybridpd.engine.base import TokenLogprobs
from hybridpd.errors import (
    DeadlineError,
    DrainingError,
    EngineError,
    HybridPDError,
    IntegrityError,
    InvalidRequestError,
    OverloadedError,
    UnavailableError,
    public_message,
    unwrap,
)
from hybridpd.integrity import TAG_BYTES, TagError, Tagger
from hybridpd.transfer.handoff_descriptor import HandoffError
from services.worker.messages import TokenChunk

#: the frame format this code writes and the only one it reads
VERSION = 1
FrameKind = Literal["tokens", "end", "error"]
KINDS: tuple[FrameKind, ...] = ("tokens", "end", "error")
#: why the sink refuses a frame (the labels of ``hybridpd_token_frames_refused_total``):
#: over the size limit, not this key's tag, another version or an unknown kind, not a
#: frame, not the number its stream waits for
REFUSALS = ("oversize", "tag", "version", "malformed", "sequence")
#: the errors an error frame names, by class name; the router raises the same class
#: (so a handoff failure before the first token is retried elsewhere), any other name
#: an EngineError
ERRORS: dict[str, type[HybridPDError]] = {
    cls.__name__: cls
    for cls in (
        InvalidRequestError,
        OverloadedError,
        UnavailableError,
        DrainingError,
        EngineError,
        DeadlineError,
        IntegrityError,
        TagError,
        HandoffError,
    )
}
#: an error frame's message is cut to this many characters (a frame fits the smallest limit)
MAX_MESSAGE = 512


class FrameError(ValueError):
    """A frame the sink refuses; ``reason`` is one of :data:`REFUSALS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """Why a decode stream failed, as its error frame carries it."""

    #: the error's class name, one of :data:`ERRORS`
    error: str
    #: what a client may be told (``errors.public_message``)
    message: str

    @staticmethod
    def of(exc: BaseException, request_id: str) -> StreamFailure:
        """``exc`` as an error frame says it: its nearest class in :data:`ERRORS`
        (else EngineError) and its public message (the details go to this log)."""
        err = unwrap(exc)
        name = next((c.__name__ for c in type(err).__mro__ if ERRORS.get(c.__name__) is c), EngineError.__name__)
        return StreamFailure(name, public_message(err, request_id)[:MAX_MESSAGE])

    def exception(self) -> HybridPDError:
        """The error the router raises for it."""
        return ERRORS.get(self.error, EngineError)(self.message)


@dataclass(frozen=True, slots=True)
class Frame:
    """One message of a decode stream (module docstring)."""

    version: int
    kind: FrameKind
    request_id: str
    seq: int
    #: tokens, end: the stream's next tokens, and their logprobs when it asked for them
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] | None = None
    #: end: why the stream finished
    finish_reason: str | None = None
    #: error: why the stream failed
    failure: StreamFailure | None = None

    @staticmethod
    def of(request_id: str, seq: int, body: TokenChunk | StreamFailure) -> Frame:
        """The frame of ``body``: a chunk's tokens (``end`` when it finishes the stream), or its failure."""
        if isinstance(body, StreamFailure):
            return Frame(VERSION, "error", request_id, seq, failure=body)
        kind: FrameKind = "end" if body.finished else "tokens"
        return Frame(VERSION, kind, request_id, seq, body.token_ids, body.logprobs, body.finish_reason)

    def item(self) -> TokenChunk | HybridPDError:
        """What the stream's reader gets: the chunk (``finished`` for an end frame), or the error."""
        if self.failure is not None:
            return self.failure.exception()
        finished = self.kind == "end"
        return TokenChunk(self.token_ids, finished, self.finish_reason if finished else None, self.logprobs)


def encode(tagger: Tagger, request_id: str, seq: int, body: TokenChunk | StreamFailure) -> bytes:
    """The tagged frame number ``seq`` of ``request_id``'s stream (:meth:`Frame.of`)."""
    f = Frame.of(request_id, seq, body)
    obj: dict[str, Any] = {"v": f.version, "kind": f.kind, "id": f.request_id, "seq": f.seq}
    if f.failure is not None:
        obj["error"], obj["message"] = f.failure.error, f.failure.message
    else:
        obj["tokens"] = list(f.token_ids)
        obj["logprobs"] = None if f.logprobs is None else [[x.logprob, x.rank, x.top] for x in f.logprobs]
        if f.kind == "end":
            obj["finish"] = f.finish_reason
    data = json.dumps(obj, separators=(",", ":")).encode()
    return tagger.tag(data) + data


def decode(tagger: Tagger, frame: bytes, max_bytes: int) -> Frame:
    """The frame in ``frame``; FrameError for one over ``max_bytes``, one whose tag is
    not this key's, one of another version or kind, or one that is not a frame
    (checked in that order: nothing is parsed before the tag held)."""
    if len(frame) > max_bytes:
        raise FrameError("oversize", "a frame of %d bytes, over the limit of %d" % (len(frame), max_bytes))
    body = memoryview(frame)[TAG_BYTES:]
    if len(frame) < TAG_BYTES or not tagger.valid(frame[:TAG_BYTES], body):
        raise FrameError("tag", "a frame without this deployment's tag (%d bytes)" % len(frame))
    try:
        obj = json.loads(bytes(body))
    except ValueError as exc:
        raise FrameError("malformed", "not a token frame: %s" % exc) from None
    if not isinstance(obj, dict):
        raise FrameError("malformed", "not a token frame: a JSON %s" % type(obj).__name__)
    version, kind = obj.get("v"), obj.get("kind")
    if type(version) is not int or version != VERSION or not isinstance(kind, str) or kind not in KINDS:
        what = "a frame of version %.20r, kind %.20r (this router reads %d)" % (version, kind, VERSION)
        raise FrameError("version", what)
    try:
        return _parse(obj, kind)
    except (KeyError, TypeError, ValueError) as exc:  # also a wrong arity or element type
        raise FrameError("malformed", "not a %s frame: %s" % (kind, exc)) from None


def _parse(obj: dict[str, Any], kind: FrameKind) -> Frame:
    rid, seq = obj["id"], obj["seq"]
    if not isinstance(rid, str) or type(seq) is not int:
        raise ValueError("its request id and number must be a string and an int")
    if kind == "error":
        error, message = obj["error"], obj["message"]
        if not isinstance(error, str) or not isinstance(message, str):
            raise ValueError("its error and message must be strings")
        return Frame(VERSION, kind, rid, seq, failure=StreamFailure(error, message))
    ids, lps = obj["tokens"], obj["logprobs"]
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError("token ids must be a list of ints")
    logprobs = None
    if lps is not None:
        logprobs = tuple(
            TokenLogprobs(float(lp), int(rank), tuple((int(t), float(v)) for t, v in top)) for lp, rank, top in lps
        )
        if len(logprobs) != len(ids):
            raise ValueError("logprobs do not match the frame's tokens")
    reason = obj["finish"] if kind == "end" else None
    if reason is not None and not isinstance(reason, str):
        raise ValueError("its finish reason must be a string")
    return Frame(VERSION, kind, rid, seq, tuple(ids), logprobs, reason)
