"""The bookkeeping of vLLM's checkpoint prefixes (``engine/vllm/stages.py``):
which request runs next, which hit and checkpoints a prompt reports, and aborts."""

from __future__ import annotations

from hybridpd.checkpoint_stages import staged_checkpoints
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.vllm.stages import STAGE_SEPARATOR, Stages

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
    assert st.pop_written("r") == (32, 144)  # the prefixes that ran, reported once
    assert st.pop_written("r") == ()


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
    assert st.pop_written("r") == ()  # it left nothing it reports
    assert not st.is_prefix(first.request_id) and not st.waiting
    assert st.abort("r") is None
