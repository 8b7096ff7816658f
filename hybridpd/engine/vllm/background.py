"""Background requests on vLLM (answer checkpoints, a P/D prompt's tail stage): ``BackgroundQueue``.

A background request (``EngineRequest.background``: a finished chat's prompt +
answer, prefilled so that the next turn hits it) must never delay foreground
work. vLLM 0.32 cannot promise that by itself: its FCFS scheduler lets a
running prefill keep its chunk every step, and priority scheduling only orders
the waiting queue. So the engine holds background requests here and hands
vLLM one only while no foreground request is live on the engine; when a
foreground request arrives, the running background one is aborted in vLLM and
put back at the head of the queue (``preempted``). It runs again from what
vLLM cached meanwhile (its full blocks). Each try runs under its own vLLM
request id (``<id>::bg<n>``), so nothing of an aborted try is mistaken for
the next one. A try samples plainly (one greedy token no one reads:
``sampling.py``), whatever its request's sampling says.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from hybridpd.engine.base import EngineRequest, RequestId

#: a background try's vLLM request id is the request's id plus this and a counter
TRY_SEPARATOR = "::bg"


@dataclass(slots=True)
class BackgroundQueue:
    """Background requests not yet in vLLM, and the one vLLM runs (at most one)."""

    queued: deque[EngineRequest] = field(default_factory=deque)
    #: request id -> what was cached for it when it arrived (the hit it reports)
    arrival_hits: dict[str, int] = field(default_factory=dict)
    #: the try vLLM runs: (its vLLM request id, the request)
    running: tuple[str, EngineRequest] | None = None
    tries: int = 0
    #: tries aborted for foreground work
    preempted: int = 0

    def add(self, request: EngineRequest, hit: int) -> None:
        """Queue ``request``, for which ``hit`` tokens are cached now."""
        self.queued.append(request)
        self.arrival_hits[request.request_id] = hit

    def reported_hit(self, request_id: str, cached: int, finished: bool) -> int:
        """The hit to report: at most what was cached when the request arrived (a
        later try also finds what an aborted one computed); ``finished``: forget it."""
        hit = self.arrival_hits.pop(request_id, cached) if finished else self.arrival_hits.get(request_id, cached)
        return min(hit, cached)

    def admit(self, foreground_live: bool) -> EngineRequest | None:
        """The next try to hand vLLM (its id a try id), or None: one runs already,
        none waits, or foreground work is live."""
        if foreground_live or self.running is not None or not self.queued:
            return None
        request = self.queued.popleft()
        self.tries += 1
        rid = "%s%s%d" % (request.request_id, TRY_SEPARATOR, self.tries)
        self.running = (rid, request)
        return replace(request, request_id=RequestId(rid))

    def owner(self, vllm_id: str) -> str | None:
        """Our request id for vLLM's ``vllm_id`` when it is the running try."""
        if self.running is not None and self.running[0] == vllm_id:
            return self.running[1].request_id
        return None

    def finished(self) -> None:
        self.running = None

    def forget(self, request_id: str) -> None:
        """A request the engine queued for itself (no one reads its output) finished."""
        self.arrival_hits.pop(request_id, None)

    def preempt(self) -> str | None:
        """Foreground work arrived: returns the running try's vLLM id to abort (the
        request goes back to the head of the queue), or None."""
        if self.running is None:
            return None
        rid, request = self.running
        self.running = None
        self.queued.appendleft(request)
        self.preempted += 1
        return rid

    def drop(self, request_id: str) -> str | None:
        """Forget ``request_id``; returns its running try's vLLM id to abort, if any."""
        self.queued = deque(r for r in self.queued if r.request_id != request_id)
        self.arrival_hits.pop(request_id, None)
        if self.running is not None and self.running[1].request_id == request_id:
            rid, self.running = self.running[0], None
            return rid
        return None

    def __len__(self) -> int:
        return len(self.queued) + (self.running is not None)
