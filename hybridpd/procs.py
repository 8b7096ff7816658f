"""Child processes the local stack starts (redis-server, mooncake_master).

A :class:`ManagedProcess` is started with its output going to a log file,
waits until its port accepts connections (or fails with the log tail), and is
stopped with SIGTERM, then SIGKILL. It is a context manager.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from hybridpd.errors import UnavailableError

logger = logging.getLogger(__name__)

#: Ray's GCS listens here by default; never give it to anything else.
RAY_DEFAULT_PORT = 6379


def split_cpus(cpus: Sequence[int]) -> tuple[list[int], list[int]]:
    """The prefill and the decode side's CPUs: the first and the second half of
    ``cpus`` (one CPU: both get it).

    >>> split_cpus([0, 1])
    ([0], [1])
    >>> split_cpus([0, 1, 2, 3, 4])
    ([0, 1], [2, 3, 4])
    >>> split_cpus([3])
    ([3], [3])
    """
    half = max(1, len(cpus) // 2)
    return list(cpus[:half]), list(cpus[half:] or cpus[:half])


def bind_role_cpus(role: str) -> list[int] | None:
    """Bind the calling thread (and the threads it starts afterwards: an actor's engine
    loop, its OpenMP pool) to ``role``'s half of the CPUs it may use now
    (:func:`split_cpus`; ``role``: prefill or decode). Returns those CPUs; None with
    one CPU or where the platform has no affinity calls."""
    get, put = getattr(os, "sched_getaffinity", None), getattr(os, "sched_setaffinity", None)
    if get is None or put is None:
        return None
    cpus = sorted(get(0))
    if len(cpus) < 2:
        return None
    prefill, decode = split_cpus(cpus)
    mine = prefill if role == "prefill" else decode
    put(0, mine)
    logger.info("%s engine bound to CPUs %s of %s", role, mine, cpus)
    return mine


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (never 6379)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port != RAY_DEFAULT_PORT:
            return port


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for bind(0) and outgoing connections (Linux; 32768-60999 elsewhere)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


#: the lowest port :func:`listen_ports` hands out: above Ray's worker ports (10002-19999 by
#: default), which the raylet gives to workers it starts after the ports are chosen
LISTEN_PORTS_FROM = 20000


def listen_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports, each free on ``host`` now, for servers that bind them later.

    They are drawn below the kernel's ephemeral range: a port from that range
    (what :func:`free_port` returns) is handed to the next bind(0) or outgoing
    connection of any process on the machine, so one chosen there can be taken
    before a slow starter binds it (vLLM binds its NIXL side channel only at
    the end of its engine start, seconds later)."""
    lo, _ = ephemeral_range()
    pool = [p for p in range(LISTEN_PORTS_FROM, lo) if p != RAY_DEFAULT_PORT]
    if len(pool) < 100 * n:  # an unusual ephemeral range: take what the kernel gives
        out: list[int] = []
        while len(out) < n:
            p = free_port(host)
            if p not in out:
                out.append(p)
        return out
    out = []
    for port in random.sample(pool, len(pool)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    raise UnavailableError("no %d free ports on %s" % (n, host))


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on ``host:port`` now (None: it can). Bound with
    SO_REUSEADDR as uvicorn binds, so a port left in TIME_WAIT is free; one that
    another process listens on is not."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return exc
    for family, kind, proto, _, addr in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                return exc
    return None


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, host: str, port: int, timeout_s: float = 20.0) -> None:
        """Start and wait until ``host:port`` accepts connections."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, **(self.env or {})}
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if port_open(host, port):
                logger.info("%s up on %s:%d (pid %d)", self.name, host, port, self.proc.pid)
                return
            time.sleep(0.05)
        tail = self.log_tail()
        self.stop()
        raise UnavailableError("%s did not come up on %s:%d; log tail:\n%s" % (self.name, host, port, tail))

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        logger.info("%s stopped", self.name)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
