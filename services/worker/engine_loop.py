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
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hybridpd.engine.base import Engine, FinishReason, RequestId, RequestOutput
from hybridpd.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class EngineLoop:
    #: how long, and how many, aborts of ids not here yet are remembered (``abort``)
    EARLY_ABORT_S = 60.0
    MAX_REMEMBERED = 4096

    def __init__(self, engine: Engine, after_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.lock = threading.RLock()
        self.queues: dict[str, queue.Queue[RequestOutput | BaseException]] = {}
        #: requests a worker is preparing (``reserved``) -> aborted meanwhile
        self._reserved: dict[str, bool] = {}
        #: aborts that came before their request: id -> when (``reserved`` consumes them).
        #: A threaded actor does not run its calls in order: the router's abort can run
        #: before the generate (or prefill) sent ahead of it
        self._early: OrderedDict[str, float] = OrderedDict()
        #: ids ``reserved`` here lately: an abort of one of them is late, not early
        self._seen: OrderedDict[str, None] = OrderedDict()
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
            self._reserved[request_id] = self._early.pop(request_id, None) is not None
            self._seen[request_id] = None
            self._seen.move_to_end(request_id)
            while len(self._seen) > self.MAX_REMEMBERED:
                self._seen.popitem(last=False)
        try:
            yield
        finally:
            with self.lock:
                self._reserved.pop(request_id, None)

    def in_flight(self) -> int:
        """Requests here now: submitted and not finished, or being prepared (``reserved``)."""
        with self.lock:
            return len(self.queues) + len(self._reserved)

    def aborted(self, request_id: str) -> bool:
        """Whether reserved ``request_id`` was aborted already (before it got here, or
        since): its worker should take nothing more for it (its ``submit`` ends it)."""
        with self.lock:
            return self._reserved.get(request_id, False)

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
        A request still reserved (not submitted yet) is marked, and ends at its submit;
        one not here yet (nor lately) is remembered, and its ``reserved`` marks it."""
        with self.lock:
            found = self.engine.abort(request_id)
            q = self.queues.pop(request_id, None)
            if request_id in self._reserved:
                self._reserved[request_id] = True
                found = True
            elif not found and q is None and request_id not in self._seen:
                now = time.monotonic()
                self._early[request_id] = now
                self._early.move_to_end(request_id)
                stale = now - self.EARLY_ABORT_S
                while len(self._early) > self.MAX_REMEMBERED or next(iter(self._early.values())) < stale:
                    self._early.popitem(last=False)
        if q is not None:
            q.put(RequestOutput(RequestId(request_id), (), True, FinishReason.ABORT))
        self._wake.set()
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                busy = self.engine.has_work()
                pause = self.engine.idle_poll_s() if busy else 0.0
            if pause > 0 and self._wake.wait(pause):
                # NOTE: only bookkeeping was left (vLLM's connector): waited out here, not under the
                # lock inside step(), so a submit or an abort is not held up. One of them (or close)
                # ended the wait early: look again before stepping
                self._wake.clear()
                continue
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
