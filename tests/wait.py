"""The one way tests wait for something asynchronous: poll a condition with a
deadline, never a fixed sleep in front of an assertion.

A sleep that is part of a scenario (a client's think time, a lease left to
expire on purpose) is not a wait for a condition and stays a sleep, with a
comment saying so."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Pending:
    """A falsy answer that carries what was seen: a predicate returns it to keep
    polling, and a timeout's message shows it."""

    def __init__(self, seen: object) -> None:
        self.seen = seen

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "Pending(%r)" % (self.seen,)


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    interval_s: float = 0.05,
    what: str = "the condition",
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` every ``interval_s`` seconds until it returns a truthy
    value, and return that value. An exception of a type in ``retry_on`` (a server
    not answering yet) counts as a falsy answer; any other propagates at once.
    After ``timeout_s`` raise AssertionError naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        last: object
        try:
            value = predicate()
        except retry_on as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError("timed out after %.1f s waiting for %s (last: %r)" % (timeout_s, what, last))
        time.sleep(interval_s)
