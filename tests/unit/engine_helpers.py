"""Shared helpers for native-engine tests."""

from __future__ import annotations

import random
from typing import Any

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine

VOCAB_LO, VOCAB_HI = 5, 2048  # avoid special ids 0..4


def make_engine(**overrides: Any) -> NativeEngine:
    extra = {k: overrides.pop(k) for k in ("export_checkpoints", "record_logits", "num_state_slots") if k in overrides}
    base: dict[str, Any] = {"num_kv_blocks": 768, "max_num_batched_tokens": 4096, "max_num_seqs": 64}
    base.update(overrides)
    return NativeEngine(load_config(env={}, overrides=base), **extra)


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
    assert not engine.tensors and not engine.seqs
    engine.kv_pool.check_consistent()
    engine.state_pool.check_consistent()
