"""The bookkeeping of vLLM's checkpoint prefixes (``engine/vllm/stages.py``):
which request runs next, which hit a prompt reports, and aborts; and when a
P/D prompt's tail stage runs (``TailQueue``)."""

from __future__ import annotations

from dataclasses import replace

from hybridpd.checkpoints import staged_checkpoints
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.vllm import stages as stages_module
from hybridpd.engine.vllm.stages import STAGE_SEPARATOR, TAIL_IDLE_S, TAIL_SUFFIX, Stages, TailQueue, TailStage

PROMPT = EngineRequest(RequestId("r"), tuple(range(100, 400)), SamplingParams(max_tokens=5, stop_token_ids=(7,)))
PLAN = staged_checkpoints([40, 150], 300, 16, False)


def test_prefixes_run_in_order_then_the_prompt() -> None:
    assert PLAN == ((32, 33), (144, 145))
    st = Stages()
    first = st.start(PROMPT, PLAN)
    assert first is not None and first.request_id == "r%s32" % STAGE_SEPARATOR
    assert first.prompt_token_ids == PROMPT.prompt_token_ids[:33]
    assert first.sampling.max_tokens == 1 and first.sampling.stop_token_ids == () and first.sampling.ignore_eos
    assert st.is_prefix(first.request_id) and not st.is_prefix("r")
    second = st.finished(first.request_id, 0)
    assert second is not None and len(second.prompt_token_ids) == 145 and st.is_prefix(second.request_id)
    prompt = st.finished(second.request_id, 32)
    assert prompt is PROMPT and not st.waiting and not st.owner and st.prefixes_run == 2
    # the first prefix computed (0 < 32): the prompt's hit is 0, not what its prefixes left
    assert st.reported_hit("r", 144, finished=False) == 0
    assert st.reported_hit("r", 144, finished=True) == 0
    assert st.reported_hit("r", 144, finished=True) == 144  # forgotten once finished


def test_a_cached_prefix_does_not_end_the_hit() -> None:
    st = Stages()
    first = st.start(PROMPT, PLAN)
    assert first is not None
    second = st.finished(first.request_id, 32)  # fully cached: nothing computed past its probe token
    assert second is not None
    assert st.finished(second.request_id, 96) is PROMPT  # computed from 96: the hit ends there
    assert st.reported_hit("r", 144, finished=True) == 96
    st2 = Stages()
    p = st2.start(PROMPT, PLAN)
    assert p is not None
    q = st2.finished(p.request_id, 32)
    assert q is not None and st2.finished(q.request_id, 144) is PROMPT
    assert st2.reported_hit("r", 160, finished=True) == 160  # every prefix cached: the prompt's own hit


def test_no_plan_and_abort() -> None:
    st = Stages()
    assert st.start(PROMPT, ()) is None and not st.waiting
    first = st.start(PROMPT, PLAN)
    assert first is not None
    assert st.abort("r") == first.request_id  # the running prefix, to abort in vLLM
    assert not st.is_prefix(first.request_id) and not st.waiting
    assert st.abort("r") is None


def _tail(rid: str, tokens: tuple[int, ...]) -> TailStage:
    prefix = replace(PROMPT, request_id=RequestId(rid + TAIL_SUFFIX), prompt_token_ids=tokens, background=True)
    return TailStage(len(tokens) - 1, prefix)


def test_a_tail_stage_rides_the_next_foreground_request_unless_that_one_extends_it() -> None:
    q = TailQueue()
    a = _tail("a", tuple(range(0, 33)))  # the tail of a 33-token prompt a: 32
    b = _tail("b", tuple(range(500, 533)))
    q.add(a)
    q.add(b)
    # the next turn of a extends a's stage: its own prefill passes 32 in that step, a's stage is dropped;
    # b's rides along (batched into the same step)
    assert q.ride(tuple(range(0, 80))) == [b.request]
    assert not q.queued and q.ran == 1 and q.dropped == 1
    q.add(a)
    assert q.drop("a") and not q.drop("a") and not q.queued  # the prompt was aborted: no one waits for it


def test_a_tail_stage_runs_alone_only_once_the_engine_was_idle() -> None:
    q = TailQueue()
    a = _tail("a", tuple(range(0, 33)))
    q.add(a)
    assert q.idle(TAIL_IDLE_S / 2) == [] and len(q.queued) == 1
    assert q.idle(TAIL_IDLE_S) == [a.request] and not q.queued and q.ran == 1
    assert q.idle(10.0) == []


def test_the_tail_queue_keeps_the_newest() -> None:
    q = TailQueue()
    for i in range(stages_module.TAIL_QUEUE_LIMIT + 2):
        q.add(_tail("p%d" % i, (i, i + 1)))
    assert len(q.queued) == stages_module.TAIL_QUEUE_LIMIT and q.dropped == 2
    newest = "p%d%s" % (stages_module.TAIL_QUEUE_LIMIT + 1, TAIL_SUFFIX)
    assert "p0" + TAIL_SUFFIX not in q.queued and newest in q.queued
