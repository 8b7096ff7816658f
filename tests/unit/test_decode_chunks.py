"""Decode → router streaming: outputs already waiting are merged into one chunk
(one Ray object), never past the end of the request, errors kept."""

from __future__ import annotations

import queue

import pytest

from hybridpd.engine.base import FinishReason, RequestId, RequestOutput
from services.decode.actor import _next_chunk

RID = RequestId("r")


def _q(*items: object) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    for it in items:
        q.put(it)
    return q


def test_outputs_waiting_are_merged_into_one_chunk() -> None:
    q = _q(RequestOutput(RID, (1,)), RequestOutput(RID, (2, 3)), RequestOutput(RID, (4,)))
    chunk = _next_chunk(q, RID)
    assert chunk.token_ids == (1, 2, 3, 4) and not chunk.finished
    assert q.empty()


def test_merging_stops_at_the_finished_output() -> None:
    done = RequestOutput(RID, (2,), finished=True, finish_reason=FinishReason.LENGTH)
    q = _q(RequestOutput(RID, (1,)), done, RequestOutput(RID, (9,)))
    chunk = _next_chunk(q, RID)
    assert chunk.token_ids == (1, 2) and chunk.finished and chunk.finish_reason == str(FinishReason.LENGTH)
    assert q.qsize() == 1  # nothing past the end is taken


def test_one_output_alone_is_one_chunk() -> None:
    chunk = _next_chunk(_q(RequestOutput(RID, (7,))), RID)
    assert chunk.token_ids == (7,)


def test_an_engine_error_behind_tokens_is_raised() -> None:
    q = _q(RequestOutput(RID, (1,)), RuntimeError("step failed"))
    with pytest.raises(RuntimeError, match="step failed"):
        _next_chunk(q, RID)


def test_a_stalled_decode_times_out() -> None:
    with pytest.raises(TimeoutError, match="stalled"):
        _next_chunk(queue.Queue(), RID, stall_s=0.05)
