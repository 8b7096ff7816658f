"""NativeEngine: the reference implementation of the engine boundary (``engine/base.py``).

One step is schedule -> run -> postprocess (after nano-vllm)::

    Scheduler.schedule()   which requests advance, by how many tokens
      (scheduler.py)       (admission: hybrid hit, blocks, checkpoint plan)
    PrefixCache.plan()     restores counted, slots reserved for the snapshots
    ModelRunner.run()      EAGLE drafts, one batched forward, sampling:
      (model_runner.py)    a RowResult of tokens per request (step.py)
    _postprocess           appends, stops, caches the prompt, finishes, outputs
      (this file)          (bookkeeping only: no tensors, no call into the runner)

The engine keeps the request lifecycle (add, step, postprocess, finish,
abort); the runner is the only part that holds tensors (weights, KV, state
slots, per-request state); ``PrefixCache`` (prefix_cache.py) the local cache's
bookkeeping: both pools (``StateCache`` for the checkpoint slots), exports,
imports and the cache events; ``HandoffTransport`` (handoff.py) the NIXL
agents, ``HandoffPins`` (handoff_pins.py) the blocks a delta handoff keeps;
``prefill_plan.py`` the hit a prefill would get, asked before it runs. ``role``
("local" | "prefill" | "decode") and ``instance`` only name things (the NIXL
agents): every member works in every role.

Exactness rules (tests compare paths token for token):

* prefill chunks and attention tiles sit at absolute multiples of 16, so a
  budget, a cache hit or an import never changes a token's arithmetic;
* restored state is the exact tensor that was saved;
* KV computed by decode is never entered into the prefix cache: decode runs
  the recurrent form, whose last bits differ from the chunked prefill form,
  and a later prefill hitting it would no longer match a full recompute.

Threading: as ``engine/base.py`` says, callers serialise every member except
``pop_handoff`` and ``fetch_handoff``. Those touch only ``_handoffs`` (a dict
``step()`` adds to and they pop from) and the transport, which locks itself.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Literal

import torch

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
    SpecStats,
    StateCheckpoint,
    WrittenCheckpoints,
)
from hybridpd.engine.native import prefill_plan
from hybridpd.engine.native.handoff import FetchedHandoff, Handoff, HandoffTransport, NativeTicket
from hybridpd.engine.native.handoff_pins import HandoffPins
from hybridpd.engine.native.model import HybridModel
from hybridpd.engine.native.model_config import KERNEL_CHUNK
from hybridpd.engine.native.model_runner import ModelRunner
from hybridpd.engine.native.prefix_cache import PrefixCache
from hybridpd.engine.native.scheduler import Scheduler
from hybridpd.engine.native.scheduler_config import SchedulerConfig
from hybridpd.engine.native.sequence import SeqStatus, Sequence, stop_reason
from hybridpd.engine.native.step import RowResult, ScheduledWork
from hybridpd.engine.profile import native_profile
from hybridpd.errors import ConfigError, IntegrityError, InvalidRequestError, OverloadedError
from hybridpd.hashing import BlockHash, BlockHasher
from hybridpd.integrity import block_hash_seed, load_key
from hybridpd.validation import check_features, validate_request

__all__ = ["NativeEngine", "SpecStats"]

ROLES = ("local", "prefill", "decode")


class NativeEngine:
    #: checkpoints from the store enter through import_checkpoint
    imports_checkpoints = True

    def __init__(
        self,
        cfg: HybridPDConfig,
        model_dir: Path,
        *,
        role: Literal["local", "prefill", "decode"] = "local",
        instance: str = "local",
        export_checkpoints: bool = False,
        num_state_slots: int | None = None,
        record_logits: bool = False,
    ) -> None:
        if cfg.checkpoint_alignment is not None and cfg.checkpoint_alignment % KERNEL_CHUNK:
            raise ConfigError(
                "checkpoint_alignment",
                "the native engine exports state at multiples of %d; got %d" % (KERNEL_CHUNK, cfg.checkpoint_alignment),
            )
        if role not in ROLES:
            raise ValueError("role must be one of %s, got %r" % (ROLES, role))
        self.cfg = cfg
        self.role = role
        self.instance = instance
        self.unit = cfg.prefix_match_unit
        self.runner = ModelRunner(
            cfg,
            model_dir,
            self.unit,
            record_logits=record_logits,
            num_state_slots=num_state_slots,
            export_checkpoints=export_checkpoints,
        )
        self.mcfg = self.runner.mcfg
        self.device = self.runner.device
        self.model_id = self.runner.model_id
        key = load_key(cfg)  # the deployment key: handoff tags and the chain's seed
        self.hasher = BlockHasher(unit=self.unit, algo=cfg.hash_algo, seed=block_hash_seed(cfg, key))
        self.cache = PrefixCache(
            self.runner,
            self.hasher,
            num_kv_blocks=cfg.num_kv_blocks,
            mamba_block_size=cfg.mamba_block_size,
            enabled=cfg.enable_prefix_caching,
            half_life_s=cfg.checkpoint_half_life_s,
            placement_share=cfg.placement_share,
        )
        #: what a hit saves, for the publisher's store ledger (checkpoint_value.py)
        self.compute_model = self.cache.state_cache.compute
        self.kv_pool = self.cache.kv_pool
        self.state_pool = self.cache.state_pool
        self.scheduler = Scheduler(SchedulerConfig.of(cfg, role), self.kv_pool, self.state_pool)
        self.transport = HandoffTransport(instance, cfg.handoff_timeout_s, cfg.device, self.unit, key)
        #: handoffs of finished prefill_only requests, until pop_handoff (another thread)
        self._handoffs: dict[str, Handoff] = {}
        #: the cached blocks delta handoffs hold (prepare_handoff)
        self.pins = HandoffPins(self.kv_pool, self.hasher)
        self.seqs: dict[str, Sequence] = {}
        self.pending: list[RequestOutput] = []
        self.spec = SpecStats()

    # -- what tests, benchmarks and scripts read ---------------------------------------
    @property
    def model(self) -> HybridModel:
        return self.runner.model

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.runner.kv_caches

    @property
    def logit_log(self) -> dict[str, list[torch.Tensor]] | None:
        """rid -> fp32 logits that chose each emitted token (``record_logits``)."""
        return self.runner.logit_log

    # -- requests ------------------------------------------------------------------------
    def _validate(self, request: EngineRequest) -> None:
        validate_request(request, self.mcfg.vocab_size, self.cfg.max_model_len)
        check_features(request.sampling, native_profile(self.cfg))
        if request.request_id in self.seqs:
            raise InvalidRequestError("duplicate request id %s" % request.request_id)

    def _check_fits(self, seq: Sequence) -> None:
        need = self.scheduler.blocks_needed(seq)
        if need > self.kv_pool.num_slots:
            raise InvalidRequestError("request needs %d KV blocks; the engine has %d" % (need, self.kv_pool.num_slots))

    def add_request(self, request: EngineRequest, prefill_only: bool = False) -> None:
        """Queue ``request``. With ``prefill_only`` it finishes after its first
        token and leaves a handoff for ``pop_handoff``."""
        self._validate(request)
        prompt = list(request.prompt_token_ids)
        seq = Sequence(
            request,
            prompt,
            len(prompt),
            request.chain(self.hasher),
            prefill_only=prefill_only,
        )
        self._check_fits(seq)
        self.seqs[seq.rid] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: RequestId | str) -> bool:
        """Free ``request_id`` (its ABORT output comes with the next step); an
        unclaimed handoff of a finished request is dropped too, and an offered one
        that decode has not read is withdrawn from NIXL (no output)."""
        dropped = self._handoffs.pop(request_id, None) is not None
        dropped |= self.transport.withdraw(request_id)  # offered, not read yet: free it now
        dropped |= self.pins.release(request_id)
        seq = self.seqs.get(request_id)
        if seq is None:
            return dropped
        self._finish(seq)
        self.pending.append(
            RequestOutput(seq.request.request_id, (), True, FinishReason.ABORT, seq.num_prompt, seq.num_cached)
        )
        return True

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.scheduler.background or self.pending)

    def idle_poll_s(self) -> float:
        return 0.0  # its work is all compute

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.seqs.pop(seq.rid, None)
        self.runner.drop(seq.rid)

    # -- the step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return outputs
        try:
            self.cache.plan(scheduled)
            results = self.runner.run(scheduled)
        except BaseException:
            self.cache.abandon(scheduled)  # no slot keyed for this step holds its state
            raise
        self.cache.commit(scheduled)
        for sw, res in zip(scheduled, results, strict=True):
            out = self._postprocess(sw, res)
            if out is not None:
                outputs.append(out)
        return outputs

    def _postprocess(self, sw: ScheduledWork, res: RowResult) -> RequestOutput | None:
        """Bookkeeping of one row: progress, tokens, stops, the prompt's cache entry,
        spec counters, finishing. None mid-prompt (nothing to say yet)."""
        seq, written = sw.seq, WrittenCheckpoints()  # only the output completing the prompt has any
        if sw.decode:
            if res.drafts:
                self.spec.steps += 1
                self.spec.emitted += res.emitted
                if len(self.spec.recent) < 100_000:
                    self.spec.recent.append(res.emitted)
        else:
            seq.num_computed += sw.num_tokens
            if not res.tokens:
                return None
            self.cache.register_prompt(seq, res.exports)
            written = self.cache.written(seq)
        seq.token_ids.extend(res.tokens)
        reason = stop_reason(seq.request.sampling, self.mcfg.eos_token_id, res.tokens[-1], seq.num_output)
        if not sw.decode and seq.prefill_only:
            if res.handoff is not None:
                self._handoffs[seq.rid] = res.handoff
            self._finish(seq)
            return self._output(seq, res, True, reason, written)
        if reason is not None:
            self._finish(seq)
        elif sw.decode:
            seq.num_computed += res.emitted  # the pending token and the accepted drafts
        else:
            seq.status = SeqStatus.DECODE
        return self._output(seq, res, reason is not None, reason, written)

    @staticmethod
    def _output(
        seq: Sequence, res: RowResult, finished: bool, reason: FinishReason | None, written: WrittenCheckpoints
    ) -> RequestOutput:
        rid, n, cached = seq.request.request_id, seq.num_prompt, seq.num_cached
        return RequestOutput(rid, res.tokens, finished, reason, n, cached, res.logprobs, written)

    # -- the local prefix cache (prefix_cache.py) -------------------------------------------
    def pop_exports(self) -> list[tuple[KVExport, StateCheckpoint]]:
        return self.cache.pop_exports()

    def pop_cache_events(self) -> list[CacheEvent]:
        return self.cache.pop_events()

    def import_checkpoint(
        self,
        kv: KVExport,
        state: StateCheckpoint,
        token_ids: Seq[int],
        cache_salt: str | None = None,
        hashes: Seq[BlockHash] = (),
    ) -> bool:
        """Enter a verified store checkpoint of ``token_ids`` (``PrefixCache.import_checkpoint``)."""
        return self.cache.import_checkpoint(kv, state, token_ids, cache_salt, hashes)

    # -- handoffs (P/D) ------------------------------------------------------------------
    def pop_handoff(self, request_id: str) -> NativeTicket | None:
        """Offer the handoff of finished ``request_id`` over NIXL (the server
        starts on first use). Called without the engine lock."""
        handoff = self._handoffs.pop(request_id, None)
        return None if handoff is None else self.transport.offer(handoff)

    def take_handoff(self, request_id: str) -> FetchedHandoff | None:
        """The handoff of finished ``request_id`` for an engine in this process,
        without NIXL (tests, benchmarks: ``decode.add_handoff(req, fetched)``)."""
        handoff = self._handoffs.pop(request_id, None)
        return None if handoff is None else FetchedHandoff.of(handoff)

    def prepare_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> int:
        """Pin the blocks of ``ticket``'s prompt this engine's prefix cache holds
        (the conversation's previous turns: ``HandoffPins.pin``), so
        ``fetch_handoff`` skips them and no admission evicts them before
        ``add_handoff`` (or ``abort``) takes them over. Returns the pinned count."""
        hashes = ticket.block_hashes if isinstance(ticket, NativeTicket) and self.cfg.enable_prefix_caching else ()
        return self.pins.pin(request, hashes)

    def fetch_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> FetchedHandoff:
        """READ and verify a ticket from a native prefill engine, but the blocks
        ``prepare_handoff`` pinned (the client starts on first use; fetches run one
        at a time). Called without the engine lock."""
        if not isinstance(ticket, NativeTicket):
            raise TypeError("the native engine reads NativeTicket handoffs, got %s" % type(ticket).__name__)
        if ticket.request_id != request.request_id:
            raise IntegrityError("handoff of %s offered for request %s" % (ticket.request_id, request.request_id))
        return self.transport.fetch(request, ticket, self.pins.held(request.request_id))

    def add_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> None:
        """Continue ``request`` from a fetched handoff (decode side of P/D)."""
        if not isinstance(ticket, FetchedHandoff):
            raise TypeError("add_handoff takes fetch_handoff's FetchedHandoff, got %s" % type(ticket).__name__)
        handoff = ticket.handoff
        if handoff.request.request_id != request.request_id:
            raise IntegrityError("handoff of %s given for %s" % (handoff.request.request_id, request.request_id))
        self.pins.check(request.request_id, ticket.held)
        try:
            self._validate(request)
            n = len(request.prompt_token_ids)
            self.runner.check_handoff(handoff, n)
            seq = Sequence(request, [*request.prompt_token_ids, handoff.first_token_id], n, request.chain(self.hasher))
            seq.num_cached = handoff.num_cached_tokens
            self._check_fits(seq)
        except BaseException:
            self.pins.release(request.request_id)
            raise
        if not self.scheduler.admit_handoff(seq, self.pins.covering(request.request_id, ticket.held)):
            # NOTE: the pins stay: the caller may try again once blocks are free (the decode
            # worker waits, bounded), or abort, which releases them
            raise OverloadedError("no KV blocks free for handoff %s" % request.request_id)
        self.pins.hand_over(request.request_id, ticket.held)
        try:
            self.runner.load_handoff(seq, handoff, ticket.held)
        except BaseException:
            self.scheduler.finish(seq)  # never run a request whose state did not load
            raise
        self.cache.register_handoff(seq)
        self.seqs[seq.rid] = seq

    def handoff_stats(self) -> HandoffStats:
        return self.transport.stats()

    def inject_fault(self, kind: str) -> None:
        """``corrupt_next_handoff``: the next offer's state changes after its checksum
        (every read moves the state, a delta handoff too); ``forge_next_handoff``: the
        next offer is tagged with a key no deployment holds; ``delay_next_handoff_read``:
        the next fetch starts after the ticket expired."""
        self.transport.inject(kind)

    def close(self) -> None:
        self.transport.close()

    # -- introspection -------------------------------------------------------------------
    def local_hit(self, token_ids: Seq[int], cache_salt: str | None = None, hashes: Seq[BlockHash] = ()) -> int:
        """The hit an admission of this prompt would get now (no side effects)."""
        return prefill_plan.probe_hit(self.scheduler, self.hasher, token_ids, cache_salt, hashes)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of waiting requests not computed yet (load for routing)."""
        return sum(s.num_prompt - s.num_computed for s in self.scheduler.waiting)

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.kv_pool.num_slots,
            num_free_blocks=self.kv_pool.num_free,
            num_cached_blocks=self.kv_pool.num_cached,
            num_state_slots=self.state_pool.num_slots,
            num_free_state_slots=self.state_pool.num_free,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
        )

    def generate(self, requests: list[EngineRequest]) -> dict[str, list[int]]:
        """Run ``requests`` to completion; returns the generated ids per request."""
        out: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.add_request(r)
        while self.has_work():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
        return out
