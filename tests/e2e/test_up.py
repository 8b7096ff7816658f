"""`hybridpd up` as a user runs it: URLs printed, services answer, Ctrl-C stops them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from hybridpd.procs import free_port, listen_ports, port_open


def test_up_starts_and_ctrl_c_stops(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "hybridpd"
    dash_port = free_port()
    # NOTE: the API ports are chosen free too (below the ephemeral range): 8000 and 50051
    # (the defaults, tested in test_config) can be held by another process of the
    # machine, and 50051 lies in the kernel's ephemeral range, where any outgoing
    # connection of an earlier test may have taken it
    http_port, grpc_port = listen_ports(2)
    api_ports = ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    proc = subprocess.Popen(
        [str(exe), "up", "--workdir", str(tmp_path), "--dashboard-port", str(dash_port), *api_ports],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Press Ctrl-C" in line:
                break
        out = "".join(lines)
        assert "Press Ctrl-C" in out, out
        redis_url = re.search(r"Redis \(prefix index\)\s+(\S+)", out).group(1)  # type: ignore[union-attr]
        master = re.search(r"Mooncake master\s+(\S+)", out).group(1)  # type: ignore[union-attr]
        dash = re.search(r"Ray dashboard\s+(\S+)", out).group(1)  # type: ignore[union-attr]
        assert redis.Redis.from_url(redis_url).ping()
        host, _, port = master.rpartition(":")
        assert port_open(host, int(port))
        assert dash == "http://127.0.0.1:%d" % dash_port
        # Ray's default: token auth, which nothing of ours turns off; the banner says how to sign in
        assert "token auth" in re.search(r"Ray dashboard.*", out).group(0)  # type: ignore[union-attr]
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(dash + "/api/version", timeout=10)
        assert denied.value.code == 401
        ray_cli = Path(sys.executable).parent / "ray"
        token = subprocess.run([str(ray_cli), "get-auth-token"], capture_output=True, text=True, check=True)
        bearer = {"Authorization": "Bearer " + token.stdout.strip()}
        signed = urllib.request.Request(dash + "/api/version", headers=bearer)
        with urllib.request.urlopen(signed, timeout=10) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert not port_open(host, int(port))
        rport = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        assert not port_open("127.0.0.1", rport)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
