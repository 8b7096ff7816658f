"""vLLM behind the engine protocol: ``VllmEngine``.

Drives vLLM's ``LLMEngine`` (started and read back by its base, ``VllmCore``,
``core.py``) one ``step()`` at a time, exactly like the native engine: the
actors' engine loop owns it. (vLLM's ``AsyncLLM`` wraps the same engine core
for asyncio servers; our actors step engines from a thread.)

Prefill/decode disaggregation uses vLLM's NixlConnector, so the handoff
ticket (``VllmTicket``, ``outputs.py``) carries no buffers of ours but vLLM's
``kv_transfer_params``:

* prefill: ``add_request(req, prefill_only=True)`` runs the prompt with
  ``max_tokens=1`` and ``do_remote_decode``; the finished output carries the
  ``kv_transfer_params`` decode needs. For hybrid models vLLM's prefill side
  stops one token short, so the token it samples is NOT the first output token
  and is never reported: the prefill output carries no tokens;
* decode: ``add_handoff(request, VllmTicket)`` submits the request with those params;
  vLLM's connector pulls KV and state from the prefill engine over NIXL and
  decode produces every output token, the first included.

So decode owns all sampling: penalties, logit bias, bad words, ``min_tokens``,
grammars and logprobs go to vLLM on decode (and on a local engine) only; the
prefill, checkpoint prefixes and background requests sample one plain greedy
token no one reads (``sampling.py``).

Token ids in, token ids out: the router tokenizes (the tokenizer files are in
the model directory, so both sides tokenize identically).

``EngineRequest.checkpoints`` (junctions, chat boundaries, client positions)
and ``EngineRequest.placement`` (the router's placed positions)
become checkpoints by prefilling the prompt's prefixes first, each ending where
vLLM's tail rule keeps a state (``stage_plan.py`` says which, ``stages.py`` keeps
their account) on local and prefill engines. The prefixes, the prompt and
background requests go to vLLM at once, tagged; vLLM's scheduler, subclassed
through its ``scheduler_cls`` extension point, says when each runs (``sequencer.py``).
vLLM also finds junctions itself, in its local cache (``args.shared_prefix_checkpoint``;
``VllmEngine.shared_prefix_checkpoint`` says whether its exact-junction option is in effect); docs/DESIGN.md section 4,
"Checkpoints on the vLLM engine".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hybridpd.checkpoint_value import LINEAR_ONLY
from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import (
    CacheEvent,
    EngineRequest,
    HandoffStats,
    HandoffTicket,
    KVExport,
    PoolStats,
    RequestId,
    RequestOutput,
    StateCheckpoint,
    WrittenCheckpoints,
)
from hybridpd.engine.vllm import adapter
from hybridpd.engine.vllm.args import Role
from hybridpd.engine.vllm.core import VllmCore
from hybridpd.engine.vllm.outputs import VllmTicket, translate
from hybridpd.engine.vllm.sequencer import SEND_HOLD_S, Tag
from hybridpd.engine.vllm.stage_plan import StagePlan
from hybridpd.engine.vllm.stages import TAIL_QUEUE_LIMIT, TAIL_SUFFIX, Stages
from hybridpd.errors import InvalidRequestError
from hybridpd.hashing import BlockHash

logger = logging.getLogger(__name__)

#: how often an engine with nothing to compute polls its connector: within ``SEND_HOLD_S`` of a
#: handoff (decode's read waits on it), and later (an unread handoff waits for vLLM's timeout)
SEND_POLL_S, IDLE_POLL_S = 0.001, 0.005
#: what a P/D prefill asks of vLLM's NixlConnector: keep the KV for decode to pull
TO_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}


@dataclass(slots=True)
class _Live:
    request: EngineRequest
    prefill_only: bool
    handoff: VllmTicket | None = None
    #: the tail vLLM keeps for the prompt as submitted (``StagePlan.tail_checkpoint``); None:
    #: its checkpoints were reported (on its first output) or it has none (decode)
    tail: int | None = None


class VllmEngine(VllmCore):
    """One vLLM engine in ``role`` (local, prefill or decode): the request lifecycle."""

    #: vLLM loads prefixes through its own connectors; its KV events feed the index
    imports_checkpoints = False
    #: our store holds nothing of vLLM's (its connector writes it): positions alone value it
    compute_model = LINEAR_ONLY

    def __init__(
        self,
        cfg: HybridPDConfig,
        model_dir: Path,
        role: Role = "local",
        *,
        instance: str = "local",
        cache_events: bool = False,
        store: tuple[str, str] | None = None,
    ) -> None:
        """Start vLLM (``VllmCore``: the arguments are its); ``pop_cache_events``
        returns its KV-cache events translated when ``cache_events``."""
        super().__init__(
            cfg,
            model_dir,
            role,
            instance=instance,
            cache_events=cache_events,
            store=store,
        )
        self.live: dict[str, _Live] = {}
        self.handoffs: dict[str, VllmTicket] = {}
        #: when the last step ended (``idle_poll_s`` counts from it)
        self._stepped_at = 0.0
        self.pending: list[RequestOutput] = []
        #: where checkpoint prefixes and tail stages go (this engine's facts, read by ``VllmCore``)
        self.plan = StagePlan(cfg, role, self.prefill_backoff, self.drop_eagle_block, self.partial_hits)
        #: prompts whose checkpoint prefixes vLLM runs (``stages.py``)
        self.stages = Stages()
        #: background requests in vLLM (answer checkpoints, tail stages), by our id
        self.background: set[str] = set()
        #: what was cached for a background request when it arrived (the hit it reports)
        self._arrival_hits: dict[str, int] = {}

    # -- requests ----------------------------------------------------------------------
    def add_request(self, request: EngineRequest, prefill_only: bool = False) -> None:
        """Queue ``request``; ``prefill_only`` stops after the first token and keeps
        the KV for a decode engine to pull (role ``prefill``)."""
        if request.request_id in self.live:
            raise InvalidRequestError("duplicate request id %s" % request.request_id)
        if prefill_only and self.role != "prefill":
            raise InvalidRequestError("prefill_only needs an engine in the prefill role, not %s" % self.role)
        if request.background:
            if prefill_only or self.role == "decode":
                raise InvalidRequestError("a background request runs whole on a local or prefill engine")
            self._register(request)
            # what is cached now is its hit (it may run after other work cached more)
            hit = self.local_hit(request.prompt_token_ids, request.cache_salt)
            self._submit_background(request)
            self._arrival_hits[request.request_id] = hit
            self.live[request.request_id] = _Live(request, False, tail=self.plan.tail_checkpoint(request, False))
            return
        transfer = dict(TO_DECODE) if prefill_only else None
        max_tokens = 1 if prefill_only else request.sampling.max_tokens
        stages = self.plan.stages(request, prefill_only)
        if prefill_only or stages:  # vLLM sees its full sampling only on decode, or after the prefixes
            self._check_sampling(request)
        self._register(request)
        tail = self.plan.tail_stage(request, prefill_only)
        # the store lookup (a round trip to the store's master) only where staging needs it: a
        # tail stage runs in the background, where vLLM's own lookup loads what the store holds
        if stages:
            hit = self.cached_hit(request)
        else:
            hit = self.local_hit(request.prompt_token_ids, request.cache_salt) if tail else 0
        plan = tuple((p, n) for p, n in stages if p > hit)
        submitted: list[tuple[str, str, int]] = []  # (vLLM id, our id, position) of each prefix
        try:
            for prefix, (position, _) in zip(Stages.prefix_requests(request, plan), plan, strict=True):
                after = submitted[-1][0] if submitted else None
                vllm_id = self._add_to_vllm(prefix, 1, None, False, Tag(after=after, prefix=True))
                submitted.append((vllm_id, prefix.request_id, position))
            tag = Tag(after=submitted[-1][0]) if submitted else None
            self._add_to_vllm(request, max_tokens, transfer, not prefill_only, tag)
        except Exception:
            if submitted:
                self.engine.abort_request([ours for _, ours, _ in submitted])
            raise
        self.stages.start(request, submitted)
        tail_at = self.plan.tail_checkpoint(request, prefill_only)  # vLLM's, whatever the hit
        self.live[request.request_id] = _Live(request, prefill_only, tail=tail_at)
        if tail is not None and tail.position > hit and len(self.background) < TAIL_QUEUE_LIMIT:
            try:  # runs once no foreground request is live; no one waits for it
                self._submit_background(tail.request)
            except InvalidRequestError:
                logger.warning("vLLM refused the tail stage of %s: its tail is not kept", request.request_id)

    def _submit_background(self, request: EngineRequest) -> None:
        """Hand vLLM a background request (our scheduler runs it while nothing else runs):
        it samples plainly, its one greedy token read by no one."""
        self._add_to_vllm(request, request.sampling.max_tokens, None, False, Tag(background=True))
        self.background.add(request.request_id)

    def _register(self, request: EngineRequest) -> None:
        """Tell the event feed the prompt's chain before vLLM can publish any of it."""
        if self.feed is not None and self.cfg.enable_prefix_caching:
            self.feed.register_prompt(request.chain(self.hasher))

    def pop_handoff(self, request_id: str) -> VllmTicket | None:
        return self.handoffs.pop(request_id, None)

    def prepare_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> int:
        """Nothing held: vLLM's connector pulls the whole prompt (no delta handoffs)."""
        return 0

    def fetch_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> VllmTicket:
        """Nothing to move here: vLLM's connector pulls KV and state during steps."""
        if not isinstance(ticket, VllmTicket):
            raise InvalidRequestError("a vLLM decode engine cannot continue a %s" % type(ticket).__name__)
        return ticket

    def add_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> None:
        """Continue a request prefilled elsewhere: vLLM pulls its KV and state over NIXL
        and generates every output token."""
        ticket = self.fetch_handoff(request, ticket)
        if request.request_id in self.live:
            raise InvalidRequestError("duplicate request id %s" % request.request_id)
        self._add_to_vllm(request, request.sampling.max_tokens, dict(ticket.kv_transfer_params), True, None)
        self.live[request.request_id] = _Live(request, False, handoff=ticket)

    def abort(self, request_id: RequestId | str) -> bool:
        if self.live.pop(request_id, None) is None:
            return False
        ids = [request_id, *self.stages.abort(request_id)]
        tail = request_id + TAIL_SUFFIX  # its tail stage: no one waits for it
        if tail in self.background:
            ids.append(tail)
        for rid in ids:
            self.background.discard(rid)
        self._arrival_hits.pop(request_id, None)
        self.engine.abort_request(ids)
        return True

    def has_work(self) -> bool:
        """Unfinished requests, or finished ones whose KV a connector still holds
        (prefill keeps blocks until decode's NIXL read is acknowledged: only
        stepping the engine core processes that acknowledgement and frees them)."""
        if self.pending or self.engine.has_unfinished_requests():
            return True
        return adapter.has_requests(self.core)

    # -- stepping ----------------------------------------------------------------------
    def idle_poll_s(self) -> float:
        """0 while a request is live or an output waits; else the connector's polling interval."""
        if self.live or self.pending:
            return 0.0
        return SEND_POLL_S if time.monotonic() - self.ledger.handed_at < SEND_HOLD_S else IDLE_POLL_S

    def step(self) -> list[RequestOutput]:
        # only connector bookkeeping left: poll it, do not spin; what passed since the last step
        # (the EngineLoop's wait outside its lock) counts
        rest = self.idle_poll_s() - (time.monotonic() - self._stepped_at)
        if rest > 0:
            time.sleep(rest)
        outputs, self.pending = self.pending, []
        stepped = self.engine.step()
        self._prefixes_done()
        for out in stepped:
            rid = out.request_id
            if out.finished:
                self.background.discard(rid)
            live = self.live.get(rid)
            if live is None:  # aborted meanwhile, a checkpoint prefix or a tail stage (ours)
                continue
            cached = self.stages.reported_hit(rid, int(out.num_cached_tokens or 0), out.finished)
            if live.request.background:  # at most what was cached when it arrived
                arrived = self._arrival_hits.pop(rid, cached) if out.finished else self._arrival_hits.get(rid, cached)
                cached = min(cached, arrived)
            if live.handoff is not None:
                cached = live.handoff.num_cached_tokens
            sampled = not live.prefill_only and not live.request.background
            got, ticket = translate(out, live.request, live.prefill_only, sampled, cached)
            if live.tail is not None:  # its first output: the prompt's prefill has run
                got = replace(got, checkpoints=WrittenCheckpoints(live.tail, self.stages.pop_written(rid)))
                live.tail = None
            if ticket is not None:
                self.handoffs[rid] = ticket
                self.ledger.handed_at = time.monotonic()
            outputs.append(got)
            if out.finished:
                del self.live[rid]
        self._stepped_at = time.monotonic()
        return outputs

    def _prefixes_done(self) -> None:
        """The checkpoint prefixes our scheduler found done this step (``sequencer.py``):
        their account (``Stages.done``); one it released before its sampled token is
        still live on vLLM's output side, and is aborted there (its scheduler has let it go)."""
        released = [
            ours
            for d in self.ledger.pop_done()
            if (ours := self.stages.done(d.vllm_id, d.cached, d.released)) is not None
        ]
        if released:
            self.engine.abort_request(released)

    def generate(self, requests: list[EngineRequest]) -> dict[str, list[int]]:
        """Run ``requests`` to completion (tests, benchmarks)."""
        for r in requests:
            self.add_request(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in requests}
        while self.has_work():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
        return out

    def pop_exports(self) -> list[tuple[KVExport, StateCheckpoint]]:
        """Checkpoints go to the store through vLLM's connector, not through us."""
        return []

    def pop_cache_events(self) -> list[CacheEvent]:
        return self.feed.pop() if self.feed is not None else []

    def import_checkpoint(
        self,
        kv: KVExport,
        state: StateCheckpoint,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        hashes: Sequence[BlockHash] = (),
    ) -> bool:
        """Never imports: store hits enter through vLLM's MooncakeStoreConnector
        (``imports_checkpoints`` is False, so workers do not call this)."""
        return False

    def handoff_stats(self) -> HandoffStats:
        """vLLM's connector owns its handoffs (its own metrics count them)."""
        return HandoffStats()

    def inject_fault(self, kind: str) -> None:
        raise ValueError("unknown fault %r (the vLLM engine injects none)" % kind)

    def queued_prompt_tokens(self) -> int:
        return sum(len(v.request.prompt_token_ids) for v in self.live.values() if v.prefill_only)

    def stats(self) -> PoolStats:
        return self._pool_stats(len(self.live))
