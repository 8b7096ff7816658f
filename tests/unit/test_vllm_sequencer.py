"""What our vLLM scheduler decides before each step (``engine/vllm/sequencer.py``),
on plain records of vLLM's request fields; ``tests/vllm/test_background.py`` and
``test_checkpoint_stages.py`` run the same decisions inside vLLM's scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from hybridpd.engine.vllm.sequencer import SEND_HOLD_S, Ledger, PrefixDone, Sequencer, Tag

pytestmark = pytest.mark.unit


@dataclass
class Stats:
    num_cached_tokens: int


@dataclass(eq=False)
class Req:
    """The fields of vLLM's ``Request`` the sequencer reads."""

    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0
    finished: bool = False
    prefill_stats: Stats | None = None

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class Queues:
    """vLLM's queues as the sequencer sees them, with what it asked of them."""

    running: list[Any] = field(default_factory=list)
    waiting: list[Any] = field(default_factory=list)
    finished_kv: bool = False
    log: list[tuple[str, str]] = field(default_factory=list)

    def queue(self, request: Any) -> None:
        self.waiting.append(request)
        self.log.append(("queue", request.request_id))

    def release(self, request: Any) -> None:
        request.finished = True
        self.running.remove(request)
        self.log.append(("release", request.request_id))

    def take_out(self, request: Any) -> bool:
        running = request in self.running
        (self.running if running else self.waiting).remove(request)
        self.log.append(("take_out", request.request_id))
        return running

    def queued(self) -> Any:
        return [*self.running, *self.waiting]

    def sending(self) -> bool:
        return self.finished_kv


def run(q: Queues, seq: Sequencer, chunk: int, cached: int = 0) -> None:
    """One step: the sequencer, then vLLM schedules ``chunk`` tokens of each waiting or running request."""
    seq.before_step(q, 100.0)
    q.running += q.waiting
    q.waiting.clear()
    for r in q.running:
        if r.prefill_stats is None:
            r.prefill_stats = Stats(cached)
        r.num_computed_tokens = min(r.num_prompt_tokens, r.num_computed_tokens + chunk)
    seq.after_schedule()


def test_a_prefix_chain_runs_in_order_and_each_is_released_at_its_checkpoint() -> None:
    seq, q = Sequencer(Ledger()), Queues()
    p1, p2, prompt = Req("p1", 33), Req("p2", 145), Req("r", 300)
    assert seq.arrive(p1, Tag(prefix=True)) is True  # the first prefix is queued at once
    q.waiting.append(p1)
    assert seq.arrive(p2, Tag(after="p1", prefix=True)) is False
    assert seq.arrive(prompt, Tag(after="p2")) is False
    assert seq.held_count() == 2
    run(q, seq, 32)  # p1: 32 of 33 tokens, its checkpoint at 32 ran
    assert q.log == [] and seq.ledger.pop_done() == []
    run(q, seq, 200)  # before this step: p1 released, p2 queued
    assert q.log == [("release", "p1"), ("queue", "p2")]
    assert seq.ledger.pop_done() == [PrefixDone("p1", 0, released=True)]
    p2.finished = True  # p2 ran whole and sampled its token: done too, not released
    run(q, seq, 300)
    assert q.log[2:] == [("queue", "r")] and seq.ledger.pop_done() == [PrefixDone("p2", 0, released=False)]
    assert seq.held_count() == 0 and not seq.prefixes and not seq.cached


def test_an_untagged_request_and_an_aborted_chain() -> None:
    seq = Sequencer(Ledger())
    assert seq.arrive(Req("plain", 10), None) is True
    p1, prompt = Req("p1", 33), Req("r", 300)
    seq.arrive(p1, Tag(prefix=True))
    seq.arrive(prompt, Tag(after="p1"))
    seq.forget(["p1", "r"])
    assert seq.held_count() == 0 and not seq.prefixes
    seq.arrive(Req("b", 10), Tag(background=True))
    seq.forget(None)
    assert seq.held_count() == 0


def test_background_waits_for_foreground_work_and_is_preempted_by_it() -> None:
    ledger = Ledger()
    seq, q = Sequencer(ledger), Queues()
    b1, b2 = Req("b1", 3000), Req("b2", 500)
    assert seq.arrive(b1, Tag(background=True)) is False and seq.arrive(b2, Tag(background=True)) is False
    run(q, seq, 256)  # nothing else: b1 runs (one at a time)
    assert q.log == [("queue", "b1")] and ledger.background_runs == 1 and b1 in q.running
    fg = Req("fg", 400)
    q.waiting.append(fg)  # vLLM queued an untagged request
    run(q, seq, 256)
    assert q.log[1:] == [("take_out", "b1")] and ledger.background_preempted == 1
    assert b1 not in q.running and list(seq.held) == [b1, b2]  # at the head of the line
    fg.finished = True
    q.running.remove(fg)
    ledger.handed_at = 100.0 - SEND_HOLD_S / 2  # a handoff's KV awaits decode's read
    q.finished_kv = True
    run(q, seq, 256)
    assert len(q.log) == 2  # held while the KV waits
    ledger.handed_at = 100.0 - SEND_HOLD_S  # past the hold: it runs again
    run(q, seq, 256)
    assert q.log[2:] == [("queue", "b1")] and ledger.background_runs == 2
