"""Run ``hybridpd up`` as a child process (benchmarks and end-to-end tests).

The child is driven only through its public interfaces: its printed banner,
HTTP, gRPC and SIGINT. ``extra_args`` are ``hybridpd up`` flags.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybridpd.errors import UnavailableError
from hybridpd.procs import listen_ports


class StackProcess:
    def __init__(
        self,
        workdir: Path,
        extra_args: list[str] | None = None,
        start_timeout_s: float = 300.0,
        exe: Path | None = None,
        drain_grace_s: float = 5.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """``exe``: the ``hybridpd`` executable (default: the one beside this Python);
        ``drain_grace_s``: how long ``stop`` lets requests in flight finish (a flag in
        ``extra_args`` wins); ``env``: variables added to this process's environment."""
        self.drain_grace_s = drain_grace_s
        self.env = {**os.environ, **(env or {})}
        self.workdir = workdir
        self.exe = exe or Path(sys.executable).parent / "hybridpd"
        self._choose_ports()
        self.extra_args = extra_args or []
        self.start_timeout_s = start_timeout_s
        self.log = workdir / "up.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def tls(self) -> bool:
        """Whether the stack serves HTTPS and gRPC over TLS (``--tls-cert-file``)."""
        return "--tls-cert-file" in self.extra_args

    @property
    def http(self) -> str:
        return "%s://127.0.0.1:%d" % ("https" if self.tls else "http", self.http_port)

    @property
    def ray_metrics(self) -> str:
        return "http://127.0.0.1:%d/metrics" % self.ray_metrics_port

    @property
    def grpc(self) -> str:
        return "127.0.0.1:%d" % self.grpc_port

    #: what a port lost between choosing it and binding it looks like in the log
    _PORT_RACE = ("already occupied", "address already in use", "failed to bind")

    def start(self, attempts: int = 3) -> StackProcess:
        """Start ``hybridpd up``; on a port taken between choosing and binding it,
        choose fresh ports and start again (at most ``attempts`` times)."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except UnavailableError as exc:
                if attempt == attempts - 1 or not any(m in str(exc).lower() for m in self._PORT_RACE):
                    raise
                self._choose_ports()
        raise AssertionError("unreachable")

    def _choose_ports(self) -> None:
        """Four free ports below the ephemeral range (``procs.listen_ports``): one
        from that range could be taken by any outgoing connection before the
        stack, which binds them seconds later, gets to it."""
        self.http_port, self.grpc_port, self.dashboard_port, self.ray_metrics_port = listen_ports(4)

    def _start_once(self) -> StackProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            str(self.exe),
            "up",
            "--workdir",
            str(self.workdir),
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--dashboard-port",
            str(self.dashboard_port),
            "--ray-metrics-port",
            str(self.ray_metrics_port),
            "--drain-grace-s",
            str(self.drain_grace_s),
            *self.extra_args,
        ]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.start_timeout_s
        while "Press Ctrl-C" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-4000:]
                self.stop()
                raise UnavailableError("hybridpd up did not start:\n" + tail)
            time.sleep(0.5)
        return self

    def attach_args(self) -> list[str]:
        """``hybridpd up`` flags that start another router on this stack's Redis, store,
        Ray cluster and actors (``worker_groups``: it attaches to the named actors,
        never creates or closes them), as the Helm chart's router replicas attach.
        With the stack's integrity key file (``key_args``).
        The flags of a later ``--redis-cluster`` stay the caller's to add; a Redis URL with a
        password is printed masked, so such a stack's caller adds its own ``--redis-url``."""
        return [
            "--ray-address",
            self.banner("Ray address"),
            "--redis-url",
            self.banner("Redis (prefix index)"),
            "--mooncake-master",
            self.banner("Mooncake master"),
            "--mooncake-metadata-url",
            self.banner("Mooncake metadata"),
            "--actor-placement",
            "worker_groups",
            *self.key_args(),
        ]

    def attach_env(self) -> dict[str, str]:
        """The environment another process needs to join this stack's Ray cluster: a
        cluster with token auth (the banner says so) takes ``RAY_AUTH_MODE=token`` from
        its joiners (the token itself is this machine's ``~/.ray/auth_token``)."""
        lines = self.log.read_text(errors="replace").splitlines()
        dash = next((ln for ln in lines if ln.strip().startswith("Ray dashboard")), "")
        return {"RAY_AUTH_MODE": "token"} if "token auth" in dash else {}

    def key_args(self) -> list[str]:
        """``--integrity-key-file`` of this stack's key (the file ``hybridpd up`` printed;
        none for a stack on the public key): every router and actor holds the one key."""
        key = self.banner("Integrity key")
        return [] if key.startswith("none") else ["--integrity-key-file", key]

    def banner(self, label: str) -> str:
        """The value ``hybridpd up`` printed after ``label`` (e.g. "Mooncake master")."""
        for line in self.log.read_text(errors="replace").splitlines():
            if line.strip().startswith(label):
                return line.strip()[len(label) :].strip()
        raise KeyError(label)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> StackProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
