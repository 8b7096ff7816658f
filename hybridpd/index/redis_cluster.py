"""A local Redis Cluster on loopback (tests, benchmarks, trying
``--redis-cluster`` on one machine): ``masters`` redis-servers, each owning an
equal range of the 16,384 hash slots, and ``replicas`` replicas of each.

``cluster-require-full-coverage no``: while a shard is down the others keep
answering for their slots. ``stop_node`` / ``start_node`` kill and restart a
node on the same port and node file: a master without a replica rejoins with
its slots (empty: persistence is off, as for the single index); a master with
one is replaced by it (a failover after ``node_timeout_ms``) and rejoins as
its replica. ``master_of`` / ``replicas_of`` read the current roles from the
cluster itself, so they stay true after a failover.
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
    def __init__(
        self,
        workdir: Path,
        masters: int = 3,
        host: str = "127.0.0.1",
        node_timeout_ms: int = 1000,
        replicas: int = 0,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError("masters must be >= 1 and replicas >= 0, got %d and %d" % (masters, replicas))
        self.workdir = workdir
        self.host = host
        self.masters = masters
        self.replicas = replicas
        self.nodes: list[RedisServer] = []  # the masters, then replicas: node masters + m * replicas + k replicates m
        for _ in range(masters * (1 + replicas)):
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
        """Start every node, give each master its slot range, join them, make each
        replica replicate its master, wait for ``cluster_state:ok`` and every link up."""
        for node in self.nodes:
            node.start()
        n = self.masters
        for i in range(n):
            lo, hi = i * SLOTS // n, (i + 1) * SLOTS // n
            self._client(i).execute_command("CLUSTER ADDSLOTS", *range(lo, hi))
        for i in range(1, len(self.nodes)):
            self._client(0).execute_command("CLUSTER MEET", self.host, self.nodes[i].port)
        self.wait_ok(timeout_s, replicated=False)
        for r in range(n, len(self.nodes)):
            master = (r - n) // self.replicas
            master_id = self._client(master).execute_command("CLUSTER MYID")
            self._replicate(r, master_id.decode() if isinstance(master_id, bytes) else master_id, timeout_s)
        self.wait_ok(timeout_s)

    def _replicate(self, r: int, master_id: str, timeout_s: float) -> None:
        """CLUSTER REPLICATE, retried until node ``r`` has heard of the master (gossip)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._client(r).execute_command("CLUSTER REPLICATE", master_id)
                return
            except redis.ResponseError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _running(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node.running]

    def wait_ok(self, timeout_s: float = 30.0, replicated: bool = True) -> None:
        """Until every running node reports ``cluster_state:ok``, knows all nodes, and
        every running replica's link to its master is up; with every node running (and
        ``replicated``), until each node also lists every slot range with all its replicas."""
        deadline = time.monotonic() + timeout_s
        last: object = ""
        everyone = replicated and len(self._running()) == len(self.nodes)
        while time.monotonic() < deadline:
            try:
                ok = True
                for i in self._running():
                    c = self._client(i)
                    info = c.cluster("INFO")
                    repl = c.info("replication")
                    holders = [len(row) - 2 for row in c.execute_command("CLUSTER SLOTS")] if everyone else []
                    if (
                        info.get("cluster_state") != "ok"
                        or int(info.get("cluster_known_nodes", 0)) != len(self.nodes)
                        or (repl.get("role") == "slave" and repl.get("master_link_status") != "up")
                        or any(h != 1 + self.replicas for h in holders)
                    ):
                        ok, last = False, (i, info.get("cluster_state"), repl.get("master_link_status"), holders)
                        break
                if ok:
                    return
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.1)
        raise UnavailableError("local Redis Cluster not ok after %.0f s: %s" % (timeout_s, last))

    def _slot_nodes(self, key: bytes | str) -> list[int]:
        """Node indices serving ``key``'s slot now, master first (CLUSTER SLOTS of a running node)."""
        ports = {node.port: i for i, node in enumerate(self.nodes)}
        c = self._client(self._running()[0])
        slot = int(c.cluster("KEYSLOT", key))
        for row in c.execute_command("CLUSTER SLOTS"):
            lo, hi, *holders = row
            if int(lo) <= slot <= int(hi):
                return [ports[int(h[1])] for h in holders]
        raise UnavailableError("no node serves slot %d" % slot)

    def master_of(self, key: bytes | str) -> int:
        """Index of the node that serves ``key``'s hash slot as master now."""
        return self._slot_nodes(key)[0]

    def replicas_of(self, key: bytes | str) -> list[int]:
        """Indices of the replicas of ``key``'s master (as the cluster sees them now)."""
        return self._slot_nodes(key)[1:]

    def stop_node(self, i: int) -> None:
        """Kill node ``i`` (a master's slots go unanswered until a replica takes over, if it has one)."""
        self.nodes[i].stop(timeout_s=2.0)

    def start_node(self, i: int, timeout_s: float = 30.0) -> None:
        """Restart node ``i`` on its port with its node file and wait until the cluster is ok."""
        self.nodes[i].start()
        self.wait_ok(timeout_s)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()

    def __enter__(self) -> LocalRedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
