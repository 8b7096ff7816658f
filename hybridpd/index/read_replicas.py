"""Read replicas of the prefix index: one replica as lookups see it (read only
while its link to its primary is up), and its connections.

A replica answers as its primary did a replication lag ago (Redis replication
is asynchronous; the router's ``RecentPrefills`` covers its own newest
prefills, and a promise broken by a removal not yet replicated is a recompute,
counted, never wrong tokens). One cut off from its primary has no bound on how
stale it is: :func:`link_up` reads ``INFO replication`` when the replica is
first named, then every :data:`LINK_CHECK_S` from the index's watcher thread
(``connection.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis
from redis.utils import str_if_bytes

logger = logging.getLogger(__name__)

#: how often a read replica's link to its primary is checked (seconds)
LINK_CHECK_S = 1.0
#: while a cluster slot has no usable replica, its replicas are looked for again this often (seconds)
REPLICA_DISCOVERY_S = 5.0


def readonly(conn: Any) -> None:
    """Connect callback of a cluster replica's connections: READONLY, so it answers for its master's slots."""
    conn.on_connect()
    conn.send_command("READONLY")
    if str_if_bytes(conn.read_response()) != "OK":
        raise redis.ConnectionError("the replica refused READONLY")


@dataclass(slots=True)
class Replica:
    """A replica lookups read while ``ok``: its link to the primary was up at its last
    check (when it was first named, then every ``LINK_CHECK_S`` off the request path)."""

    name: str
    pool: Any
    ok: bool | None = None  # None: not checked yet

    def check(self) -> None:
        up, why = link_up(self.pool)
        if up and self.ok is not True:
            logger.info("index replica %s: reading it", self.name)
        elif not up and self.ok is not False:
            logger.warning("index replica %s: not read (%s)", self.name, why)
        self.ok = up

    def failed(self, exc: BaseException) -> None:
        if self.ok:
            logger.warning("index replica %s: not read until its link checks up again: %s", self.name, exc)
        self.ok = False


def link_up(pool: Any) -> tuple[bool, str]:
    """Whether the server of ``pool`` is a replica whose link to its primary is up (and why not)."""
    try:
        info = redis.Redis(connection_pool=pool).info("replication")
    except redis.ResponseError as exc:
        if "NOPERM" in str(exc):  # INFO is in ACL @dangerous: trust the operator's replica
            return True, ""
        return False, str(exc)
    except redis.RedisError as exc:
        return False, str(exc)
    if info.get("role") != "slave":
        return False, "role %s, not a replica" % info.get("role")
    if info.get("master_link_status") != "up":
        return False, "its link to the primary is %s" % info.get("master_link_status")
    return True, ""
