"""Dispatch: where a request runs, and the calls to the actors that run it.

    route    tokens -> hash chain -> ONE index lookup (+ RecentPrefills)
             -> routing.choose (cost = tokens to compute + store loads + queued work)
    prefill  the routed prefill actor; a dead or unavailable one: once more on
             the next instance by name (recomputing whatever it lacks)
    decode   a Ray streaming generator on a decode actor (its chunks over the
             token sink, token_channel.py): the one whose prefix
             cache holds the prompt's leading blocks (the conversation's previous
             turns: its handoff moves only the new ones) unless it is overloaded,
             else round robin (routing.choose_decode);
             a handoff that fails before any chunk: prefill once more (elsewhere
             when possible) and go on only if it produced the same tokens
    live     a ping to every instance (``liveness.py``): the kinds none of whose
             instances serves (the router's readiness); the instances that
             drain, which routing leaves out while another serves

The extra checkpoints a routed prefill leaves (the junction, chat boundaries,
placement) are ``prefill_checkpoints.py``'s.

Engine-agnostic: a :class:`PrefillResult` carries the tokens sampled at prefill
(possibly none) and an opaque ticket only the decode engine reads. Every actor
await runs within the request's :class:`Deadline`. A :class:`Flight`
(``flight.py``) records which actors hold the request's work, so that an
unfinished request can be aborted on all of them. Index failures degrade routing to load-only; they
never fail a request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field

from ray.exceptions import RayActorError

from hybridpd.config import HybridPDConfig
from hybridpd.divergence import DivergenceHistory
from hybridpd.engine.base import EngineRequest
from hybridpd.engine.profile import EngineProfile, profile_of
from hybridpd.errors import IntegrityError, NotFoundError, UnavailableError, describe
from hybridpd.hashing import BlockHash, BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.integrity import block_hash_seed
from hybridpd.transfer.handoff_descriptor import HandoffError
from services.router.admission import Deadline
from services.router.flight import Flight
from services.router.liveness import Liveness
from services.router.metrics import RouterMetrics
from services.router.prefill_checkpoints import PrefillCheckpoints
from services.router.routing import (
    RecentPrefills,
    RouteDecision,
    SeenPrefixes,
    choose,
    choose_decode,
    dispatch_work,
)
from services.worker.api import DecodeClient, PrefillClient
from services.worker.messages import PrefillCommand, PrefillResult, TokenChunk

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Route:
    decision: RouteDecision
    #: the prompt's chain hashes (None when caching is off)
    hashes: list[BlockHash] | None
    #: how far the prompt's attention blocks are cached anywhere (tokens; the index lookup)
    known: int = 0
    #: the lookup answered: ``known`` (and :meth:`Dispatcher.seen`) say why the prefix (did not) hit
    looked_up: bool = False
    #: per decode instance, the leading blocks of the chain it holds (decode affinity; the
    #: same lookup's answer, empty without one or with one decode instance)
    held: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Hits:
    hashes: list[BlockHash] | None
    local: dict[str, int]
    store: int
    index_ok: bool
    known: int = 0
    held: Mapping[str, int] = field(default_factory=dict)


class Dispatcher:
    """Routing state and actor calls of one router (event-loop confined).

    ``prefill`` and ``decode`` (name -> client) are the caller's collections,
    shared, not copied. What depends on the engine is read from its profile
    (``engine/profile.py``); every hit the router predicts is a prefill engine's."""

    def __init__(
        self,
        cfg: HybridPDConfig,
        index: PrefixIndex | None,
        prefill: dict[str, PrefillClient],
        decode: dict[str, DecodeClient],
        metrics: RouterMetrics,
    ) -> None:
        self.cfg = cfg
        self.profile: EngineProfile = profile_of(cfg)
        self.index = index
        self.prefill_actors = prefill
        self.decode_actors = decode
        self.metrics = metrics
        # NOTE: the engines' seed: derived from the deployment key on our own hashing (integrity.py)
        self.hasher = BlockHasher(unit=cfg.prefix_match_unit, algo=cfg.hash_algo, seed=block_hash_seed(cfg))
        #: per instance, the work (routing.dispatch_work) of our prefills in flight there
        self.queued: dict[str, float] = dict.fromkeys(prefill, 0.0)
        #: checkpoints our finished prefills left, until the index reports them (a hint)
        geometry = self.profile.geometry
        self.recent = RecentPrefills(geometry.unit, geometry.block, geometry.alignment, self.profile.eagle_drop_prefill)
        #: how far we routed each prefix before (the ``evicted`` outcome)
        self.seen_prefixes = SeenPrefixes()
        #: how far routed prompts shared a prefix with earlier ones: the placement's prior
        self.divergence = DivergenceHistory()
        #: prompt tokens a prefill does not compute: vLLM's P/D prefill stops one short (its
        #: NixlConnector truncates a hybrid model's prompt; ``VllmEngine.prefill_backoff``), so
        #: its hits and tail lie below ``N - 1`` and the lookup is capped as it is
        self.prefill_backoff = self.profile.prefill_backoff
        self._rr_decode = itertools.count()
        #: per decode instance, our decode streams running there (decode affinity's load)
        self.decoding: dict[str, int] = {}
        self._rr_prefill = itertools.count()
        #: which instances serve (pings), and which drain
        self.liveness = Liveness(prefill, decode)
        #: the extra checkpoints of our prefills (the junction, boundaries, placement)
        self.checkpoints = PrefillCheckpoints(cfg, self.profile, self.divergence, metrics)

    # -- liveness -----------------------------------------------------------------------
    async def unserved(self) -> list[str]:
        """The kinds of instance no instance of which answers a ping (``Liveness.unserved``)."""
        return await self.liveness.unserved()

    # -- route --------------------------------------------------------------------------
    async def route(self, req: EngineRequest, force: str | None = None) -> Route:
        """The prefill instance for ``req`` (``force``: that one, NotFoundError if unknown)."""
        names = self.liveness.routable(sorted(self.prefill_actors))
        if force is not None and force not in self.prefill_actors:
            raise NotFoundError("no prefill instance %r" % force[:100])  # the instance names are not a client's
        # NOTE: the request builder hashed the prompt in the tokenizer pool (``request_builder.build``),
        # once for its n choices; the chain travels with the request (``EngineRequest.block_hashes``)
        # and nothing hashes it again. A request built elsewhere is hashed here, off the event loop
        # (a 164K-token chain is ~0.8 ms of C that holds the GIL)
        hashes: list[BlockHash] | None = None
        if self.cfg.enable_prefix_caching:
            whole = len(req.block_hashes) >= len(req.prompt_token_ids) // self.hasher.unit
            hashes = req.chain(self.hasher) if whole else await asyncio.to_thread(req.chain, self.hasher)
        if self.cfg.routing == "round_robin" and force is None:
            name = names[next(self._rr_prefill) % len(names)]
            return Route(RouteDecision(name, 0, 0, 0, "round_robin"), hashes)
        hits = await self._lookup(req, hashes)
        if force is not None:
            lh = hits.local.get(force, 0)
            decision = RouteDecision(force, max(lh, hits.store), hits.store, lh, "forced")
        else:
            spread = bytes(hits.hashes[0]) if hits.hashes else req.request_id.encode()
            decision = choose(
                len(req.prompt_token_ids), names, hits.local, hits.store, self.queued, hits.index_ok, spread
            )
        looked_up = hits.index_ok and hits.hashes is not None
        return Route(decision, hits.hashes, hits.known, looked_up, hits.held)

    def with_junction(self, req: EngineRequest, route: Route, boundaries: tuple[int, ...] = ()) -> EngineRequest:
        """``req`` as its prefill runs it, with the extra checkpoints of its route's
        lookup and the chat message ``boundaries`` (``PrefillCheckpoints.for_prefill``)."""
        d = route.decision
        return self.checkpoints.for_prefill(req, d.expected_hit, route.known, route.looked_up, boundaries)

    async def _lookup(self, req: EngineRequest, hashes: list[BlockHash] | None) -> _Hits:
        """Look the prompt's chain ``hashes`` up (None: caching is off): local hits
        (raised by RecentPrefills) and the store hit."""
        if self.index is None or hashes is None:
            return _Hits(hashes, {}, 0, self.index is not None)
        n = len(req.prompt_token_ids)
        t0 = time.perf_counter()
        try:
            m = n - self.prefill_backoff if n > self.prefill_backoff else n  # the tokens the prefill computes
            u, drop = self.cfg.prefix_match_unit, self.profile.eagle_drop_prefill
            decode = sorted(self.decode_actors) if len(self.decode_actors) > 1 else []  # decode affinity
            res = await asyncio.to_thread(self.index.lookup, hashes, m, u, drop, decode)
            self.metrics.index_lookups.labels(res.source).inc()
            self.metrics.live_prefill.set(len(res.instance_hits))
            local = self.recent.merge(hashes, m, res.instance_hits)
            return _Hits(hashes, local, res.store_hit, True, res.known, res.held)
        except UnavailableError as exc:
            logger.warning("prefix index unavailable, routing on load only: %s", exc)
            return _Hits(hashes, {}, 0, False)
        finally:
            self.metrics.index_lookup.observe(time.perf_counter() - t0)

    def broken_promise(self, route: Route, pr: PrefillResult) -> None:
        """The prefill restored less than the lookup promised. Where our store entries
        mirror another writer's puts (vLLM's MooncakeStoreConnector: its evictions are
        never reported), a store promise that a load could not keep drops the state
        entry it rested on, off the event loop; the next lookup finds the next one
        (``EngineProfile.store_entries_unreported_evictions``). The native engine
        repairs its own store entries when a load fails (``store/loader.py``); local
        entries follow the engines' events."""
        d = route.decision
        if not self.profile.store_entries_unreported_evictions or self.index is None or route.hashes is None:
            return
        if d.store_hit <= max(d.local_hit, pr.num_cached_tokens) or pr.instance != d.instance:
            return
        state = route.hashes[d.store_hit // self.cfg.prefix_match_unit - 1]
        self.metrics.store_repairs.inc()
        asyncio.get_running_loop().run_in_executor(None, self._remove_store_state, state)

    def _remove_store_state(self, state: BlockHash) -> None:
        assert self.index is not None
        try:
            self.index.remove_store(state_hashes=[state])
        except UnavailableError as exc:
            logger.debug("store entry not repaired (index unavailable): %s", exc)

    async def seen(self, route: Route) -> int:
        """How far (tokens) we routed ``route``'s prompt before; then remember it. Off
        the routing path: the orchestrator runs it while the prefill runs."""
        if route.hashes is None:
            return 0
        return await asyncio.to_thread(self.seen_prefixes.observe, route.hashes) * self.cfg.prefix_match_unit

    # -- prefill ------------------------------------------------------------------------
    async def prefill(
        self,
        req: EngineRequest,
        decision: RouteDecision,
        flight: Flight,
        deadline: Deadline,
        hashes: list[BlockHash] | None = None,
    ) -> PrefillResult:
        """Prefill on ``decision.instance``; on a dead or unavailable actor, once more
        on the next instance by name. UnavailableError when no attempt succeeded."""
        names = [decision.instance] + [x for x in sorted(self.prefill_actors) if x != decision.instance]
        for attempt, name in enumerate(names[:2]):
            try:
                return await self._prefill_on(name, req, decision if attempt == 0 else None, flight, deadline, hashes)
            except (RayActorError, UnavailableError) as exc:
                self.recent.forget_instance(name)  # restarted or failing: its cache is not to be counted on
                if attempt == 1 or len(names) < 2:
                    raise UnavailableError("prefill of %s failed: %s" % (req.request_id, describe(exc))) from None
                logger.warning("prefill of %s on %s failed (%s): retrying on %s", req.request_id, name, exc, names[1])
                self.metrics.retries.labels("prefill").inc()
        raise UnavailableError("no prefill instance")  # unreachable

    async def _prefill_on(
        self,
        name: str,
        req: EngineRequest,
        decision: RouteDecision | None,
        flight: Flight,
        deadline: Deadline,
        hashes: list[BlockHash] | None,
    ) -> PrefillResult:
        """One prefill call; ``decision`` None for a retry (recompute everything)."""
        n = len(req.prompt_token_ids)
        actor = self.prefill_actors[name]
        # the store hit is loaded only when it beats the routed instance's local one
        store_hit = decision.store_hit if decision is not None and decision.store_hit > decision.local_hit else 0
        work = dispatch_work(n, decision) if decision is not None else float(n)
        flight.hold(actor)
        self.queued[name] += work
        try:
            pr = await deadline.within(actor.prefill(PrefillCommand(req, store_hit)))
        except (RayActorError, UnavailableError):
            flight.drop(actor)
            raise
        finally:
            self.queued[name] -= work
        if hashes and self.index is not None:
            self.recent.record(pr.instance, hashes, n, pr.num_cached_tokens, pr.tail_checkpoint)
            for position in pr.extra_checkpoints:
                self.recent.record(pr.instance, hashes, n, pr.num_cached_tokens, position)
        return pr

    def answer(self, instance: str, req: EngineRequest) -> bool:
        """Ask ``instance`` to prefill ``req`` (prompt + answer) at low priority, fire
        and forget (``PrefillWorker.answer``). False when the instance is gone."""
        actor = self.prefill_actors.get(instance)
        if actor is None:
            return False
        actor.answer(req)
        return True

    # -- decode -------------------------------------------------------------------------
    async def decode(
        self,
        pr: PrefillResult,
        req: EngineRequest,
        flight: Flight,
        deadline: Deadline,
        held: Mapping[str, int] | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Decode chunks of ``req`` continued from ``pr`` (which has a handoff), until
        the stream ends (``held``: its route's ``Route.held``, decode affinity).
        A handoff that fails (IntegrityError, HandoffError, a dead actor) before the
        first chunk is prefilled and decoded once more; later, or a second time, the
        request fails with UnavailableError."""
        failed: str | None = None
        for attempt in range(2):
            name = self._pick_decode(avoid=failed, held=held or {})
            actor = self.decode_actors[name]
            flight.hold(actor)
            stream = actor.generate(pr, req)
            started = False
            self.decoding[name] = self.decoding.get(name, 0) + 1
            try:
                while (chunk := await deadline.within(stream.next())) is not None:
                    started = True
                    yield chunk
                return
            except (IntegrityError, HandoffError, RayActorError) as exc:
                flight.drop(actor)
                failed = name
                if started or attempt == 1:
                    raise UnavailableError("decode of %s failed: %s" % (req.request_id, describe(exc))) from None
                logger.warning("handoff of %s failed (%s): prefilling again", req.request_id, exc)
                self.metrics.retries.labels("handoff").inc()
                pr = await self._prefill_again(pr, req, flight, deadline)
            finally:
                stream.close()
                self.decoding[name] -= 1

    def _pick_decode(self, avoid: str | None, held: Mapping[str, int]) -> str:
        """The decode instance (``routing.choose_decode``): with more than one, the one
        that holds most of the prompt's leading blocks (``held``: the route's lookup
        answered it in its round trip; empty, as without the index or when it failed:
        round robin). ``avoid``: the one whose handoff just failed (unless it is the only one)."""
        every = sorted(self.decode_actors)
        names = [n for n in self.liveness.routable(every) if n != avoid] or every
        held = {n: held[n] for n in names if n in held}
        name, kind = choose_decode(names, held, self.decoding, self.cfg.decode_affinity_slack, next(self._rr_decode))
        self.metrics.decode_routing.labels(kind).inc()
        return name

    async def _prefill_again(
        self, pr: PrefillResult, req: EngineRequest, flight: Flight, deadline: Deadline
    ) -> PrefillResult:
        """Prefill ``req`` again, on another instance than ``pr``'s when there is one.
        Its tokens were already sent: the new result must have the same, and a handoff."""
        others = [x for x in sorted(self.prefill_actors) if x != pr.instance] or [pr.instance]
        pr2 = await self.prefill(req, RouteDecision(others[0], 0, 0, 0, "retry"), flight, deadline)
        if pr2.token_ids != pr.token_ids or not pr2.has_handoff:
            raise UnavailableError("re-prefill of %s diverged from the token already sent" % req.request_id) from None
        return pr2
