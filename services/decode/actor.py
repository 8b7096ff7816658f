"""Decode actor: pulls a handoff over NIXL, decodes (EAGLE), streams tokens.

``generate`` is a generator: the actor yields :class:`TokenChunk` objects as
the engine produces them (a Ray streaming generator), the last one with
``finished`` set. ``abort`` (or the caller dropping the stream) frees the
request's blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import DraftState, Handoff, KVExport, StateCheckpoint
from hybridpd.engine.factory import make_engine
from hybridpd.engine.vllm.engine import VllmHandoff
from hybridpd.errors import IntegrityError
from hybridpd.transfer.nixl_handoff import HandoffClient
from services.worker.base import WorkerBase, ray_metrics, startup_guard
from services.worker.engine_loop import EngineLoop
from services.worker.messages import PrefillResult, TokenChunk
from services.worker.metrics import DECODE_COUNTERS, DECODE_GAUGES, DECODE_HISTOGRAMS

logger = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    def __init__(self, cfg: HybridPDConfig, name: str) -> None:
        with startup_guard(name):
            self._start(cfg, name)

    def _start(self, cfg: HybridPDConfig, name: str) -> None:
        self.cfg = cfg
        self.name = name
        self.engine = make_engine(cfg, "decode")
        self.client = HandoffClient("%s-%d" % (name, int(time.time() * 1000) % 100000))
        self.client_lock = threading.Lock()
        self.loop = EngineLoop(self.engine)
        self.stats_lock = threading.Lock()
        self.counters: dict[str, float] = {
            "handoffs": 0,
            "nixl_read_bytes": 0,
            "checksum_failures": 0,
            "decode_tokens": 0,
        }
        self.delay_next_read = False
        self._stop = threading.Event()
        self.metrics = ray_metrics(name, DECODE_COUNTERS, DECODE_GAUGES, DECODE_HISTOGRAMS)
        if self.metrics is not None:
            self.metrics.run(self._metric_snapshot, self._stop)

    def inject_fault(self, kind: str) -> None:
        """Test hook (only reachable when the config enables fault injection)."""
        self._allow_fault(kind, "delay_next_handoff_read")
        self.delay_next_read = True

    def _pull(self, prefill, request) -> Handoff:
        desc = prefill.descriptor
        if self.delay_next_read:  # fault injection: arrive after prefill's handoff timeout
            self.delay_next_read = False
            time.sleep(max(0.0, desc.expires_at - time.time()) + 0.5)
        t0 = time.perf_counter()
        try:
            with self.client_lock:
                bufs = self.client.fetch(desc, device=self.cfg.device)
        except IntegrityError:
            with self.stats_lock:
                self.counters["checksum_failures"] += 1
            raise
        with self.stats_lock:
            self.counters["handoffs"] += 1
            self.counters["nixl_read_bytes"] += desc.nbytes
        if self.metrics is not None:
            self.metrics.observe("nixl_read_seconds", time.perf_counter() - t0)
        n_kv = len(prefill.kv_meta.shapes)
        n_st = len(prefill.state_meta.shapes)
        return Handoff(
            request=request,
            first_token_id=prefill.first_token_id,
            num_cached_tokens=prefill.num_cached_tokens,
            kv=KVExport(prefill.kv_meta, tuple(bufs[:n_kv])),
            state=StateCheckpoint(prefill.state_meta, None, tuple(bufs[n_kv : n_kv + n_st])),
            draft=DraftState(prefill.draft_meta, tuple(bufs[n_kv + n_st :])),
        )

    def generate(self, prefill: PrefillResult, request) -> Iterator[TokenChunk]:
        """Continue ``request`` from its prefill; yields chunks until finished."""
        with self.engine_errors():
            yield from self._generate(prefill, request)

    def _generate(self, prefill: PrefillResult, request) -> Iterator[TokenChunk]:
        handoff: Handoff | VllmHandoff
        if prefill.transfer_params is not None:  # vLLM: its NixlConnector pulls the KV
            handoff = VllmHandoff(request, None, prefill.num_cached_tokens, prefill.transfer_params)
            with self.stats_lock:
                self.counters["handoffs"] += 1
        else:
            handoff = self._pull(prefill, request)
        q = self.loop.submit(request.request_id, lambda: self.engine.add_handoff(handoff))
        try:
            while True:
                chunk = _next_chunk(q, request.request_id)
                with self.stats_lock:
                    self.counters["decode_tokens"] += len(chunk.token_ids)
                yield chunk
                if chunk.finished:
                    return
        finally:
            # a consumer that went away (client disconnect) ends up here too
            self.loop.abort(request.request_id)

    def abort(self, request_id: str) -> bool:
        return self.loop.abort(request_id)

    def _metric_snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        with self.loop.lock:
            pool = self.engine.stats()
            spec = self.engine.spec
            steps, emitted, recent = spec.steps, spec.emitted, spec.drain()
        if self.metrics is not None:
            for n in recent:
                self.metrics.observe("eagle_acceptance_length", n)
        with self.stats_lock:
            counters = dict(self.counters)
        counters.update(eagle_steps=steps, eagle_emitted_tokens=emitted)
        return counters, {"decode_running_requests": pool.num_running, "free_kv_blocks": pool.num_free_blocks}

    def stats(self) -> dict:
        with self.loop.lock:
            acc = self.engine.spec.mean_acceptance_length
        return {**self._base_stats(), "eagle_mean_acceptance_length": acc}

    def close(self) -> None:
        self._stop.set()
        self.loop.close()
        self.client.close()


def _next_chunk(q: queue.Queue, request_id: str, stall_s: float = 600.0) -> TokenChunk:
    """Block for the next engine output of ``request_id``, then merge every
    output already waiting behind it into one chunk: when the engine produces
    tokens faster than the router reads the stream (the router bounds how far
    the generator may run ahead), they cross Ray as one object, not one each."""
    try:
        outs = [q.get(timeout=stall_s)]
    except queue.Empty:
        raise TimeoutError("decode of %s stalled" % request_id) from None
    while not (isinstance(outs[-1], BaseException) or outs[-1].finished):
        try:
            outs.append(q.get_nowait())
        except queue.Empty:
            break
    if isinstance(outs[-1], BaseException):
        raise outs[-1]
    last = outs[-1]
    tokens = tuple(t for o in outs for t in o.new_token_ids)
    return TokenChunk(tokens, last.finished, None if last.finish_reason is None else str(last.finish_reason))
