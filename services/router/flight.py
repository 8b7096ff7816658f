"""Which actors hold a request's work now: what an abort must reach
(``Dispatcher`` holds and drops them as it calls them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.api import WorkerClient


@dataclass(slots=True)
class Flight:
    """The actors that hold a request's work now: what an abort must reach.
    An actor is held from the call that sends it work; a call that fails drops
    it again (the actor is gone, or it ended the request itself)."""

    request_id: str
    actors: list[WorkerClient] = field(default_factory=list)

    def hold(self, actor: WorkerClient) -> None:
        if all(a is not actor for a in self.actors):
            self.actors.append(actor)

    def drop(self, actor: WorkerClient) -> None:
        self.actors = [a for a in self.actors if a is not actor]

    def abort(self) -> None:
        """Ask every holder to free the request (fire and forget)."""
        for actor in self.actors:
            actor.abort(self.request_id)
