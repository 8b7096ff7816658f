"""Drain the hybridpd actors of a Ray node before its pod goes away (``hybridpd
drain-actors``, the Ray worker pods' preStop hook in the Helm chart).

Each prefill and decode actor on the node is told to drain (``WorkerBase.drain``:
it refuses new work, which the routers send elsewhere, and its pings say it does
not serve); then this waits until none of them runs a request, for at most the
grace, saying every ``LOG_S`` how many it still waits for.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import click

logger = logging.getLogger(__name__)

#: the worker classes whose actors drain
WORKER_CLASSES = ("PrefillWorker", "DecodeWorker")
#: how often the wait says how many requests are left
LOG_S = 5.0


def node_actors(all_nodes: bool) -> dict[str, Any]:
    """The live hybridpd actors of this Ray node (or of every node) by name."""
    import ray
    from ray.util.state import list_actors

    filters: list[tuple[str, str, str | bool | int | float]] = [("state", "=", "ALIVE")]
    if not all_nodes:
        filters.append(("node_id", "=", ray.get_runtime_context().get_node_id()))
    # NOTE: the cluster this driver joined, by its GCS address: without one the state API looks
    # for "the" local Ray and fails when a machine runs more than one
    gcs = ray.get_runtime_context().gcs_address
    listed = list_actors(address=gcs, filters=filters, detail=True, limit=10_000)
    found = [a for a in listed if a.class_name in WORKER_CLASSES]
    return {a.name: ray.get_actor(a.name, namespace=a.ray_namespace) for a in found if a.name}


def drain(handles: dict[str, Any], grace_s: float, poll_s: float = 0.5) -> int:
    """Drain ``handles`` and wait until they run nothing (or ``grace_s`` passed); returns
    how many requests were still running at the end (0: drained)."""
    import ray

    if not handles:
        return 0
    running = dict(zip(handles, ray.get([h.drain.remote() for h in handles.values()]), strict=True))
    t0 = said = time.monotonic()
    click.echo("draining %s: %d requests in flight" % (", ".join(sorted(handles)), sum(running.values())))
    while sum(running.values()) and time.monotonic() - t0 < grace_s:
        time.sleep(poll_s)
        running = dict(zip(handles, ray.get([h.running.remote() for h in handles.values()]), strict=True))
        if time.monotonic() - said >= LOG_S:
            said = time.monotonic()
            left = grace_s - (said - t0)
            click.echo("draining: %d requests in flight, %.0fs left" % (sum(running.values()), left))
    return sum(running.values())
