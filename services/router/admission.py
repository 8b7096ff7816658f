"""Admission: the checks a request passes before the router does any work for it.

    draining (``drain``: DrainingError, 503 with Retry-After)
    in-flight limit (max_inflight_requests: OverloadedError, 429), counted in
      choices: an API request holds one slot per choice, taken before it is
      tokenized (``choices.run_request``)
      -> a Deadline (request_timeout_s from arrival: DeadlineError, 504)
    validate (hybridpd/validation.py, shared with the engines), once built

Lifecycle: :meth:`Admission.enter` either raises (nothing held) or counts the
slots in flight and returns their :class:`Ticket`; its holder must call
:meth:`Admission.release` afterwards (in a ``finally``; a second call does
nothing). :meth:`Admission.admit` validates and enters one slot, for a request
that was built without a ticket.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from hybridpd.engine.base import EngineRequest
from hybridpd.errors import DeadlineError, DrainingError, OverloadedError
from hybridpd.validation import validate_request

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Deadline:
    """A request's arrival time and how long it may take in all."""

    t_arrive: float
    timeout_s: float

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_arrive

    async def within(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` within what is left of the deadline; past it the
        await is cancelled and DeadlineError raised."""
        left = self.timeout_s - self.elapsed()
        try:
            return await asyncio.wait_for(awaitable, timeout=max(left, 0.001))
        except TimeoutError:
            raise DeadlineError("request exceeded its %.0fs deadline" % self.timeout_s) from None


@dataclass(slots=True)
class Ticket:
    """The in-flight slots one request holds, from admission to its end."""

    slots: int
    deadline: Deadline
    released: bool = False


class Admission:
    """Validation and the in-flight limit of one router (event-loop confined)."""

    def __init__(self, vocab_size: int, max_model_len: int, max_inflight: int, timeout_s: float) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.inflight = 0
        #: set for good by ``drain``: nothing new is admitted
        self.draining = False

    def enter(self, slots: int = 1) -> Ticket:
        """Count ``slots`` (a request's choices) in flight, before any work is done for
        them; OverloadedError (nothing counted) past ``max_inflight``, DrainingError
        once draining."""
        if self.draining:
            raise DrainingError("this router is shutting down: it admits no new request; retry", retry_after_s=1.0)
        if self.inflight + slots > self.max_inflight:
            raise OverloadedError("too many requests in flight (%d)" % self.inflight, retry_after_s=1.0)
        self.inflight += slots
        return Ticket(slots, Deadline(time.perf_counter(), self.timeout_s))

    def validate(self, req: EngineRequest) -> None:
        """InvalidRequestError unless the model can serve ``req`` (``validation.py``)."""
        validate_request(req, self.vocab_size, self.max_model_len)

    def admit(self, req: EngineRequest) -> Ticket:
        """Validate ``req`` and count it in flight (one slot); raises InvalidRequestError
        or OverloadedError (then nothing is counted)."""
        self.validate(req)
        return self.enter(1)

    def release(self, ticket: Ticket) -> None:
        """The request holding ``ticket`` ended, whichever way (once; again: nothing)."""
        if not ticket.released:
            ticket.released = True
            self.inflight -= ticket.slots
