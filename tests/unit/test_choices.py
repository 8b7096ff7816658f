"""``services/router/choices.py``: n and batches as choices. Siblings start after
their prompt's first choice has an event, get seed + j, and do not start when the
first choice failed or the client aborted the request; greedy n and seeds past the
range are refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.errors import InvalidRequestError, UnavailableError
from hybridpd.validation import SEED_MAX
from services.router.choices import expand, serve
from services.router.output import Event, OutputOptions
from services.router.request_builder import Built

pytestmark = pytest.mark.unit


class _Orch:
    """What ``serve`` uses of the orchestrator: ``stream`` and ``aborted``."""

    def __init__(self, fail: set[str] = frozenset(), abort_after_first: bool = False) -> None:
        self.aborted: dict[str, None] = {}
        self.started: list[str] = []
        self.fail, self.abort_after_first = fail, abort_after_first

    async def stream(self, req: EngineRequest, *args: Any) -> AsyncIterator[Event]:
        self.started.append(req.request_id)
        if req.request_id in self.fail:
            raise UnavailableError("no instance for %s" % req.request_id)
        if self.abort_after_first:
            self.aborted["r"] = None  # the client's Abort lands while the first choice runs
        await asyncio.sleep(0)
        yield Event((req.sampling.seed or 0,), "x", True, "length")


def _built(seed: int | None = 1, temperature: float = 1.0) -> Built:
    return Built(EngineRequest(RequestId("r"), (5, 6, 7), SamplingParams(temperature=temperature, seed=seed)))


async def _run(orch: _Orch, n: int, builts: list[Built] | None = None) -> list[tuple[int, Event]]:
    return [x async for x in serve(orch, expand(builts or [_built()], n), "test", None, OutputOptions())]  # type: ignore[arg-type]


def test_siblings_get_their_ids_and_seed_plus_j() -> None:
    orch = _Orch()
    got = asyncio.run(_run(orch, 3))
    assert sorted((i, ev.token_ids) for i, ev in got) == [(0, (1,)), (1, (2,)), (2, (3,))]
    assert orch.started[0] == "r-0" and sorted(orch.started) == ["r-0", "r-1", "r-2"]
    assert orch.aborted == {}


def test_a_failed_first_choice_starts_no_sibling() -> None:
    orch = _Orch(fail={"r-0"})
    with pytest.raises(UnavailableError):
        asyncio.run(_run(orch, 3))
    assert orch.started == ["r-0"]


def test_an_aborted_request_starts_no_sibling() -> None:
    orch = _Orch(abort_after_first=True)
    got = asyncio.run(_run(orch, 3))
    assert [i for i, _ in got] == [0] and orch.started == ["r-0"] and orch.aborted == {}


def test_batches_index_prompt_times_n() -> None:
    orch = _Orch()
    got = asyncio.run(_run(orch, 2, [_built(10), _built(20)]))
    assert sorted((i, ev.token_ids) for i, ev in got) == [(0, (10,)), (1, (11,)), (2, (20,)), (3, (21,))]


def test_greedy_n_and_seeds_past_the_range_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="n must be 1 when using greedy sampling"):
        expand([_built(temperature=0.0)], 2)
    with pytest.raises(InvalidRequestError, match="seed"):
        expand([_built(seed=SEED_MAX)], 2)
    assert len(expand([_built(temperature=0.0)], 1)) == 1
