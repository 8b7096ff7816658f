"""One thread owns an engine and steps it; callers talk to it through queues.

Engines are not thread-safe: every call into the engine happens under
``EngineLoop.lock``, and only the loop thread calls ``step()``. A caller
``submit``s a request and reads its :class:`RequestOutput` objects from the
returned queue; the last one has ``finished`` set. Hooks run in the loop
thread after each step (the prefill actor uses one to hand checkpoint exports
to its publisher).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hybridpd.engine.base import Engine, FinishReason, RequestId, RequestOutput
from hybridpd.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine, after_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.lock = threading.RLock()
        self.queues: dict[str, queue.Queue[RequestOutput | BaseException]] = {}
        #: requests a worker is preparing (``reserved``) -> aborted meanwhile
        self._reserved: dict[str, bool] = {}
        self.after_step = after_step
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @contextmanager
    def reserved(self, request_id: str) -> Iterator[None]:
        """Around the work a worker does for ``request_id`` before ``submit`` (a store
        load, a handoff fetch): an abort arriving meanwhile is remembered, and the
        ``submit`` that follows ends the request at once instead of running it."""
        with self.lock:
            if request_id in self.queues or request_id in self._reserved:
                raise InvalidRequestError("request id %s is already running here" % request_id)
            self._reserved[request_id] = False
        try:
            yield
        finally:
            with self.lock:
                self._reserved.pop(request_id, None)

    def submit(self, request_id: str, add: Callable[[], None]) -> queue.Queue[RequestOutput | BaseException]:
        """Run ``add()`` (which adds ``request_id`` to the engine) and return its output
        queue. A request id already running is refused (its reader keeps its queue);
        one aborted while reserved gets a final ABORT output without being added."""
        q: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        with self.lock:
            if request_id in self.queues:
                raise InvalidRequestError("request id %s is already running here" % request_id)
            if self._reserved.pop(request_id, False):
                # NOTE: what the preparation holds in the engine goes too (a delta handoff's pinned
                # blocks, pinned after the abort arrived); for an id it does not know, a no-op
                self.engine.abort(request_id)
                q.put(RequestOutput(RequestId(request_id), (), True, FinishReason.ABORT))
                return q
            self.queues[request_id] = q
            try:
                add()
            except BaseException:
                self.queues.pop(request_id, None)
                raise
        self._wake.set()
        return q

    def abort(self, request_id: str) -> bool:
        """Abort ``request_id`` in the engine; its reader gets a final ABORT output now
        (an engine need not emit one: vLLM's abort does not), so no reader waits on it.
        A request still reserved (not submitted yet) is marked, and ends at its submit."""
        with self.lock:
            found = self.engine.abort(request_id)
            q = self.queues.pop(request_id, None)
            if request_id in self._reserved:
                self._reserved[request_id] = True
                found = True
        if q is not None:
            q.put(RequestOutput(RequestId(request_id), (), True, FinishReason.ABORT))
        self._wake.set()
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                busy = self.engine.has_work()
            if not busy:
                # NOTE: submit() and abort() set _wake, and has_work() is checked again after the
                # clear: no wake-up is lost, so an idle loop sleeps (1 s is only a safety net)
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                with self.lock:
                    outputs = self.engine.step()
                    if self.after_step is not None:
                        self.after_step()
            except Exception as exc:  # a broken step fails its requests, never the loop
                logger.exception("engine step failed")
                with self.lock:
                    for rid, q in list(self.queues.items()):
                        q.put(exc)
                        self.engine.abort(rid)
                    self.queues.clear()
                continue
            for out in outputs:
                target = self.queues.get(out.request_id)
                if target is None:
                    continue
                target.put(out)
                if out.finished:
                    self.queues.pop(out.request_id, None)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)
