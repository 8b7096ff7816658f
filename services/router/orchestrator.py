"""The one request flow behind both public APIs, in three parts:

    admission.py  in-flight limit (429), the request's deadline (504), validate
    dispatch.py   route (hash chain, ONE index lookup, routing.choose),
                  prefill (one retry elsewhere), decode relay (handoff retry)
    output.py     incremental detokenization, stop strings, usage -> Event

``Orchestrator.stream()`` is an async generator of :class:`Event`. The
prefill's tokens (the native engine's first token; none from vLLM, whose
decode samples every output token) are sent first; a request that finished at
prefill (a finish reason, or no handoff ticket) ends there, else the decode
stream follows. A prefill with neither tokens, a finish reason nor a ticket fails
the request (UnavailableError). TTFT is observed when its first token arrives
(either side); decode is chosen on the route's hash chain. When the consumer
stops early (client disconnect, cancel) or the request fails or hits a stop
string, the ``finally`` aborts the work on every actor holding it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import ParamSpec, TypeVar

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams, TokenLogprobs
from hybridpd.errors import EngineError, InvalidRequestError, UnavailableError
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.prefix_outcomes import prefix_token_split
from hybridpd.tokenizer import TextTokenizer
from services.router.admission import Admission, Deadline, Ticket
from services.router.answers import AnswerMemory, AnswerPlan, strip_stop
from services.router.dispatch import Dispatcher
from services.router.flight import Flight
from services.router.metrics import RouterMetrics
from services.router.output import Event, OutputOptions, OutputProcessor
from services.worker.api import DecodeClient, PrefillClient
from services.worker.messages import PrefillResult, TokenChunk

logger = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")
#: client ids remembered as aborted (``Orchestrator.aborted``)
MAX_ABORTED = 4096


@dataclass(slots=True)
class _Run:
    """One request inside :meth:`Orchestrator.stream`: what its ``finally`` needs."""

    req: EngineRequest
    api: str
    deadline: Deadline
    flight: Flight
    output: OutputProcessor | None = None
    status: str = "error"
    #: the client got its last event
    finished: bool = False
    #: the engines finished the request themselves (else: abort it on every holder)
    engine_done: bool = False
    #: when the last output arrived (inter-token latency)
    last: float = 0.0
    #: make the answer reusable at the end (chat)
    answer: AnswerPlan | None = None
    #: chat message boundaries the dispatcher may stage (vLLM: ``Built.boundaries``)
    boundaries: tuple[int, ...] = ()
    #: the prefill instance that served the prompt
    instance: str | None = None
    finish_reason: str | None = None
    #: the slot this request took itself (it came without a ticket): released at its end
    own: Ticket | None = None
    #: the decode instances' held blocks of the prompt (its route's lookup): decode affinity
    held: Mapping[str, int] = field(default_factory=dict)


class Orchestrator:
    def __init__(
        self,
        cfg: HybridPDConfig,
        tokenizer: TextTokenizer,
        model_id: str,
        index: PrefixIndex | None,
        prefill: dict[str, PrefillClient],
        decode: dict[str, DecodeClient],
        metrics: RouterMetrics,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.admission = Admission(
            tokenizer.vocab_size, cfg.max_model_len, cfg.max_inflight_requests, cfg.request_timeout_s
        )
        self.dispatch = Dispatcher(cfg, index, prefill, decode, metrics)
        #: tokenizing and chat-template rendering, off the event loop and after admission
        #: (``off_loop``); bounded: at most ``tokenizer_threads`` run at once
        self.tokenizer_pool = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="hybridpd-tokenizer")
        #: answer ids under the text the client got (the next turn's prompt reuses them)
        self.answers = AnswerMemory()
        #: request id -> the actors holding its work (for Abort)
        self.running: dict[str, Flight] = {}
        #: client request ids aborted while their choices run (``choices.serve`` starts no
        #: sibling of one, and forgets it when they end); insertion-ordered, bounded
        self.aborted: dict[str, None] = {}
        metrics.configured_prefill.set(len(prefill))
        metrics.live_prefill.set(len(prefill))

    def drain(self) -> None:
        """Stop being ready (``/ready`` 503, gRPC health NOT_SERVING) and admitting
        (503 with Retry-After) for good, so load balancers send nothing new while the
        requests in flight finish (SIGTERM: ``server.RouterServer.serve``)."""
        self.admission.draining = True

    async def readiness(self) -> str | None:
        """None while this router can serve: not draining, and a prefill and a decode
        instance live (``Dispatcher.unserved``); else why not."""
        missing = await self.dispatch.unserved()
        if self.admission.draining:
            return "draining"
        return "no live %s instance" % " or ".join(missing) if missing else None

    async def stream(
        self,
        req: EngineRequest,
        api: str,
        force_instance: str | None = None,
        stop: tuple[str, ...] | OutputOptions = (),
        answer: AnswerPlan | None = None,
        boundaries: tuple[int, ...] = (),
        ticket: Ticket | None = None,
    ) -> AsyncIterator[Event]:
        """Serve ``req``: Events until one is finished. Raises InvalidRequestError,
        OverloadedError (before any work), NotFoundError (``force_instance``),
        UnavailableError, DeadlineError. ``api`` labels the request metrics.
        ``answer``: make the answer part of the cached prefix once the request
        ends normally (``answers.py``); ``boundaries``: chat message boundaries
        the dispatcher may stage (``Built.boundaries``); ``ticket``: the slots
        its API request took on admission (``choices.run_request``, which
        releases them; None: this request takes one slot itself)."""
        if req.request_id in self.running:  # actors key work by id: a second one would clobber the first
            raise InvalidRequestError("request id %s is already in flight" % req.request_id)
        own = None
        if ticket is None:
            ticket = own = self.admission.admit(req)
        else:
            self.admission.validate(req)
        run = _Run(req, api, ticket.deadline, Flight(req.request_id), answer=answer, boundaries=boundaries, own=own)
        self.running[req.request_id] = run.flight
        try:
            pr, split, promised = await self._prefill(run, force_instance)
            n = len(req.prompt_token_ids)
            out = run.output = OutputProcessor(self.tokenizer, stop, n, pr.num_cached_tokens, split, promised)
            done = pr.finish_reason is not None or not pr.has_handoff  # the request ended at prefill
            if pr.token_ids or pr.finish_reason is not None:
                ev = self._event(run, out, pr.token_ids, done, pr.finish_reason or "length", pr.logprobs)
                yield ev
                if ev.finished:
                    return
            elif not pr.has_handoff:
                raise UnavailableError("prefill of %s returned neither a token nor a handoff" % req.request_id)
            async with aclosing(self.dispatch.decode(pr, run.req, run.flight, run.deadline, run.held)) as chunks:
                async for chunk in chunks:
                    ev = self._decoded(run, out, chunk)
                    yield ev
                    if ev.finished:
                        return
            raise UnavailableError("decode stream of %s ended without finishing" % req.request_id)
        except (GeneratorExit, asyncio.CancelledError):
            run.status = "cancelled"  # the client went away (or a stop string closed us)
            raise
        finally:
            self._end(run)

    async def _prefill(
        self, run: _Run, force_instance: str | None
    ) -> tuple[PrefillResult, dict[str, int] | None, int | None]:
        """Route and prefill ``run.req``; counts the decision and the prompt. Returns the
        result and, for a looked-up request, why its prompt tokens were (not) restored
        and the hit the index promised on the instance it was routed to (counted kept
        or broken against what the prefill restored)."""
        route = await self.dispatch.route(run.req, force_instance)
        decision, run.held = route.decision, route.held
        if route.hashes is not None:  # the chain travels with the request: prefill and decode hash nothing
            run.req = replace(run.req, block_hashes=tuple(route.hashes))
        req = run.req
        self.metrics.routing.labels(decision.kind).inc()
        self.metrics.queue_time.observe(run.deadline.elapsed())
        preq = self.dispatch.with_junction(req, route, run.boundaries)
        seen = asyncio.ensure_future(self.dispatch.seen(route)) if route.looked_up else None
        t_call = time.perf_counter()
        pr = await self.dispatch.prefill(preq, decision, run.flight, run.deadline, route.hashes)
        run.last = time.perf_counter()
        self.metrics.ttft_stage.labels("prefill").observe(pr.prefill_seconds)
        self.metrics.ttft_stage.labels("prefill_call").observe(max(run.last - t_call - pr.prefill_seconds, 0.0))
        run.instance = pr.instance
        if run.answer is not None and run.answer.answer_span is not None:
            a0, a1 = run.answer.answer_span
            hit = min(max(pr.num_cached_tokens - a0, 0), a1 - a0)
            self.metrics.answer_tokens.labels("hit").inc(hit)
            self.metrics.answer_tokens.labels("recomputed").inc(a1 - a0 - hit)
        n = len(req.prompt_token_ids)
        self.metrics.prompt_tokens.inc(n)
        self.metrics.cached_tokens.inc(pr.num_cached_tokens)
        split = promised = None
        if seen is not None:
            cfg = self.cfg
            split = prefix_token_split(
                n,
                cfg.prefix_match_unit,
                self.dispatch.profile.eagle_drop_prefill,
                pr.num_cached_tokens,
                route.known,
                await seen,
                self.dispatch.prefill_backoff,
            )
            for outcome, count in split.items():
                if count:
                    self.metrics.prefix_tokens.labels(outcome).inc(count)
            promised = decision.expected_hit if pr.instance == decision.instance else 0  # a retry: no promise
            broken = max(promised - pr.num_cached_tokens, 0)
            self.metrics.index_promise_tokens.labels("kept").inc(promised - broken)
            self.metrics.index_promise_tokens.labels("broken").inc(broken)
            if broken:
                self.dispatch.broken_promise(route, pr)
        logger.info(
            "request %s: %d prompt tokens, %d cached (%s on %s)",
            req.request_id,
            n,
            pr.num_cached_tokens,
            decision.kind,
            decision.instance,
        )
        return pr, split, promised

    def _decoded(self, run: _Run, out: OutputProcessor, chunk: TokenChunk) -> Event:
        now = time.perf_counter()
        if out.count == 0 and chunk.token_ids:  # decode samples the first token (vLLM)
            self.metrics.ttft_stage.labels("decode").observe(now - run.last)
        self.metrics.itl.observe(now - run.last)
        run.last = now
        return self._event(run, out, chunk.token_ids, chunk.finished, chunk.finish_reason, chunk.logprobs)

    @staticmethod
    def _check_failed(run: _Run, reason: str | None) -> None:
        """EngineError where the engine reported that it failed the request (never a 200)."""
        if reason == "error":
            raise EngineError("the engine failed request %s" % run.req.request_id)

    def _event(
        self,
        run: _Run,
        out: OutputProcessor,
        token_ids: tuple[int, ...],
        done: bool,
        reason: str | None,
        logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> Event:
        """The Event for new tokens (``done``: the engine ended the request with ``reason``)."""
        self._check_failed(run, reason)
        if out.count == 0 and token_ids:  # the request's first token, from prefill or decode
            self.metrics.ttft.observe(run.deadline.elapsed())
        ev = out.push(token_ids, done, reason, logprobs)
        if ev.finished:
            run.finished, run.engine_done, run.status = True, done, "ok"
            run.finish_reason = ev.finish_reason
        return ev

    def _end(self, run: _Run) -> None:
        """Whatever way the request ended: release, abort unless the engines finished it, count."""
        if run.own is not None:
            self.admission.release(run.own)
        rid = run.req.request_id
        if self.running.get(rid) is run.flight:
            del self.running[rid]
        if not run.engine_done:
            # client gone, stop string, cancel or failure: free the work on every holder
            run.flight.abort()
        self.metrics.requests.labels(run.api, run.status).inc()
        self.metrics.e2e.observe(run.deadline.elapsed())
        if run.finished and run.output is not None:
            self.metrics.completion_tokens.inc(run.output.count)
            if run.answer is not None:
                try:
                    self._keep_answer(run, run.answer, run.output)
                except Exception:  # an answer checkpoint is an optimisation: never fail the request for it
                    logger.exception("answer checkpoint of %s not requested", run.req.request_id)

    def _keep_answer(self, run: _Run, plan: AnswerPlan, out: OutputProcessor) -> None:
        """Make a normally ended chat answer reusable (``answers.py``): remember its
        ids under its text, and ask the prefill instance that served the prompt
        to prefill prompt + answer at low priority. Where the answer ends inside a
        character (the client got the text before it), the ids before the cut are
        the answer. Nothing after a stop string (the client did not receive every
        token) or past the context."""
        if out.stopped_on_string or run.finish_reason not in ("stop", "length") or run.instance is None:
            return
        if out.opts.include_stop_str_in_output or not out.opts.skip_special_tokens:
            return  # the text the client got is not the answer's own text
        if run.status != "ok":  # e.g. the client went away at the last event
            return
        stops = self.tokenizer.stop_token_ids
        unread = out.detok.unread
        # NOTE: the usual end (nothing unread, or the stop id) needs no decode on the event loop
        whole = not unread or (len(unread) == 1 and unread[0] in stops)
        received = len(out.detok.ids) if whole else out.detok.received()
        if received is None:
            return  # no ids are exactly the text the client got
        req, gen = run.req, out.detok.ids[:received]
        prompt = req.prompt_token_ids
        self.answers.remember(
            plan.salt, plan.prompt_text + out.detok.emitted, prompt + strip_stop(gen, stops), len(prompt)
        )
        ids = prompt + tuple(gen)
        if len(ids) + 1 > self.cfg.max_model_len or not self.cfg.enable_prefix_caching:
            return
        warm = EngineRequest(
            RequestId("answer-%s-%s" % (req.request_id, uuid.uuid4().hex[:8])),
            ids,
            SamplingParams(max_tokens=1),
            req.cache_salt,
            background=True,
            block_hashes=req.block_hashes,  # the prompt's chain: the prefill hashes only the answer's blocks
        )
        if self.dispatch.answer(run.instance, warm):
            self.metrics.answer_checkpoints.inc()

    async def off_loop(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args)`` in the tokenizer pool: tokenizing and template rendering never
        hold the event loop that serves every stream of this router."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, lambda: fn(*args, **kwargs))

    def abort(self, request_id: str) -> bool:
        """Abort ``request_id`` (or, for a request of several choices, each of its
        ``<id>-<index>`` choices) on the actors holding it; False if none does."""
        self.aborted[request_id] = None
        while len(self.aborted) > MAX_ABORTED:
            self.aborted.pop(next(iter(self.aborted)))
        flights = [self.running[request_id]] if request_id in self.running else []
        if not flights:
            prefix = request_id + "-"
            flights = [f for rid, f in self.running.items() if rid.startswith(prefix) and rid[len(prefix) :].isdigit()]
        held = [f for f in flights if f.actors]
        for flight in held:
            flight.abort()
        return bool(held)
