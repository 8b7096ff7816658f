"""Faults on a real stack: outputs stay correct, failures are clean, the
state plane recovers. This module runs its own stack (it breaks things)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from hybridpd.index.redis_server import redis_server_binary
from hybridpd.procs import port_open
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt


@pytest.fixture(scope="module")
def fstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(Path(tmp_path_factory.mktemp("faults")), ["--fault-injection"])
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)


def _complete(stack: Stack, tokens: list[int], max_tokens: int = 6, **extra: object):  # type: ignore[no-untyped-def]
    return _client(stack).completions.create(
        model="tiny",
        prompt=tokens,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )


def _metric(stack: Stack, name: str) -> float:
    total = 0.0
    for line in httpx.get(stack.http + "/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _pid_listening(port: int) -> int:
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return c.pid
    raise AssertionError("nothing listens on %d" % port)


def test_corrupted_handoff_is_detected_and_redone(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    tokens = list(prompt(150, 61))
    r = httpx.post(fstack.http + "/v1/hybridpd/faults", json={"corrupt_next_handoff": "prefill-0"})
    assert r.status_code == 200
    before = _metric(fstack, 'hybridpd_retries_total{kind="handoff"}')
    got = _complete(fstack, tokens, hybridpd_prefill_instance="prefill-0")
    assert got.choices[0].token_ids == run(tokens, 6)  # type: ignore[attr-defined]
    assert _metric(fstack, 'hybridpd_retries_total{kind="handoff"}') == before + 1


def test_redis_down_serves_then_recovers(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    url = fstack.banner("Redis (prefix index)")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    os.kill(_pid_listening(port), signal.SIGKILL)
    time.sleep(0.5)
    before = _metric(fstack, 'hybridpd_routing_decisions_total{decision="index_unavailable"}')
    tokens = list(prompt(300, 62))
    got = _complete(fstack, tokens)
    assert got.choices[0].token_ids == run(tokens, 6)  # type: ignore[attr-defined]
    assert _metric(fstack, 'hybridpd_routing_decisions_total{decision="index_unavailable"}') == before + 1
    assert "prefix index unavailable" in fstack.log.read_text(errors="replace")
    # Redis comes back (empty: persistence is off); hits return for new checkpoints
    redis = subprocess.Popen(
        [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", port):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.5)  # heartbeats re-register the instances
        base = list(prompt(300, 63))
        _complete(fstack, base, hybridpd_prefill_instance="prefill-1")
        time.sleep(1.0)
        ext = _complete(fstack, base + list(prompt(40, 64)), hybridpd_prefill_instance="prefill-0")
        assert ext.usage.prompt_tokens_details.cached_tokens > 0  # loaded via the store, found via Redis
        assert ext.choices[0].token_ids == run(base + list(prompt(40, 64)), 6)  # type: ignore[attr-defined]
    finally:
        redis.terminate()
        redis.wait(10)


def test_mooncake_down_recomputes(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    master = fstack.banner("Mooncake master")
    os.kill(_pid_listening(int(master.rsplit(":", 1)[1])), signal.SIGKILL)
    time.sleep(0.5)
    base = list(prompt(260, 65))
    _complete(fstack, base, hybridpd_prefill_instance="prefill-0")
    ext = base + list(prompt(30, 66))
    got = _complete(fstack, ext, hybridpd_prefill_instance="prefill-1")
    assert got.choices[0].token_ids == run(ext, 6)  # type: ignore[attr-defined]


def test_prefill_actor_killed_mid_prefill_is_retried(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    pid = httpx.get(fstack.http + "/v1/hybridpd/stats", timeout=30).json()["prefill-0"]["pid"]
    tokens = list(prompt(6000, 67))
    result: dict = {}

    def call() -> None:
        try:
            result["resp"] = _complete(fstack, tokens, 4, hybridpd_prefill_instance="prefill-0")
        except Exception as exc:  # the assertion below reports it
            result["exc"] = exc

    t = threading.Thread(target=call)
    t.start()
    time.sleep(1.0)  # prefill-0 is busy with the 6,000-token prompt
    os.kill(pid, signal.SIGKILL)
    t.join(300)
    assert "exc" not in result, result.get("exc")
    assert result["resp"].choices[0].token_ids == run(tokens, 4)
    assert _metric(fstack, 'hybridpd_retries_total{kind="prefill"}') >= 1


def test_decode_killed_mid_stream_is_a_clean_error(fstack: Stack) -> None:
    """Chosen behaviour: tokens already streamed cannot be taken back, so the
    stream ends with an error event and no [DONE]; never a cut stream that looks
    finished. (Ray restarts the actor for later requests.)"""
    pid = httpx.get(fstack.http + "/v1/hybridpd/stats", timeout=30).json()["decode-0"]["pid"]
    body = {
        "model": "tiny",
        "prompt": list(prompt(100, 68)),
        "max_tokens": 5000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    lines = []
    with httpx.stream("POST", fstack.http + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 5:
                os.kill(pid, signal.SIGKILL)
    assert lines[-1] != "data: [DONE]"
    assert '"error"' in lines[-1] and "decode" in lines[-1]
    assert not any('"finish_reason": "length"' in x for x in lines)
