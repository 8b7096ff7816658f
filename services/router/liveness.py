"""Which instances serve: a ping to every instance, the kinds none of whose
instances answers (the router's readiness), and the instances that drain,
which routing leaves out while another serves.
"""

from __future__ import annotations

import asyncio
import time

from services.worker.api import DecodeClient, PrefillClient, WorkerClient

#: an instance that does not answer a ping within this long is not live (``Liveness.unserved``)
PING_TIMEOUT_S = 2.0
#: how long the answer of the last pings is reused
LIVE_TTL_S = 1.0


class Liveness:
    """The last pings' answer for one router (event-loop confined). ``prefill`` and
    ``decode`` (name -> client) are the caller's collections, shared, not copied."""

    def __init__(self, prefill: dict[str, PrefillClient], decode: dict[str, DecodeClient]) -> None:
        self.prefill = prefill
        self.decode = decode
        #: instances the last pings found draining (``WorkerBase.drain``)
        self.draining: set[str] = set()
        #: the last pings' answer (monotonic time, the kinds with no live instance), the pings under way
        self._live: tuple[float, list[str]] | None = None
        self._live_check: asyncio.Future[list[str]] | None = None

    async def unserved(self) -> list[str]:
        """The kinds of instance ("prefill", "decode") of which none answered a ping
        within ``PING_TIMEOUT_S`` (a dead, restarting or hung actor does not): what
        keeps this router from serving. Asked at most once per ``LIVE_TTL_S``; callers
        meanwhile share the last answer, or the check under way."""
        if self._live is None or time.monotonic() - self._live[0] >= LIVE_TTL_S:
            if self._live_check is None or self._live_check.done():
                self._live_check = asyncio.ensure_future(self._ping_all(PING_TIMEOUT_S))
            self._live = (time.monotonic(), await asyncio.shield(self._live_check))
        return self._live[1]

    async def _ping_all(self, timeout_s: float) -> list[str]:
        async def live(client: WorkerClient) -> bool | None:
            try:
                return await asyncio.wait_for(client.serving(), timeout_s)
            except Exception:  # dead (Ray's error), restarting or hung (the timeout): not live
                return None

        kinds = (("prefill", list(self.prefill.values())), ("decode", list(self.decode.values())))
        clients = [c for _, cs in kinds for c in cs]
        got = dict(zip((c.name for c in clients), await asyncio.gather(*(live(c) for c in clients)), strict=True))
        #: instances that answered but drain: routing leaves them out while another serves
        self.draining = {name for name, ok in got.items() if ok is False}
        return [kind for kind, cs in kinds if not any(got[c.name] for c in cs)]

    def routable(self, names: list[str]) -> list[str]:
        """``names`` without the instances the last pings found draining (all of them
        when every one drains: a draining instance refuses, which is an honest 503)."""
        return [n for n in names if n not in self.draining] or names
