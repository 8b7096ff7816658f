"""SIGTERM to a serving `hybridpd up` drains (issue #51): /ready turns false and
the gRPC health NOT_SERVING, a new request is a 503 with Retry-After, and a
1500-token stream running at the signal finishes with every token and [DONE];
then the process exits 0. A second signal stops at once. Each test runs its own
stack (it stops it)."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.conftest import Stack
from tests.wait import Pending, wait_until

TOKENS = 1500


class Reader(threading.Thread):
    """Reads one SSE completion stream; ``started`` after its first lines; ``stop``
    closes it (the client goes away)."""

    def __init__(self, stack: Stack, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = stack.http + "/v1/completions"
        self.body = {
            "model": "tiny",
            "prompt": "The delta rule",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self.lines: list[str] = []
        self.started, self.stop = threading.Event(), threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line)
                        if len(self.lines) == 3:
                            self.started.set()
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:
            pass  # cut by a forced stop: the test looks at the lines


def test_sigterm_drains_a_running_stream_to_its_end(tmp_path: Path) -> None:
    stack = Stack(tmp_path, ["--num-prefill", "1"], drain_grace_s=300)
    stack.start()
    try:
        stream, holder = Reader(stack, TOKENS), Reader(stack, 14000)  # the holder keeps the drain open
        assert stream.started.wait(120) and holder.started.wait(120), "the streams did not start"
        assert stream.is_alive(), "the %d-token stream ended before the signal" % TOKENS
        assert stack.proc is not None
        stack.proc.send_signal(signal.SIGTERM)

        def not_ready() -> bool | Pending:
            r = httpx.get(stack.http + "/ready", timeout=10)
            return True if r.status_code == 503 else Pending(r.status_code)

        wait_until(not_ready, 30, 0.05, "/ready false while draining")
        assert "draining" in httpx.get(stack.http + "/ready", timeout=10).json()["error"]["message"]
        refused = httpx.post(stack.http + "/v1/completions", json={**stream.body, "stream": False}, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert "shutting down" in refused.json()["error"]["message"]
        with grpc.insecure_channel(stack.grpc) as channel:
            got = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING

        stream.join(300)
        assert not stream.is_alive()
        assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        assert json.loads(stream.lines[-2].removeprefix("data: "))["usage"]["completion_tokens"] == TOKENS
        holder.stop.set()  # its client goes away: the drain ends
        assert stack.proc.wait(120) == 0
        assert "drained in" in stack.log.read_text(errors="replace")
    finally:
        stack.stop()


def test_a_second_signal_stops_at_once(tmp_path: Path) -> None:
    stack = Stack(tmp_path, ["--num-prefill", "1"], drain_grace_s=600)
    stack.start()
    try:
        holder = Reader(stack, 14000)
        assert holder.started.wait(120)
        assert stack.proc is not None
        stack.proc.send_signal(signal.SIGINT)
        wait_until(lambda: "draining" in stack.log.read_text(errors="replace") or Pending("no drain yet"), 30, 0.05)
        stack.proc.send_signal(signal.SIGINT)
        assert stack.proc.wait(90) == 0  # not the 600 s grace
        assert "drain ended with 1 requests in flight" in stack.log.read_text(errors="replace")
    finally:
        stack.stop()


def test_drain_actors_waits_for_their_requests_and_routing_leaves_them(tmp_path: Path) -> None:
    """`hybridpd drain-actors` (the chart's preStop hook of the Ray worker pods): every
    actor of the node refuses new work and the command waits until none runs a request."""
    import os
    import subprocess
    import sys
    import time

    stack = Stack(tmp_path, ["--num-prefill", "1"])
    stack.start()
    try:
        holder = Reader(stack, 14000)
        assert holder.started.wait(120)
        exe = Path(sys.executable).parent / "hybridpd"
        argv = [str(exe), "drain-actors", "--address", stack.banner("Ray address"), "--grace-s", "300"]
        env = {**os.environ, "RAY_AUTH_MODE": "token"}  # a driver joins a token-auth cluster so
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("draining ") and "requests in flight" in line:
                break
        assert any("1 requests in flight" in x for x in lines), lines  # the holder's decode
        time.sleep(1.0)
        assert proc.poll() is None, "drain-actors ended while a request ran"

        def refused() -> bool | Pending:
            r = httpx.post(stack.http + "/v1/completions", json={**holder.body, "stream": False}, timeout=60)
            return True if r.status_code == 503 else Pending(r.status_code)

        wait_until(refused, 30, 0.2, "a new request refused by draining actors")
        ready = httpx.get(stack.http + "/ready", timeout=10)
        assert ready.status_code == 503 and "no live prefill or decode instance" in ready.text
        holder.stop.set()  # the client goes away: its request ends
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "drained" in out, "".join(lines) + out
    finally:
        stack.stop()
