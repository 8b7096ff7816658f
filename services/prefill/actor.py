"""Prefill actor: loads a hit, computes the rest, exports checkpoints, hands off.

Per request (``prefill``):

1. if the index promised a longer hit in MooncakeStore than the local cache
   has, load it (verified; a stale entry is repaired and we recompute);
2. run the prompt through the engine (batched with concurrent requests);
3. return the tokens sampled at prefill and the engine's handoff ticket
   (opaque here: the native engine has offered KV + state + EAGLE hidden to
   NIXL, vLLM's connector holds its KV for decode to pull).

After each engine step the publisher (``publisher.py``) takes the engine's
checkpoint exports (put in the store, then published) and its cache events
(mirrored into this instance's index entries). A heartbeat thread keeps the
instance live in the index. Redis or store failures degrade to local-only caching; they never fail
a request. Nothing here depends on which engine runs (``engine/base.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict, replace

from hybridpd.checkpoints import checkpoint_position
from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import Engine, EngineRequest, FinishReason, HandoffStats
from hybridpd.engine.factory import make_engine
from hybridpd.engine.profile import EngineProfile, profile_of
from hybridpd.errors import IntegrityError, UnavailableError
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.integrity import load_key
from hybridpd.store.client import BadObjectError, CheckpointStore
from hybridpd.store.loader import fetch_checkpoint
from services.prefill.answers import AnswerCheckpoints
from services.prefill.publisher import CachePublisher
from services.worker.base import WorkerBase, ray_metrics, startup_guard
from services.worker.engine_loop import EngineLoop
from services.worker.messages import PrefillCommand, PrefillResult
from services.worker.metrics import PREFILL_COUNTERS, PREFILL_GAUGES, PREFILL_HISTOGRAMS, PrefillCounters

logger = logging.getLogger(__name__)

#: how long a prefill waits for its cache events to reach the index before returning
PUBLISH_WAIT_S = 0.25


def _store_host(cfg: HybridPDConfig) -> str:
    """The address this actor's MooncakeStore client advertises ('auto': its Ray node IP)."""
    if cfg.store_host != "auto":
        return cfg.store_host
    import ray

    return ray.util.get_node_ip_address()


def engine_store(cfg: HybridPDConfig, store: tuple[str, str] | None) -> tuple[str, str] | None:
    """The store (Mooncake master, metadata URL) the prefill engine itself is given: where
    the engine's own connector loads store hits (it imports no checkpoints: vLLM's
    MooncakeStoreConnector saves and loads), only with ``vllm_store`` on."""
    return store if profile_of(cfg).imports_checkpoints or cfg.vllm_store else None


class PrefillWorker(WorkerBase):
    """The actor's body (plain class, so tests can also run it in-process).

    ``engine``: tests pass an engine built elsewhere; actors build theirs from ``cfg``."""

    counters: PrefillCounters

    def __init__(
        self,
        cfg: HybridPDConfig,
        name: str,
        redis_url: str | None,
        mooncake_master: str | None,
        metadata_url: str | None,
        *,
        engine: Engine | None = None,
    ) -> None:
        with startup_guard(name):
            self._start(cfg, name, redis_url, mooncake_master, metadata_url, engine)

    def _start(
        self,
        cfg: HybridPDConfig,
        name: str,
        redis_url: str | None,
        mooncake_master: str | None,
        metadata_url: str | None,
        engine: Engine | None,
    ) -> None:
        self.cfg = cfg
        #: the engine's policy; this actor's engine runs in the prefill role
        self.profile: EngineProfile = profile_of(cfg)
        self.name = name
        store_addr = (mooncake_master, metadata_url) if mooncake_master and metadata_url else None
        self.engine = engine or make_engine(
            cfg,
            "prefill",
            instance=name,
            export_checkpoints=bool(mooncake_master),
            cache_events=bool(redis_url),
            store=engine_store(cfg, store_addr),
        )
        self.index = PrefixIndex(redis_url, self.engine.model_id, cluster=cfg.redis_cluster) if redis_url else None
        self.store = (
            CheckpointStore(
                *store_addr, self.engine.model_id, local_host=_store_host(cfg), key=load_key(cfg), lazy=True
            )
            if store_addr is not None and self.engine.imports_checkpoints  # vLLM: its connector
            else None
        )
        self.stats_lock = threading.Lock()
        self.counters = PrefillCounters()
        self.metrics = ray_metrics(name, PREFILL_COUNTERS, PREFILL_GAUGES, PREFILL_HISTOGRAMS)
        self.publisher = CachePublisher(
            name,
            self.index,
            self.store,
            self.engine.unit,
            self.counters,
            self.stats_lock,
            self._observe,
            hasher=self.engine.hasher,
            state_budget_bytes=int(cfg.store_state_budget_mb * (1 << 20)),
            half_life_s=cfg.checkpoint_half_life_s,
            compute=self.engine.compute_model,
            speculative_share=cfg.placement_share,
        )
        self.loop = EngineLoop(self.engine, after_step=lambda: self.publisher.collect(self.engine))
        self.answers = AnswerCheckpoints(
            self.engine,
            self.loop,
            self.publisher.flush,
            self.counters,
            self.stats_lock,
            self._observe,
            self._tag_answer,
            max_recompute=4 * cfg.max_num_batched_tokens,
        )
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        if self.metrics is not None:
            self.metrics.run(self._metric_snapshot, self._stop)

    # -- requests ----------------------------------------------------------------------
    def prefill(self, cmd: PrefillCommand) -> PrefillResult:
        self.refuse_if_draining()
        t0 = time.perf_counter()
        try:
            with self.engine_errors():
                return replace(self._prefill(cmd), prefill_seconds=time.perf_counter() - t0)
        finally:
            self._observe("prefill_seconds", time.perf_counter() - t0)

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

    def _handoff_stats(self) -> HandoffStats:
        """The engine's handoff accounting; its release latencies go to the histogram."""
        hs = self.engine.handoff_stats()
        for s in hs.release_latencies:
            self._observe("handoff_seconds", s)
        with self.stats_lock:
            self.counters.handoffs_expired = hs.expired
        return hs

    def _metric_snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        self._handoff_stats()
        with self.stats_lock:
            counters: dict[str, float] = asdict(self.counters)
        gauges: dict[str, float] = {**self.load(), "store_state_bytes": self.publisher.ledger_stats().nbytes}
        return counters, gauges

    def _prefill(self, cmd: PrefillCommand) -> PrefillResult:
        req = cmd.request
        with self.loop.reserved(req.request_id):  # an abort during the store load is not lost
            loaded = self._maybe_load(cmd)
            q = self.loop.submit(req.request_id, lambda: self.engine.add_request(req, prefill_only=True))
        try:
            out = q.get(timeout=self.cfg.request_timeout_s + 30.0)
        except queue.Empty:
            self.loop.abort(req.request_id)
            raise UnavailableError("prefill of %s on %s stalled" % (req.request_id, self.name)) from None
        if isinstance(out, BaseException):
            raise out
        ticket = self.engine.pop_handoff(req.request_id)
        with self.stats_lock:
            self.counters.prefill_computed_tokens += out.num_prompt_tokens - out.num_cached_tokens
            self.counters.prefill_loaded_tokens += out.num_cached_tokens
            self.counters.handoff_offered_bytes += ticket.nbytes if ticket is not None else 0
        self.publisher.flush(PUBLISH_WAIT_S)  # the router's next lookup sees this prompt's cache
        if out.num_cached_tokens > 0:  # a reuse of the checkpoint there (its value: checkpoint_value.py)
            self.publisher.record_hit(req, out.num_cached_tokens)
        if ticket is None and not out.new_token_ids and out.finish_reason is not FinishReason.ABORT:
            raise UnavailableError(
                "prefill of %s on %s produced neither a token nor a handoff" % (req.request_id, self.name)
            )
        return PrefillResult(
            request_id=req.request_id,
            instance=self.name,
            token_ids=out.new_token_ids,
            finish_reason=None if ticket is not None or out.finish_reason is None else str(out.finish_reason),
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            loaded_from_store=loaded,
            ticket=ticket,
            tail_checkpoint=out.checkpoints.tail,
            extra_checkpoints=out.checkpoints.extra,
            logprobs=out.logprobs,
        )

    def _maybe_load(self, cmd: PrefillCommand) -> int:
        """Import the store hit when it beats the local cache. Returns tokens loaded."""
        req = cmd.request
        if self.store is None or cmd.store_hit <= 0 or not self.engine.imports_checkpoints:
            return 0
        u = self.engine.unit
        tokens = list(req.prompt_token_ids)
        with self.loop.lock:
            local = self.engine.local_hit(tokens, req.cache_salt, req.block_hashes)
        if cmd.store_hit <= local:
            return 0
        # NOTE: where EAGLE replays (a prefill engine with a drafter: eagle_drop_prefill) the hit
        # rule drops the last cached block, so load the replay block after the hit too (the
        # lookup promised it).
        kv_end = min(cmd.store_hit + (u if self.profile.eagle_drop_prefill else 0), len(tokens) // u * u)
        hashes = self.engine.hasher.extend(req.block_hashes, tokens[:kv_end], cache_salt=req.cache_salt)
        t0 = time.perf_counter()
        try:
            ck = fetch_checkpoint(self.index, self.store, hashes, u, cmd.store_hit, self._refused)
            self._observe("store_get_seconds", time.perf_counter() - t0)
        except Exception as exc:  # store/index failures of any kind degrade, never fail
            logger.warning("store load failed (%s): recomputing", exc)
            ck = None
        if ck is None:
            with self.stats_lock:
                self.counters.prefill_store_load_failures += 1
            return 0
        with self.stats_lock:
            self.counters.store_get_bytes += sum(b.numel() * b.element_size() for b in ck[0].buffers + ck[1].buffers)
        try:
            with self.loop.lock:
                ok = self.engine.import_checkpoint(ck[0], ck[1], tokens, req.cache_salt, hashes)
        except IntegrityError as exc:  # verified by the store, refused by the engine: recompute
            logger.warning("checkpoint refused by the engine (%s): recomputing", exc)
            ok = False
        with self.stats_lock:
            self.counters.prefill_store_loads += int(ok)
            self.counters.prefill_store_load_failures += int(not ok)
        return cmd.store_hit if ok else 0

    def _refused(self, exc: IntegrityError) -> None:
        """A store object the loader refused: one whose checksum held but whose keyed tag
        failed is counted apart (written without this deployment's key)."""
        if isinstance(exc, BadObjectError) and exc.forged:
            with self.stats_lock:
                self.counters.store_tag_failures += 1

    def answer(self, req: EngineRequest) -> bool:
        """Make ``req`` (a finished chat's prompt + answer, ``background``) part of the
        cached prefix at low priority (``answers.py``); returns at once."""
        return self.answers.submit(req)

    def _tag_answer(self, req: EngineRequest) -> None:
        """Count the bytes of ``req``'s tail checkpoint export as an answer's."""
        n = len(req.prompt_token_ids)
        pos = checkpoint_position(n, self.engine.unit, self.profile.eagle_drop_prefill)
        if pos > 0:
            self.publisher.tag_answer(req.chain(self.engine.hasher)[pos // self.engine.unit - 1])

    def abort(self, request_id: str) -> bool:
        return self.loop.abort(request_id)

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            if self.index is not None:
                try:
                    self.index.heartbeat(self.name)
                except UnavailableError:
                    logger.debug("heartbeat failed: index unavailable")
            self._stop.wait(1.0)

    # -- introspection -------------------------------------------------------------------
    def load(self) -> dict[str, float]:
        """The load gauges: prompt tokens queued, requests running, free KV blocks."""
        with self.loop.lock:
            st = self.engine.stats()
            queued = self.engine.queued_prompt_tokens()
        return {
            "prefill_queued_tokens": queued,
            "prefill_running_requests": st.num_running,
            "free_kv_blocks": st.num_free_blocks,
        }

    def stats(self) -> dict[str, object]:
        hs = self._handoff_stats()
        led = self.publisher.ledger_stats()
        store_state = {
            "bytes": led.nbytes,
            "objects": led.objects,
            "tokens": led.tokens,
            "budget_bytes": led.budget_bytes,
            "bytes_per_token": led.nbytes / led.tokens if led.tokens else 0.0,
        }
        return {
            **self._base_stats(),
            "handoffs_outstanding": hs.outstanding,
            "handoffs_expired": hs.expired,
            "store_state": store_state,
        }

    def close(self) -> None:
        self._stop.set()
        self.answers.close()
        self.loop.close()
        self.publisher.close()
        self.engine.close()
        if self.store is not None:
            self.store.close()
