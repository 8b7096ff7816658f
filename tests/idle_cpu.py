"""CPU an idle stack's actors burn: read from their processes, not asked of them.

The actors report their pids in ``/v1/hybridpd/stats``; their CPU time (all
threads, user + system) is read with psutil before and after a window in
which no request is in flight, so the measurement itself adds no work to
them. The bound (2% of one core per actor) sits far below a busy-polling
loop (a UCX progress thread driven without pause costs 60% or more of a
core) and above Ray's own per-worker housekeeping (under 1% on the 2-core
machines we run on).
"""

from __future__ import annotations

import time

import psutil

#: fraction of one core an idle actor may use
IDLE_CPU_LIMIT = 0.02
#: the same for an actor that holds a vLLM engine: vLLM keeps threads of its own awake
#: when idle (gloo's TCP loop of its one-process group, ~0.3% of a core; its KV-event
#: publisher, woken 10 times a second, ~0.1%), on top of Ray's worker (~0.8%). Measured
#: 1.4-1.6% here and up to 2.2% on a slower CPU of our kind (CI, 2026-12-01), so the
#: bound is 3%: still 20x below one busy-polling progress thread.
VLLM_IDLE_CPU_LIMIT = 0.03


def actor_pids(stats: dict) -> dict[str, int]:
    """Actor name -> pid from the router's stats."""
    pids = {name: int(s["pid"]) for name, s in stats.items() if "pid" in s}
    assert len(pids) == len(stats), "an actor reported no pid: %s" % stats
    return pids


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def idle_cpu(pids: dict[str, int], warmup_s: float = 10.0, window_s: float = 24.0) -> dict[str, float]:
    """Each actor's CPU use over ``window_s`` after ``warmup_s``, as a fraction of one core."""
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    for name, proc in procs.items():
        assert proc.cmdline()[0].startswith("ray::"), (name, proc.cmdline())
    time.sleep(warmup_s)  # the scenario: the stack left idle (startup work done)
    before = {name: _cpu_s(p) for name, p in procs.items()}
    t0 = time.monotonic()
    time.sleep(window_s)  # the measurement window
    after = {name: _cpu_s(p) for name, p in procs.items()}
    elapsed = time.monotonic() - t0
    return {name: (after[name] - before[name]) / elapsed for name in procs}
