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
vLLM's tail rule keeps a state (``stage_plan.py`` says which, ``stages.py`` runs
them) on local and prefill engines. vLLM also finds junctions itself, in its
local cache (``args.shared_prefix_checkpoint``; ``VllmEngine.shared_prefix_checkpoint``
says whether its exact-junction option is in effect); docs/DESIGN.md section 4,
"Checkpoints on the vLLM engine".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hybridpd.checkpoint_value import LINEAR_ONLY
from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import (
    CacheEvent,
    EngineRequest,
    FinishReason,
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
from hybridpd.engine.vllm.background import BackgroundQueue
from hybridpd.engine.vllm.core import VllmCore
from hybridpd.engine.vllm.outputs import VllmTicket, output, translate
from hybridpd.engine.vllm.stage_plan import StagePlan
from hybridpd.engine.vllm.stages import TAIL_QUEUE_LIMIT, TAIL_SUFFIX, Stages
from hybridpd.errors import InvalidRequestError
from hybridpd.hashing import BlockHash

logger = logging.getLogger(__name__)

#: a background try (a P/D prompt's tail stage, an answer prefill) waits while a handed-off
#: prefill's KV awaits decode's NIXL read, at most this long after the handoff: NIXL progresses
#: only when this engine steps (``patches.nixl_without_progress_thread``), so a background step
#: (a whole prefill chunk) would hold decode's read, and the first token, until it ended
SEND_HOLD_S = 1.0
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
        #: when the newest P/D prefill finished here (its KV handed to decode: ``SEND_HOLD_S``)
        self._handed_at = -SEND_HOLD_S
        #: when the last step ended (``idle_poll_s`` counts from it)
        self._stepped_at = 0.0
        self.pending: list[RequestOutput] = []
        #: where checkpoint prefixes and tail stages go (this engine's facts, read by ``VllmCore``)
        self.plan = StagePlan(cfg, role, self.prefill_backoff, self.drop_eagle_block, self.partial_hits)
        #: prompts waiting for their checkpoint prefixes (``stages.py``)
        self.stages = Stages()
        #: checkpoint prefixes in vLLM: our request id -> (vLLM's request id, prefix length)
        self._prefixes: dict[str, tuple[str, int]] = {}
        #: background requests (answer checkpoints), run only while no foreground one is live
        self.background = BackgroundQueue()

    # -- requests ----------------------------------------------------------------------
    def _submit(self, req: EngineRequest, max_tokens: int, transfer: dict[str, Any] | None, *, full: bool) -> None:
        """Hand ``req`` to vLLM: ``full`` with every sampling field (local and decode
        requests), else plain (a P/D prefill, a checkpoint prefix, a background try:
        ``sampling.py``). vLLM's refusal of a request is ours (InvalidRequestError)."""
        internal = self._add_to_vllm(req, max_tokens, transfer, full)
        if self.stages.is_prefix(req.request_id):  # released once its checkpoint is written
            self._prefixes[req.request_id] = (internal, len(req.prompt_token_ids))

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
            # handed to vLLM by step() once no foreground request is live; what is cached now is its hit
            self.background.add(request, self.local_hit(request.prompt_token_ids, request.cache_salt))
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
        first = self.stages.start(request, tuple((p, n) for p, n in stages if p > hit))
        try:
            if first is not None:
                self._submit(first, 1, None, full=False)
            else:
                self._submit(request, max_tokens, transfer, full=not prefill_only)
        except Exception:
            self.stages.abort(request.request_id)
            raise
        tail_at = self.plan.tail_checkpoint(request, prefill_only)  # vLLM's, whatever the hit
        self.live[request.request_id] = _Live(request, prefill_only, tail=tail_at)
        if tail is not None and tail.position > hit and len(self.background.queued) < TAIL_QUEUE_LIMIT:
            self.background.add(tail.request, 0)  # runs once no foreground request is live
        preempted = self.background.preempt()
        if preempted is not None:  # never let a background prefill hold a chunk foreground work needs
            self.engine.abort_request([preempted])

    def _register(self, request: EngineRequest) -> None:
        """Tell the event feed the prompt's chain before vLLM can publish any of it."""
        if self.feed is not None and self.cfg.enable_prefix_caching:
            self.feed.register_prompt(request.chain(self.hasher))

    def _admit_background(self) -> None:
        foreground = any(not v.request.background for v in self.live.values()) or self._sending()
        nxt = self.background.admit(foreground)
        if nxt is None:
            return
        try:
            self._submit(nxt, nxt.sampling.max_tokens, None, full=False)  # no one reads its token
        except Exception:
            running = self.background.running
            self.background.finished()
            self._fail(running[1].request_id if running is not None else nxt.request_id)

    def _sending(self) -> bool:
        """Whether a handed-off prefill's KV still waits for decode's read (vLLM keeps
        its blocks until NIXL reports it sent), for at most ``SEND_HOLD_S``."""
        if not self.background.queued or time.monotonic() - self._handed_at >= SEND_HOLD_S:
            return False
        return adapter.has_finished_requests(self.core)

    def _fail(self, request_id: str) -> None:
        """vLLM refused a request this engine submits on its own (a checkpoint prefix's
        prompt, a background try): that request ends aborted, the others run on."""
        logger.exception("vLLM refused %s: it ends aborted", request_id)
        live = self.live.pop(request_id, None)
        if live is not None:
            self.pending.append(output(live.request, (), True, FinishReason.ABORT, 0))

    def _resume(self, request_id: str, cached: int) -> None:
        """A checkpoint prefix finished: submit the next one, or the prompt."""
        nxt = self.stages.finished(request_id, cached)
        if nxt is None:
            return
        main = self.stages.owner.get(nxt.request_id, nxt.request_id)
        try:
            if self.stages.is_prefix(nxt.request_id):
                self._submit(nxt, 1, None, full=False)
                return
            live = self.live[nxt.request_id]
            transfer = dict(TO_DECODE) if live.prefill_only else None
            max_tokens = 1 if live.prefill_only else nxt.sampling.max_tokens
            self._submit(nxt, max_tokens, transfer, full=not live.prefill_only)
        except Exception:
            self.stages.abort(main)
            self._fail(main)

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
        self._submit(request, request.sampling.max_tokens, dict(ticket.kv_transfer_params), full=True)
        self.live[request.request_id] = _Live(request, False, handoff=ticket)

    def abort(self, request_id: RequestId | str) -> bool:
        if self.live.pop(request_id, None) is None:
            return False
        tail = self.background.drop(request_id + TAIL_SUFFIX)  # its tail stage: no one waits for it
        if tail is not None:
            self.engine.abort_request([tail])
        if self.background.queued or self.background.running is not None:
            running = self.background.drop(request_id)
            if running is not None:
                self.engine.abort_request([running])
                return True
        prefix = self.stages.abort(request_id)
        self.engine.abort_request([prefix if prefix is not None else request_id])
        return True

    def has_work(self) -> bool:
        """Unfinished requests, or finished ones whose KV a connector still holds
        (prefill keeps blocks until decode's NIXL read is acknowledged: only
        stepping the engine core processes that acknowledgement and frees them)."""
        if self.pending or self.background.queued or self.engine.has_unfinished_requests():
            return True
        return adapter.has_requests(self.core)

    # -- stepping ----------------------------------------------------------------------
    def idle_poll_s(self) -> float:
        """0 while a request is live or an output waits; else the connector's polling interval."""
        if self.live or self.pending:
            return 0.0
        return SEND_POLL_S if time.monotonic() - self._handed_at < SEND_HOLD_S else IDLE_POLL_S

    def step(self) -> list[RequestOutput]:
        # only connector bookkeeping left: poll it, do not spin; what passed since the last step
        # (the EngineLoop's wait outside its lock) counts
        rest = self.idle_poll_s() - (time.monotonic() - self._stepped_at)
        if rest > 0:
            time.sleep(rest)
        outputs, self.pending = self.pending, []
        self._admit_background()
        for out in self.engine.step():
            if self.stages.is_prefix(out.request_id):  # a checkpoint prefix: never reported
                if out.finished:
                    self._resume(out.request_id, int(out.num_cached_tokens or 0))
                continue
            rid = self.background.owner(out.request_id) or out.request_id
            background = rid != out.request_id
            if background and out.finished:
                self.background.finished()
            live = self.live.get(rid)
            if live is None:  # aborted meanwhile, a preempted background try, or a tail stage (ours)
                if background and out.finished:
                    self.background.forget(rid)
                continue
            cached = self.stages.reported_hit(rid, int(out.num_cached_tokens or 0), out.finished)
            if background:  # not what an earlier, preempted try of it left
                cached = self.background.reported_hit(rid, cached, out.finished)
            if live.handoff is not None:
                cached = live.handoff.num_cached_tokens
            sampled = not live.prefill_only and not background
            got, ticket = translate(out, live.request, live.prefill_only, sampled, cached)
            if live.tail is not None:  # its first output: the prompt's prefill has run
                got = replace(got, checkpoints=WrittenCheckpoints(live.tail, self.stages.pop_written(rid)))
                live.tail = None
            if ticket is not None:
                self.handoffs[rid] = ticket
                self._handed_at = time.monotonic()
            outputs.append(got)
            if out.finished:
                del self.live[rid]
        self._release_prefixes()
        self._stepped_at = time.monotonic()
        return outputs

    def _release_prefixes(self) -> None:
        """Checkpoint prefixes whose chunk up to their last token ran this step:
        vLLM wrote (and keyed) the state at their checkpoint when it scheduled that
        chunk, so each is aborted before its one sampled token and the next prefix,
        or the prompt, goes on at once (one engine step per prefix instead of two;
        the checkpoint stays cached as a finished prefix's does, the freed blocks
        keep their keys)."""
        if not self._prefixes:
            return
        for rid, (internal, length) in list(self._prefixes.items()):
            if not self.stages.is_prefix(rid):  # finished, or its prompt was aborted
                del self._prefixes[rid]
                continue
            cached = self._prefix_ran(internal, length)
            if cached is None:
                continue
            del self._prefixes[rid]
            self.engine.abort_request([rid])
            self.stages.prefixes_released += 1
            self._resume(rid, cached)

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
