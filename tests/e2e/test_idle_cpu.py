"""Idle means idle: after serving, an idle stack's actors (native engine) each
use under 2% of one core (no busy-polling progress loop). The stack is the
session's shared one (``conftest.stack``): it has served whatever ran before, and
starting a stack of its own only to leave it idle added its start and stop."""

from __future__ import annotations

import httpx

from tests.e2e.conftest import Stack
from tests.idle_cpu import IDLE_CPU_LIMIT, actor_pids, idle_cpu


def test_idle_actors_use_under_two_percent_of_a_core(stack: Stack) -> None:
    model = httpx.get(stack.http + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The delta rule", "max_tokens": 16, "temperature": 0}
    resp = httpx.post(stack.http + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    pids = actor_pids(stack.wait_all_free(30))  # the handoff was released: nothing outstanding
    assert sorted(pids) == ["decode-0", "prefill-0", "prefill-1"]
    use = idle_cpu(pids)
    shown = {n: "%.2f%%" % (100 * u) for n, u in use.items()}
    print("idle CPU per actor (native):", shown)
    assert all(u < IDLE_CPU_LIMIT for u in use.values()), shown
