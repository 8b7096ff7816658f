"""The bookkeeping of vLLM's checkpoint prefixes (``engine/vllm/stages.py``): the
prefix requests of a plan, which hit and checkpoints a prompt reports, and aborts."""

from __future__ import annotations

import pytest

from hybridpd.checkpoint_stages import staged_checkpoints
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.vllm.stages import STAGE_SEPARATOR, Stages

pytestmark = pytest.mark.unit

PROMPT = EngineRequest(RequestId("r"), tuple(range(100, 400)), SamplingParams(max_tokens=5, stop_token_ids=(7,)))
PLAN = staged_checkpoints([40, 150], 300, 16, False)
#: what the engine hands vLLM: (vLLM's id, our id, position) of each prefix
SUBMITTED = [("v32", "r%s32" % STAGE_SEPARATOR, 32), ("v144", "r%s144" % STAGE_SEPARATOR, 144)]


def test_the_prefix_requests_of_a_plan() -> None:
    assert PLAN == ((32, 33), (144, 145))
    first, second = Stages.prefix_requests(PROMPT, PLAN)
    assert first.request_id == "r%s32" % STAGE_SEPARATOR and first.prompt_token_ids == PROMPT.prompt_token_ids[:33]
    assert first.sampling.max_tokens == 1 and first.sampling.stop_token_ids == () and first.sampling.ignore_eos
    assert second.request_id == "r%s144" % STAGE_SEPARATOR and len(second.prompt_token_ids) == 145
    assert Stages.prefix_requests(PROMPT, ()) == []


def test_prefixes_done_in_order_report_the_hit_and_the_checkpoints() -> None:
    st = Stages()
    st.start(PROMPT, SUBMITTED)
    assert st.prefixes_run == 2 and set(st.owner) == {"v32", "v144"}
    assert st.done("v32", 0, released=True) == "r%s32" % STAGE_SEPARATOR  # released: abort it on vLLM's output side
    assert st.pop_written("r") == ()  # not all done yet
    assert st.done("v144", 32, released=False) is None  # it finished itself
    assert not st.waiting and not st.owner and st.prefixes_released == 1
    # the first prefix computed (0 < 32): the prompt's hit is 0, not what its prefixes left
    assert st.reported_hit("r", 144, finished=False) == 0
    assert st.reported_hit("r", 144, finished=True) == 0
    assert st.reported_hit("r", 144, finished=True) == 144  # forgotten once finished
    assert st.pop_written("r") == (32, 144)  # the prefixes that ran, reported once
    assert st.pop_written("r") == ()


def test_a_cached_prefix_does_not_end_the_hit() -> None:
    st = Stages()
    st.start(PROMPT, SUBMITTED)
    st.done("v32", 32, released=True)  # fully cached: nothing computed past its probe token
    st.done("v144", 96, released=True)  # computed from 96: the hit ends there
    assert st.reported_hit("r", 144, finished=True) == 96
    st2 = Stages()
    st2.start(PROMPT, SUBMITTED)
    st2.done("v32", 32, released=True)
    st2.done("v144", 144, released=True)
    assert st2.reported_hit("r", 160, finished=True) == 160  # every prefix cached: the prompt's own hit


def test_no_plan_and_abort() -> None:
    st = Stages()
    st.start(PROMPT, [])
    assert not st.waiting and st.prefixes_run == 0
    st.start(PROMPT, SUBMITTED)
    st.done("v32", 0, released=True)
    assert st.abort("r") == ["r%s144" % STAGE_SEPARATOR]  # the prefix still in vLLM, to abort there
    assert st.pop_written("r") == () and not st.waiting and not st.owner
    assert st.done("v144", 0, released=True) is None  # a late report of an aborted prompt's prefix
    assert st.abort("r") == []
