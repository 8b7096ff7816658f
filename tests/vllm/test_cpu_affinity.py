"""A vLLM engine built in our process keeps the CPUs it was given (``patches.kept_cpu_affinity``).

vLLM's NixlConnector worker moves the thread that builds it to the last core of each
NUMA node (in ``vllm serve`` that thread only moves KV); in our actors the engine
computes on that thread's successors, so without the fix every prefill and decode
engine of a machine runs on one core. Checked on a prefill engine (NixlConnector) in a
fresh process: the building thread and a thread started afterwards (as the engine loop
is) may run on every CPU the process had.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.integration


def _affinity_worker(q_out) -> None:  # type: ignore[no-untyped-def]
    from hybridpd.procs import free_port
    from tests.vllm.workers import _engine

    given = sorted(os.sched_getaffinity(0))
    eng = _engine("prefill", {}, side_port=free_port())
    seen: list[list[int]] = []
    t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    q_out.put({"given": given, "after": sorted(os.sched_getaffinity(0)), "new_thread": seen[0]})
    eng.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: a pin to one core changes nothing")
def test_prefill_engine_keeps_the_cpus_it_was_given() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_affinity_worker, args=(q,))
    p.start()
    try:
        got = q.get(timeout=600)
    finally:
        p.join(60)
    print(got)
    assert got["after"] == got["given"] and got["new_thread"] == got["given"]
