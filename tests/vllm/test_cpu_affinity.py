"""A vLLM engine built in our process keeps the CPUs it was given (``patches.kept_cpu_affinity``).

vLLM's NixlConnector worker moves the thread that builds it to the last core of each
NUMA node (in ``vllm serve`` that thread only moves KV); in our actors the engine
computes on that thread's successors, so without the fix every prefill and decode
engine of a machine runs on one core. Checked on a prefill engine (NixlConnector) in a
fresh process: the building thread and a thread started afterwards (as the engine loop
is) may run on every CPU the process had, or on the prefill half of them under
``cpu_binding: split`` (``procs.bind_role_cpus``, from ``make_engine``). The same
engine, built and closed, leaves none of the variables it sets for vLLM's build in the
environment (``engine/vllm/environment.py``).
"""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.integration


def _affinity_worker(q_out, binding: str) -> None:  # type: ignore[no-untyped-def]
    from hybridpd.config import load_config
    from hybridpd.engine.factory import make_engine
    from tests.vllm.workers import BASE

    given = sorted(os.sched_getaffinity(0))
    environ = dict(os.environ)  # no NIXL side-channel port given: the engine's build picks one
    eng = make_engine(load_config(env={}, overrides={**BASE, "cpu_binding": binding}), "prefill", instance="affinity")
    seen: list[list[int]] = []
    t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    got = {"given": given, "after": sorted(os.sched_getaffinity(0)), "new_thread": seen[0]}
    eng.close()
    changed = {k for k in {*environ, *os.environ} if environ.get(k) != os.environ.get(k)}
    q_out.put({**got, "environ_changed": {k: (environ.get(k), os.environ.get(k)) for k in sorted(changed)}})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: a pin to one core changes nothing")
@pytest.mark.parametrize("binding", ["off", "split"])
def test_prefill_engine_keeps_the_cpus_it_was_given(binding: str) -> None:
    """``off``: every CPU the process had; ``split`` (``cpu_binding``): the prefill
    half, also where vLLM pins to a core outside it (the last one)."""
    from hybridpd.procs import split_cpus
    from tests.vllm.workers import run_spawned

    got = run_spawned(_affinity_worker, binding)
    print(got)
    want = got["given"] if binding == "off" else split_cpus(got["given"])[0]
    assert got["after"] == want and got["new_thread"] == want
    # #53: the variables the engine sets for vLLM's build are gone once it is built and closed;
    # what vLLM writes itself (its CPU platform: threads, LD_PRELOAD, ...) is vLLM's
    from hybridpd.engine.vllm.environment import MANAGED

    assert not set(got["environ_changed"]) & set(MANAGED), got["environ_changed"]
