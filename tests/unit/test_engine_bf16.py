"""bf16 runs: chunked, batched and EAGLE paths agree with a one-shot run up to
bf16 rounding (the tests of record are fp32 and bit-exact; this guards the
bf16 path from rotting).

bf16 is compared with a tolerance on every machine, never bit for bit: on
an AMX-BF16 Xeon, oneDNN's bf16 matmul rows differ with the number of rows
(``row_invariance_problem(torch.bfloat16)`` says so there), and bf16 logits
of the tiny model have exact ties, so which side of a near-tie wins depends
on the CPU. The rule is ``tests/greedy.py``'s: tokens equal up to the
reference's first near-tie, and logprobs within ``BF16_TOL`` of the
reference wherever both saw the same tokens.
"""

from __future__ import annotations

import torch

from tests.greedy import BF16_TOL, GreedyReference, assert_greedy_matches
from tests.unit.engine_helpers import assert_no_leaks, make_engine, prompt, req

PROMPTS = {"b%d" % n: prompt(n, n) for n in (1, 17, 100, 700)}
MAX_TOKENS = 8


def _logprobs(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def _reference(rows: list[torch.Tensor], tokens: list[int]) -> GreedyReference:
    top = _logprobs(rows).topk(2, dim=-1).values
    return GreedyReference(tokens, (top[:, 0] - top[:, 1]).tolist())


def _assert_bf16_match(
    rid: str, got: list[int], got_rows: list[torch.Tensor], want: list[int], want_rows: list[torch.Tensor]
) -> None:
    assert_greedy_matches(got, _reference(want_rows, want), BF16_TOL, what=rid)
    # logprobs of the reference's 5 best tokens agree wherever both runs had seen the same
    # tokens (the far tail of the vocabulary is where bf16 rounding steps are largest)
    same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want) - 1)
    ref_lp = _logprobs(want_rows[: same + 1])
    top = ref_lp.topk(5, dim=-1).indices
    diff = (_logprobs(got_rows[: same + 1]).gather(1, top) - ref_lp.gather(1, top)).abs().max().item()
    assert diff <= BF16_TOL, "%s: logprobs differ by %.3f over the first %d tokens" % (rid, diff, same + 1)


def test_bf16_chunked_batched_and_eagle_match_one_shot() -> None:
    one_shot: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
    for rid, toks in PROMPTS.items():
        eng = make_engine(dtype="bfloat16", enable_prefix_caching=False, record_logits=True)
        got = eng.generate([req(rid, toks, MAX_TOKENS)])
        assert eng.logit_log is not None
        one_shot[rid] = (got[rid], eng.logit_log[rid])
    eng = make_engine(dtype="bfloat16", max_num_batched_tokens=48, eagle=True, record_logits=True)
    assert str(eng.kv_caches[0][0].dtype) == "torch.bfloat16"
    got = eng.generate([req(rid, toks, MAX_TOKENS) for rid, toks in PROMPTS.items()])
    assert eng.logit_log is not None
    for rid, (want, want_rows) in one_shot.items():
        _assert_bf16_match(rid, got[rid], eng.logit_log[rid], want, want_rows)
    assert_no_leaks(eng)


def test_tolerant_comparison_catches_a_wrong_path() -> None:
    """The comparison is not vacuous: a run whose KV and state came from another
    prefix (the same last 100 tokens after a different 600) fails it."""
    toks = PROMPTS["b700"]
    eng = make_engine(dtype="bfloat16", enable_prefix_caching=False, record_logits=True)
    want = eng.generate([req("r", toks, MAX_TOKENS)])["r"]
    assert eng.logit_log is not None
    bad = make_engine(dtype="bfloat16", enable_prefix_caching=False, record_logits=True)
    wrong = bad.generate([req("w", prompt(600, 5) + toks[-100:], MAX_TOKENS)])["w"]
    assert bad.logit_log is not None
    try:
        _assert_bf16_match("wrong", wrong, bad.logit_log["w"], want, eng.logit_log["r"])
    except AssertionError:
        return
    raise AssertionError("a wrong continuation passed the tolerant comparison: %s vs %s" % (wrong, want))
