"""What hybridpd's vLLM scheduler decides before each step: ``Sequencer``, with the
``Tag`` a request carries to it and the ``Ledger`` it keeps for the engine.

The scheduler is vLLM's own, subclassed through vLLM's ``scheduler_cls`` extension
point (``adapter.scheduler_class``); the decisions are made here, on vLLM's
``Request`` objects read through a few attributes (no vLLM import). The engine
hands vLLM each request once (``VllmEngine.add_request``): a prompt's checkpoint
prefixes and the prompt, a background request, each tagged in its sampling's
``extra_args`` (:data:`TAG`). Before each step the scheduler:

* **runs a prompt's checkpoint prefixes one after another, then the prompt.** A
  request tagged ``after`` a prefix stays out of vLLM's queues until that prefix
  is done: its chunk up to its last token ran (vLLM wrote and keyed the state at
  its checkpoint when it ran that chunk) or it finished. A prefix done before its
  sampled token is finished there (``released``: one step per prefix, not two).
  Either way the ledger records it with the tokens vLLM found cached for it (the
  engine's hit and written-checkpoint bookkeeping: ``stages.py``);
* **keeps background requests from delaying foreground work.** A background
  request (an answer checkpoint, a P/D prompt's tail stage) waits out of vLLM's
  queues while any other request is in them, or while a handed-off prefill's KV
  awaits decode's read (at most :data:`SEND_HOLD_S` after the handoff: NIXL
  progresses only when this engine steps, so a background chunk would hold the
  read). Otherwise one runs at a time. One that foreground work meets in vLLM's
  queues is taken out again, a running one by vLLM's own preemption (its blocks
  freed, its full blocks left in the prefix cache to resume from), and waits at
  the head of the line.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

#: the key of our tag in a vLLM request's ``SamplingParams.extra_args``
TAG = "hybridpd"
#: a background request waits this long after a P/D handoff while its KV awaits decode's read
SEND_HOLD_S = 1.0


@dataclass(frozen=True, slots=True)
class Tag:
    """What the engine tells its scheduler of one request."""

    #: vLLM's id of the checkpoint prefix this request waits for
    after: str | None = None
    #: a checkpoint prefix: done once its chunk up to its last token ran
    prefix: bool = False
    #: a background request
    background: bool = False

    def extra_args(self) -> dict[str, Any]:
        return {TAG: {"after": self.after, "prefix": self.prefix, "background": self.background}}

    @staticmethod
    def of(extra_args: Mapping[str, Any] | None) -> Tag | None:
        """The tag in a request's ``extra_args`` (None: untagged, vLLM schedules it as it is)."""
        raw = extra_args.get(TAG) if extra_args else None
        if raw is None:
            return None
        return Tag(raw["after"], bool(raw["prefix"]), bool(raw["background"]))


@dataclass(frozen=True, slots=True)
class PrefixDone:
    """A checkpoint prefix vLLM ran up to its checkpoint."""

    vllm_id: str
    #: the tokens vLLM found cached for it
    cached: int
    #: finished by the scheduler before its sampled token (else it finished itself)
    released: bool


@dataclass(slots=True)
class Ledger:
    """What the engine and its scheduler tell each other (one process, one thread)."""

    #: when the newest P/D prefill was handed off here (the engine sets it)
    handed_at: float = -math.inf
    #: prefixes done since the engine last looked (``pop_done``)
    done: list[PrefixDone] = field(default_factory=list)
    #: background requests handed to vLLM's queues, and those taken out again for foreground work
    background_runs: int = 0
    background_preempted: int = 0

    def pop_done(self) -> list[PrefixDone]:
        done, self.done = self.done, []
        return done


class Queues(Protocol):
    """What the scheduler subclass does for the sequencer, in vLLM's terms."""

    def queue(self, request: Any) -> None:
        """Into vLLM's waiting queue (a new request, or one taken out before)."""

    def release(self, request: Any) -> None:
        """Finish a checkpoint prefix (aborted: its sampled token is not wanted)."""

    def take_out(self, request: Any) -> bool:
        """Out of vLLM's queues (a running one preempted); whether it was running."""

    def queued(self) -> Iterable[Any]:
        """The requests in vLLM's queues, running and waiting."""

    def sending(self) -> bool:
        """Whether finished requests' KV still waits for a connector's send."""


@dataclass(slots=True)
class Sequencer:
    """The requests one scheduler holds back, and why."""

    ledger: Ledger
    #: checkpoint prefixes in vLLM's queues, by vLLM id
    prefixes: dict[str, Any] = field(default_factory=dict)
    #: what vLLM found cached for each prefix it scheduled
    cached: dict[str, int] = field(default_factory=dict)
    #: prefix vLLM id -> the request held until that prefix is done
    behind: dict[str, Any] = field(default_factory=dict)
    #: background requests out of vLLM's queues, in the order they run
    held: deque[Any] = field(default_factory=deque)
    #: background requests in vLLM's queues (at most one), by vLLM id
    admitted: dict[str, Any] = field(default_factory=dict)

    def arrive(self, request: Any, tag: Tag | None) -> bool:
        """A request reached the scheduler: True where vLLM queues it now."""
        if tag is None:
            return True
        if tag.background:
            self.held.append(request)
            return False
        if tag.prefix:
            self.prefixes[request.request_id] = request
        if tag.after is not None and tag.after in self.prefixes:
            self.behind[tag.after] = request
            return False
        return True

    def held_count(self) -> int:
        return len(self.behind) + len(self.held)

    def forget(self, ids: Iterable[str] | None) -> None:
        """Requests finished from outside (aborted), or every request (None)."""
        if ids is None:
            for part in (self.prefixes, self.cached, self.behind, self.held, self.admitted):
                part.clear()
            return
        gone = set(ids)
        for rid in gone:
            self.prefixes.pop(rid, None)
            self.cached.pop(rid, None)
            self.admitted.pop(rid, None)
        self.behind = {k: r for k, r in self.behind.items() if r.request_id not in gone}
        self.held = deque(r for r in self.held if r.request_id not in gone)

    def before_step(self, queues: Queues, now: float) -> None:
        """Let through what may run this step (module docstring)."""
        for rid, request in list(self.prefixes.items()):
            finished = request.is_finished()
            ran = (
                rid in self.cached
                and request.num_in_flight_tokens == 0
                and request.num_computed_tokens >= request.num_prompt_tokens - 1
            )
            if not (finished or ran):
                continue
            if not finished:
                queues.release(request)
            del self.prefixes[rid]
            self.ledger.done.append(PrefixDone(rid, self.cached.pop(rid, 0), released=not finished))
        for rid in [k for k in self.behind if k not in self.prefixes]:  # its prefix is done (or gone)
            queues.queue(self.behind.pop(rid))
        self._background(queues, now)

    def _background(self, queues: Queues, now: float) -> None:
        for rid, request in list(self.admitted.items()):
            if request.is_finished():
                del self.admitted[rid]
        if not self.held and not self.admitted:
            return
        foreground = any(r.request_id not in self.admitted for r in queues.queued()) or (
            now - self.ledger.handed_at < SEND_HOLD_S and queues.sending()
        )
        if foreground:
            for rid, request in list(self.admitted.items()):
                del self.admitted[rid]
                if queues.take_out(request):
                    self.ledger.background_preempted += 1
                self.held.appendleft(request)
        elif not self.admitted and self.held:
            request = self.held.popleft()
            self.admitted[request.request_id] = request
            self.ledger.background_runs += 1
            queues.queue(request)

    def after_schedule(self) -> None:
        """Note what vLLM found cached for the prefixes it scheduled this step."""
        for rid, request in self.prefixes.items():
            stats = request.prefill_stats  # set when vLLM first schedules it, taken by its first output
            if rid not in self.cached and request.num_computed_tokens > 0 and stats is not None:
                self.cached[rid] = int(stats.num_cached_tokens)
