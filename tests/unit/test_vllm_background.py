"""The bookkeeping of background requests on vLLM (``engine/vllm/background.py``)."""

from __future__ import annotations

from dataclasses import replace

from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.vllm.background import TRY_SEPARATOR, BackgroundQueue

A = EngineRequest(RequestId("a"), (1, 2, 3), SamplingParams(max_tokens=1), background=True)
B = replace(A, request_id=RequestId("b"))


def test_one_try_at_a_time_and_only_without_foreground() -> None:
    q = BackgroundQueue()
    q.add(A, 0)
    q.add(B, 16)
    assert q.admit(foreground_live=True) is None
    first = q.admit(foreground_live=False)
    assert first is not None and first.request_id == "a%s1" % TRY_SEPARATOR
    assert q.admit(foreground_live=False) is None  # one runs already
    assert q.owner(first.request_id) == "a" and q.owner("a") is None
    # foreground arrives: the try is aborted and A goes back to the head, under a new try id
    assert q.preempt() == first.request_id and q.preempted == 1 and q.running is None
    again = q.admit(foreground_live=False)
    assert again is not None and again.request_id == "a%s2" % TRY_SEPARATOR and q.owner(first.request_id) is None
    q.finished()
    nxt = q.admit(foreground_live=False)
    assert nxt is not None and nxt.request_id.startswith("b" + TRY_SEPARATOR) and len(q) == 1


def test_reported_hit_is_the_arrival_hit_and_drop() -> None:
    q = BackgroundQueue()
    q.add(A, 0)
    q.add(B, 16)
    # a retry finds what the aborted try computed: never reported as cached
    assert q.reported_hit("a", 640, finished=False) == 0
    assert q.reported_hit("a", 640, finished=True) == 0
    assert q.reported_hit("a", 640, finished=True) == 640  # forgotten
    assert q.reported_hit("b", 8, finished=True) == 8  # evicted meanwhile: the lower count
    q.add(A, 0)
    t = q.admit(foreground_live=False)
    assert t is not None and q.drop("a") == t.request_id and q.running is None and len(q) == 1  # B waits
    assert q.drop("a") is None
