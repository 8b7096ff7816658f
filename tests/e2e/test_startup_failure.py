"""An actor that fails while starting ends `hybridpd up` at once: a non-zero exit
and that actor's own error, well within a minute (the other actors are not
waited for, and Ray does not restart a constructor that raised)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpd.procs import free_port


def test_an_actor_failing_at_startup_ends_up_with_its_error(tmp_path: Path) -> None:
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a valid config: every field has its default
    (model / "model.safetensors").write_bytes(b"not a safetensors file")  # weights that do not load
    ports = [str(free_port()) for _ in range(4)]
    argv = [
        str(Path(sys.executable).parent / "hybridpd"),
        "up",
        "--workdir",
        str(tmp_path / "wd"),
        "--model",
        str(model),
    ]
    argv += [
        "--http-port",
        ports[0],
        "--grpc-port",
        ports[1],
        "--dashboard-port",
        ports[2],
        "--ray-metrics-port",
        ports[3],
    ]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=dict(os.environ))
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    # the actor is named, its own error comes first, then the traceback Ray carried over
    m = re.search(r"error: actor ((?:prefill|decode)-\d) failed to start: (.*)", out)
    assert m is not None, out[-4000:]
    assert "SafetensorError" in m.group(2) or "safetensors" in m.group(2).lower(), m.group(0)
    assert "model.safetensors" in out or "load_file" in out, out[-4000:]  # the traceback points at the load
    assert elapsed < 60, elapsed


@pytest.mark.parametrize("taken", ["--http-port", "--grpc-port"])
def test_a_port_taken_by_another_process_fails_before_the_ready_banner(tmp_path: Path, taken: str) -> None:
    """The stack says "Press Ctrl-C to stop." only once both servers listen: a port
    another process holds fails `hybridpd up` (which StackProcess.start retries on
    fresh ports) instead of a stack that refuses every connection; it is found
    before anything starts, and the error names the flag. A port lost after that
    check fails the router's bind: test_errors_and_health.py
    test_a_port_lost_before_the_bind_fails_before_ready."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        ports = {flag: str(free_port()) for flag in ("--http-port", "--grpc-port", "--dashboard-port")}
        ports[taken] = str(holder.getsockname()[1])
        argv = [str(Path(sys.executable).parent / "hybridpd"), "up", "--workdir", str(tmp_path / "wd")]
        argv += [*(x for kv in ports.items() for x in kv), "--ray-metrics-port", str(free_port())]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "Press Ctrl-C" not in out, out[-4000:]
    assert "already in use" in out.lower(), out[-4000:]
    assert "(%s)" % taken in out, out[-4000:]  # the error names the flag to change
