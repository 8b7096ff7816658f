"""Fake Ray actor handles for the router's unit tests (a test double: the e2e tier
runs the real stack).

They mimic Ray's calling convention only: ``actor.method.remote(*args)`` returns
an awaitable, and decode's ``generate.options(num_returns="streaming",
...).remote(pr, req)`` an async iterator of awaitables (a failed chunk is an
awaitable that raises, like an ObjectRef of a failed generator step). They
replay one fixed token script through the repo's real tokenizer, so texts and
token ids are exact.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ray.exceptions import RayActorError

from hybridpd.engine.base import EngineRequest, HandoffTicket
from hybridpd.model_files import TOKENIZER_DIR
from hybridpd.tokenizer import TextTokenizer
from services.worker.api import DecodeClient, PrefillClient, decode_name
from services.worker.messages import PrefillCommand, PrefillResult, TokenChunk

TOK = TextTokenizer(TOKENIZER_DIR)
TEXT = " Hello world, the STOP here. héllo 日本 and more text, to the end."
#: 36 ids: 0 ' H', 1 'e', 2 'll', 3 'o', ..., 8 ' the', 9 ' S', 10 'T', 11 'O', 12 'P', 13 ' he',
#: 16 ' h', 17-18 'é' (two bytes), 21 ' ', 22-24 '日', 25-27 '本', 28 ' and', ...
SCRIPT = tuple(TOK.encode(TEXT))
PROMPT = (5, 6, 7)
CACHED = 2


def done(value: Any) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


def _alive(down: bool, name: str) -> str:
    if down:
        raise RayActorError()
    return name


def failed(exc: BaseException) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


class Method:
    """``actor.method``: ``remote`` records its arguments and returns an awaitable."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)
        res = self.fn(*args)
        return asyncio.ensure_future(res) if inspect.isawaitable(res) else done(res)


class StreamingMethod(Method):
    """A generator method: ``options(...)`` then ``remote`` gives an async iterator of awaitables."""

    def __init__(self, fn: Callable[..., AsyncIterator[Any]]) -> None:
        super().__init__(fn)
        self.options_seen: list[dict[str, Any]] = []

    def options(self, **kw: Any) -> StreamingMethod:
        self.options_seen.append(kw)
        return self

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.fn(*args)


class FakePrefill:
    """Samples ``produce`` tokens of ``tokens`` at prefill (1: native engine, 0: vLLM) and
    leaves a handoff ticket unless the request is complete (or ``ticket`` is False);
    ``finish``: the request ends at prefill with that reason (no ticket)."""

    def __init__(
        self,
        name: str,
        *,
        produce: int = 1,
        tokens: Sequence[int] = SCRIPT,
        fail: BaseException | None = None,
        delay: float = 0.0,
        gate: asyncio.Event | None = None,
        ticket: bool = True,
        finish: str | None = None,
    ) -> None:
        self.name, self.produce, self.tokens, self.fail = name, produce, tuple(tokens), fail
        self.delay, self.gate, self.ticket, self.finish = delay, gate, ticket, finish
        self.prefill = Method(self._prefill)
        self.abort = Method(lambda rid: False)
        #: a dead actor: its pings raise, as Ray's calls to one do
        self.down = False
        self.ready = Method(lambda: _alive(self.down, self.name))
        self.draining = False
        self.serving = Method(lambda: bool(_alive(self.down, self.name)) and not self.draining)

    async def _prefill(self, cmd: PrefillCommand) -> PrefillResult:
        if self.gate is not None:
            await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        req = cmd.request
        out = self.tokens[: self.produce]
        n = len(req.prompt_token_ids)
        if self.finish is not None or len(out) >= req.sampling.max_tokens:
            return PrefillResult(req.request_id, self.name, out, self.finish or "length", n, CACHED, 0)
        ticket = HandoffTicket(req.request_id) if self.ticket else None
        return PrefillResult(req.request_id, self.name, out, None, n, CACHED, 0, ticket)


class FakeDecode:
    """Continues SCRIPT after the prefill's tokens in chunks of ``sizes`` (cycled) up
    to max_tokens. ``fail_first``: the next stream fails at once (one shot, a failed
    handoff); ``fail_after``/``stall_after``: fail / stall after that many chunks."""

    def __init__(
        self,
        sizes: Sequence[int] = (2, 3),
        *,
        fail_first: BaseException | None = None,
        fail_after: tuple[int, BaseException] | None = None,
        stall_after: int | None = None,
    ) -> None:
        self.sizes, self.fail_first, self.fail_after, self.stall_after = sizes, fail_first, fail_after, stall_after
        self.generate = StreamingMethod(self._stream)
        self.abort = Method(lambda rid: False)
        self.down = False
        self.ready = Method(lambda: _alive(self.down, "decode"))
        self.draining = False
        self.serving = Method(lambda: bool(_alive(self.down, "decode")) and not self.draining)

    async def _stream(self, pr: PrefillResult, req: EngineRequest) -> AsyncIterator[asyncio.Future]:
        if self.fail_first is not None:
            exc, self.fail_first = self.fail_first, None
            yield failed(exc)
            return
        pos, end, sizes = len(pr.token_ids), req.sampling.max_tokens, itertools.cycle(self.sizes)
        for sent in itertools.count():
            if self.fail_after is not None and sent == self.fail_after[0]:
                yield failed(self.fail_after[1])
                return
            if self.stall_after is not None and sent == self.stall_after:
                await asyncio.sleep(60)
            k = min(next(sizes), end - pos)
            pos += k
            last = pos >= end
            yield done(TokenChunk(SCRIPT[pos - k : pos], last, "length" if last else None))
            if last:
                return


def clients(
    prefills: dict[str, Any], decodes: Sequence[Any] = ()
) -> tuple[dict[str, PrefillClient], dict[str, DecodeClient]]:
    """The router's typed clients over fake handles (decode ones named ``decode-<j>``)."""
    pre = {name: PrefillClient(name, h) for name, h in prefills.items()}
    dec = {decode_name(j): DecodeClient(decode_name(j), h) for j, h in enumerate(decodes)}
    return pre, dec
