"""bf16 runs, and on this CPU the exactness recipe holds for it too (the
tests of record are fp32; this guards the bf16 path from rotting)."""

from __future__ import annotations

from tests.unit.engine_helpers import assert_no_leaks, make_engine, prompt, req


def test_bf16_chunked_and_batched_equal_one_shot() -> None:
    prompts = {"b%d" % n: prompt(n, n) for n in (1, 17, 100, 700)}
    one_shot = {}
    for rid, toks in prompts.items():
        eng = make_engine(dtype="bfloat16", enable_prefix_caching=False)
        one_shot.update(eng.generate([req(rid, toks, 8)]))
    eng = make_engine(dtype="bfloat16", max_num_batched_tokens=48, eagle=True)
    assert eng.kv_caches[0][0].dtype.is_floating_point and str(eng.kv_caches[0][0].dtype) == "torch.bfloat16"
    got = eng.generate([req(rid, toks, 8) for rid, toks in prompts.items()])
    assert got == one_shot
    assert all(len(v) == 8 for v in got.values())
    assert_no_leaks(eng)
