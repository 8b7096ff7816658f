"""Background requests (answer checkpoints) on the vLLM engine, held by our
scheduler (``engine/vllm/sequencer.py``), on vllm-cpu with the tiny Qwen3-Next.

vLLM's prefill chunk is shrunk to 256 tokens so that a 3,000-token background
prefill spans many steps. While it runs, a foreground request arrives: from
the next step on the background request is out of vLLM's queues (preempted by
vLLM's own preemption, held again), the foreground request runs alone to its
end, and only then does the background request run again and finish;
afterwards vLLM's own lookup (``VllmEngine.local_hit``) finds the background
prompt's tail checkpoint. Every assertion reads scheduler state or counts,
exact on any CPU.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("vllm")

CTX = mp.get_context("spawn")
CHUNK, BG_TOKENS, FG_TOKENS = 256, 3000, 400


def background_worker(q_out: Any) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import hybridpd.engine.vllm.core as vllm_core
    import hybridpd.engine.vllm.engine as vllm_engine
    from tests.vllm.workers import BASE, req, tokens

    real = vllm_core.engine_kwargs  # the engine's arguments are built where it starts vLLM
    vllm_core.engine_kwargs = lambda *a, **k: {**real(*a, **k), "max_num_batched_tokens": CHUNK}
    from hybridpd.config import load_config
    from hybridpd.engine.vllm.tiny import resolve

    eng = vllm_engine.VllmEngine(load_config(env={}, overrides=BASE), resolve(), "local")
    sched = eng._core().scheduler
    bg_tokens, fg_tokens = tokens(BG_TOKENS, 21), tokens(FG_TOKENS, 22)
    bg = replace(req("bg", bg_tokens, 1), background=True)
    fg = req("fg", fg_tokens, 4)
    out: dict[str, Any] = {"order": [], "overlap_steps": 0, "fg_steps": 0}

    def bg_in_queues() -> bool:
        return any(r.request_id.startswith("bg-") for r in itertools.chain(sched.running, sched.waiting))

    eng.add_request(bg)
    assert not bg_in_queues() and eng.ledger.background_runs == 0  # held: let into vLLM's queues by the next step
    steps = 0
    while not any(r.request_id.startswith("bg-") and r.num_computed_tokens >= 2 * CHUNK for r in sched.running):
        for o in eng.step():
            assert not o.finished, "the background prefill ended before the foreground request came"
        steps += 1
        assert steps < 50
    out["bg_computed_before"] = max(r.num_computed_tokens for r in sched.requests.values())
    eng.add_request(fg)
    while eng.has_work():
        fg_live = "fg" in eng.live
        outs = eng.step()
        if fg_live:  # each step fg ran: bg was not scheduled beside it (else it would be running)
            out["fg_steps"] += 1
            out["overlap_steps"] += bg_in_queues()
            out.setdefault("preempted", eng.ledger.background_preempted)
        for o in outs:
            if o.finished:
                out["order"].append(o.request_id)
                out["cached_" + o.request_id] = o.num_cached_tokens
    out["tries"] = eng.ledger.background_runs
    out["local_hit_bg"] = eng.local_hit(bg_tokens)
    out["local_hit_fresh"] = eng.local_hit(tokens(500, 23))
    eng.close()
    q_out.put(out)


def test_a_background_prefill_yields_to_a_foreground_request() -> None:
    q = CTX.Queue()
    p = CTX.Process(target=background_worker, args=(q,))
    p.start()
    try:
        got = q.get(timeout=900)
    finally:
        p.join(60)
    print(got)
    assert got["bg_computed_before"] >= 2 * CHUNK  # the background prefill was under way
    assert got["preempted"] == 1  # after fg's first step
    assert got["overlap_steps"] == 0 and got["fg_steps"] >= 1  # no step ran both
    assert got["order"] == ["fg", "bg"] and got["tries"] == 2
    assert got["local_hit_bg"] == (BG_TOKENS - 1) // 16 * 16  # its tail checkpoint, by vLLM's own lookup
    assert got["local_hit_fresh"] == 0
