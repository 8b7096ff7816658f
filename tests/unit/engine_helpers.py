"""Shared helpers for native-engine tests."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.models.bundled import resolve_model_dir

VOCAB_LO, VOCAB_HI = 5, 2048  # avoid special ids 0..4
#: the bundled models path-equality tests run on: trained weights and seeded random ones
MODELS = ("tiny", "tiny-random")
_model = ["tiny"]
#: state block sizes the path-equality tests run at: vLLM's align-mode columns (64) and the
#: default (None: B = u), as ``make_engine(mamba_block_size=...)`` takes them
BLOCKS = (64, None)


def block_id(block: int | None) -> str:
    return "B%d" % block if block is not None else "Bu"


@pytest.fixture(scope="module", params=MODELS, autouse=True, name="bundled_model")
def bundled_model_fixture(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs every test of a module that imports it once per bundled model
    (``make_engine`` builds that model)."""
    _model[0] = request.param
    yield request.param
    _model[0] = "tiny"


def make_engine(**overrides: Any) -> NativeEngine:
    kwargs = ("export_checkpoints", "record_logits", "num_state_slots", "role", "instance")
    extra = {k: overrides.pop(k) for k in kwargs if k in overrides}
    base: dict[str, Any] = {
        "model": _model[0],
        "num_kv_blocks": 768,
        "max_num_batched_tokens": 4096,
        "max_num_seqs": 64,
        # the protocol examples these tests check are written for vLLM's align-mode columns;
        # mamba_block_size=None gives the default, B = prefix_match_unit
        "mamba_block_size": 64,
    }
    base.update(overrides)
    cfg = load_config(env={}, overrides=base)
    return NativeEngine(cfg, resolve_model_dir(cfg.model), **extra)


def prompt(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n))


def req(rid: str, tokens: tuple[int, ...], max_tokens: int = 6, **sp: Any) -> EngineRequest:
    return EngineRequest(RequestId(rid), tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp))


def assert_no_leaks(engine: NativeEngine) -> None:
    st = engine.stats()
    assert st.num_free_blocks == st.num_blocks, st
    assert st.num_free_state_slots == st.num_state_slots, st
    assert st.num_running == 0 and st.num_waiting == 0, st
    assert not engine.runner.tensors and not engine.seqs
    assert not engine._handoffs  # every handoff was popped
    engine.kv_pool.check_consistent()
    engine.state_pool.check_consistent()
