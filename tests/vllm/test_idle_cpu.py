"""Idle means idle with the vLLM engine too: `hybridpd up --engine vllm --model tiny`
as the README writes it (no --dtype: bf16 on CPU) serves the README's request, and
afterwards each idle actor uses under 3% of one core (vLLM's NIXL agent without its
busy progress thread, one gloo event loop instead of one per process group; the 2%
of the native actors plus what vLLM's own idle threads take, see ``tests/idle_cpu.py``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

from tests.e2e.conftest import Stack
from tests.idle_cpu import VLLM_IDLE_CPU_LIMIT, actor_pids, idle_cpu


def test_readme_command_serves_and_idle_actors_use_under_three_percent_of_a_core(tmp_path: Path) -> None:
    with Stack(tmp_path, ["--engine", "vllm", "--model", "tiny"], start_timeout_s=600) as stack:
        body = {"model": "tiny", "prompt": "The delta rule", "max_tokens": 16, "temperature": 0}
        resp = httpx.post(stack.http + "/v1/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 16
        pids = actor_pids(stack.wait_all_free(60))  # decode read the KV: prefill released it
        use = idle_cpu(pids)
    shown = {n: "%.2f%%" % (100 * u) for n, u in use.items()}
    print("idle CPU per actor (vllm):", shown)
    assert all(u < VLLM_IDLE_CPU_LIMIT for u in use.values()), shown
