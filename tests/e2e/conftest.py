"""The whole local stack, started the way a user starts it: `hybridpd up`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from hybridpd.procs import free_port


@dataclass(frozen=True)
class Stack:
    http: str
    grpc: str
    log: Path

    def stats(self) -> dict:
        return httpx.get(self.http + "/v1/hybridpd/stats", timeout=30).json()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    wd = Path(tmp_path_factory.mktemp("stack"))
    http_port, grpc_port, dash = free_port(), free_port(), free_port()
    log = wd / "up.log"
    exe = Path(sys.executable).parent / "hybridpd"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                str(exe),
                "up",
                "--workdir",
                str(wd),
                "--http-port",
                str(http_port),
                "--grpc-port",
                str(grpc_port),
                "--dashboard-port",
                str(dash),
                "--eagle",
                "--max-inflight-requests",
                "4",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        )
    try:
        deadline = time.monotonic() + 300
        while "Press Ctrl-C" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("hybridpd up did not start:\n" + log.read_text(errors="replace")[-4000:])
            time.sleep(0.5)
        yield Stack("http://127.0.0.1:%d" % http_port, "127.0.0.1:%d" % grpc_port, log)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
