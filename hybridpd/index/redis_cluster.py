"""A local Redis Cluster of ``masters`` redis-servers on loopback (tests,
benchmarks, trying ``--redis-cluster`` on one machine).

Each master is a ``RedisServer`` in cluster mode owning an equal range of the
16,384 hash slots; no replicas. ``cluster-require-full-coverage no``: while a
master is down the others keep answering for their slots. ``stop_master`` /
``start_master`` kill and restart one on the same port and node file, so it
rejoins with its slots (empty: persistence is off, as for the single index).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import redis

from hybridpd.errors import UnavailableError
from hybridpd.index.redis_server import RedisServer

SLOTS = 16384
#: a node's cluster bus listens on its port + 10000
BUS_OFFSET = 10000


def _bus_free_port(host: str) -> int:
    """A port p with p and p + 10000 both free (the cluster bus is p + 10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port + BUS_OFFSET >= 65536:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port + BUS_OFFSET))
            except OSError:
                continue
        return port
    raise UnavailableError("no free port pair (p, p + 10000) for a cluster node")


class LocalRedisCluster:
    def __init__(self, workdir: Path, masters: int = 3, host: str = "127.0.0.1", node_timeout_ms: int = 1000) -> None:
        if masters < 1:
            raise ValueError("masters must be >= 1, got %d" % masters)
        self.workdir = workdir
        self.host = host
        self.nodes: list[RedisServer] = []
        for _ in range(masters):
            port = _bus_free_port(host)
            node_dir = workdir / ("node-%d" % port)
            node_dir.mkdir(parents=True, exist_ok=True)
            extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node_dir / "nodes.conf"),
                "--cluster-node-timeout",
                str(node_timeout_ms),
                "--cluster-require-full-coverage",
                "no",
            ]
            self.nodes.append(RedisServer(node_dir, port=port, host=host, extra_args=extra))

    @property
    def url(self) -> str:
        """Any node's URL (the first): a cluster client discovers the rest."""
        return self.nodes[0].url

    def _client(self, i: int) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.nodes[i].port, socket_timeout=5)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every node, give each its slot range, join them, wait for ``cluster_state:ok``."""
        for node in self.nodes:
            node.start()
        n = len(self.nodes)
        for i in range(n):
            lo, hi = i * SLOTS // n, (i + 1) * SLOTS // n
            self._client(i).execute_command("CLUSTER ADDSLOTS", *range(lo, hi))
        for i in range(1, n):
            self._client(0).execute_command("CLUSTER MEET", self.host, self.nodes[i].port)
        self.wait_ok(timeout_s)

    def wait_ok(self, timeout_s: float = 30.0, nodes: list[int] | None = None) -> None:
        """Until every (running) node reports ``cluster_state:ok`` and knows all of them."""
        deadline = time.monotonic() + timeout_s
        want = range(len(self.nodes)) if nodes is None else nodes
        last: object = ""
        while time.monotonic() < deadline:
            try:
                infos = [self._client(i).cluster("INFO") for i in want]
                if all(
                    d.get("cluster_state") == "ok" and int(d.get("cluster_known_nodes", 0)) == len(self.nodes)
                    for d in infos
                ):
                    return
                last = infos[0]
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.1)
        raise UnavailableError("local Redis Cluster not ok after %.0f s: %s" % (timeout_s, last))

    def master_of(self, key: bytes | str) -> int:
        """Index of the node that owns ``key``'s hash slot (node i owns range i of n)."""
        slot = int(self._client(0).cluster("KEYSLOT", key))
        n = len(self.nodes)
        return next(i for i in range(n) if i * SLOTS // n <= slot < (i + 1) * SLOTS // n)

    def stop_master(self, i: int) -> None:
        """Kill node ``i`` (its slots go unanswered; the others keep serving)."""
        self.nodes[i].stop(timeout_s=2.0)

    def start_master(self, i: int, timeout_s: float = 30.0) -> None:
        """Restart node ``i`` on its port with its node file: it rejoins with its (empty) slots."""
        self.nodes[i].start()
        self.wait_ok(timeout_s)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()

    def __enter__(self) -> LocalRedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
