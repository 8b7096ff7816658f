"""One API request, the same for HTTP and gRPC (:func:`run_request`), and its
choices: ``n`` per prompt, and a batch of prompts.

    parsed       ->  prompts x n checked (``max_choices``), then admitted: one
                     in-flight slot per choice (429 before any work)
                 ->  each prompt built (tokenized, rendered) in the tokenizer pool
    prompts x n  ->  one engine request per choice (index = prompt * n + j)
                     the first of each prompt runs at once; its siblings start
                     once it has its first event (its prefill ended: the prompt
                     is cached where it ran, so theirs hit it: computed once)
                 ->  (index, Event) as they come, every choice's until it ends

A sibling's request id is ``<id>-<index>`` and its seed ``seed + j`` (vLLM's
rule for ``n``); only the first choice of a prompt keeps its answer
checkpoint. A failure of any choice fails the request: the others are
cancelled, and each one's ``finally`` aborts its work on every actor. The
request's slots are released when its last choice ended, whichever way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

from hybridpd.engine.base import EngineRequest, RequestId
from hybridpd.errors import InvalidRequestError
from hybridpd.validation import GREEDY_EPS, SEED_MAX
from services.router.admission import Ticket
from services.router.orchestrator import Orchestrator
from services.router.output import Event, OutputOptions
from services.router.request_builder import ApiRequest, Built, build, check_choices, loggable

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice to serve: its index in the response and what runs for it."""

    index: int
    built: Built
    #: the first choice of its prompt (its siblings wait for its prefill)
    leader: bool = True
    #: the request id the client knows (``Orchestrator.abort`` of it stops every choice)
    parent: str = ""


async def run_request(
    orch: Orchestrator,
    apis: Sequence[ApiRequest],
    n: int,
    api: str,
    served_model: str,
    force: str | None = None,
    on_built: Callable[[list[Choice]], None] | None = None,
) -> AsyncGenerator[tuple[int, Event], None]:
    """Serve one API request of ``apis`` (its prompts, ``n`` choices each): admitted
    first (``check_choices``, then one slot per choice: OverloadedError before any
    work), each prompt then built in the tokenizer pool (``Orchestrator.off_loop``),
    ``on_built`` told its choices, and every choice's events as :func:`serve` gives
    them. Its slots are released when this generator ends or is closed."""
    check_choices(len(apis), n, orch.cfg)
    client = apis[0].client_id
    if client is not None:
        logger.info("request %s: client request id %s", apis[0].request_id, loggable(client))
    ticket = orch.admission.enter(len(apis) * n)
    try:
        builts = [await orch.off_loop(build, a, orch, served_model) for a in apis]
        choices = expand(builts, n)
        if on_built is not None:
            on_built(choices)
        async with aclosing(serve(orch, choices, api, force, apis[0].output, ticket)) as events:
            async for item in events:
                yield item
    finally:
        orch.admission.release(ticket)


def expand(builts: list[Built], n: int) -> list[Choice]:
    """``n`` choices per built prompt, with their own ids and seeds (module docstring).
    InvalidRequestError for ``n`` > 1 with greedy sampling, as vLLM's server refuses it
    (its choices would all be the same), and for seeds past the range."""
    if n > 1 and any(b.request.sampling.temperature < GREEDY_EPS for b in builts):
        raise InvalidRequestError("n must be 1 when using greedy sampling, got %d." % n)
    seeds = [b.request.sampling.seed for b in builts if b.request.sampling.seed is not None]
    if seeds and max(seeds) + n - 1 > SEED_MAX:
        raise InvalidRequestError("seed: choice j samples with seed + j; seed + n - 1 exceeds %d" % SEED_MAX)
    if len(builts) == 1 and n == 1:
        return [Choice(0, builts[0], parent=builts[0].request.request_id)]
    out: list[Choice] = []
    for p, built in enumerate(builts):
        for j in range(n):
            index = p * n + j
            req = built.request
            sp = req.sampling
            seed = sp.seed + j if sp.seed is not None and j else sp.seed
            rid = RequestId("%s-%d" % (req.request_id, index))
            child = replace(req, request_id=rid, sampling=replace(sp, seed=seed))
            answer = built.answer if j == 0 else None
            out.append(Choice(index, replace(built, request=child, answer=answer), j == 0, req.request_id))
    return out


@dataclass(slots=True)
class _Gate:
    """A prompt's siblings wait here until its first choice has its prefill (or ended)."""

    opened: asyncio.Event
    #: the first choice failed: its siblings do not start
    failed: bool = False


async def serve(
    orch: Orchestrator,
    choices: list[Choice],
    api: str,
    force: str | None,
    opts: OutputOptions,
    ticket: Ticket | None = None,
) -> AsyncGenerator[tuple[int, Event], None]:
    """Every choice's events, tagged with its index, until each has its last one.
    Raises what a choice raised (the others cancelled). A sibling whose request was
    aborted (``Orchestrator.abort`` of the client's id) or whose first choice failed
    does not start. ``ticket``: the slots the request took on admission (None: each
    choice takes its own)."""
    if len(choices) == 1:
        c = choices[0]
        try:
            async with aclosing(_stream(orch, c.built, api, force, opts, ticket)) as events:
                async for ev in events:
                    yield c.index, ev
        finally:
            orch.aborted.pop(c.parent, None)
        return
    queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()
    gates: dict[int, _Gate] = {}
    tasks: list[asyncio.Task[None]] = []
    leader = -1
    for c in choices:
        if c.leader:
            leader = c.index
            gates[leader] = _Gate(asyncio.Event())
        tasks.append(asyncio.ensure_future(_drive(orch, c, api, force, opts, queue, gates[leader], ticket)))
    try:
        left = len(choices)
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for parent in {c.parent for c in choices}:
            orch.aborted.pop(parent, None)


async def _drive(
    orch: Orchestrator,
    c: Choice,
    api: str,
    force: str | None,
    opts: OutputOptions,
    queue: asyncio.Queue[tuple[int, Event | BaseException | None]],
    gate: _Gate,
    ticket: Ticket | None,
) -> None:
    """Run one choice into ``queue``: its events, an exception if it failed, then None."""
    try:
        if not c.leader:
            await gate.opened.wait()
            if gate.failed or c.parent in orch.aborted:
                await queue.put((c.index, None))
                return
        async with aclosing(_stream(orch, c.built, api, force, opts, ticket)) as events:
            async for ev in events:
                if c.leader:
                    gate.opened.set()
                await queue.put((c.index, ev))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        gate.failed |= c.leader
        await queue.put((c.index, exc))
    finally:
        if c.leader:
            gate.opened.set()  # a failed or empty first choice must not hold its siblings forever
    await queue.put((c.index, None))


def _stream(
    orch: Orchestrator, built: Built, api: str, force: str | None, opts: OutputOptions, ticket: Ticket | None
) -> AsyncGenerator[Event, None]:
    req: EngineRequest = built.request
    return orch.stream(req, api, force, opts, built.answer, built.boundaries, ticket)  # type: ignore[return-value]
