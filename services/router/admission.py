"""Admission: the checks a request passes before the router does any work for it.

    validate (hybridpd/validation.py, shared with the engines)
      -> in-flight limit (max_inflight_requests: OverloadedError, 429)
      -> a Deadline (request_timeout_s from arrival: DeadlineError, 504)

Lifecycle: :meth:`Admission.admit` either raises (nothing held) or counts the
request in flight and returns its :class:`Deadline`; the caller must call
:meth:`Admission.release` exactly once afterwards (in a ``finally``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from hybridpd.engine.base import EngineRequest
from hybridpd.errors import DeadlineError, OverloadedError
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


class Admission:
    """Validation and the in-flight limit of one router (event-loop confined)."""

    def __init__(self, vocab_size: int, max_model_len: int, max_inflight: int, timeout_s: float) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.inflight = 0

    def admit(self, req: EngineRequest) -> Deadline:
        """Validate ``req`` and count it in flight; raises InvalidRequestError or
        OverloadedError (then nothing is counted)."""
        validate_request(req, self.vocab_size, self.max_model_len)
        if self.inflight >= self.max_inflight:
            raise OverloadedError("too many requests in flight (%d)" % self.inflight, retry_after_s=1.0)
        self.inflight += 1
        return Deadline(time.perf_counter(), self.timeout_s)

    def release(self) -> None:
        """An admitted request ended, whichever way."""
        self.inflight -= 1
