"""Where a vLLM engine stages checkpoint prefixes and a P/D prompt's own tail
(``engine/vllm/stage_plan.py``), without vLLM: the engine's facts are given."""

from __future__ import annotations

import pytest

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId
from hybridpd.engine.vllm.stage_plan import StagePlan
from hybridpd.engine.vllm.stages import PLAIN, TAIL_SUFFIX

pytestmark = pytest.mark.unit

CFG = load_config(env={}, overrides={"engine": "vllm", "prefix_match_unit": 16})


def _req(n: int, checkpoints: tuple[int, ...] = ()) -> EngineRequest:
    return EngineRequest(RequestId("r"), tuple(range(1000, 1000 + n)), checkpoints=checkpoints)


def test_a_pd_prefill_computes_all_but_its_backoff_and_keeps_its_tail_below_it() -> None:
    pd = StagePlan(CFG, "prefill", prefill_backoff=1, drop_eagle_block=False, partial_hits=True)
    assert pd.computed_prompt_tokens(_req(97), prefill_only=True) == 96
    assert pd.computed_prompt_tokens(_req(97), prefill_only=False) == 97
    assert pd.tail_checkpoint(_req(97), prefill_only=True) == 80  # (96 - 1) // 16 * 16
    assert pd.tail_checkpoint(_req(97), prefill_only=False) == 96


def test_the_tail_stage_leaves_the_tail_one_engine_would() -> None:
    pd = StagePlan(CFG, "prefill", prefill_backoff=1, drop_eagle_block=False, partial_hits=True)
    stage = pd.tail_stage(_req(97), prefill_only=True)
    assert stage is not None and stage.position == 96
    assert stage.request.request_id == "r" + TAIL_SUFFIX and len(stage.request.prompt_token_ids) == 97
    assert stage.request.background and stage.request.sampling == PLAIN
    assert pd.tail_stage(_req(98), prefill_only=True) is None  # the truncated tail is already 96
    assert pd.tail_stage(_req(97), prefill_only=False) is None  # not a P/D prefill
    whole_blocks = StagePlan(CFG, "prefill", prefill_backoff=1, drop_eagle_block=False, partial_hits=False)
    assert whole_blocks.tail_stage(_req(97), prefill_only=True) is None


def test_stages_lie_past_the_hit_and_never_on_decode() -> None:
    local = StagePlan(CFG, "local", prefill_backoff=0, drop_eagle_block=False, partial_hits=True)
    req = _req(200, checkpoints=(40, 100, 150))
    assert local.stages(req, prefill_only=False) == ((32, 33), (96, 97), (144, 145))
    assert local.stages(req, prefill_only=False, hit=96) == ((144, 145),)
    assert StagePlan(CFG, "decode", 0, False, True).stages(req, prefill_only=False) == ()
    assert StagePlan(CFG, "local", 0, False, partial_hits=False).stages(req, prefill_only=False) == ()
    assert local.stages(_req(200), prefill_only=False) == ()  # nothing asked for
