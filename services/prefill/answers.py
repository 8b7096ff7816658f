"""Answer checkpoints, prefill side: prompt + answer through the
ordinary chunked prefill, at low priority, after the stream ended.

The router sends a finished chat request's prompt + generated ids here, to
the instance that prefilled the prompt (its local cache holds the prompt's
checkpoint, so only the answer is computed). Each runs as a background
request (``EngineRequest.background``: the scheduler gives it only the step
budget other requests leave and never admits it while another waits) that
samples one token and finishes, so the engine caches its full blocks, saves
and exports the checkpoint at the last unit boundary of prompt + answer, and
the publisher puts them in the index and the store like any prefill's.

Why a prefill and not decode's own state: decode-written KV and state differ
from the chunked prefill's in their last bits (other kernels, other
reduction order), and a hit must restore exactly what a one-shot prefill of
the same tokens computes (fp32 native: the same arithmetic; the e2e test
compares the next turn's greedy tokens with a no-cache run). Recomputing the answer
is a prefill of answer-length tokens at a time the instance has nothing
better to do.

One thread takes them in order, at most ``MAX_QUEUED`` waiting (past that the
oldest is dropped and counted): a flood of answers never occupies the actor's
request threads or grows without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from hybridpd.engine.base import Engine, EngineRequest
from services.worker.engine_loop import EngineLoop
from services.worker.metrics import PrefillCounters

logger = logging.getLogger(__name__)

#: answers waiting on one instance; past that the oldest are dropped
MAX_QUEUED = 256
#: how long one answer prefill may take before it is abandoned
ANSWER_TIMEOUT_S = 600.0


class AnswerCheckpoints:
    def __init__(
        self,
        engine: Engine,
        loop: EngineLoop,
        flush: Callable[[float], bool],
        counters: PrefillCounters,
        counters_lock: threading.Lock,
        observe: Callable[[str, float], None],
        tag: Callable[[EngineRequest], None] = lambda req: None,
        max_recompute: int = 2048,
    ) -> None:
        """``flush(timeout)`` waits until the engine's cache events are in the index;
        ``counters`` are the worker's (written under ``counters_lock``); ``observe(histogram, s)``;
        ``tag(req)`` marks the checkpoint ``req`` will export as an answer's;
        ``max_recompute``: skip an answer whose prefill would compute more (its
        prompt's checkpoint is gone here)."""
        self.engine, self.loop, self.flush, self.observe = engine, loop, flush, observe
        self.counters, self.counters_lock = counters, counters_lock
        self.tag = tag
        #: an answer whose prefill would compute more tokens than this is skipped
        self.max_recompute = max_recompute
        self._queue: deque[tuple[EngineRequest, float]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="answer-checkpoints", daemon=True)
        self._thread.start()

    def submit(self, req: EngineRequest) -> bool:
        """Queue ``req`` (a background request; False, counted as skipped, for any
        other). Either engine runs it at low priority: the native scheduler on the
        budget others leave, vLLM only while no foreground request is live
        (``engine/vllm/sequencer.py``)."""
        if not req.background:
            with self.counters_lock:
                self.counters.answer_checkpoints_skipped += 1
            return False
        with self._cond:
            self._queue.append((req, time.perf_counter()))
            dropped = len(self._queue) - MAX_QUEUED
            for _ in range(max(dropped, 0)):
                self._queue.popleft()
            self._cond.notify()
        if dropped > 0:
            with self.counters_lock:
                self.counters.answer_checkpoints_dropped += dropped
        return True

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._stop)
                if self._stop:
                    return
                req, t0 = self._queue.popleft()
            try:
                self._one(req, t0)
            except Exception:  # a failed answer checkpoint costs a later hit, never a request
                logger.exception("answer checkpoint of %s failed", req.request_id)
                with self.counters_lock:
                    self.counters.answer_checkpoints_failed += 1

    def _one(self, req: EngineRequest, t0: float) -> None:
        # the router's chain covers the prompt: hash the answer's blocks once, here
        req = replace(req, block_hashes=tuple(req.chain(self.engine.hasher)))
        with self.loop.lock:
            hit = self.engine.local_hit(list(req.prompt_token_ids), req.cache_salt, req.block_hashes)
        if len(req.prompt_token_ids) - hit > self.max_recompute:
            # the prompt's checkpoint is gone here: recomputing a long conversation is not worth it
            with self.counters_lock:
                self.counters.answer_checkpoints_skipped += 1
            return
        self.tag(req)
        q = self.loop.submit(req.request_id, lambda: self.engine.add_request(req, prefill_only=False))
        while True:
            try:
                out = q.get(timeout=ANSWER_TIMEOUT_S)
            except queue.Empty:
                self.loop.abort(req.request_id)
                raise TimeoutError("answer prefill did not finish in %.0f s" % ANSWER_TIMEOUT_S) from None
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                break
        self.flush(0.25)
        with self.counters_lock:
            self.counters.answer_checkpoints += 1
            self.counters.answer_checkpoint_tokens += out.num_prompt_tokens - out.num_cached_tokens
        self.observe("answer_publish_seconds", time.perf_counter() - t0)
        logger.debug(
            "answer checkpoint %s: %d tokens, %d cached", req.request_id, out.num_prompt_tokens, out.num_cached_tokens
        )

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(5)
