"""The one request flow behind both public APIs.

    tokens -> hash chain -> ONE index lookup -> route (routing.py: cost =
              tokens to compute + store loads + the work queued there)
           -> prefill actor (loads the hit, computes, exports, offers NIXL)
           -> decode actor (pulls over NIXL, decodes with EAGLE, streams)

``stream()`` is an async generator of :class:`Event`; when the consumer stops
early (client disconnect, stop string, cancel), the ``finally`` aborts the work
on the actors so their blocks are freed. Index failures degrade routing to
load-only; they never fail a request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import EngineRequest
from hybridpd.errors import (
    DeadlineError,
    IntegrityError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    UnavailableError,
    describe,
)
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.tokenizer import IncrementalDetokenizer, TextTokenizer
from hybridpd.transfer.nixl_handoff import HandoffError
from services.router.metrics import RouterMetrics
from services.router.routing import RecentPrefills, RouteDecision, choose, dispatch_work
from services.worker.messages import PrefillCommand, PrefillResult, TokenChunk

#: torch.Generator.manual_seed accepts exactly this range.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1

logger = logging.getLogger(__name__)

#: chunks a decode stream may run ahead of this router; past that the decode
#: actor waits and merges what the engine produced meanwhile into one chunk
STREAM_AHEAD = 4


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Event:
    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None


class Orchestrator:
    def __init__(
        self,
        cfg: HybridPDConfig,
        tokenizer: TextTokenizer,
        model_id: str,
        index: PrefixIndex | None,
        prefill: dict[str, Any],
        decode: list[Any],
        metrics: RouterMetrics,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.hasher = BlockHasher(unit=cfg.prefix_match_unit, algo=cfg.hash_algo, seed=cfg.hash_seed)
        self.model_id = model_id
        self.index = index
        self.prefill = prefill
        self.decode = decode
        self.decode_by_name = {"decode-%d" % i: d for i, d in enumerate(decode)}
        self.metrics = metrics
        self.max_inflight = cfg.max_inflight_requests
        self.inflight = 0
        #: per instance, the work (routing.dispatch_work) of our prefills in flight there
        self.queued: dict[str, float] = dict.fromkeys(prefill, 0.0)
        #: checkpoints our finished prefills left, until the index reports them (a hint)
        self.recent = RecentPrefills(cfg.prefix_match_unit, cfg.mamba_block_size, cfg.checkpoint_alignment, cfg.eagle)
        metrics.configured_prefill.set(len(prefill))
        metrics.live_prefill.set(len(prefill))
        self.running: dict[str, tuple[Any, Any]] = {}
        self._rr = itertools.count()
        self._rr_prefill = itertools.count()

    def validate(self, req: EngineRequest) -> None:
        p = req.prompt_token_ids
        if not p:
            raise InvalidRequestError("prompt must not be empty")
        if min(p) < 0 or max(p) >= self.tokenizer.vocab_size:
            raise InvalidRequestError("token ids must lie in [0, %d)" % self.tokenizer.vocab_size)
        sp = req.sampling
        if sp.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be >= 1")
        if not (math.isfinite(sp.temperature) and 0.0 <= sp.temperature <= 2.0):
            raise InvalidRequestError("temperature must be a number in [0, 2]")
        if not (math.isfinite(sp.top_p) and 0.0 < sp.top_p <= 1.0):
            raise InvalidRequestError("top_p must be a number in (0, 1]")
        if sp.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0")
        if sp.seed is not None and not (SEED_MIN <= sp.seed <= SEED_MAX):
            raise InvalidRequestError("seed must lie in [%d, %d]" % (SEED_MIN, SEED_MAX))
        if len(p) + req.sampling.max_tokens > self.cfg.max_model_len:
            raise InvalidRequestError(
                "prompt (%d tokens) + max_tokens (%d) exceeds the model's context of %d tokens"
                % (len(p), req.sampling.max_tokens, self.cfg.max_model_len)
            )

    async def _route(self, req: EngineRequest, force: str | None) -> tuple[RouteDecision, list | None]:
        """The decision, and the prompt's chain (None when caching or the index is off)."""
        n = len(req.prompt_token_ids)
        names = sorted(self.prefill)
        if force is not None:
            if force not in self.prefill:
                raise NotFoundError("no prefill instance %r (have %s)" % (force, ", ".join(names)))
        if self.cfg.routing == "round_robin" and force is None:
            name = names[next(self._rr_prefill) % len(names)]
            return RouteDecision(name, 0, 0, 0, "round_robin"), None
        store_hit, local, index_ok = 0, {}, self.index is not None
        hashes = None
        if self.index is not None and self.cfg.enable_prefix_caching:
            # NOTE: off the event loop: a 164K-token chain is ~1 ms of C without the GIL
            hashes = await asyncio.to_thread(self.hasher.chain, req.prompt_token_ids, cache_salt=req.cache_salt)
            t0 = time.perf_counter()
            try:
                res = await asyncio.to_thread(self.index.lookup, hashes, n, self.cfg.prefix_match_unit, self.cfg.eagle)
                store_hit = res.store_hit
                self.metrics.live_prefill.set(len(res.instance_hits))
                local = self.recent.merge(hashes, n, res.instance_hits)
            except UnavailableError as exc:
                index_ok = False
                logger.warning("prefix index unavailable, routing on load only: %s", exc)
            self.metrics.index_lookup.observe(time.perf_counter() - t0)
        if force is not None:
            lh = local.get(force, 0)
            return RouteDecision(force, max(lh, store_hit), store_hit, lh, "forced"), hashes
        return choose(n, names, local, store_hit, self.queued, index_ok), hashes

    async def _within(self, awaitable: Any, t_arrive: float) -> Any:
        """Await ``awaitable`` within what is left of the request's deadline."""
        left = self.cfg.request_timeout_s - (time.perf_counter() - t_arrive)
        try:
            return await asyncio.wait_for(awaitable, timeout=max(left, 0.001))
        except TimeoutError:
            raise DeadlineError("request exceeded its %.0fs deadline" % self.cfg.request_timeout_s) from None

    async def _prefill(
        self, req: EngineRequest, decision: RouteDecision, t_arrive: float, hashes: list | None = None
    ) -> tuple[PrefillResult, Any]:
        """Prefill on the routed instance; on a dead or unavailable actor, once more
        on the next instance (recomputing whatever it lacks)."""
        n = len(req.prompt_token_ids)
        names = [decision.instance] + [x for x in sorted(self.prefill) if x != decision.instance]
        for attempt, name in enumerate(names[:2]):
            actor = self.prefill[name]
            self.running[req.request_id] = (actor, None)
            store_hit = decision.store_hit if decision.store_hit > decision.local_hit and attempt == 0 else 0
            work = dispatch_work(n, decision) if attempt == 0 else float(n)
            self.queued[name] += work
            try:
                pr = await self._within(actor.prefill.remote(PrefillCommand(req, store_hit)), t_arrive)
                if hashes:
                    self.recent.record(pr.instance, hashes, n, pr.num_cached_tokens)
                return pr, actor
            except (RayActorError, UnavailableError) as exc:
                self.recent.forget_instance(name)  # restarted or failing: its cache is not to be counted on
                if attempt == 1 or len(names) < 2:
                    raise UnavailableError("prefill of %s failed: %s" % (req.request_id, describe(exc))) from None
                logger.warning("prefill of %s on %s failed (%s): retrying on %s", req.request_id, name, exc, names[1])
                self.metrics.retries.labels("prefill").inc()
            finally:
                self.queued[name] -= work
        raise UnavailableError("no prefill instance")  # unreachable

    async def _decode(
        self, pr: PrefillResult, req: EngineRequest, decision: RouteDecision, t_arrive: float
    ) -> AsyncIterator[tuple[Any, TokenChunk]]:
        """Stream decode chunks. A handoff that fails verification or expired
        before any token was decoded is prefilled once more (elsewhere when
        possible); its first token must equal the one already sent."""
        for attempt in range(2):
            decode_actor = self._pick_decode()
            gen = decode_actor.generate.options(
                num_returns="streaming", _generator_backpressure_num_objects=STREAM_AHEAD
            ).remote(pr, req)
            started = False
            try:
                async for ref in gen:
                    chunk: TokenChunk = await self._within(ref, t_arrive)
                    started = True
                    yield decode_actor, chunk
                return
            except (IntegrityError, HandoffError, RayActorError) as exc:
                if started or attempt == 1:
                    raise UnavailableError("decode of %s failed: %s" % (req.request_id, describe(exc))) from None
                logger.warning("handoff of %s failed (%s): prefilling again", req.request_id, exc)
                self.metrics.retries.labels("handoff").inc()
                others = [x for x in sorted(self.prefill) if x != pr.instance] or [pr.instance]
                retry = RouteDecision(others[0], 0, 0, 0, "retry")
                pr2, _ = await self._prefill(req, retry, t_arrive)
                if pr2.first_token_id != pr.first_token_id or not pr2.has_handoff:
                    raise UnavailableError(
                        "re-prefill of %s diverged from the token already sent" % req.request_id
                    ) from None
                pr = pr2

    def _pick_decode(self) -> Any:
        return self.decode[next(self._rr) % len(self.decode)]

    async def stream(
        self, req: EngineRequest, api: str, force_instance: str | None = None, stop: tuple[str, ...] = ()
    ) -> AsyncIterator[Event]:
        self.validate(req)
        if self.inflight >= self.max_inflight:
            raise OverloadedError("too many requests in flight (%d)" % self.inflight, retry_after_s=1.0)
        t_arrive = time.perf_counter()
        self.inflight += 1
        rid = req.request_id
        status = "error"
        decision: RouteDecision | None = None
        prefill_actor = decode_actor = None
        finished = False  # the client got its last event
        engine_done = False  # the engines finished the request themselves (else: abort it on both sides)
        n = len(req.prompt_token_ids)
        try:
            decision, hashes = await self._route(req, force_instance)
            self.metrics.routing.labels(decision.kind).inc()
            self.metrics.queue_time.observe(time.perf_counter() - t_arrive)
            pr, prefill_actor = await self._prefill(req, decision, t_arrive, hashes)
            now = time.perf_counter()
            last = now
            detok = IncrementalDetokenizer(self.tokenizer)
            count = 0
            self.metrics.prompt_tokens.inc(n)
            self.metrics.cached_tokens.inc(pr.num_cached_tokens)

            def usage() -> Usage:
                return Usage(n, pr.num_cached_tokens, count)

            if pr.first_token_id is not None:  # native: prefill sampled the first token
                self.metrics.ttft.observe(now - t_arrive)
                count = 1
                text = detok.push([pr.first_token_id])
                hit_stop = _find_stop(detok.emitted, stop)
                if hit_stop is not None or pr.finish_reason is not None or not pr.has_handoff:
                    finished = True
                    engine_done = pr.finish_reason is not None or not pr.has_handoff
                    status = "ok"
                    reason = "stop" if hit_stop is not None else (pr.finish_reason or "length")
                    yield Event((pr.first_token_id,), _trim(text, detok, hit_stop), True, reason, usage())
                    return
                yield Event((pr.first_token_id,), text)
            elif not pr.has_handoff:
                raise UnavailableError("prefill of %s returned neither a token nor a handoff" % rid)
            logger.info(
                "request %s: %d prompt tokens, %d cached (%s on %s)",
                rid,
                n,
                pr.num_cached_tokens,
                decision.kind,
                decision.instance,
            )
            async for decode_actor, chunk in self._decode(pr, req, decision, t_arrive):
                self.running[rid] = (prefill_actor, decode_actor)
                if count == 0 and chunk.token_ids:  # vLLM: decode produced the first token
                    self.metrics.ttft.observe(time.perf_counter() - t_arrive)
                count += len(chunk.token_ids)
                now = time.perf_counter()
                self.metrics.itl.observe(now - last)
                last = now
                delta = detok.push(chunk.token_ids)
                hit_stop = _find_stop(detok.emitted, stop)
                if hit_stop is not None:
                    finished = True
                    engine_done = chunk.finished
                    status = "ok"
                    yield Event(chunk.token_ids, _trim(delta, detok, hit_stop), True, "stop", usage())
                    return
                if chunk.finished:
                    finished = engine_done = True
                    status = "ok"
                    yield Event(chunk.token_ids, delta, True, chunk.finish_reason, usage())
                    return
                yield Event(chunk.token_ids, delta)
            raise UnavailableError("decode stream of %s ended without finishing" % rid)
        except (GeneratorExit, asyncio.CancelledError):
            status = "cancelled"  # the client went away (or a stop string closed us)
            raise
        finally:
            self.inflight -= 1
            held = self.running.pop(rid, (None, None))
            if not engine_done:
                # client gone, stop string, cancel or failure: free the work on both sides
                for actor in {id(a): a for a in (*held, prefill_actor, decode_actor) if a is not None}.values():
                    actor.abort.remote(rid)
            self.metrics.requests.labels(api, status).inc()
            self.metrics.e2e.observe(time.perf_counter() - t_arrive)
            if finished:
                self.metrics.completion_tokens.inc(count)

    def abort(self, request_id: str) -> bool:
        actors = self.running.get(request_id)
        if actors is None:
            return False
        for actor in actors:
            if actor is not None:
                actor.abort.remote(request_id)
        return True


def _find_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None


def _trim(delta: str, detok: IncrementalDetokenizer, stop_at: int | None) -> str:
    """The part of ``delta`` before the stop string (``stop_at`` indexes the full text)."""
    if stop_at is None:
        return delta
    before = len(detok.emitted) - len(delta)
    return delta[: max(stop_at - before, 0)]
