"""Prefill actor: loads a hit, computes the rest, exports checkpoints, hands off.

Per request (``prefill``):

1. if the index promised a longer hit in MooncakeStore than the local cache
   has, load it (verified; a stale entry is repaired and we recompute);
2. run the prompt through the engine (batched with concurrent requests);
3. offer the KV + final state + EAGLE hidden to NIXL and return the
   descriptor with the first token.

Checkpoints the engine exported are put in the store by a publisher thread,
then published in the index (never before the put succeeded), together with
this instance's local cache entries. A heartbeat thread reports load. Redis or
store failures degrade to local-only caching; they never fail a request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import KVExport, StateCheckpoint
from hybridpd.engine.factory import make_engine
from hybridpd.engine.vllm.engine import VllmHandoff
from hybridpd.engine.vllm.kv_events import kv_events_endpoint
from hybridpd.errors import UnavailableError
from hybridpd.index.prefix_index import InstanceLoad, PrefixIndex
from hybridpd.store.client import CheckpointStore
from hybridpd.store.loader import fetch_checkpoint
from hybridpd.transfer.nixl_handoff import HandoffServer
from services.worker.base import WorkerBase, ray_metrics, startup_guard
from services.worker.engine_loop import EngineLoop
from services.worker.messages import PrefillCommand, PrefillResult
from services.worker.metrics import PREFILL_COUNTERS, PREFILL_GAUGES, PREFILL_HISTOGRAMS

logger = logging.getLogger(__name__)


def _store_host(cfg: HybridPDConfig) -> str:
    """The address this actor's MooncakeStore client advertises ('auto': its Ray node IP)."""
    if cfg.store_host != "auto":
        return cfg.store_host
    import ray

    return ray.util.get_node_ip_address()


class PrefillWorker(WorkerBase):
    """The actor's body (plain class, so tests can also run it in-process)."""

    def __init__(
        self,
        cfg: HybridPDConfig,
        name: str,
        redis_url: str | None,
        mooncake_master: str | None,
        metadata_url: str | None,
    ) -> None:
        with startup_guard(name):
            self._start(cfg, name, redis_url, mooncake_master, metadata_url)

    def _start(
        self,
        cfg: HybridPDConfig,
        name: str,
        redis_url: str | None,
        mooncake_master: str | None,
        metadata_url: str | None,
    ) -> None:
        self.cfg = cfg
        self.name = name
        events = kv_events_endpoint() if cfg.engine == "vllm" and redis_url else None
        self.engine = make_engine(
            cfg,
            "prefill",
            export_checkpoints=bool(mooncake_master),
            kv_events_endpoint=events,
            store=(mooncake_master, metadata_url) if mooncake_master and metadata_url else None,
        )
        self.index = PrefixIndex(redis_url, self.engine.model_id) if redis_url else None
        self.kv_feed = None
        if events is not None and self.index is not None:  # vLLM: its KV events feed the index
            from hybridpd.engine.vllm.kv_events import KVEventFeed

            self.kv_feed = KVEventFeed(self.index, name, self.engine.hasher)
            self.kv_feed.start(events)
        self.store = (
            CheckpointStore(mooncake_master, metadata_url, self.engine.model_id, local_host=_store_host(cfg))
            if mooncake_master and metadata_url and self.engine.imports_checkpoints  # vLLM: its connector
            else None
        )
        self.handoffs = HandoffServer(
            "%s-%s" % (name, int(time.time() * 1000) % 100000), timeout_s=cfg.handoff_timeout_s
        )
        self.corrupt_next = False
        self.publish_q: queue.Queue[tuple[KVExport, StateCheckpoint]] = queue.Queue()
        self.stats_lock = threading.Lock()
        self.counters = dict.fromkeys(PREFILL_COUNTERS, 0)
        self.loop = EngineLoop(self.engine, after_step=self._collect_exports)
        self._stop = threading.Event()
        threading.Thread(target=self._publisher, name="publisher", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        self.metrics = ray_metrics(name, PREFILL_COUNTERS, PREFILL_GAUGES, PREFILL_HISTOGRAMS)
        if self.metrics is not None:
            self.metrics.run(self._metric_snapshot, self._stop)

    # -- requests ----------------------------------------------------------------------
    def prefill(self, cmd: PrefillCommand) -> PrefillResult:
        t0 = time.perf_counter()
        try:
            with self.engine_errors():
                return self._prefill(cmd)
        finally:
            self._observe("prefill_seconds", time.perf_counter() - t0)

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

    def _metric_snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        with self.stats_lock:
            counters: dict[str, float] = dict(self.counters)
        counters["handoffs_expired"] = self.handoffs.expired
        latencies, self.handoffs.release_latencies = self.handoffs.release_latencies, []
        for s in latencies:
            self._observe("handoff_seconds", s)
        load = self.load()
        gauges: dict[str, float] = {
            "prefill_queued_tokens": load.queued_tokens,
            "prefill_running_requests": load.running_requests,
            "free_kv_blocks": load.free_blocks,
        }
        return counters, gauges

    def _prefill(self, cmd: PrefillCommand) -> PrefillResult:
        req = cmd.request
        loaded = self._maybe_load(cmd)
        q = self.loop.submit(req.request_id, lambda: self.engine.add_request(req, prefill_only=True))
        out = q.get()
        if isinstance(out, BaseException):
            raise out
        with self.loop.lock:
            handoff = self.engine.handoffs.pop(req.request_id, None)
        with self.stats_lock:
            self.counters["prefill_computed_tokens"] += out.num_prompt_tokens - out.num_cached_tokens
            self.counters["prefill_loaded_tokens"] += out.num_cached_tokens
        self._publish_local(req)
        result = PrefillResult(
            request_id=req.request_id,
            instance=self.name,
            first_token_id=out.new_token_ids[0] if out.new_token_ids else None,
            finish_reason=None if out.finish_reason is None else str(out.finish_reason),
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            loaded_from_store=loaded,
        )
        if handoff is None:
            if result.first_token_id is None:  # vLLM finished the prefill without a handoff (failed)
                raise UnavailableError("prefill of %s on %s produced no handoff" % (req.request_id, self.name))
            return result
        if isinstance(handoff, VllmHandoff):  # vLLM's NixlConnector moves the KV itself
            return PrefillResult(**{**_fields(result), "transfer_params": handoff.kv_transfer_params})
        desc = self.handoffs.offer(handoff.buffers(), req.request_id)
        if self.corrupt_next:  # fault injection: flip a byte after the checksum was taken
            self.corrupt_next = False
            with torch.inference_mode():
                handoff.kv.buffers[0].view(-1)[0] += 1.0
        with self.stats_lock:
            self.counters["handoff_offered_bytes"] += desc.nbytes
        return PrefillResult(
            **{
                **_fields(result),
                "descriptor": desc,
                "kv_meta": handoff.kv.meta,
                "state_meta": handoff.state.meta,
                "draft_meta": handoff.draft.meta,
            }
        )

    def _maybe_load(self, cmd: PrefillCommand) -> int:
        """Import the store hit when it beats the local cache. Returns tokens loaded."""
        req = cmd.request
        if self.store is None or cmd.store_hit <= 0 or not self.engine.imports_checkpoints:
            return 0
        u = self.engine.unit
        tokens = list(req.prompt_token_ids)
        with self.loop.lock:
            local = self.engine.local_hit(tokens, req.cache_salt)
        if cmd.store_hit <= local:
            return 0
        # NOTE: under EAGLE our own hit rule drops the last cached block, so load the
        # replay block after the hit too (the lookup promised it is in the store).
        kv_end = min(cmd.store_hit + (u if self.cfg.eagle else 0), len(tokens) // u * u)
        hashes = self.engine.hasher.chain(tokens[:kv_end], cache_salt=req.cache_salt)
        t0 = time.perf_counter()
        try:
            ck = fetch_checkpoint(self.index, self.store, hashes, u, cmd.store_hit)
            self._observe("store_get_seconds", time.perf_counter() - t0)
        except Exception as exc:  # store/index failures of any kind degrade, never fail
            logger.warning("store load failed (%s): recomputing", exc)
            ck = None
        if ck is not None:
            with self.stats_lock:
                self.counters["store_get_bytes"] += sum(
                    b.numel() * b.element_size() for b in ck[0].buffers + ck[1].buffers
                )
        if ck is None:
            with self.stats_lock:
                self.counters["prefill_store_load_failures"] += 1
            return 0
        with self.loop.lock:
            ok = self.engine.import_checkpoint(ck[0], ck[1], tokens, req.cache_salt)
        with self.stats_lock:
            self.counters["prefill_store_loads"] += int(ok)
        return cmd.store_hit if ok else 0

    def abort(self, request_id: str) -> bool:
        return self.loop.abort(request_id)

    def inject_fault(self, kind: str) -> None:
        """Test hook (only reachable when the config enables fault injection)."""
        self._allow_fault(kind, "corrupt_next_handoff")
        self.corrupt_next = True

    # -- publishing ----------------------------------------------------------------------
    def _collect_exports(self) -> None:  # runs in the loop thread, under the engine lock
        for item in self.engine.pop_exports():
            self.publish_q.put(item)

    def _publisher(self) -> None:
        while not self._stop.is_set():
            try:
                kv, st = self.publish_q.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                assert self.store is not None
                res = self.store.put_checkpoint(kv, st, self.engine.unit)
                with self.stats_lock:
                    self.counters["checkpoint_exports"] += 1
                    self.counters["checkpoint_export_bytes"] += res.bytes_written
                self._observe("store_put_seconds", res.seconds)
                if self.index is not None:  # published only after the put succeeded
                    self.index.publish_store(kv.block_hashes, st.key, st.meta.position)
            except Exception as exc:  # store/index failures of any kind degrade, never fail
                with self.stats_lock:
                    self.counters["checkpoint_export_failures"] += 1
                logger.warning("checkpoint at %d not published: %s", st.meta.position, exc)

    def _publish_local(self, req) -> None:
        if self.index is None:
            return
        with self.loop.lock:
            kv, st = self.engine.cached_hashes(list(req.prompt_token_ids), req.cache_salt)
        try:
            self.index.publish_local(self.name, kv, st)
        except UnavailableError:
            logger.debug("index unavailable: local entries not published")

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            if self.index is not None:
                try:
                    self.index.heartbeat(self.name, self.load())
                except UnavailableError:
                    logger.debug("heartbeat failed: index unavailable")
            self._stop.wait(1.0)

    # -- introspection -------------------------------------------------------------------
    def load(self) -> InstanceLoad:
        with self.loop.lock:
            st = self.engine.stats()
            queued = self.engine.queued_prompt_tokens()
        return InstanceLoad(queued_tokens=queued, running_requests=st.num_running, free_blocks=st.num_free_blocks)

    def stats(self) -> dict:
        return {
            **self._base_stats(),
            "handoffs_outstanding": self.handoffs.outstanding(),
            "handoffs_expired": self.handoffs.expired,
        }

    def close(self) -> None:
        self._stop.set()
        if self.kv_feed is not None:
            self.kv_feed.close()
        self.loop.close()
        self.handoffs.close()
        if self.store is not None:
            self.store.close()


def _fields(obj: object) -> dict:
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__}  # type: ignore[attr-defined]
